"""A model's layers over the ranks of a torchrun launch: rank 0 drives, every rank computes its slice.

    torchrun --nproc-per-node 2 -m offload run --config x.yaml --prompt "Hi"
    # rank 0: Runner -> make_target -> PipelineExecutor (embeddings + the first slice), the engine, the tokenizer
    # rank r: run_stage(config): a stage Executor over its slice (the last one holds the head), forever until stop

Each pass: rank 0 sends every worker a control message (JSON: the KV operations since the last pass and the
`ForwardBatch`), computes its layers, and sends the hidden states [N, H] (float32 on the wire) to rank 1;
each rank computes its layers and passes them on; the last rank applies the head and sends the logits
[rows, V] float32 back to rank 0 (the head stays with the last layers: its weights stream in the same
pass order; the price is V floats per kept row on the last hop instead of H). A pass's sequences go in
`distributed.micro_batches` contiguous runs, so that rank r computes run k while rank r+1 computes run k-1
(each run is a pass of its own on every rank; auto splits only passes large enough to be bound by their math,
prefill chunks, not by reading the weights, which a run re-reads). Batch-1 latency is the sum of the stages
plus one hop per rank: one sequence cannot be split, so nothing overlaps.

KV lives with its layer's rank: every rank has a KV pool over its own layers, with the same number of
logical and device blocks (the minimum the ranks' plans allow, agreed before any pool is made). Rank 0's
engine owns the logical block table; `ReplicatedKV` applies each sequence operation (add, fork, reserve,
free, truncate, pool resizes) at once and replays it on every rank with the next message, so every rank
gives the same sequence the same id and blocks; demotion and eviction stay each rank's own. A truncation,
whose kept length depends on where each rank's blocks live, is agreed first (the minimum, to a fixpoint).

Failure: `offload.runtime.ranks` (collective timeouts, liveness beats, the rank named). This module knows
passes, stages and KV operations; not requests, sampling or text (the engine's, on rank 0).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.kv.cache import PagedKVCache
from offload.model.checkpoint import Checkpoint
from offload.plan.calibrate import load_calibration
from offload.plan.planner import run_capacities
from offload.plan.stages import RankSpeed, plan_stage_of, split_layers
from offload.runtime.device import resolve_device, resolve_dtype
from offload.runtime.executor import Executor, ForwardBatch
from offload.runtime.impls import executor_class, model_impl
from offload.runtime.ranks import RankError, Ranks, env_rank, launched, rank_device
from schedulers.plan import Capacities
from schedulers.timeline import Timeline

log = logging.getLogger(__name__)

WIRE = torch.float32  # hidden states and logits between ranks (exact for every compute dtype)
MIN_SPLIT_TOKENS = 64  # tokens a micro-batch needs before its math, not its weight reads, bounds a stage


def plan_stage(config: OffloadConfig, ranks: Ranks, caps: Capacities | None) -> tuple[OffloadConfig, range]:
    """This rank's slice and its config with the KV pool sizes and prefill chunk every rank agreed (minimums),
    so that every rank's pool takes the same sequences and blocks. A rank that cannot plan stops them all."""
    cfg = Checkpoint(config.model).config
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype)
    values, error, mine = [0, 0, 0, 0, 0], None, [1.0] * 5
    try:
        caps = caps or run_capacities(config, device)
        cal = load_calibration(config.calibration)
        mine = RankSpeed.of(caps, cal, device.type).to_list()
    except Exception as e:  # every rank must reach the exchanges below, or the others wait for it
        error = e
    speeds = [RankSpeed(*v) for v in ranks.gather(mine)]  # `layers: auto` weighs each rank's own
    try:
        if error is not None:
            raise error
        layers = split_layers(config, cfg, dtype, ranks.world, speeds)[ranks.rank]
        stage = plan_stage_of(config, cfg, dtype, device, caps, cal, layers, ranks.rank, ranks.world)
        values = stage.kv
    except Exception as e:
        error = e
    failed, *agreed = ranks.agree_min([ranks.world if error is None else ranks.rank, *values])
    if error is not None:
        raise error
    if failed < ranks.world:
        raise RankError(f"rank {failed} could not plan its layers (its own error says why); every rank stops")
    gpu, cpu, disk, chunk, resident = agreed
    # the prefix cache stays off: its hits and evictions would differ between ranks' pools (a follow-up)
    kv = dataclasses.replace(config.kv_cache, gpu_blocks=gpu or None, cpu_blocks=cpu, disk_blocks=disk,
                             prefix_cache="off")
    config = config.replace(kv_cache=kv, activations=dataclasses.replace(config.activations, prefill_chunk=chunk))
    ranks.resident = bool(resident)  # no rank streams: micro-batches read no weight twice (`auto_micro_batches`)
    log.warning("%s", stage.describe(gpu))
    return config, layers


