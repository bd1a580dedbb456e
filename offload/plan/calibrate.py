"""Calibration: this machine's links and layer kernels, measured once, saved, and read back by the planner.

    offload calibrate [--disk-path DIR] [-o FILE]

    links     bytes per second of each link: cold disk reads (the prefetcher's pattern), memcpy,
              and on CUDA pinned and pageable host->device and device->host copies (CUDA events)
    compute   per device type, a decoder layer's time at a few token counts, measured on three layer
              shapes (TinyLlama's, one a quarter as wide and a tiny one, the run's dtype) and split into a
              fixed cost per layer (`layer_overhead_s`: the ops, allocations and kernel launches a layer
              makes whatever its size, which dominate a small model's step) and weight bytes per second (the
              rest, which scales with the layer's bytes), on two lines: layers narrower than the middle
              shape read their bytes slower (`Calibration.layer_seconds`)

A `Calibration` is saved as JSON (default: `$OFFLOAD_CACHE/calibration.json`) and loaded back;
with no file, conservative defaults stand in and say so. Example files for machines we do not
have live in `scripts/calibrations/`. The cost model (`offload.plan.costmodel`, `predict`) reads
the numbers; this module measures and stores them, and picks the compute dtype of a CPU run.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from offload.config import cache_dir
from offload.errors import ConfigError
from offload.model import kernels
from offload.plan import machine
from offload.plan.links import DEFAULT_LINKS, measure_links
from offload.plan.memory import PACKED, ram_available
from offload.plan.probe import (  # noqa: F401 (re-exported)
    PROBE_SHARE,
    REFERENCE,
    SMALL,
    SPLIT_TOKENS,
    cache_curve,
    dense_layer_bytes,
    faster_curve,
    faster_of,
    hot_share,
    llc_bytes,
    log_linear,
    measure_compute,
)
from storage import io
from storage.errors import OffloadError
from storage.heap import trim_heap
from storage.units import fmt_bytes

log = logging.getLogger(__name__)


class CalibrationError(OffloadError):
    """A calibration file is missing or is not one."""


VERSION = 1
#: a calibration during which other work kept more than this share of the CPUs busy timed the kernels slow (two
#: first starts at once on 2 cores, each measuring while the other did: a step of 8 ms planned at 20-23 ms); `offload
#: chat --auto` measures it again at its next starts, up to BUSY_ROUNDS measurements in all, keeping the faster tables
BUSY, BUSY_ROUNDS = 0.25, 3
#: Used when no calibration file exists: slow but real hardware (a SATA-class disk, PCIe 3 x8, a laptop CPU).
DEFAULTS: dict[str, Any] = {
    "links": DEFAULT_LINKS,
    "compute": {"cpu": {"tokens": [1, 8, 64, 512], "weight_bytes_per_s": [4e9, 4e9, 3e9, 0.6e9]},
                "cuda": {"tokens": [1, 8, 64, 512], "weight_bytes_per_s": [300e9, 300e9, 250e9, 60e9]}},
}


@dataclass
class Calibration:
    links: dict[str, float]  # link name -> bytes per second
    compute: dict[str, dict[str, list[float]]]  # device type -> {"tokens": [...], "weight_bytes_per_s": [...]}
    source: str = "defaults"  # "defaults" or the file it came from
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def defaults(cls) -> Calibration:
        return cls(dict(DEFAULTS["links"]), json.loads(json.dumps(DEFAULTS["compute"])), "defaults")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """The file at `path` (CalibrationError if it is missing or not a calibration file)."""
        path = Path(path)
        if not path.is_file():
            raise CalibrationError(f"calibration file {str(path)!r} does not exist; run `offload calibrate -o {path}`")
        try:
            data = json.loads(path.read_text())
            links, compute = dict(data["links"]), dict(data["compute"])
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise CalibrationError(f"{path}: not a calibration file (needs 'links' and 'compute'); run `offload "
                              "calibrate` again") from None
        merged = dict(DEFAULTS["links"]) | {k: float(v) for k, v in links.items()}
        return cls(merged, compute, str(path), {k: v for k, v in data.items() if k not in ("links", "compute")})

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        io.atomic_write_bytes(path, json.dumps({"version": VERSION, **self.meta, "links": self.links,
                                                "compute": self.compute}, indent=2).encode())  # (never read half)

    @property
    def other_machine(self) -> str | None:
        """How the machine this file measured differs from this one (`offload.plan.machine`), or None."""
        return None if self.source == "defaults" else machine.other_machine(self.meta.get("machine"))

    @property
    def stale(self) -> bool:
        """Were the CPU kernels this file measured not the ones this install runs (`kernels.VERSION`)?"""
        return self.source != "defaults" and "cpu" in self.compute and self.meta.get("kernels") != kernels_id()

    @property
    def busy(self) -> float:
        """The share of the CPUs other work kept busy while this file measured (0: quiet, or not recorded)."""
        return float(self.meta.get("others_busy") or 0.0)

    def keep_faster(self, older: Calibration) -> Calibration:
        """This measurement with each table and link of `older` (this machine's, these kernels') that went faster
        (`faster_of`), counting the rounds: a measurement again where other work slowed the last one (`BUSY`)."""
        compute = {k: faster_of(t, older.compute[k]) if k in older.compute else t for k, t in self.compute.items()}
        links = {k: max(v, older.links.get(k, 0.0)) for k, v in self.links.items()}
        return Calibration(links, compute, self.source, self.meta | {"rounds": older.meta.get("rounds", 1) + 1})

    def _table(self, device_type: str) -> dict[str, list[float]]:
        return self.compute.get(device_type) or DEFAULTS["compute"]["cuda" if device_type == "cuda" else "cpu"]

    def weight_bytes_per_s(self, device_type: str, tokens: int, reads: float | None = None) -> float:
        """Layer-kernel throughput for a pass of `tokens` rows, interpolated in log(tokens). `reads`: the weight
        bytes a pass reads; where the table measured layers beyond the last-level cache (`offload.plan.probe`), the
        pass's bytes found in the cache (`hot`) go at the cached rate and the rest at the cold one (from DRAM)."""
        table = self._table(device_type)
        rate = _interpolate(table["tokens"], table["weight_bytes_per_s"], tokens)
        hot = self.hot(table, "weight_bytes_per_s", reads)
        if hot == 1.0:
            return rate
        return 1 / (hot / rate + (1 - hot) / _interpolate(table["tokens"], table["cold_weight_bytes_per_s"], tokens))

    def layer_overhead_s(self, device_type: str, tokens: int) -> float:
        """Seconds a decoder layer costs whatever its size at a pass of `tokens` rows (0 in files without it)."""
        return self._overhead(device_type, tokens, "layer_overhead_s")

    def layer_seconds(self, device_type: str, tokens: int, nbytes: float, reads: float | None = None) -> float:
        """A decoder layer of `nbytes` dense bytes at a pass of `tokens` rows: fixed cost + bytes / rate on the line
        its size falls on (the `narrow_` one below `narrow_bytes`: `offload.plan.probe.measure_compute`), the pass's
        share of cached bytes (`hot`) on the cached line and the rest on the cold one (never faster than cached)."""
        table = self._table(device_type)
        seg = "narrow_" if nbytes < table.get("narrow_bytes", 0) else ""

        def on(line: str) -> float:
            fixed = self._overhead(device_type, tokens, f"{line}layer_overhead_s" if f"{line}layer_overhead_s" in
                                   table else f"{seg}layer_overhead_s")
            return fixed + nbytes / _interpolate(table["tokens"], table[f"{line}weight_bytes_per_s"], tokens)
        hot, cached = self.hot(table, f"{seg}weight_bytes_per_s", reads), on(seg)
        return cached if hot == 1.0 else hot * cached + (1 - hot) * max(cached, on(f"cold_{seg}"))

    def pass_overhead_s(self, device_type: str, tokens: int, reads: float | None = None, engine: bool = True
                        ) -> float:
        """Seconds a pass of `tokens` rows costs beside its layers: its KV step, RoPE (`offload.plan.probe`; 0 in
        files without it), and (`engine`) the engine's step around it: sampling, the head's and embedding's calls
        (`offload.runtime.overhead`; 0 in files without it). `reads`: the weight bytes a pass reads; the share of
        them not found in the cache (`hot`) pushes both out of it, as the `cold_` columns measured."""
        table = self._table(device_type)
        hot = self.hot(table, "pass_overhead_s", reads)
        own = self._overhead(device_type, tokens, "pass_overhead_s")
        if hot < 1.0:
            own = hot * own + (1 - hot) * self._overhead(device_type, tokens, "cold_pass_overhead_s")
        if not engine:
            return own
        warm = float(table.get("engine_overhead_s", 0.0))
        hot = self.hot(table, "engine_overhead_s", reads)
        return own + hot * warm + (1 - hot) * float(table.get("cold_engine_overhead_s", warm))

    def hot(self, table: dict[str, list[float]], key: str, reads: float | None) -> float:
        """The share of a pass's `reads` weight bytes the next pass finds in the last-level cache: off the
        calibration's `cache_curve` (`offload.plan.probe.hot_share`), or in files without one all of them where they
        fit in CACHE_SHARE of the cache; 1 where `reads` is not given or the table has no cold twin of `key`."""
        if reads is None or f"cold_{key}" not in table:
            return 1.0
        if self.meta.get("cache_curve"):
            return hot_share(self.meta["cache_curve"], reads)
        return 1.0 if reads <= CACHE_SHARE * self.meta.get("llc_bytes", 0) else 0.0

    def _overhead(self, device_type: str, tokens: int, key: str) -> float:
        table = self._table(device_type)
        if key not in table:
            return 0.0
        return log_linear(table["tokens"], table[key], tokens)


