"""The executor of a model transformers runs: the seam the engine drives, over `TieredModel`.

    ex = HFExecutor(config)              # what `offload.runtime.impls.executor_class` picks for model_impl
    kv = ex.ensure_kv(blocks)            # HFSequences: the paged cache's bookkeeping + a DynamicCache per sequence
    logits = ex.forward(ForwardBatch.last([sid], [[1, 5, 9]]))

Everything the native executor plans is planned the same way (placement, ring, prefetch depth, the store on
disk: `TieredWeights` over the groups of `offload.model.generic`), and the engine admits, prefills in chunks,
forks samples and keeps conversations as it does natively: the paged KV cache still counts every sequence's
blocks and lengths (`HFSequences`), while the keys and values live in transformers' `DynamicCache`, one per
sequence, on the device, in the KV region the plan reserved (the bookkeeping's blocks hold nothing). What does
not apply on this path: the KV cache's cold tiers (host/disk blocks,
int8 cold blocks: kv_cache.cpu_blocks/disk_blocks are taken as 0), speculative decoding (verification needs
Offload's batched tree attention) and pipeline stages. int8/int4 weights (`weights.quantization`) pack the
blocks' matrices: they stream packed and are multiplied as they lie (a Linear's, the routed experts':
`offload.hf.packed`) or dequantized module by module as they run; a GPTQ / AWQ checkpoint's are stored as they
are and dequantized as their Linear runs. A pass runs each sequence's own forward (a ragged batch of
DynamicCaches has no common shape), the sequences in lockstep block by block (`offload.hf.lockstep`), so that a
streamed block is read once a pass whatever the batch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import torch

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.hf.model import TieredModel
from offload.kv.cache import PagedKVCache
from offload.model.config import ModelConfig, quant_method
from offload.runtime.cores import share_cores
from offload.runtime.executor import Executor, ForwardBatch
from schedulers.plan import Capacities
from schedulers.timeline import Timeline


class HFSequences(PagedKVCache):
    """The paged cache's bookkeeping (admission, lengths, forks, truncation) with each sequence's keys and
    values in a transformers cache (`caches[sid]`: None until its first pass), kept in step with it. Its
    blocks hold nothing (one layer of one 1-wide head: a few bytes each), so the device KV region the plan
    reserved is left to the DynamicCaches, which fill about as much."""

    holds_kv = False

    def __init__(self, cfg: ModelConfig, *args: Any, **kwargs: Any) -> None:
        blank = dataclasses.replace(cfg, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, moe_layers=(False,),
                                    sliding_windows=(None,))
        super().__init__(blank, *args, **{**kwargs, "memory": None})
        self.caches: dict[int, Any] = {}

    def fork(self, sid: int, reserve_tokens: int) -> int:
        child = super().fork(sid, reserve_tokens)
        if self.caches.get(sid) is not None:  # n samples of one prompt: each its own copy of the prompt's KV
            self.caches[child] = copy.deepcopy(self.caches[sid])
        return child

    def free_sequence(self, sid: int) -> None:
        super().free_sequence(sid)
        self.caches.pop(sid, None)

    def truncate(self, sid: int, length: int, reserve: bool = False) -> int:
        kept = super().truncate(sid, length, reserve)
        cache = self.caches.get(sid)
        if cache is not None and cache.get_seq_length() > kept:
            if kept == 0:
                self.caches[sid] = None
            else:  # a negative count: the tokens to forget, in every transformers version
                cache.crop(kept - cache.get_seq_length())
        return kept


class HFExecutor(Executor):
    """One model's forward pass, run by transformers with its weights from the tiers (see the module doc)."""

    kv_class = HFSequences

    def __init__(self, config: OffloadConfig, timeline: Timeline | None = None,
                 capacities: Capacities | None = None, layers: range | None = None, concurrency: int = 1,
                 context: int | None = None) -> None:
        refuse_unsupported(config, layers)
        kv = dataclasses.replace(config.kv_cache, cpu_blocks=0, disk_blocks=0)  # no cold KV tiers on this path
        super().__init__(config.replace(kv_cache=kv), timeline, capacities, None, concurrency, context)
        try:
            self.model = TieredModel(self.checkpoint.path, self.cfg, self.weights, self.device, self.compute_dtype)
        except BaseException:
            self.close()
            raise

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, V] float32 (`ForwardBatch.last` or `every_token`), each sequence run on its own."""
        if hidden is not None or batch.keep is not None:
            raise ConfigError("model_impl transformers runs whole passes of plain tokens: no pipeline stages, no "
                              "speculative verification")
        kv = self.kv
        assert isinstance(kv, HFSequences), "call ensure_kv first"
        kv.prepare(list(batch.sids), batch.q_lens)  # the blocks and lengths the engine admits by
        share_cores(self.timeline)
        try:
            with self.timeline.range(f"offload/compute/{len(batch.sids)} sequences"):
                done = self.model.run_all([(torch.tensor(t), kv.caches.get(sid))
                                           for sid, t in zip(batch.sids, batch.tokens)], batch.every)
            out = []
            for sid, (logits, cache) in zip(batch.sids, done):
                kv.caches[sid] = cache
                out.append(logits)
        except BaseException:
            self.weights.abort_pass()
            raise
        finally:
            self.timeline.next_step()
        return torch.cat(out)


#: quantized checkpoints this path reads: each matrix dequantized as it is read (`offload.model.checkpoint`), or
#: (GPTQ, AWQ) stored as it is and dequantized as its module runs
READ = ("mxfp4", "fp8", "compressed-tensors", "gptq", "awq")


def refuse_unsupported(config: OffloadConfig, layers: range | None) -> None:
    """What the transformers path cannot do, refused before anything loads, each in one sentence."""
    try:
        raw = json.loads((config.model / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}  # the checkpoint's own reader says what is wrong with it
    if isinstance(raw, dict) and raw.get("quantization_config") and quant_method(raw) not in READ:
        raise ConfigError(f"model_impl transformers: quantization_config.quant_method {quant_method(raw)!r} is not "
                          "read (Offload reads MXFP4, block FP8, compressed-tensors, GPTQ and AWQ checkpoints); use a "
                          "float checkpoint")
    if config.speculative.enabled:
        raise ConfigError("speculative: decoding with a draft needs Offload's own math; set speculative.enabled: "
                          "false or model_impl: native")
    if layers is not None:
        raise ConfigError("model_impl transformers runs the whole model in one executor (no pipeline stages)")
