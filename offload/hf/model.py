"""A transformers model on the meta device whose weights come, block by block, from a weight source.

    model = TieredModel(checkpoint_dir, cfg, weights, device, compute_dtype)
    [(logits, cache)] = model.run_all([(ids, cache)], every=False)   # ids [n] (CPU) -> logits [1 or n, V] float32

transformers builds the module tree from config.json under accelerate's `init_empty_weights` (parameters
on `meta`, buffers such as RoPE tables real). accelerate hooks (`ModelHook`, `add_hook_to_module`) then
attach the weights where they run:

- the token embeddings: the rows of the pass's distinct tokens, read by `weights.embed` (from wherever the
  table lives, by rows), bound as a small table while the ids are renumbered into it; the module's own
  forward (scaling, as Gemma's does) runs on it;
- each decoder block `layer.i`: acquired from the weight source before the block runs (the prefetcher has
  streamed it into the ring, or it is resident), its tensors bound to the block's parameters as views (no
  copy unless the compute dtype differs), handed back after it; an int8/int4 matrix is handed packed to its
  module by a hook on it, which multiplies it as it lies (a Linear; transformers' experts modules, the routed
  experts' rows: `offload.hf.packed`), or dequantized right before its module runs (one scratch buffer: one dense
  matrix at a time; stacked experts, the routed ones only); on a CPU every nn.Linear multiplies by Offload's
  kernels (`offload.hf.packed.Linear`), a dense weight too;
- the head (final norm, LM head): acquired before the first of its modules runs, released after the LM head.

Several sequences of a pass (`run_all`) run in lockstep (`offload.hf.lockstep`): each block's group is bound by
the first sequence to run it and released by the last, so a streamed block is read once a pass.

After each module runs its parameters are put back on `meta`, so nothing holds a slot the prefetcher
reuses. The KV cache is transformers' own (a `DynamicCache` per sequence, made by the model). Knows
transformers' module tree and the group names of `offload.model.generic`; not tiers, requests or sampling.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from accelerate.hooks import ModelHook, add_hook_to_module
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, cache_utils

from offload.errors import CheckpointError
from offload.hf import packed as packing
from offload.hf.lockstep import Lockstep
from offload.model.config import ModelConfig
from offload.model.generic import LM_HEAD, block_module
from offload.weights.groups import group_sources

#: A parameter to bind: (module, attribute, the group's tensor name)
Binding = tuple[nn.Module, str, str]


class Bound:
    """A group's tensors bound to their modules for one forward, and the meta parameters put back after."""

    def __init__(self, weights: Any, group: str, bindings: list[Binding], dtype: torch.dtype) -> None:
        self.weights, self.group, self.bindings, self.dtype = weights, group, bindings, dtype
        # (module, leaf, its meta tensor, a parameter? else a persistent buffer)
        self.meta = [(m, leaf, getattr(m, leaf), leaf in dict(m.named_parameters(recurse=False)))
                     for m, leaf, _ in bindings]
        self.held = False
        self.lazy: dict[str, tuple[DenseOnUse, str]] = {}  # packed matrices: (their module's hook, leaf)

    def bind(self) -> None:
        views = self.weights.acquire(self.group)
        self.held = True
        for (m, leaf, name), (_, _, meta, param) in zip(self.bindings, self.meta):
            t = views[name]
            if name in self.lazy:
                hook, leaf = self.lazy[name]
                hook.packed[leaf] = t
            else:  # (experts transformers stacks: their rows one after another, viewed as its [E, ...])
                t = t if t.shape == meta.shape else t.view(meta.shape)
                put(m, leaf, t if t.dtype == self.dtype else t.to(self.dtype), param)

    def unbind(self, release: bool = True) -> None:
        for m, leaf, meta, param in self.meta:
            put(m, leaf, meta, param)
        for hook, leaf in self.lazy.values():
            hook.packed.pop(leaf, None)
        if self.held and release:
            self.weights.release(self.group)
        self.held = False


def put(m: nn.Module, leaf: str, t: torch.Tensor, param: bool) -> None:
    """Make `t` the module's tensor `leaf` (a parameter, or a persistent buffer), without a copy."""
    if param:
        m._parameters[leaf] = t  # a plain tensor where the Parameter was: modules read it as `self.weight`
    else:
        setattr(m, leaf, t)