def encode_batch(b: ForwardBatch) -> dict[str, Any]:
    return {"sids": b.sids, "tokens": b.tokens, "every": b.every, "keep": b.keep, "lanes": b.lanes}


def micro_batches(b: ForwardBatch, parts: int) -> list[ForwardBatch]:
    """The batch's sequences in at most `parts` contiguous runs of about equal tokens (a sequence is never split;
    the runs' logits, concatenated, are the batch's)."""
    total, cuts, acc = sum(b.q_lens), [0], 0
    for i, n in enumerate(b.q_lens[:-1]):
        acc += n
        if len(cuts) < parts and (2 * acc + b.q_lens[i + 1]) * parts > 2 * total * len(cuts):
            cuts.append(i + 1)  # the next sequence's middle lies past this run's share
    cuts.append(len(b.sids))

    def part(xs: tuple | None, lo: int, hi: int) -> tuple | None:
        return None if xs is None else xs[lo:hi]
    return [ForwardBatch(b.sids[lo:hi], b.tokens[lo:hi], b.every, part(b.keep, lo, hi), part(b.lanes, lo, hi))
            for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def auto_micro_batches(b: ForwardBatch, world: int, resident: bool) -> int:
    """`micro_batches: auto`: one run per rank when the pass is large enough for its math to outweigh reading
    the weights (MIN_SPLIT_TOKENS tokens a run) and no rank streams; else the pass goes whole. A decode pass
    of a few rows is bound by the bytes each stage reads, and a run re-reads them: splitting it only adds."""
    return max(1, min(world, sum(b.q_lens) // MIN_SPLIT_TOKENS)) if resident else 1


def logit_rows(b: ForwardBatch) -> int:
    return sum(b.keep) if b.keep is not None else sum(b.q_lens) if b.every else len(b.sids)


# -- rank 0 -------------------------------------------------------------------------------------------
class ReplicatedKV:
    """Rank 0's KV pool as the engine sees it: each sequence operation applied here at once and replayed on
    every rank with the next message; everything else read from the local pool."""

    def __init__(self, owner: PipelineExecutor) -> None:
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner.local_kv, name)

    def add_sequence(self, reserve_tokens: int = 0) -> int:
        return self._owner.record("add_sequence", reserve_tokens)

    def fork(self, sid: int, reserve_tokens: int) -> int:
        return self._owner.record("fork", sid, reserve_tokens)

    def reserve(self, sid: int, total_tokens: int) -> Any:
        return self._owner.record("reserve", sid, total_tokens)

    def release_reservation(self, sid: int) -> None:
        self._owner.record("release_reservation", sid)

    def free_sequence(self, sid: int) -> None:
        self._owner.record("free_sequence", sid)

    def truncate(self, sid: int, length: int, reserve: bool = False) -> int:
        return self._owner.truncate(sid, length, reserve)


class PipelineExecutor(Executor):
    """Rank 0's executor: its own slice (the embeddings and the first layers), then the other ranks' in turn;
    `forward` returns the last rank's logits. What the engine and the runner call is an `Executor`'s."""

    def __init__(self, config: OffloadConfig, ranks: Ranks, timeline: Timeline | None = None,
                 capacities: Capacities | None = None, layers: range | None = None) -> None:
        super().__init__(config, timeline, capacities, layers)
        self.ranks = ranks
        self.wire = self.device if ranks.backend == "nccl" else torch.device("cpu")
        self._replica = ReplicatedKV(self)
        self._ops: list[list[Any]] = []
        self._closed = False

    @property
    def local_kv(self) -> PagedKVCache | None:
        return Executor.kv.fget(self)  # type: ignore[attr-defined]

    @property
    def kv(self) -> Any:
        return self._replica if self.local_kv is not None else None

    def ensure_kv(self, blocks: int) -> Any:
        self.record("ensure_kv", blocks)
        return self.kv

    def fix_kv(self, blocks: int) -> Any:
        self.record("fix_kv", blocks)
        return self.kv

    def record(self, op: str, *args: Any) -> Any:
        """Apply a KV operation here and queue it for every rank."""
        target = super() if op in ("ensure_kv", "fix_kv") else self.local_kv
        out = getattr(target, op)(*args)
        self._ops.append([op, list(args)])
        return out

    def _broadcast(self, msg: dict[str, Any], replies: bool = False) -> list[dict[str, Any]]:
        if self.ranks.failed is not None:
            raise self.ranks.failed
        out = []
        with self.ranks.lock:
            msg["ops"], self._ops = self._ops, []
            for w in range(1, self.ranks.world):
                self._wait(lambda w=w: self.ranks.send_control(w, msg), w, f"sending rank {w} its next message")
            for w in range(1, self.ranks.world) if replies else ():
                out.append(self._wait(lambda w=w: self.ranks.recv_control(w), w, f"waiting for rank {w}'s answer"))
            self.ranks.sent = time.monotonic()
        return out

    def truncate(self, sid: int, length: int, reserve: bool = False) -> int:
        """The length every rank can keep (each rank's own blocks decide: the minimum, to a fixpoint)."""
        while True:
            answers = self._broadcast({"kind": "probe", "sid": sid, "length": length}, replies=True)
            kept = min([self.local_kv.keepable(sid, length)] + [a["keep"] for a in answers])
            if kept == length:
                return self.record("truncate", sid, length, reserve)
            length = kept

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The whole model's pass: logits [rows, V] float32 from the last rank (see `ForwardBatch`).

        The sequences go in micro-batches: rank 0 computes the next one while rank 1 computes this one, and so
        on down the ranks; their logits come back in order."""
        m = self.config.distributed.micro_batches or auto_micro_batches(batch, self.ranks.world, self.ranks.resident)
        parts = micro_batches(batch, m)
        self._broadcast({"kind": "pass", "batches": [encode_batch(b) for b in parts]})
        last = self.ranks.world - 1
        outs = [torch.empty(logit_rows(b), self.cfg.vocab_size, dtype=WIRE, device=self.wire) for b in parts]
        recvs = [dist.irecv(o, last) for o in outs]
        sends = []  # (work, tensor): each tensor stays referenced until its send completes
        for b in parts:
            x = super().forward(b).to(self.wire, WIRE).contiguous()  # [N, H]: this rank's layers
            sends.append((self._wait(lambda x=x: dist.isend(x, 1), 1, "sending rank 1 its hidden states"), x))
        for work, _ in sends:
            self._wait(work.wait, 1, "sending rank 1 its hidden states")
        for work in recvs:
            self._wait(work.wait, last, f"waiting for rank {last}'s logits")
        return torch.cat(outs).to(self.device)

    def _wait(self, call: Any, peer: int, doing: str) -> Any:
        """call(); a failure becomes the RankError naming the rank, and the pipeline is broken from then on."""
        try:
            return call()
        except Exception as e:
            self.ranks.failed = self.ranks.failure(doing, e, peer)
            raise self.ranks.failed from e

    def close(self) -> None:
        """Tell every worker to stop, then release this rank's memory; safe to call twice."""
        if not self._closed:
            self._closed = True
            if self.ranks.failed is None:
                try:
                    self._broadcast({"kind": "stop"})
                except RankError as e:
                    log.warning("%s", e)
            self.ranks.close()
        super().close()


def make_target(config: OffloadConfig, timeline: Timeline | None = None,
                capacities: Capacities | None = None, concurrency: int = 1, context: int | None = None) -> Executor:
    """The runner's target: an `Executor`, or under torchrun rank 0's `PipelineExecutor` (joining the launch).
    `concurrency`: the sequences the caller means to decode together, `context`: the most tokens one holds where the
    caller knows it (an automatic KV pool is planned for them; the stages of a launch plan for the model's context)."""
    if not launched():
        return executor_class(config)(config, timeline, capacities, concurrency=concurrency,  # native | transformers
                                      context=context)
    if env_rank() != 0:
        raise ConfigError("under torchrun only rank 0 makes a Runner; the other ranks run "
                          "offload.runtime.pipeline.run_stage(config) (the CLI does this for run, chat and serve)")
    if config.speculative.enabled:
        raise ConfigError("speculative decoding does not run over several ranks yet; set speculative.draft: none")
    if model_impl(config) != "native":
        raise ConfigError(f"{config.model} runs on the transformers path, which does not run over several ranks "
                          "yet; launch it without torchrun")
    config = rank_device(config)
    ranks = Ranks.join(config, resolve_device(config.device))
    try:
        config, layers = plan_stage(config, ranks, capacities)
        ranks.keep_alive()  # the workers wait for their first pass while this rank loads its weights
        return PipelineExecutor(config, ranks, timeline, capacities, layers)
    except BaseException as e:
        ranks.note_failure(f"rank 0 could not start: {e}")
        ranks.close()
        raise


# -- every other rank --------------------------------------------------------------------------------
def run_stage(config: OffloadConfig) -> None:
    """A worker rank: its slice of the model, passes as rank 0 sends them, until rank 0 says stop."""
    config = rank_device(config)
    ranks = Ranks.join(config, resolve_device(config.device))
    ex: Executor | None = None
    try:
        config, layers = plan_stage(config, ranks, None)
        ex = Executor(config, Timeline(enabled=False), None, layers)
        _serve(ex, ranks)
    except RankError as e:
        ranks.note_failure(str(e))
        raise
    except BaseException as e:
        ranks.note_failure(f"{type(e).__name__}: {e}")
        raise
    finally:
        if ex is not None:
            ex.close()
        ranks.close()


def _serve(ex: Executor, ranks: Ranks) -> None:
    wire = ex.device if ranks.backend == "nccl" else torch.device("cpu")
    prev, nxt = ranks.rank - 1, 0 if ex.has_head else ranks.rank + 1
    while True:
        try:
            msg = ranks.recv_control(0)
        except Exception as e:
            raise ranks.failure("waiting for rank 0's next message", e, 0) from e
        for op, args in msg["ops"]:
            getattr(ex if op in ("ensure_kv", "fix_kv") else ex.kv, op)(*args)
        kind = msg["kind"]
        if kind == "stop":
            return
        if kind == "probe":
            assert ex.kv is not None
            ranks.send_control(0, {"keep": ex.kv.keepable(msg["sid"], msg["length"])})
        elif kind == "pass":
            sends = []  # the tensors stay referenced until their sends complete
            for b in (ForwardBatch(**d) for d in msg["batches"]):
                h = torch.empty(sum(b.q_lens), ex.cfg.hidden_size, dtype=WIRE, device=wire)
                try:
                    dist.recv(h, prev)
                except Exception as e:
                    raise ranks.failure(f"waiting for rank {prev}'s hidden states", e, prev) from e
                out = ex.forward(b, hidden=h.to(ex.device, ex.compute_dtype)).to(wire, WIRE).contiguous()
                sends.append((dist.isend(out, nxt), out))
            for work, _ in sends:
                try:
                    work.wait()
                except Exception as e:
                    raise ranks.failure(f"sending rank {nxt} this stage's output", e, nxt) from e