def _interpolate(xs: list[float], ys: list[float], tokens: int) -> float:
    """ys at `tokens`, interpolated in log(tokens); past the last point, time grows linearly with tokens."""
    if tokens <= xs[0]:
        return ys[0]
    if tokens >= xs[-1]:
        return ys[-1] * xs[-1] / tokens
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= tokens <= x1:
            w = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
    return ys[-1]


# ----------------------------------------------------------------------------- the model side
#: Where a calibration has no `cache_curve` (`offload.plan.probe`; older files), the share of the last-level
#: cache a pass's weights may fill and still be read from it the next pass (other data and other processes take the
#: rest; a cyclic pass over more than the cache finds none of it there). A 2-core VM's 260 MB L3, SmolLM2-135M
#: decode: int4 (85 MB a pass) ran at the cached rate, int8 (143 MB) near the cold one.
CACHE_SHARE = 0.4
#: halvings of REFERENCE's WIDTHS a short-of-RAM calibration may use (hidden 1024, then 512: still 20x SMALL's bytes)
SHRINKS = 2
WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


#: float32 compute is chosen on a CPU that multiplies 64 rows at least this much faster in float32
FLOAT32_MARGIN = 1.5


def compute_dtype(name: str, dtype: torch.dtype, device: torch.device, packed: bool) -> torch.dtype:
    """The dtype the math runs in (`compute_dtype`), the weights keeping `dtype` in the store and on the wire.

    `auto`: `dtype`, except on a CPU whose 16-bit matrix products are slow (`_slow_on_cpu`), where the math runs
    in float32 in every placement alike (the planner falls back to `dtype` only when a float32 plan cannot fit).
    Packed weights multiply in `dtype`."""
    if name != "auto":
        chosen = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
        if packed and chosen != dtype:
            raise ConfigError(f"compute_dtype: {name} differs from dtype, but packed weights (weights.quantization) "
                              f"multiply in dtype; set compute_dtype: auto")
        return chosen
    if device.type != "cpu" or dtype == torch.float32 or packed:
        return dtype
    return torch.float32 if _slow_on_cpu(dtype) else dtype


