"""Predictions for a plan: time per decode step and per prefill token, and what would help most.

The model side of the cost model: a group's compute time is its weight bytes over the
calibrated layer-kernel throughput at that pass's token count, plus the calibrated fixed cost of a
layer (its ops and allocations, whatever its size), plus reading its KV blocks;
`offload.plan.costmodel.simulate` turns those and the link bandwidths into a pass time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from offload.kv.fetch import host_in_place
from offload.model.config import ModelConfig
from offload.plan.calibrate import Calibration
from offload.plan.costmodel import Prediction, plan_bytes, simulate
from offload.plan.experts import HOST_ROUND_TRIP_S, routed_share
from offload.weights.groups import WeightFormat, model_layouts
from schedulers.plan import Capacities, Plan
from storage.errors import CapacityError
from storage.units import MiB, ceil_div, fmt_bytes


@dataclass(frozen=True)
class Workload:
    batch: int = 1  # sequences decoded together
    context: int = 128  # tokens of KV each sequence attends over
    prefill_chunk: int = 512  # tokens per prefill pass


@dataclass(frozen=True)
class KVTiers:
    """Where a run keeps its KV blocks: `device` blocks in the pool the layers read in place, then up to `cpu` and
    `disk` blocks in the cold tiers (`cold_bytes` each, every layer), which every pass fetches again, layer by layer
    (`offload.kv.fetch`, on the weights' side thread), but for host blocks a CPU run reads where they lie
    (`host_in_place`: attention reads them as it reads the pool)."""

    block_size: int
    device: int
    cpu: int = 0
    disk: int = 0
    cold_bytes: int = 0
    host_in_place: bool = False

    @classmethod
    def of(cls, run_plan: Any, planner: Any) -> KVTiers | None:
        """Where a `planner.RunPlan` keeps KV blocks (its `Planner`'s cold format); None: a pool sized per request,
        which holds any context."""
        if run_plan.kv_blocks == 0:
            return None
        kv = run_plan.kv
        return cls(kv.block_size, run_plan.kv_blocks, kv.cpu_blocks, kv.disk_blocks, planner.cold_block_bytes,
                   host_in_place(planner.device.type, planner.cold_fmt.name))

    def over(self, work: Workload) -> int:
        """Blocks of the workload's sequences the device pool cannot hold."""
        return max(0, work.batch * ceil_div(work.context, self.block_size) - self.device)

    def cold(self, work: Workload) -> tuple[int, int]:
        """Of those, the blocks in the host tier and on disk (the host tier's first; what neither holds: neither)."""
        host = min(self.over(work), self.cpu)
        return host, min(self.over(work) - host, self.disk)

    def side(self, plan: Plan, work: Workload) -> dict[str, tuple[int, int]]:
        """Each layer group's cold KV bytes a pass, (host, disk), as `costmodel.simulate` takes them (host blocks
        read in place: none)."""
        host, disk = self.cold(work)
        host = 0 if self.host_in_place else host
        layers = [g for g in plan.order if g.startswith("layer.") and ".expert." not in g]
        if not (host or disk) or not layers:
            return {}
        per = self.cold_bytes // len(layers)  # a block's bytes of one layer
        return {g: (host * per, disk * per) for g in layers}


def cold_kv(kv: KVTiers | None, work: Workload) -> dict[str, int]:
    """The workload's KV blocks outside the device pool (in the host tier, on disk, held by neither) and the bytes a
    step fetches of them (host blocks read in place: not fetched)."""
    host, disk = kv.cold(work) if kv is not None else (0, 0)
    fetched = disk + (0 if kv is None or kv.host_in_place else host)
    return {"host_blocks": host, "disk_blocks": disk, "bytes_per_step": fetched * (kv.cold_bytes if kv else 0),
            "host_in_place": bool(kv and kv.host_in_place),
            "blocks_not_held": kv.over(work) - host - disk if kv is not None else 0}


def compute_sizes(cfg: ModelConfig, dtype: torch.dtype, fmt: WeightFormat, cal: Calibration,
                  device_type: str, groups: Sequence[Any] = ()) -> dict[str, int]:
    """Per group, the dense bytes at `dtype` that the cost model prices at the calibrated compute rate, a packed
    format's scaled by how much slower (or faster) its kernels went than the dense ones at one token, where the
    calibration measured the format (`compute["cpu/int4"]`); else at dense speed: a layer's to the dense bytes whose
    layer takes as long as the format's layer of its own bytes (`Calibration.layer_seconds`, fixed cost included), the
    head's and experts' by the ratio of the two rates. `groups`: the run's `GroupSpec`s, whose bytes a pass reads as
    stored say which rates (cached or from DRAM); none: the cached ones."""
    sizes = {name: layout.nbytes for name, layout in model_layouts(cfg, dtype).items()}
    if fmt.prequant is not None or fmt.quantization == "none" or device_type not in cal.compute:
        return sizes
    key = f"{device_type}/int{fmt.bits}"
    reads = sum(g.nbytes for g in groups if not g.rows_only) if groups else None

    def factor(bits: int) -> float:
        other = f"{device_type}/int{bits}"
        return cal.weight_bytes_per_s(device_type, 1, reads) / cal.weight_bytes_per_s(other, 1, reads) \
            if other in cal.compute else 1.0

    @functools.cache
    def layer(n: int) -> int:  # the dense bytes taking the format's time (bisection: time grows with bytes)
        goal, lo, hi = cal.layer_seconds(key, 1, n, reads), 0.0, float(max(n, 1))
        while cal.layer_seconds(device_type, 1, hi, reads) < goal:
            lo, hi = hi, 2 * hi
        for _ in range(40):
            lo, hi = (lo, (lo + hi) / 2) if cal.layer_seconds(device_type, 1, (lo + hi) / 2, reads) >= goal else \
                ((lo + hi) / 2, hi)
        return int(hi)
    head, experts = factor(fmt.tensor_bits("lm_head")) if fmt.packs(cfg, "lm_head") else 1.0, factor(fmt.bits)
    return {g: (int(n * experts) if ".expert." in g else layer(n) if key in cal.compute else n)
            if g.startswith("layer.") else int(n * head) if g == "head" else n for g, n in sizes.items()}


def compute_seconds(plan: Plan, cfg: ModelConfig, cal: Calibration, device_type: str, tokens: int, context: int,
                    batch: int, dtype_bytes: int, sizes: dict[str, int] | None = None) -> dict[str, float]:
    """Per group, seconds of compute for one pass of `tokens` rows (`batch` sequences of `context` tokens).

    `sizes`: the groups' bytes at the compute dtype when they differ from the moved bytes (packed
    int8/int4 weights move fewer bytes but multiply at the dense rate); default the plan's sizes.
    """
    reads = sum(n for g, n in plan.sizes.items() if g not in plan.rows_only)  # a pass's weight bytes: from the
    thr = cal.weight_bytes_per_s(device_type, tokens, reads)  # cache where they fit in it, else from DRAM
    share = routed_share(cfg, tokens)  # an expert computes only when routed; on the host when the plan says so
    host_thr = cal.weight_bytes_per_s("cpu", tokens, reads)
    kv_bytes = batch * context * 2 * cfg.kv_size * dtype_bytes  # one layer's K and V, read by attention
    out = {}
    for g, size in plan.sizes.items():
        size = (sizes or {}).get(g, size)
        if ".expert." in g:
            out[g] = share * (size / (host_thr if g in plan.host_compute else thr)
                              + (HOST_ROUND_TRIP_S if g in plan.host_compute else 0.0))
        elif g.startswith("layer."):
            out[g] = (cal.layer_seconds(device_type, tokens, size, reads)
                      + kv_bytes / cal.links.get("device memory", cal.links["memcpy"]))
        elif g == "head":  # only each sequence's last token goes through the LM head
            out[g] = size / cal.weight_bytes_per_s(device_type, min(tokens, batch), reads)
    first = next((g for g in plan.order if g.startswith("layer.") and g in out), None)
    if first is not None:  # the pass's own bookkeeping (its KV step, RoPE) before its first layer
        out[first] += cal.pass_overhead_s(device_type, tokens, reads)
    return out


def predict_decode(plan: Plan, cfg: ModelConfig, cal: Calibration, device_type: str, work: Workload,
                   dtype_bytes: int, sizes: dict[str, int] | None = None, kv: KVTiers | None = None) -> Prediction:
    """One decode step; with `kv`, the cold KV blocks the workload's context leaves outside the device pool are
    fetched every step too."""
    comp = compute_seconds(plan, cfg, cal, device_type, work.batch, work.context, work.batch, dtype_bytes, sizes)
    return simulate(plan, comp, cal.links, share=routed_share(cfg, work.batch),
                    side=kv.side(plan, work) if kv is not None else None)


def predict_prefill_per_token(plan: Plan, cfg: ModelConfig, cal: Calibration, device_type: str, work: Workload,
                              dtype_bytes: int, sizes: dict[str, int] | None = None) -> float:
    tokens = work.prefill_chunk
    comp = compute_seconds(plan, cfg, cal, device_type, tokens, tokens, 1, dtype_bytes, sizes)
    return simulate(plan, comp, cal.links, share=routed_share(cfg, tokens)).step_s / tokens


@dataclass(frozen=True)
class Suggestion:
    change: str
    step_s: float
    tokens_per_s: float
    note: str = ""


def suggestions(make_plan_for, base_caps, depth: int, cfg: ModelConfig, cal: Calibration, device_type: str,
                work: Workload, dtype_bytes: int, current: Prediction,
                sizes: dict[str, int] | None = None, kv: KVTiers | None = None) -> list[Suggestion]:
    """What-ifs through the same cost model: more cpu capacity, another depth, a larger batch.

    `make_plan_for(caps, depth) -> Plan` re-plans with other capacities or depth.
    """
    base_tps = work.batch / current.step_s
    out: list[Suggestion] = []

    def add(change: str, plan: Plan | None, batch: int = work.batch, note: str = "") -> None:
        if plan is None:
            return
        w = dataclasses.replace(work, batch=batch)
        pred = predict_decode(plan, cfg, cal, device_type, w, dtype_bytes, sizes, kv)
        out.append(Suggestion(change, pred.step_s, batch / pred.step_s, note))

    streamed_from_disk = plan_bytes(make_plan_for(base_caps, depth), "disk read")
    if streamed_from_disk and base_caps.cpu is not None:
        extra = ceil_div(streamed_from_disk, MiB) * MiB  # what the disk serves per step, in whole MiB
        more = dataclasses.replace(base_caps, cpu=base_caps.cpu + extra)
        add(f"tiers.cpu.capacity +{fmt_bytes(extra, digits=1)} (nothing read from disk)",
            _try(make_plan_for, more, depth))
    if base_caps.gpu is not None:
        add("tiers.gpu.capacity +50%", _try(make_plan_for, dataclasses.replace(base_caps, gpu=int(base_caps.gpu * 1.5)),
                                            depth))
    for d in (depth - 1, depth + 1):
        if d >= 0:
            add(f"prefetch.depth {d}", _try(make_plan_for, base_caps, d))
    add(f"batch {work.batch * 8} (more sequences share each transfer)", make_plan_for(base_caps, depth),
        batch=work.batch * 8)
    out.sort(key=lambda s: -s.tokens_per_s)
    return [s for s in out if s.tokens_per_s > base_tps * 1.02]


def _try(make_plan_for: Callable[[Capacities, int], Plan], caps: Capacities, depth: int) -> Plan | None:
    try:
        return make_plan_for(caps, depth)
    except CapacityError:
        return None
