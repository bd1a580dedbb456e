"""The compute probe of a calibration: test decoder layers timed as a run computes them.

A layer's time at a pass of n tokens is split into a fixed cost (`layer_overhead_s`) and weight bytes per second,
from three shapes (`REFERENCE`, or a smaller one where RAM is short, `NARROW` and `SMALL`): two such lines in a
layer's bytes, the `narrow_` one for layers smaller than NARROW's. On a CPU a resident pass runs its layers back to
back in one call (`offload.runtime.resident`), so the probe does too, and it times each line twice:

    weight_bytes_per_s        copies of one layer (its bytes stay in the CPU's caches after the first): what a
                              model whose layers fit in the last-level cache sees
    cold_weight_bytes_per_s   distinct copies beyond the last-level cache (`llc_bytes`): what a model larger
                              than the cache sees, every byte from DRAM

The planner picks one by the bytes a pass reads (`Calibration.layer_seconds`, `weight_bytes_per_s`). Knows the model
math and the KV pool it runs the layers over; not files or plans.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from offload.kv.cache import PagedKVCache
from offload.model import functional as M
from offload.model import kernels
from offload.model.config import ModelConfig
from offload.plan.memory import ram_available
from offload.weights.groups import WeightFormat, group_layout, weight_views
from offload.weights.quant import Scratch
from storage.arena import aligned_empty
from storage.units import blocks_for

REFERENCE = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
             "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 32000}
#: a tiny layer (1/300 of REFERENCE's bytes, its time nearly all fixed cost): with REFERENCE, splits a layer's
#: time into a fixed cost and a byte rate at pass sizes up to SPLIT_TOKENS tokens
SMALL = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 32000}
SPLIT_TOKENS = 8
#: a narrow layer (REFERENCE's widths / 4: 1/16 of its bytes, 5.5 MB in bf16), timed beside them: two lines in a
#: layer's bytes, not one (`measure_compute`); a test layer less than NARROW_SPAN times its bytes makes one line
NARROW = REFERENCE | {k: REFERENCE[k] // 4 for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                      "num_key_value_heads")}
NARROW_SPAN = 3
#: copies of a test layer a CPU probe runs in one call for the cached rate, as a resident pass runs its layers
RUN_LAYERS = 4
#: the most distinct copies the cold rate runs through (a small test layer on a large cache)
MAX_COPIES = 64
#: where the size of the last-level cache is not known
DEFAULT_LLC = 32 * 2**20
#: a test layer's time at a token count is the median of at least 5 runs and of as many as fit in this many
#: seconds (at most MAX_RUNS), as a run's step is a mean over its layers: a VM's memory swings from one millisecond
#: to the next. The best of 5 runs of a 2-3 ms layer had put a 2-core Zen 4's int8 REFERENCE layer at 37-60 GB/s
#: (dense bytes) from one call to the next, the first calls of a process the slowest, where a 1.7B int8 run
#: streamed 53-66; `offload plan` against 4 measured runs of 6 models: within 20% 14 -> 17 times of 24, the worst
#: +82 -> +52% (the 1.7B int8, every time the worst)
TYPICAL_S = 0.15
MAX_RUNS = 60


def llc_bytes() -> int:
    """The CPU's last-level cache in bytes (Linux sysfs; `DEFAULT_LLC` where it says nothing)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            if (index / "type").read_text().strip() == "Instruction":
                continue
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        try:
            best = max(best, int(size.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best or DEFAULT_LLC


def measure_compute(device: torch.device, dtype: torch.dtype, tokens: tuple[int, ...] = (1, 8, 64, 512),
                    context: int = 64, compute: torch.dtype | None = None,
                    quantization: str = "none", shape: dict[str, Any] = REFERENCE,
                    cold_bytes: int = 0) -> dict[str, list[float]]:
    """One decoder layer's time per pass of n tokens, as a fixed cost per layer and weight bytes per second.

    The layer is computed as a run computes it: weights stored in `dtype` (group-wise packed with
    `quantization`), activations and KV in `compute` (default `dtype`). At decode-like token counts (up to
    SPLIT_TOKENS) three shapes (`shape`: REFERENCE unless RAM is short; NARROW; SMALL) give a layer's time as two
    lines in its bytes (`_line`): t = overhead + bytes / rate through NARROW and `shape` (`layer_overhead_s`,
    `weight_bytes_per_s`: layers of NARROW's bytes or more) and through SMALL and NARROW (the `narrow_` columns,
    `narrow_bytes`: smaller layers), as a narrow layer reads its bytes slower than a wide one (per row and per
    product costs: SmolLM2-135M's 576-wide int4 layer, 2-core Zen 4, 30-40 GB/s of dense bytes where one line
    through SMALL and REFERENCE said 60-70, its plan -20%); a `shape` within NARROW_SPAN of NARROW: one line through
    SMALL and it. Past SPLIT_TOKENS, where a pass's work grows with its tokens and attention, the large layer's
    rate alone. With `cold_bytes` (a CPU), the layers are also timed through distinct copies of about that many
    bytes in all (a layer larger than them: its own runs, already from DRAM): the `cold_` columns, lines through
    the same shapes, what a model larger than the cache sees (up to SPLIT_TOKENS; past them every byte read feeds
    as many rows, the products bound a pass, and the cold rate is the cached one).
    The bytes are a layer's dense bytes at `dtype` whatever the format, so a packed format's table says how fast
    its kernels go through the same matrices (the planner's `compute_sizes` are dense bytes)."""
    compute = compute or dtype
    big = _layer_seconds(shape, device, dtype, tokens, context, compute, quantization, cold_bytes)
    decode = tuple(n for n in tokens if n <= SPLIT_TOKENS)  # (past them the lines are the wide layer's rate alone)
    narrow = _layer_seconds(NARROW, device, dtype, decode, context, compute, quantization, cold_bytes) \
        if big[0] >= NARROW_SPAN * dense_layer_bytes(NARROW, dtype) else None
    small = _layer_seconds(SMALL, device, dtype, tokens, context, compute, quantization, 0)
    table: dict[str, Any] = {"tokens": list(tokens)}
    shapes = (small, narrow, big) if narrow else (small, big)
    for i, n in enumerate(tokens):
        for pre in ("", "cold_") if cold_bytes else ("",):
            if n > SPLIT_TOKENS:  # (cold: every byte feeds many rows, the cached rate; `_layer_seconds`)
                lines = {seg: (big[0] / big[1][i], 0.0) for seg in ("", "narrow_")[:len(shapes) - 1]}
            else:  # the top line through the two largest, the narrow one through the two smallest
                points = [(b, (cold if pre and cold else hot)[i]) for b, hot, cold in shapes]
                lines = {"": _line(*points[-2], *points[-1])} | \
                    ({"narrow_": _line(*points[0], *points[1])} if narrow else {})
            for seg, (rate, overhead) in lines.items():
                table.setdefault(f"{pre}{seg}weight_bytes_per_s", []).append(rate)
                table.setdefault(f"{pre}{seg}layer_overhead_s", []).append(overhead)
    if narrow is not None:
        table["narrow_bytes"] = narrow[0]
    table |= {"pass_overhead_s": pass_seconds(device, compute, tokens, context)}
    if device.type == "cpu":
        table["cold_pass_overhead_s"] = pass_seconds(device, compute, tokens, context, cold=True)
    return table


def _line(b0: int, t0: float, b1: int, t1: float) -> tuple[float, float]:
    """(rate, overhead) of t = overhead + bytes / rate through a layer of `b0` bytes timed at `t0` s and a larger one
    of `b1` at `t1`; where timing noise makes the overhead come out negative (or the larger no slower), the larger
    one's rate alone."""
    rate = (b1 - b0) / (t1 - t0) if t1 > t0 else b1 / t1
    overhead = t0 - b0 / rate
    return (rate, overhead) if overhead > 0 else (b1 / t1, 0.0)


def dense_layer_bytes(shape: dict[str, Any], dtype: torch.dtype) -> int:
    """A decoder layer of a test `shape`'s bytes, dense in `dtype` (what the tables' rates are in)."""
    return group_layout(ModelConfig.from_dict(shape), "layer.0", dtype).nbytes


def faster_of(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, list[float]]:
    """Two `measure_compute` tables of one layer merged: at each pass size the rate, fixed cost and cold rate of the one
    that went faster, the smaller pass costs. (Where a calibration's dense layers were timed in a slow stretch of a
    shared host: one of ~10 calibrations on a 2-core Zen 4 put them at 11 GB/s, its int8 layers measured seconds later
    at the usual rate and the plan of a bf16 run off by +170%.)"""
    faster = [b if rb > ra else a for ra, rb in zip(a["weight_bytes_per_s"], b["weight_bytes_per_s"])]
    out = dict(a)
    for key in a.keys() & b.keys():
        if key.endswith("pass_overhead_s"):
            out[key] = [min(x, y) for x, y in zip(a[key], b[key])]
        elif key.endswith(("weight_bytes_per_s", "layer_overhead_s")):  # (each line of the faster table)
            out[key] = [src[key][i] for i, src in enumerate(faster)]
    return out


def pass_seconds(device: torch.device, compute: torch.dtype, tokens: tuple[int, ...], context: int = 64,
                 cold: bool = False) -> list[float]:
    """A pass's fixed cost beside its layers at each token count: the KV pool's step for its sequences (blocks,
    block tables, the mask: `PagedKVCache.prepare`), RoPE at the new positions and the token ids, as the executor's
    `begin_pass` makes them (SMALL's shape: the cost is bookkeeping, not bytes); the best of 5. `cold` (a CPU): each
    timed as a pass of a model larger than the cache meets it, after the previous pass's weights went through the
    caches (`evictor`): its ~20 small torch ops cost ~4x more then (SmolLM2-135M bf16 decode: 0.14 ms hot, 0.6 ms
    cold, ~0.6 ms in the run)."""
    cfg = ModelConfig.from_dict(SMALL)
    rope = M.Rope(cfg, device, compute)
    flush = evictor() if cold and device.type == "cpu" else (lambda: None)
    out = []
    for n in tokens:
        batch = max(1, min(n, 8)) if n <= 8 else 1
        per_seq = n // batch
        kv = PagedKVCache(cfg, 16, batch * blocks_for(context + 6 * per_seq, 16), compute, device)
        sids = [kv.add_sequence() for _ in range(batch)]
        kv.prepare(sids, [context] * batch)
        best = math.inf
        for _ in range(5):
            flush()
            t0 = time.perf_counter()
            layout_, step = kv.prepare(sids, [per_seq] * batch)
            rope(layout_.positions)
            torch.tensor([1] * (batch * per_seq), dtype=torch.long)
            kv.view(0, layout_, step).paged(None)  # the step's mask
            best = min(best, time.perf_counter() - t0)
        out.append(best)
    return out


#: the probes (buffers, test layers) take at most this share of the RAM the process may still fill, one at a time
PROBE_SHARE = 1 / 4
#: the smallest buffer `cache_curve` reads (past any core's L2), each next one half again as large
CURVE_FROM = 16 * 2**20
#: bytes each round of a `cache_curve` size reads (at least two passes over its buffer)
CURVE_ROUND = 512 * 2**20


def cache_curve(limit: int) -> dict[str, list[float]]:
    """How fast this process reads a buffer again and again by its size: {"bytes": [...], "bytes_per_s": [...]} from
    CURVE_FROM up to `limit` (the best of 3 rounds a size). The last-level cache sysfs names can be a host's, shared
    with other machines: a 2-core Xeon VM's says 480 MiB, and its buffers ran at 52 GB/s up to 96 MiB, 39 at 128, 31
    from 192 (DRAM); SmolLM2-135M int8 (175 MB a decode step) planned at the cached rate was -48% off its run. The
    planner reads a pass's share of cached rate off this curve (`hot_share`)."""
    sizes, rates, size = [], [], CURVE_FROM
    while size <= limit:
        buf = torch.ones(size // 4, dtype=torch.float32)
        buf.sum()
        passes = max(2, CURVE_ROUND // size)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(passes):
                buf.sum()
            best = min(best, time.perf_counter() - t0)
        sizes.append(size)
        rates.append(size * passes / best)
        del buf
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # 16, 24, 32, 48, 64, ... MiB
    return {"bytes": sizes, "bytes_per_s": rates}


def faster_curve(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, list[float]]:
    """Two `cache_curve`s of the same sizes merged: at each size the faster read. Where a pass's weights sit near
    the cache's edge its share there moves with what the machine's other tenants hold (SmolLM2-135M int8, 143 MB a
    pass, a 2-core Xeon VM: 134 MB read at 33.2 and, minutes later, 42.7 GB/s; the plan's step 7.6 and 6.1 ms
    against 6.1 measured): like the layers' tables (`faster_of`), the calibration keeps the faster of two."""
    if a["bytes"] != b["bytes"]:
        return a
    return {"bytes": list(a["bytes"]), "bytes_per_s": [max(x, y) for x, y in zip(a["bytes_per_s"], b["bytes_per_s"])]}


def hot_share(curve: dict[str, list[float]], reads: float) -> float:
    """The share of a pass's weight bytes (`reads` of them, read once a pass) its next pass finds in the cache, off
    a `cache_curve`: where its read rate falls between the curve's first (the cache) and its last (DRAM)."""
    sizes = curve["bytes"]
    rates = [min(curve["bytes_per_s"][:i + 1]) for i in range(len(sizes))]  # more bytes are never read faster
    fast, slow = rates[0], rates[-1]
    if fast <= 1.05 * slow:  # no cache the curve can see at these sizes
        return 1.0 if reads < sizes[0] else 0.0
    return min(1.0, max(0.0, (log_linear(sizes, rates, reads) - slow) / (fast - slow)))


def log_linear(xs: list[float], ys: list[float], x: float) -> float:
    """ys at x, linear in log(x) between the points, flat outside them."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return (1 - w) * y0 + w * y1
    return ys[0] if x <= xs[0] else ys[-1]


#: the most bytes `evictor`'s call reads to push other data out of the caches
EVICT_MAX = 512 * 2**20


def evictor() -> Callable[[], None]:
    """A call that reads twice the last-level cache's bytes (at most EVICT_MAX, and PROBE_SHARE of the RAM the
    process may still fill): what a pass's weights do to the caches, so bookkeeping timed after it finds its code and
    data where a run finds them (in DRAM). Its buffer lives as long as the call. (A Xeon VM's sysfs names a 480 MiB
    cache: its 512 MiB buffer had the first `chat --auto` in a 600 MiB memory cgroup killed while calibrating.)"""
    room = int(ram_available() * PROBE_SHARE)
    buf = torch.ones(max(min(2 * llc_bytes(), EVICT_MAX, room), 2**20) // 4, dtype=torch.float32)
    return lambda: buf.sum()


def _layer_seconds(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, tokens: tuple[int, ...],
                   context: int, compute: torch.dtype, quantization: str,
                   cold_bytes: int = 0) -> tuple[int, list[float], list[float] | None]:
    """(the layer's dense bytes at `dtype`, the median time (`TYPICAL_S`) of a layer of `shape` at each token count
    (a CPU: per layer of a run of `RUN_LAYERS` copies of it), the same through distinct copies of about `cold_bytes`
    (None without: not a CPU, or no cold bytes asked))."""
    cfg = ModelConfig.from_dict(shape)
    fmt = WeightFormat(quantization)
    layout = group_layout(cfg, "layer.0", dtype, fmt)
    def fresh() -> torch.Tensor:  # a layer's bytes in the memory a run's CPU tier gives them (huge pages)
        return aligned_empty(layout.nbytes) if device.type == "cpu" else \
            torch.empty(layout.nbytes, dtype=torch.uint8, device=device)

    buf = fresh()
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, t in layout.views(buf).items():
        if t.dtype == torch.uint8:  # packed codes
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
        elif name.endswith(".sz"):  # (scale, zero) pairs of weights ~ N(0, 1 / in)
            t.copy_((torch.rand(t.shape, generator=g) * 0.01).to(dtype))
        else:
            t.copy_((torch.randn(t.shape, generator=g) / max(t.shape[-1], 1) ** 0.5).to(dtype))

    def weights(b: torch.Tensor) -> M.LayerWeights:  # upcast after the transfer as the run does: all but the
        views = layout.views(b)  # matrices a CPU kernel widens as it multiplies
        views = {k: v if v.dtype == torch.uint8 or kernels.widens(v, compute) else v.to(compute)
                 for k, v in views.items()}
        return M.LayerWeights.from_views(weight_views(cfg, "layer.0", views, Scratch(), fmt))

    w = weights(buf)
    probe = torch.zeros(1, cfg.hidden_size, dtype=compute, device=device)
    run = M.layer_run(probe, [w] * RUN_LAYERS, cfg) if device.type == "cpu" else None
    # the copies beside w: together at most cold_bytes
    copies = min(MAX_COPIES, math.ceil(cold_bytes / layout.nbytes)) if run is not None else 0
    copies = copies if copies >= 2 else 0
    others = [weights(fresh().copy_(buf)) for _ in range(copies - 1)]
    cold_run = M.layer_run(probe, [w] + others, cfg) if copies else None
    rope = M.Rope(cfg, device, compute)
    planes = ModelConfig.from_dict(shape | {"num_hidden_layers": max(RUN_LAYERS, copies)})  # the KV pool's layers
    hot: list[float] = []
    cold: list[float] | None = [] if cold_run is not None else None
    for n in tokens:
        batch = max(1, min(n, 8)) if n <= 8 else 1  # decode-like for small n, one prefill chunk for large
        per_seq = n // batch
        kv = PagedKVCache(planes, 16, batch * blocks_for(context + per_seq, 16), compute, device)
        sids = [kv.add_sequence() for _ in range(batch)]
        kv.prepare(sids, [context] * batch)
        timed = ((run, hot), (cold_run, cold)) if cold is not None and n <= SPLIT_TOKENS else ((run, hot),)
        for which, times in timed:
            seen: list[float] = []
            start = time.perf_counter()
            while len(seen) < 5 or (len(seen) < MAX_RUNS and time.perf_counter() - start < TYPICAL_S):
                for s in sids:
                    kv.seqs[s].length = context
                layout_, step = kv.prepare(sids, [per_seq] * batch)
                x = torch.randn(batch * per_seq, cfg.hidden_size, generator=g).to(device=device, dtype=compute)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0, view = time.perf_counter(), kv.view(0, layout_, step)
                paged = M.paged_pool(view, None, x) if which is not None else None
                if paged is not None:  # as a resident CPU pass runs: per layer of the run
                    M.run_layers(which, x, view, paged, layout_, rope(layout_.positions), cfg)
                    seen.append((time.perf_counter() - t0) / which.size)
                    continue
                M.decoder_layer(x, w, view, layout_, rope(layout_.positions), cfg, None)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seen.append(time.perf_counter() - t0)
            times.append(sorted(seen)[len(seen) // 2])
        if cold is not None and n > SPLIT_TOKENS:  # many rows a pass: the products bound it, not where the bytes
            cold.append(hot[-1])  # come from (the Xeon's REFERENCE layer, bf16: 64 tokens 12.6 ms cold, 12.4 hot)
    return dense_layer_bytes(shape, dtype), hot, cold