@functools.cache
def _slow_on_cpu(dtype: torch.dtype) -> bool:
    """Does this CPU multiply 64 rows of `dtype` by a `dtype` weight FLOAT32_MARGIN times slower than in float32?

    With the row-invariant kernels, no, and nothing is timed: they multiply the weight as it is stored whatever the
    activations' dtype (fp16 widened to float32 either way; bf16 by bf16 in pairs, a decode row 1.3-1.6x faster than
    widening it and 64 rows as fast on a 2-core Zen 3 without AVX-512, faster with AVX-512 BF16). Timing two such
    equal products decided by noise: under load the ratio of the two ~10 ms timings swung 0.65-1.57 from process to
    process (8 processes), so two runs of one config could compute in different dtypes and give different tokens.
    Without them, torch's products are timed (`_cpu_matmul_s`), where the gap is real: bf16 153 ms against float32
    46 ms for a 5632x2048 weight at 64 rows on a 2-core AVX2 machine."""
    if kernels.ROW_INVARIANT and kernels.widens(torch.empty(1, 1, dtype=dtype), dtype):
        return False
    return _cpu_matmul_s(dtype) > FLOAT32_MARGIN * _cpu_matmul_s(torch.float32)


@functools.cache
def _cpu_matmul_s(dtype: torch.dtype) -> float:
    """Best of 3: torch's product of 64 rows of `dtype` and a [2816, 1024] weight of `dtype` (a run without the
    row-invariant kernels upcasts the weights to the compute dtype beforehand). Once per process, ~10-30 ms."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g).to(dtype)
    w = torch.randn(2816, 1024, generator=g).to(dtype)
    torch.nn.functional.linear(x, w)  # warm-up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


def reference_shape(budget: int, dtype: torch.dtype, compute: torch.dtype) -> dict[str, Any] | None:
    """REFERENCE, or its widths halved up to SHRINKS times: the largest whose test layer fits in `budget`, or None."""
    for k in range(SHRINKS + 1):
        shape = REFERENCE | {key: max(REFERENCE[key] >> k, 1) for key in WIDTHS}
        if layer_probe_bytes(shape, dtype, compute) <= budget:
            return shape
    return None


def layer_probe_bytes(shape: dict[str, Any], dtype: torch.dtype, compute: torch.dtype) -> int:
    """RAM `measure_compute` takes for a layer of `shape`: at most three times the layer at the wider of `dtype` and
    `compute` (stored, upcast, activations; REFERENCE in float32 took 1.8), beside what any layer's run costs."""
    wide = max(dtype, compute, key=lambda d: d.itemsize)
    return 3 * dense_layer_bytes(shape, wide)


