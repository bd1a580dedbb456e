"""The runner: tokenise, admit, prefill in chunks, decode, sample, stream. The public Python API.

    runner = Runner.from_config("offload.yaml")
    [result] = runner.generate(["Once upon a time"], max_new_tokens=32)
    print(result.text, result.stats.decode_ms_per_step)

The runner drives one forward pass at a time over flat token rows; where the weights come
from (resident, or streamed through the tiers) is the weight source's business, and the
model math in `offload.model` knows neither.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.kv.cache import PagedKVCache
from offload.model import functional as M
from offload.model import hub
from offload.model.chat import GenerationDefaults
from offload.model.checkpoint import Checkpoint
from offload.model.tokenizer import TextTokenizer
from offload.plan.calibrate import load_calibration
from offload.plan.planner import Planner, pass_tokens, resolve_capacities
from offload.plan.speculative import reserve_draft, streaming_note, verify_cost, without_draft
from offload.runtime.engine import Engine, Output, Request, Sampling, blocks_needed, row_blocks, tree_blocks
from offload.runtime.results import GenerationResult, RunStats, TokenCallback
from offload.runtime.speculative import Speculator, check_draft, draft_config, target_config
from offload.weights.groups import WeightFormat, check_tensors
from offload.weights.tiered import TieredWeights
from schedulers.timeline import Timeline
from schedulers.traffic import Traffic

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

class WeightSource(Protocol):
    """Where the runner gets each group's weights; `acquire` may wait, `release` frees its slot."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # [N] (CPU) -> [N, H] on the device
    def acquire(self, group: str) -> dict[str, M.Weight]: ...
    def release(self, group: str) -> None: ...
    def experts(self, layer: int) -> Any: ...  # a MoE layer's ExpertSource (offload.weights.experts)
    def abort_pass(self) -> None: ...  # a pass stopped half way: start the next one cleanly
    def close(self) -> None: ...


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {name!r} was asked for but CUDA is not available here; use device: cpu")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r} does not exist; this machine has {torch.cuda.device_count()} GPUs")
    return dev


def resolve_dtype(name: str, checkpoint_dtype: str | None) -> torch.dtype:
    if name == "auto":
        return DTYPES.get(checkpoint_dtype or "", torch.bfloat16)
    return DTYPES[name]


class _Owned:
    """What a runner must release (loader threads, thread pools, slot files, the store's lock), kept apart
    from the runner so that a finalizer can release it after the runner itself is gone."""

    def __init__(self) -> None:
        self.weights: WeightSource | None = None
        self.kv: PagedKVCache | None = None
        self.draft: Runner | None = None  # the speculative draft, a runner of its own

    def close(self) -> None:
        draft, weights, kv, self.draft, self.weights, self.kv = self.draft, self.weights, self.kv, None, None, None
        try:
            if draft is not None:
                draft.close()
            if weights is not None:
                weights.close()
        finally:
            if kv is not None:
                kv.close()