class DenseOnUse(ModelHook):
    """A module's int8/int4 matrices (a Linear's weight; the gate_up_proj and down_proj of stacked experts, viewed
    as its [E, ...]) while its group is bound: handed to the module packed where it multiplies them as they lie
    (`offload.hf.packed.multipliable`), else dequantized right before it runs (stacked experts: the routed ones'
    rows only) and put back after. One matrix goes into the weight source's one scratch buffer (a module's product
    consumes it before the next module's dequantizes); a module of several dequantizes each into its own."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.leaves: dict[str, bool] = {}  # leaf -> a parameter? (else a persistent buffer)
        self.packed: dict[str, Any] = {}  # leaf -> its quant.PackedLinear while its group is bound
        self.meta: dict[str, torch.Tensor] = {}
        self.flipped: dict[str, bool] = {}  # leaf -> stored as each expert's transpose (`GenericTensors.transposed`)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if packing.multipliable(module, self.packed, self.flipped):  # multiplied as they lie (`offload.hf.packed`)
            module.offload_packed = self.packed
            return args, kwargs
        routed = packing.routed(module, args, kwargs)
        for leaf, packed in self.packed.items():
            self.meta[leaf] = meta = getattr(module, leaf)
            if routed is not None and meta.dim() == 3 and len(routed) < meta.shape[0]:
                dense = packed.dense_parts(meta.shape[0], routed, self.dtype)  # (the routed experts' rows only)
            else:
                dense = packed.dense(scratch=len(self.leaves) == 1).to(self.dtype)
            if self.flipped.get(leaf):  # [E out, in] -> the module's [E, in, out]
                dense = dense.view(meta.shape[0], meta.shape[2], meta.shape[1]).transpose(1, 2)
            put(module, leaf, dense if dense.shape == meta.shape else dense.view(meta.shape), self.leaves[leaf])
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if getattr(module, "offload_packed", None) is not None:
            module.offload_packed = None
        for leaf, meta in self.meta.items():
            put(module, leaf, meta, self.leaves[leaf])
        self.meta.clear()
        return output


class GroupHook(ModelHook):
    """Bind a group before the module runs and release it after (a decoder block); several sequences in lockstep
    (`steps()`, `offload.hf.lockstep`): the first to run it binds it, the last releases it."""

    def __init__(self, bound: Bound, stage: int, steps: Callable[[], Lockstep | None]) -> None:
        self.bound, self.stage, self.steps = bound, stage, steps

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if (steps := self.steps()) is not None:
            steps.arrive(self.stage)
        if steps is None or steps.first:
            self.bound.bind()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if (steps := self.steps()) is None or steps.last:
            self.bound.unbind()
        return output


class HeadHook(ModelHook):
    """The head's modules (final norm, LM head): bound before the first of them runs, released after `last` (in
    lockstep, by the last sequence)."""

    def __init__(self, bound: Bound, last: bool, steps: Callable[[], Lockstep | None]) -> None:
        self.bound, self.last, self.steps = bound, last, steps

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if (steps := self.steps()) is not None:
            steps.arrive("head")
        if not self.bound.held:
            self.bound.bind()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.last and ((steps := self.steps()) is None or steps.last):
            self.bound.unbind()
        return output


class EmbedHook(ModelHook):
    """The token embeddings: the rows of the pass's distinct ids as a small table, the ids renumbered into it."""

    def __init__(self, weights: Any, dtype: torch.dtype) -> None:
        self.weights, self.dtype = weights, dtype

    def pre_forward(self, module: nn.Module, ids: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        unique, inverse = torch.unique(ids.cpu(), return_inverse=True)
        table = self.weights.embed(unique)  # [U, H] on the device
        self.meta, self.padding = module._parameters["weight"], getattr(module, "padding_idx", None)
        module._parameters["weight"] = table.to(self.dtype)
        if self.padding is not None:  # only for training; F.embedding checks it against the table's rows
            module.padding_idx = None
        return (inverse.to(table.device), *args), kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module._parameters["weight"] = self.meta
        if self.padding is not None:
            module.padding_idx = self.padding
        return output


class TieredModel:
    """transformers' model of a checkpoint, its weights bound from `weights` (a WeightSource) as it runs."""

    def __init__(self, path: Path, cfg: ModelConfig, weights: Any, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        hf_config = AutoConfig.from_pretrained(path)
        if getattr(hf_config, "text_config", None) is not None and "text_config" not in cfg.raw:
            hf_config = hf_config.get_text_config()  # (a multimodal checkpoint run as its language model)
        try:
            with init_empty_weights():
                self.model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        except ValueError as e:  # transformers knows no causal LM for this config
            raise CheckpointError(f"{path}: transformers cannot build a causal LM from its config.json "
                                  f"({str(e).splitlines()[0][:160]}); Offload runs causal LMs transformers "
                                  "knows") from None
        self.model.eval()
        packing.install(self.model)
        packing.adopt(self.model)
        recurrent = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
        if any(isinstance(layer, recurrent) for layer in self.new_cache().layers):  # (Jamba, Qwen3-Next, ...)
            raise CheckpointError(f"{path}: {type(self.model).__name__} keeps a recurrent state (linear-attention or "
                                  "Mamba layers), which Offload's transformers path does not run (it takes a "
                                  "sequence back to earlier tokens by cropping its KV cache); run it with "
                                  "transformers itself")
        # transformers >= 5.2x names the cache `cache` (`past_key_values` before)
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        for m in self.model.modules():  # RoPE tables and other buffers are real: they go to the device
            for k, b in list(m.named_buffers(recurse=False)):
                if b.device.type != "meta":
                    setattr(m, k, b.to(device))
        self.bounds: list[Bound] = []
        self.lockstep: Lockstep | None = None  # while several sequences run a pass (`run_all`)
        covered = self._attach(cfg, weights)
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        missing = sorted(params - covered)
        if missing:
            raise CheckpointError(f"{path}: the model's parameter {missing[0]!r} (of {len(missing)}) has no tensor in "
                                  "the checkpoint; its tensor names are not the ones transformers gives this model")

    def _attach(self, cfg: ModelConfig, weights: Any) -> set[str]:
        """Hook every group onto its modules; returns the parameter names bound."""
        root, covered = self.model, set()
        names = {id(m): n for n, m in root.named_modules()}

        def steps() -> Lockstep | None:
            return self.lockstep

        def bindings(group: str) -> list[Binding]:
            out = []
            for name, _ in group_sources(cfg, group):
                path, _, leaf = name.rpartition(".")
                try:  # (the LM head: the module transformers multiplies by, whatever the checkpoint names it)
                    module = root.get_output_embeddings() if name == LM_HEAD else root.get_submodule(path)
                    covered.add(f"{names[id(module)]}.{leaf}" if name == LM_HEAD else name)
                except AttributeError:
                    raise CheckpointError(f"checkpoint tensor {name!r} names no module of transformers' "
                                          f"{type(root).__name__}; the checkpoint and config.json do not belong "
                                          "together") from None
                out.append((module, leaf, name))
            return out

        lazy: dict[int, DenseOnUse] = {}  # a module's hook for its packed matrices
        for i in range(cfg.num_layers):
            group = f"layer.{i}"
            b = bindings(group)
            block = root.get_submodule(block_module(b[0][2]))
            bound = Bound(weights, group, b, self.dtype)
            for (m, leaf, name), (_, _, _, param) in zip(b, bound.meta):
                if weights.fmt.packs(cfg, name):
                    if id(m) not in lazy:
                        lazy[id(m)] = DenseOnUse(self.dtype)
                        add_hook_to_module(m, lazy[id(m)])
                    lazy[id(m)].leaves[leaf] = param
                    lazy[id(m)].flipped[leaf] = name in cfg.tensors.transposed
                    bound.lazy[name] = (lazy[id(m)], leaf)
            self.bounds.append(bound)
            add_hook_to_module(block, GroupHook(bound, i, steps))
        head = Bound(weights, "head", bindings("head"), self.dtype)
        self.bounds.append(head)
        out_embed = root.get_output_embeddings()
        owners = {id(m): m for m, _, name in head.bindings if name != LM_HEAD}
        for m in owners.values():
            add_hook_to_module(m, HeadHook(head, False, steps))
        add_hook_to_module(out_embed, HeadHook(head, True, steps))
        embed = root.get_input_embeddings()
        add_hook_to_module(embed, EmbedHook(weights, self.dtype))
        # between passes a stand-in of the table's shape, dtype and device (one element): Llama 4 moves the ids to
        # its embeddings' device before they run, and a meta table took them to meta
        shape = embed._parameters["weight"].shape
        embed._parameters["weight"] = torch.zeros((), dtype=self.dtype, device=self.device).expand(shape)
        covered.add(cfg.tensors.embed[0])
        return covered

    def new_cache(self) -> DynamicCache:
        """A sequence's cache. Sliding-window layers record the keys past their window (as assisted generation
        has them do), so that a conversation can forget its last tokens (`crop`) and still attend correctly."""
        cache = DynamicCache(config=self.model.config)
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        return cache

    def run_all(self, seqs: list[tuple[torch.Tensor, Any]], every: bool) -> list[tuple[torch.Tensor, Any]]:
        """Each sequence's new tokens ids [n] through the model with its cache (None: a new one): logits [n, V]
        (`every`) or [1, V] float32, and the cache holding them; in lockstep where there are several
        (`offload.hf.lockstep`: each streamed block read once for all of them)."""
        forwards = [functools.partial(self._forward, ids, cache, every) for ids, cache in seqs]
        try:
            if len(seqs) == 1 or not Lockstep.available():
                return [f() for f in forwards]
            self.lockstep = Lockstep(len(seqs))
            return self.lockstep.run(forwards)
        except BaseException:
            self.abort()
            raise
        finally:
            self.lockstep = None

    def _forward(self, ids: torch.Tensor, cache: Any, every: bool) -> tuple[torch.Tensor, Any]:
        cache = self.new_cache() if cache is None else cache
        out = self.model(input_ids=ids[None].to(self.device), use_cache=True, logits_to_keep=0 if every else 1,
                         **{self.cache_arg: cache})
        return out.logits[0].float(), out[self.cache_arg]

    def abort(self) -> None:
        """A forward stopped half way: every module back on meta, no packed matrix left handed to one (the weight
        source resets its own pass)."""
        for b in self.bounds:
            b.unbind(release=False)
        for m in self.model.modules():
            if getattr(m, "offload_packed", None) is not None:
                m.offload_packed = None