def default_path() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration(path: str | Path | None = None) -> Calibration:
    """The file at `path`, else the saved one, else conservative defaults (an explicit missing file is an error)."""
    if path is None:
        path = default_path()
        if not path.is_file():
            return Calibration.defaults()
    try:
        cal = Calibration.load(path)
    except CalibrationError as e:
        raise ConfigError(str(e)) from None
    if cal.stale and str(path) not in _warned:
        _warned.add(str(path))
        log.warning("calibration %s measured other CPU kernels than these: the plan's compute times may be off; "
                    "run `offload calibrate -o %s` to measure them", path, path)
    elif (other := cal.other_machine) and str(path) not in _warned:
        _warned.add(str(path))
        log.warning("calibration %s measured another machine (%s): the plan's times are that machine's; run "
                    "`offload calibrate -o %s` to measure this one", path, other, path)
    elif cal.busy > BUSY and str(path) not in _warned:
        _warned.add(str(path))
        log.warning("calibration %s was measured while other work kept %.0f%% of the CPUs busy: the plan's compute "
                    "times may be too slow; run `offload calibrate -o %s` when the machine is quieter", path,
                    100 * cal.busy, path)
    return cal


_warned: set[str] = set()  # calibration files already named in a warning


def kernels_id() -> str:
    """The CPU kernels a run uses: their version and which ones (row-invariant or the library's)."""
    return f"{kernels.VERSION}-{'invariant' if kernels.ROW_INVARIANT else 'library'}"