class Runner:
    """Everything it starts is released by `close()` (or `with`), else when it is garbage-collected, else at
    interpreter exit (a `weakref.finalize`), so a script that never calls `close()` still exits cleanly."""

    def __init__(self, config: OffloadConfig, timeline: Timeline | None = None) -> None:
        self._owned = _Owned()
        self._finalizer = weakref.finalize(self, self._owned.close)
        if config.hub:  # a Hub id: the weights come now (resumed if a download was interrupted)
            config = config.replace(model=hub.fetch(config.hub))
        self.config = config
        self.device = resolve_device(config.device)
        self.checkpoint = Checkpoint(config.model)
        self.cfg = self.checkpoint.config
        # every tensor config.json and the weight format imply, from the headers: before planning or allocating
        check_tensors(self.checkpoint, WeightFormat.from_config(config.weights, self.cfg))
        self.dtype = resolve_dtype(config.dtype, self.cfg.torch_dtype)
        self.tokenizer = TextTokenizer.from_checkpoint(config.model)
        # generation_config.json: every EOS id (with config.json's) and the default sampling
        self.generation = GenerationDefaults.from_checkpoint(config.model, self.cfg.eos_token_ids)
        self.timeline = timeline or Timeline(nvtx=self.device.type == "cuda", keep_steps=config.timeline.keep_steps)
        self.traffic = Traffic()  # bytes moved by weights and KV blocks, per route
        self.last_stats: RunStats | None = None
        self._layer_groups = [f"layer.{i}" for i in range(self.cfg.num_layers)]
        # speculative decoding: the draft is placed first, every weight resident; the target plans around it
        self.draft: Runner | None = None
        self.speculator: Speculator | None = None
        caps = resolve_capacities(config.tiers, self.device)
        if config.speculative.enabled:
            self.config = config = target_config(config)
            self.draft = self._owned.draft = Runner(draft_config(config), Timeline(enabled=False))
            try:
                check_draft(self, self.draft)
            except BaseException:
                self.close()
                raise
            caps = reserve_draft(config, caps, self.draft.plan.used("gpu"), self.draft.kv_block_bytes)
        # KV: with tiers, a fixed pool inside the device tier's budget; without, sized per request
        run_plan = Planner(config, self.cfg, self.dtype, self.device, caps).run_plan()
        if self.draft is not None and run_plan.plan.streamed:  # what the draft's memory costs the target
            note = streaming_note(run_plan.plan, without_draft(config, self.cfg, self.dtype, self.device).plan)
            if note:
                log.warning("%s", note)
        self.kv_settings = run_plan.kv
        self.compute_dtype = run_plan.compute_dtype  # the math and the KV cache; the weights move as self.dtype
        self.rope = M.Rope(self.cfg, self.device, self.compute_dtype)
        self.kv_block_bytes = run_plan.kv_block_bytes  # device bytes of one KV block (all layers)
        self.plan = run_plan.plan
        self.prefill_chunk = run_plan.prefill_chunk  # activations.prefill_chunk, `auto` resolved
        self.weights: WeightSource = TieredWeights(config, self.checkpoint, self.dtype, self.device,
                                                   self.timeline, run_plan.plan, self.traffic, self.compute_dtype)
        self._kv_fixed = run_plan.kv_blocks > 0
        if self._kv_fixed:
            try:
                nbytes = run_plan.kv_blocks * run_plan.kv_block_bytes
                memory = self.weights.allocate_kv(nbytes) if config.tiers else None
                host = run_plan.plan.host_reserve  # the cold host blocks, in the cpu tier's (pinned) arena
                host_memory = self.weights.allocate_kv(host, "cpu") if config.tiers and host else None
                self.kv = self._make_kv(run_plan.kv_blocks, memory, host_memory)
            except BaseException:
                self.close()
                raise
        if self.draft is not None:
            if self.kv is not None:  # one draft block for every target block: what is admitted fits both
                self.draft._kv_fixed, self.draft.kv = True, self.draft._make_kv(self.kv.logical.num_blocks)
            cost = verify_cost(self.plan, self.cfg, load_calibration(config.calibration), self.device.type,
                               self.dtype.itemsize)
            self.speculator = Speculator(self.draft, config.speculative.tokens, self.timeline, cost)

    # what the runner owns lives in `_owned`, which the finalizer closes
    @property
    def weights(self) -> WeightSource:
        assert self._owned.weights is not None, "the runner is closed"
        return self._owned.weights

    @weights.setter
    def weights(self, value: WeightSource) -> None:
        self._owned.weights = value

    @property
    def kv(self) -> PagedKVCache | None:
        return self._owned.kv

    @kv.setter
    def kv(self, value: PagedKVCache | None) -> None:
        self._owned.kv = value

    def _make_kv(self, gpu_blocks: int, memory: torch.Tensor | None = None,
                 host_memory: torch.Tensor | None = None) -> PagedKVCache:
        s = self.kv_settings
        disk = self.config.tiers.disk if self.config.tiers else None
        return PagedKVCache(self.cfg, s.block_size, gpu_blocks, self.compute_dtype, self.device, memory=memory,
                            settings=s,
                            disk_dir=disk.path / "kv-scratch" if disk is not None and s.disk_blocks else None,
                            pin_memory=self.device.type == "cuda", timeline=self.timeline, rope=self.rope,
                            traffic=self.traffic, host_memory=host_memory,
                            page_cache=bool(disk and disk.page_cache))

    @classmethod
    def from_config(cls, source: str | Path | Mapping[str, Any] | OffloadConfig) -> Runner:
        config = source if isinstance(source, OffloadConfig) else OffloadConfig.load(source)
        return cls(config)

    def close(self) -> None:
        """Stop and join every thread, close files and release memory (the draft's too); safe to call twice."""
        self._finalizer()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the forward pass ---------------------------------------------------------------------
    def _forward(self, sids: list[int], tokens: list[list[int]], all_logits: bool = False,
                 keep: Sequence[int] | None = None, lanes: list[int] | None = None) -> torch.Tensor:
        """Run new `tokens[b]` of sequences `sids` through the model; logits [rows, V] float32.

        Rows are every token (all_logits), the last `keep[b]` new tokens of each sequence (speculative
        verification; `lanes[b]`: the tree branch a sequence verifies), or each sequence's last new token.
        """
        kv = self._kv()
        layout, step = kv.prepare(sids, [len(t) for t in tokens])
        if keep is not None:  # verifying drafts: each token column multiplies as a plain decode step would
            lanes = lanes or [0] * len(sids)  # -1: a prompt chunk riding in the pass
            columns = max((n for n, b in zip(layout.q_lens, lanes) if b >= 0), default=0)
            layout = dataclasses.replace(layout, columns=columns,
                                         row_groups=M.column_groups(layout.q_lens, layout.positions.device, lanes))
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)
        cold = any(g.tier != "gpu" for g in step.groups)
        try:
            if cold:  # each layer's cold KV rides with that layer's weights
                self.weights.submit_side({g: functools.partial(kv.fetch_cold, i, step)
                                          for i, g in enumerate(self._layer_groups)})
            x = self.weights.embed(ids)  # [N, H]
            cos_sin = self.rope(layout.positions)
            rope_table = self.rope if self.kv_settings.restore == "recompute" else None
            tl = self.timeline
            for i, group in enumerate(self._layer_groups):
                w = M.LayerWeights.from_views(self.weights.acquire(group))
                experts = self.weights.experts(i) if w.moe is not None else None  # it releases the layer's group
                view = kv.view(i, layout, step, self.weights.side_result(group) if cold else None)
                with tl.range(f"offload/compute/{group}"):
                    x = M.decoder_layer(x, w, view, layout, cos_sin, self.cfg, self.cfg.sliding_windows[i],
                                        rope_table, experts)
                if experts is None:
                    self.weights.release(group)
                else:
                    experts.finish()
            head_groups = None
            if keep is not None:
                ends = torch.tensor(layout.q_lens).cumsum(0).tolist()
                x = x[torch.cat([torch.arange(e - n, e) for e, n in zip(ends, keep)]).to(x.device)]
                head_groups = M.column_groups(list(keep), x.device, lanes)
            elif not all_logits:
                x = x[layout.last_token_rows()]
            w = M.HeadWeights.from_views(self.weights.acquire("head"))
            with tl.range("offload/compute/head"):
                logits = M.head(x, w, self.cfg, head_groups)
            self.weights.release("head")
        except BaseException:
            self.weights.abort_pass()
            raise
        finally:
            self.timeline.next_step()
        return logits

    def _kv(self) -> PagedKVCache:
        assert self.kv is not None, "call _ensure_kv first"
        return self.kv

    def _ensure_kv(self, blocks_needed: int) -> PagedKVCache:
        """The device block pool: fixed (tiers or kv_cache.gpu_blocks), or grown to fit the request."""
        if self._kv_fixed:
            assert self.kv is not None
            return self.kv
        if self.kv is None or self.kv.pool.num_blocks < blocks_needed:
            if self.kv is not None:
                self.kv.close()
            self.kv = None  # drop the old pool before allocating the new one
            self.kv = self._make_kv(blocks_needed)
        return self.kv

    def fix_kv_pool(self, gpu_blocks: int) -> PagedKVCache:
        """Keep one device KV pool for a long-lived engine (a server): a fixed pool stays as planned,
        a per-request one is made with `gpu_blocks` blocks now and no longer resized."""
        kv = self._ensure_kv(gpu_blocks)
        self._kv_fixed = True
        return kv

    # -- public API ---------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(
                    f"{self.config.model} has no tokenizer.json, so prompts must be lists of token ids"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("a prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the model's vocabulary (0..{self.cfg.vocab_size - 1})")
        return ids

    @torch.inference_mode()
    def prefill_logits(self, token_ids: Sequence[Sequence[int]] | Sequence[int]) -> torch.Tensor:
        """Logits for every prompt position: [batch, max_len, vocab] float32; past a prompt's end, zeros."""
        if token_ids and isinstance(token_ids[0], int):
            token_ids = [token_ids]  # type: ignore[list-item]
        prompts = [self.encode(p) for p in token_ids]  # type: ignore[arg-type]
        kv = self._ensure_kv(sum(self._blocks(len(p)) for p in prompts))
        sids = [kv.add_sequence() for _ in prompts]
        try:
            out = torch.zeros(len(prompts), max(map(len, prompts)), self.cfg.vocab_size)
            for chunk in self._prefill_chunks(sids, prompts):
                logits = self._forward([s for s, _, _ in chunk], [t for _, t, _ in chunk], all_logits=True)
                row = 0
                for sid, toks, start in chunk:
                    out[sids.index(sid), start : start + len(toks)] = logits[row : row + len(toks)].cpu()
                    row += len(toks)
            return out
        finally:
            for s in sids:
                kv.free_sequence(s)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.config.kv_cache.block_size)

    def _prefill_chunks(self, sids: list[int], prompts: list[list[int]]):
        """Yield passes of at most `prefill_chunk` tokens: [(sid, tokens, start position)], in prompt order."""
        pending = deque((sid, p, 0) for sid, p in zip(sids, prompts))
        while pending:
            chunk, left = [], self.prefill_chunk
            while pending and left > 0:
                sid, p, start = pending.popleft()
                take = min(left, len(p) - start, pass_tokens(self.prefill_chunk, start))
                chunk.append((sid, p[start : start + take], start))
                left -= take
                if start + take < len(p):
                    pending.appendleft((sid, p, start + take))
            yield chunk

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_on_eos: bool = True,
        on_token: TokenCallback | None = None,
        num_samples: int = 1,
        stop: Sequence[str] = (),
    ) -> list[GenerationResult]:
        """Generate up to `max_new_tokens` for each prompt (strings or token-id lists).

        Prompts are admitted while their worst-case KV (prompt + max_new_tokens, for every sample)
        fits the KV cache; the rest wait for blocks to free up and join the running batch at a pass
        boundary; each prompt's tokens are the same as if it ran alone. With `num_samples=n` a prompt
        is prefilled once and its n samples share the prompt's KV blocks copy-on-write; results are
        prompt-major (prompt i, sample s at index i * n + s). Output o samples from its own generator,
        seeded `seed + o`. An output ends at any EOS id of generation_config.json / config.json
        (`stop_on_eos`) or when its text contains a `stop` string (its text then ends before it).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
        if num_samples < 1:
            raise ConfigError(f"num_samples must be at least 1, got {num_samples}")
        encoded = [self.encode(p) for p in prompts]
        eos = frozenset(self.generation.eos_token_ids) if stop_on_eos else frozenset()
        requests = [Request(p, Sampling(max_new_tokens, temperature, top_p, top_k,
                                        None if seed is None else seed + i * num_samples, num_samples, eos,
                                        tuple(stop)),
                            name=f"prompt {i}", on_token=on_token)
                    for i, p in enumerate(encoded)]
        stats = RunStats(prompt_tokens=sum(map(len, encoded)))
        bs = self.kv_settings.block_size
        need = sum(blocks_needed(len(r.prompt), r.sampling, bs) for r in requests)
        if self.speculator is not None and self.config.speculative.tree:  # room for every output's branches
            need += tree_blocks(sum(r.sampling.n for r in requests), row_blocks(self.speculator.most_tokens + 1, bs))
        self._ensure_kv(need)  # unless fixed
        if self.draft is not None:
            self.draft._ensure_kv(need)
        Engine(self, stats).run(requests)
        stats.generated_tokens = sum(len(o.token_ids) for r in requests for o in r.outputs)
        self.last_stats = stats
        return [GenerationResult(r.prompt, o.token_ids, self.output_text(o), o.finish_reason, stats)
                for r in requests for o in r.outputs]

    def output_text(self, o: Output) -> str:
        """An output's text: decoded, and cut before the stop string when one ended it."""
        if o.stops is not None:
            return o.stops.text
        return self.tokenizer.decode(o.token_ids) if self.tokenizer else ""
