"""One model's forward pass over a weight source and a KV pool: the seam every user of the model goes through.

    ex = Executor(config)                                   # plan -> weight source (tiers) -> KV pool
    kv = ex.ensure_kv(blocks)                               # the device block pool: fixed, or grown to fit
    sid = kv.add_sequence()
    logits = ex.forward(ForwardBatch.last([sid], [[1, 5, 9]]))          # [1, vocab] float32
    ex.close()

Who calls it: the engine loop (one pass per step over every running sequence), speculative decoding
(the draft is a second executor, every weight resident), conversations (through the engine) and
`prefill_logits`. It knows the checkpoint's shape, the device and dtypes, the plan, the weight source, the
KV pool, RoPE, prefill chunking and the timeline; not text, sampling, requests or admission (the engine's).

What a pass is made of (a subclass, or a strategy calling these, may extend it):

    begin_pass(batch) -> LayerPass   the rows' layout, the KV step and RoPE every layer shares
    layer(i, x, p) -> x              one decoder layer: acquire its group, compute, release (a MoE layer's
                                     routed experts come from the weight source's `experts(i)`)
    layers, has_head                 the layers a pass runs: a pipeline stage takes hidden states
                                     (`forward(batch, hidden=x)`) and, without the head, returns them
    head_logits(x, p)                the rows the batch keeps -> logits

The model math is `offload.model.functional` (pure); where the weights come from is the weight source's
business (`offload.weights.tiered`); the blocks are `offload.kv.cache`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from offload.config import OffloadConfig
from offload.kv.cache import PagedKVCache
from offload.kv.view import LayerKV
from offload.model import functional as M
from offload.model import kernels
from offload.model.checkpoint import Checkpoint
from offload.model.layout import column_groups, kept_rows
from offload.plan.passes import pass_tokens
from offload.plan.planner import Planner, run_capacities
from offload.runtime.cores import share_cores
from offload.runtime.device import DTYPES, resolve_device, resolve_dtype  # noqa: F401 (re-exported)
from offload.runtime.passes import ForwardBatch, LayerPass, PromptChunk  # noqa: F401 (re-exported)
from offload.runtime.resident import ResidentLayers
from offload.weights.groups import WeightFormat
from offload.weights.reading import check_tensors
from offload.weights.tiered import TieredWeights
from schedulers.plan import Capacities
from schedulers.timeline import Timeline
from schedulers.traffic import Traffic
from schedulers.transfer import TransferEngine
from storage.heap import TRIM_ROWS, trim_heap
from storage.units import blocks_for

log = logging.getLogger(__name__)

@runtime_checkable
class WeightSource(Protocol):
    """Where an executor gets each group's weights (`TieredWeights`: resident, or streamed through the tiers).

    Groups are acquired in the plan's order each pass (`layer.0` .. `layer.N-1`, `head`); `acquire` may wait
    for the bytes, and the views it returns stay valid until `release`."""

    engine: TransferEngine  # the run's one transfer engine (cold KV blocks cross on it too)

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # [N] (CPU) -> [N, H] on the device, compute dtype
    def acquire(self, group: str) -> dict[str, M.Weight]: ...  # the group's tensors (packed matrices as PackedWeight)
    # its slot may be reused; span: when its compute ran (timeline times), where the caller timed it itself
    def release(self, group: str, span: tuple[float, float] | None = None) -> None: ...
    def experts(self, layer: int) -> Any: ...  # a MoE layer's ExpertSource (offload.weights.experts)
    def expert_stats(self) -> dict[str, Any]: ...  # the expert cache's hits, misses, prediction accuracy
    def abort_pass(self) -> None: ...  # a pass stopped half way: start the next one cleanly
    # KV memory inside the tier budgets the plan reserved: 1-D uint8, the device pool ("gpu") or cold host ("cpu")
    def allocate_kv(self, nbytes: int, tier: str = "gpu") -> torch.Tensor: ...
    # per-pass work that rides with the weights, keyed by group (each job returns (result, bytes moved));
    # `side_result(group)` waits for that group's
    def submit_side(self, jobs: Mapping[str, Callable[[], tuple[Any, int]]]) -> None: ...
    def side_result(self, group: str) -> Any: ...
    def close(self) -> None: ...


class _Resources:
    """What an executor must release (loader threads, slot files, the store's lock), kept apart from it so
    that a finalizer can release it after the executor itself is gone."""

    def __init__(self) -> None:
        self.weights: WeightSource | None = None
        self.kv: PagedKVCache | None = None

    def close(self) -> None:
        weights, kv, self.weights, self.kv = self.weights, self.kv, None, None
        try:
            if weights is not None:
                weights.close()
        finally:
            if kv is not None:
                kv.close()


class Executor:
    """Everything it starts is released by `close()`, else when it is garbage-collected, else at exit.

    `capacities` (bytes per tier) default to what the config's tiers resolve to on this machine; the runner
    passes less when a speculative draft already took its share of the device. `concurrency`: the sequences
    the caller means to decode together, `context`: the most tokens one holds where the caller knows it (the planner
    sizes an automatic KV pool for them). The config's `model` must
    be a local directory (`OffloadConfig.fetched()` brings a Hub checkpoint first)."""

    kv_class: type[PagedKVCache] = PagedKVCache  # the KV pool a subclass keeps (offload.hf: DynamicCaches beside it)

    def __init__(self, config: OffloadConfig, timeline: Timeline | None = None,
                 capacities: Capacities | None = None, layers: range | None = None, concurrency: int = 1,
                 context: int | None = None) -> None:
        share_cores()  # this thread's first look: its first window spans the load (two runs started together)
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.close)
        self.config = config
        self.device = resolve_device(config.device)
        self.checkpoint = Checkpoint(config.model, config.model_impl)
        self.cfg = self.checkpoint.config
        # every tensor config.json and the weight format imply, from the headers: before planning or allocating
        check_tensors(self.checkpoint, WeightFormat.from_config(config.weights, self.cfg))
        kernels.use_activations(config.weights.int4_activations, config.weights.int8_activations)
        self.dtype = resolve_dtype(config.dtype, self.cfg.torch_dtype)  # the weights move as this
        self.timeline = timeline or Timeline(nvtx=self.device.type == "cuda", keep_steps=config.timeline.keep_steps)
        self.traffic = Traffic()  # bytes moved by weights and KV blocks, per route
        self.layers = range(self.cfg.num_layers) if layers is None else layers  # the slice a pass runs
        self.layer_groups = tuple(f"layer.{i}" for i in range(self.cfg.num_layers))
        self.resident = ResidentLayers(self)  # a pass's layers: runs of resident ones in one compiled call each
        caps = capacities if capacities is not None else run_capacities(config, self.device)
        run_plan = Planner(config, self.cfg, self.dtype, self.device, caps, self.layers, concurrency,
                           context).run_plan()
        self.batch = run_plan.batch  # sequences the device KV pool keeps decoding together (None: sized per request)
        self.kv_settings = run_plan.kv
        self.compute_dtype = run_plan.compute_dtype  # the math and the KV cache
        self.rope = M.Rope(self.cfg, self.device, self.compute_dtype)
        self.kv_block_bytes = run_plan.kv_block_bytes  # device bytes of one KV block (all layers)
        self.plan = run_plan.plan
        self.prefill_chunk = run_plan.prefill_chunk  # activations.prefill_chunk, `auto` resolved
        self._res.weights = TieredWeights(config, self.checkpoint, self.dtype, self.device, self.timeline,
                                          run_plan.plan, self.traffic, self.compute_dtype, self.layers)
        self._kv_fixed = run_plan.kv_blocks > 0
        if self._kv_fixed:  # tiers (or kv_cache.gpu_blocks): one pool inside the device tier's budget
            try:
                nbytes = run_plan.kv_blocks * run_plan.kv_block_bytes
                memory = self.weights.allocate_kv(nbytes) if config.tiers and self.kv_class.holds_kv else None
                host = run_plan.plan.host_reserve  # the cold host blocks, in the cpu tier's (pinned) arena
                host_memory = self.weights.allocate_kv(host, "cpu") if config.tiers and host else None
                self._res.kv = self._make_kv(run_plan.kv_blocks, memory, host_memory)
            except BaseException:
                self.close()
                raise

    @property
    def weights(self) -> WeightSource:
        assert self._res.weights is not None, "the executor is closed"
        return self._res.weights

    @property
    def kv(self) -> PagedKVCache | None:
        """The KV block pool (None until `ensure_kv` when the config sizes it per request)."""
        return self._res.kv

    @property
    def has_head(self) -> bool:
        """Does a pass end with the head (logits), or hand hidden states on (a pipeline stage)?"""
        return self.layers.stop == self.cfg.num_layers

    def close(self) -> None:
        """Stop and join every thread, close files and release memory; safe to call twice."""
        self.resident.forget()
        self._finalizer()

    # -- the KV pool ----------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.kv_settings.block_size)

    @property
    def kv_fixed(self) -> bool:
        return self._kv_fixed

    def ensure_kv(self, blocks: int) -> PagedKVCache:
        """The device block pool: fixed (tiers, kv_cache.gpu_blocks, `fix_kv`), or (re)made with `blocks`."""
        if self._kv_fixed:
            assert self.kv is not None
            return self.kv
        if self.kv is None or self.kv.pool.num_blocks < blocks:
            old, self._res.kv = self._res.kv, None
            if old is not None:
                old.close()  # the old pool goes before the new one is allocated
            self._res.kv = self._make_kv(blocks)
        return self._res.kv

    def fix_kv(self, blocks: int) -> PagedKVCache:
        """Keep one pool from now on (a long-lived engine): a planned pool stays as it is, a per-request one
        is made with `blocks` blocks (if smaller) and no longer resized."""
        kv = self.ensure_kv(blocks)
        self._kv_fixed = True
        return kv

    def _make_kv(self, gpu_blocks: int, memory: torch.Tensor | None = None,
                 host_memory: torch.Tensor | None = None) -> PagedKVCache:
        s = self.kv_settings
        disk = self.config.tiers.disk if self.config.tiers else None
        return self.kv_class(self.cfg, s.block_size, gpu_blocks, self.compute_dtype, self.device, memory=memory,
                            settings=s,
                            disk_dir=disk.path / "kv-scratch" if disk is not None and s.disk_blocks else None,
                            pin_memory=self.device.type == "cuda", timeline=self.timeline, rope=self.rope,
                            traffic=self.traffic, host_memory=host_memory, engine=self.weights.engine,
                            page_cache=bool(disk and disk.page_cache), identity=self.kv_identity,
                            prefix_dir=disk.path / "prefix-cache" if disk is not None else None, layers=self.layers)

    @functools.cached_property
    def kv_identity(self) -> str:
        """What this executor's K/V depend on besides the tokens: the checkpoint (its path, config and weight
        files' sizes and times), the weight format, the compute dtype and the layers (the prefix cache's key root)."""
        model = Path(self.config.model).resolve()
        files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model.glob("*.safetensors"))
        return f"{model}|{self.cfg}|{files}|{self.config.weights}|{self.compute_dtype}|{self.layers}"

    # -- the forward pass -----------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One pass over `self.layers`: logits [rows, V] float32 (see `ForwardBatch`), or, without the head
        (a pipeline stage), hidden states [N, H]. `hidden` [N, H]: the previous stage's, instead of embedding
        the tokens. The new tokens' K/V are written into the KV pool."""
        share_cores(self.timeline)
        p = self.begin_pass(batch)
        try:
            self._start_cold_fetch(p)
            x = self.weights.embed(p.ids) if hidden is None else hidden  # [N, H]
            # runs of resident layers in one call each, the rest one by one; a decode step's head with the last run
            x, logits = self.resident(x, p, self.has_head and self._every_row(p))
            out = logits if logits is not None else self.head_logits(x, p) if self.has_head else x
        except BaseException:
            self.weights.abort_pass()
            raise
        finally:
            self.timeline.next_step()
        return out

    def begin_pass(self, batch: ForwardBatch) -> LayerPass:
        """Place the pass's tokens in the KV pool (blocks allocated, cold ones scheduled) and lay its rows out."""
        kv = self.kv
        assert kv is not None, "call ensure_kv first"
        layout, step = kv.prepare(list(batch.sids), batch.q_lens)
        if batch.keep is not None:  # verifying drafts: each token column multiplies as a plain decode step would
            lanes = list(batch.lanes or ())
            columns = max((n for n, b in zip(layout.q_lens, lanes) if b >= 0), default=0)
            layout = dataclasses.replace(layout, columns=columns,
                                         row_groups=column_groups(layout.q_lens, layout.positions.device, lanes))
        ids = torch.tensor([t for seq in batch.tokens for t in seq], dtype=torch.long)
        rope_table = self.rope if self.kv_settings.restore == "recompute" else None
        cold = kv.fetches(step)
        return LayerPass(batch, ids, layout, step, self.rope(layout.positions, max(layout.kv_lens, default=0)),
                         rope_table, cold)

    def layer(self, i: int, x: torch.Tensor, p: LayerPass) -> torch.Tensor:
        """Decoder layer i on x [N, H] -> [N, H], its group acquired for the computation and released after."""
        group = self.layer_groups[i]
        view = self.kv_view(i, p)  # (its cold blocks first: a wait for them is a stall, not the layer's compute)
        w = M.LayerWeights.from_views(self.weights.acquire(group))
        experts = self.weights.experts(i) if w.moe is not None else None  # it releases the layer's group
        with self.timeline.range(f"offload/compute/{group}"):
            x = M.decoder_layer(x, w, view, p.layout, p.cos_sin, self.cfg, self.cfg.sliding_windows[i], p.rope_table,
                                experts)
        if self.device.type == "cpu" and x.shape[0] >= TRIM_ROWS:  # a prompt's pass: its temporaries leave the heap
            trim_heap()
        if experts is None:
            self.weights.release(group)
        else:
            experts.finish()
        return x

    def kv_view(self, i: int, p: LayerPass) -> LayerKV:
        """What layer i of the pass reads and writes of the KV pool (its cold blocks fetched by now)."""
        assert self.kv is not None
        return self.kv.view(i, p.layout, p.step, self._cold_blocks(i, p))

    @staticmethod
    def _every_row(p: LayerPass) -> bool:
        """Does the pass keep the logits of each of its rows (`head_logits` takes none out)?"""
        b = p.batch
        return b.keep is None and (b.every or all(n == 1 for n in p.layout.q_lens))

    def head_logits(self, x: torch.Tensor, p: LayerPass) -> torch.Tensor:
        """x [N, H] -> logits [rows, V] float32 of the rows the batch keeps."""
        b, groups = p.batch, None
        if b.keep is not None:
            rows = kept_rows(p.layout.q_lens, list(b.keep), x.device)
            x = x if rows is None else x[rows]
            groups = column_groups(list(b.keep), x.device, list(b.lanes or ()))
        elif not self._every_row(p):  # (one row a sequence: already its last)
            x = x[p.layout.last_token_rows()]
        w = M.HeadWeights.from_views(self.weights.acquire("head"))
        with self.timeline.range("offload/compute/head"):
            logits = M.head(x, w, self.cfg, groups)
        self.weights.release("head")
        return logits

    # -- cold KV: each layer's host/disk blocks ride with that layer's weights (the weight source's side jobs) --
    def _start_cold_fetch(self, p: LayerPass) -> None:
        if p.cold:
            kv = self.kv
            assert kv is not None
            self.weights.submit_side({self.layer_groups[i]: functools.partial(kv.fetch_cold, i, p.step)
                                      for i in self.layers})

    def _cold_blocks(self, i: int, p: LayerPass) -> Any:
        return self.weights.side_result(self.layer_groups[i]) if p.cold else None

    # -- prompts --------------------------------------------------------------------------------
    def prefill_chunks(self, sids: Sequence[int], prompts: Sequence[Sequence[int]]) -> Iterator[list[PromptChunk]]:
        """Passes of at most `prefill_chunk` prompt tokens, in prompt order (fewer once a prompt's context
        outgrows the attention workspace: `offload.plan.passes.pass_tokens`)."""
        pending = deque(PromptChunk(sid, list(p), 0) for sid, p in zip(sids, prompts))
        while pending:
            chunk: list[PromptChunk] = []
            left = self.prefill_chunk
            while pending and left > 0:
                sid, p, start = pending.popleft()
                take = min(left, len(p) - start, pass_tokens(self.prefill_chunk, start))
                chunk.append(PromptChunk(sid, p[start : start + take], start))
                left -= take
                if start + take < len(p):
                    pending.appendleft(PromptChunk(sid, p, start + take))
            yield chunk

    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits for every position of each prompt (token ids): [batch, max_len, vocab] float32, zeros past a
        prompt's end. Its sequences are freed after."""
        kv = self.ensure_kv(sum(self.blocks_for(len(p)) for p in prompts))
        sids = [kv.add_sequence() for _ in prompts]
        try:
            out = torch.zeros(len(prompts), max(map(len, prompts)), self.cfg.vocab_size)
            row_of = {sid: b for b, sid in enumerate(sids)}
            for chunk in self.prefill_chunks(sids, prompts):
                logits = self.forward(ForwardBatch.every_token([c.sid for c in chunk], [c.tokens for c in chunk]))
                row = 0
                for c in chunk:
                    out[row_of[c.sid], c.start : c.start + len(c.tokens)] = logits[row : row + len(c.tokens)].cpu()
                    row += len(c.tokens)
            return out
        finally:
            for s in sids:
                kv.free_sequence(s)