def calibrate(device: torch.device, dtype: torch.dtype, disk_path: Path | None,
              engine: Callable[[Calibration, torch.device, torch.dtype], dict[str, float]] | None = None,
              packed: Sequence[str] = PACKED, locked: bool = False) -> Calibration:
    """This machine, each probe (buffers, test layers) within PROBE_SHARE of the RAM the process may still fill,
    under the machine's calibration lock (`machine.calibration_lock`; `locked`: the caller holds it), waiting while
    another process measures: two measuring at once would each time the other's load.
    `engine` (a CPU): times what a decode step costs beyond the probes' tables, given them
    (`offload.runtime.overhead.engine_overhead_s`, which the plan cannot import); its columns join the CPU's
    table. `packed` (a CPU): the packed formats whose kernels are timed too (`cpu/int8`, `cpu/int4`); `offload
    chat --auto` names only those its run computes with, as each format's first use compiles its kernels (SmolLM2's
    bf16 first start, cold kernel cache: calibration 206 -> 72 s without the packed ones it never ran)."""
    if not locked:
        lock = machine.calibration_lock(disk_path or Path(tempfile.gettempdir()))
        try:
            lock.exclusive(on_wait=lambda who: log.warning("calibration: waiting for %s to finish measuring", who))
            lock.announce("calibrating")
            return calibrate(device, dtype, disk_path, engine, packed, locked=True)
        finally:
            lock.close()
    budget, start = int(ram_available() * PROBE_SHARE), machine.busy_mark()
    links = measure_links(device, disk_path, budget)
    run_dtype = compute_dtype("auto", dtype, device, False)  # what an all-in-memory dense run computes in
    shape = REFERENCE if device.type == "cuda" else reference_shape(budget, dtype, run_dtype)  # CUDA's: GPU memory
    llc = llc_bytes()  # distinct test layers beyond the cache, beside the probe layer, where the budget has room
    cold = min(2 * llc, budget - layer_probe_bytes(shape, dtype, run_dtype)) if device.type == "cpu" and shape else 0
    cold = cold if cold >= llc else 0
    reach = min(2 * llc, budget)  # the cache curve's largest read
    curve = cache_curve(reach) if cold else None  # how much of that cache this process gets
    compute = {} if shape is None else {device.type: measure_compute(device, dtype, compute=run_dtype, shape=shape,
                                                                     cold_bytes=cold)}
    if shape is None:
        log.warning("calibration: a %s probe budget fits no test layer: default compute tables", fmt_bytes(budget))
    elif device.type == "cpu":  # packed kernels differ from dense ones there (and multiply in dtype)
        def tables() -> dict[str, dict[str, list[float]]]:
            return {f"cpu/{s}": measure_compute(device, dtype, (1, 8, 64), quantization=s, shape=shape,
                                                cold_bytes=cold) for s in packed}
        compute |= tables()
        # every table timed again a round later, the faster timings kept (`faster_of`: a slow stretch of a shared
        # host): `offload plan` against 12 runs, 2-core Zen 4, within 20% 10 -> 12 times, the worst +36 -> +20%
        again = {"cpu": measure_compute(device, dtype, compute=run_dtype, shape=shape, cold_bytes=cold)} | tables()
        compute |= {key: faster_of(compute[key], table) for key, table in again.items()}
        curve = curve and faster_curve(curve, cache_curve(reach))  # (its reading a round later too)
    meta = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": str(device),
            "kernels": kernels_id(), "activations": dict(kernels.ACTIVATIONS),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpus": os.cpu_count(), "machine": machine.identity(), "llc_bytes": llc,
            "cache_curve": curve if curve and curve["bytes"][-1] >= llc else None,
            "dtype": str(dtype).removeprefix("torch."),
            "compute_dtype": str(run_dtype).removeprefix("torch."),
            "reference_hidden_size": shape and shape["hidden_size"],
            "disk_path": str(disk_path) if disk_path else None}
    cal = Calibration(links, compute, "measured", meta)
    if engine is not None and device.type == "cpu" and device.type in compute:
        compute[device.type].update(engine(cal, device, dtype))
    busy = machine.busy_share(start, machine.busy_mark())  # (`BUSY`)
    meta["others_busy"] = None if busy is None else round(busy, 3)
    gc.collect()  # the probes' layers (their packed matrices, scratch, closures) sit in reference cycles: 2.6 GiB
    trim_heap()  # held after it with the collector off, 63 MiB collected and trimmed (SmolLM2's first start, 24 GiB)
    return cal
