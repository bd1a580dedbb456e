"""Calibration: this machine's links and layer kernels, measured once, saved, and read back by the planner.

    offload calibrate [--disk-path DIR] [-o FILE]

    links     bytes per second of each link: cold disk reads (the prefetcher's pattern), memcpy,
              and on CUDA pinned and pageable host->device and device->host copies (CUDA events)
    compute   per device type, a decoder layer's time at a few token counts, measured on two layer
              shapes (TinyLlama's and a tiny one, the run's dtype) and split into a fixed cost per
              layer (`layer_overhead_s`: the ops, allocations and kernel launches a layer makes whatever its
              size, which dominate a small model's step) and weight bytes per second (the rest, which
              scales with the layer's bytes)

A `Calibration` is saved as JSON (default: `$OFFLOAD_CACHE/calibration.json`) and loaded back;
with no file, conservative defaults stand in and say so. Example files for machines we do not
have live in `scripts/calibrations/`. The cost model (`offload.plan.costmodel`, `predict`) reads
the numbers; this module measures and stores them, and picks the compute dtype of a CPU run.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from offload.config import cache_dir
from offload.errors import ConfigError
from offload.kv.cache import PagedKVCache
from offload.model import functional as M
from offload.model import kernels
from offload.model.config import ModelConfig
from offload.plan.links import measure_cuda_links, measure_disk, measure_memcpy
from offload.plan.memory import ram_available
from offload.weights.groups import WeightFormat, group_layout, model_layouts, weight_views
from offload.weights.quant import Scratch
from storage.errors import OffloadError
from storage.units import blocks_for, fmt_bytes

log = logging.getLogger(__name__)


class CalibrationError(OffloadError):
    """A calibration file is missing or is not one."""


VERSION = 1
#: Used when no calibration file exists: slow but real hardware (a SATA-class disk, PCIe 3 x8, a laptop CPU).
DEFAULTS: dict[str, Any] = {
    "links": {"disk read": 0.5e9, "host->device": 6e9, "host->device pageable": 3e9, "device->host": 6e9,
              "memcpy": 4e9, "device memory": 4e9},
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
        path.write_text(json.dumps({"version": VERSION, **self.meta, "links": self.links, "compute": self.compute},
                                   indent=2))

    @property
    def stale(self) -> bool:
        """Were the CPU kernels this file measured not the ones this install runs (`kernels.VERSION`)?"""
        return self.source != "defaults" and "cpu" in self.compute and self.meta.get("kernels") != kernels_id()

    def _table(self, device_type: str) -> dict[str, list[float]]:
        return self.compute.get(device_type) or DEFAULTS["compute"]["cuda" if device_type == "cuda" else "cpu"]

    def weight_bytes_per_s(self, device_type: str, tokens: int) -> float:
        """Layer-kernel throughput for a pass of `tokens` rows, interpolated in log(tokens)."""
        table = self._table(device_type)
        return _interpolate(table["tokens"], table["weight_bytes_per_s"], tokens)

    def layer_overhead_s(self, device_type: str, tokens: int) -> float:
        """Seconds a decoder layer costs whatever its size at a pass of `tokens` rows (0 in files without it)."""
        table = self._table(device_type)
        if "layer_overhead_s" not in table:
            return 0.0
        xs, ys = table["tokens"], table["layer_overhead_s"]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):  # linear in log(tokens), flat outside
            if x0 <= tokens <= x1:
                w = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return (1 - w) * y0 + w * y1
        return ys[0] if tokens <= xs[0] else ys[-1]


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


# ----------------------------------------------------------------------------- measurements
def measure_links(device: torch.device, disk_path: Path | None, budget: int = 2**30) -> dict[str, float]:
    """Every link this machine has, in bytes per second (defaults for the ones it cannot measure), each probe
    within `budget` bytes of RAM: memcpy's two buffers, disk's buffer and its page cache, CUDA's host buffer."""
    half = max(budget // 2, 2**20)
    links: dict[str, float] = {"memcpy": measure_memcpy(min(half, 256 * 2**20))}
    if disk_path is not None:
        links["disk read"] = measure_disk(disk_path, min(half, 512 * 2**20))
    if device.type == "cuda":
        links |= measure_cuda_links(device, min(2 * half, 256 * 2**20))
    else:
        # a CPU compute device reads host memory in place: "copies" to it are memcpy-speed at worst
        links["host->device"] = links["device->host"] = links["host->device pageable"] = links["memcpy"]
        links["device memory"] = links["memcpy"]
    return DEFAULTS["links"] | links


# ----------------------------------------------------------------------------- the model side
REFERENCE = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
             "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 32000}
#: a tiny layer (1/300 of REFERENCE's bytes, its time nearly all fixed cost): with REFERENCE, splits a layer's
#: time into a fixed cost and a byte rate at pass sizes up to SPLIT_TOKENS tokens
SMALL = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 32000}
SPLIT_TOKENS = 8
#: halvings of REFERENCE's WIDTHS a short-of-RAM calibration may use (hidden 1024, then 512: still 20x SMALL's bytes)
SHRINKS = 2
WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
#: the probes (buffers, test layers) take at most this share of the RAM the process may still fill, one at a time
PROBE_SHARE = 1 / 4


#: float32 compute is chosen on a CPU that multiplies 64 rows at least this much faster in float32
FLOAT32_MARGIN = 1.5


def compute_dtype(name: str, dtype: torch.dtype, device: torch.device, packed: bool) -> torch.dtype:
    """The dtype the math runs in (`compute_dtype`), the weights keeping `dtype` in the store and on the wire.

    `auto`: `dtype`, except on a CPU whose 16-bit matrix products are slow (no native bf16: a 5632x2048
    weight at 64 rows takes 153 ms in bf16 and 46 ms in float32 on a 2-core AVX2 machine), where the
    weights are upcast after the transfer, in every placement alike (the planner falls back to `dtype`
    only when a float32 plan cannot fit). Packed weights multiply in `dtype`."""
    if name != "auto":
        chosen = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
        if packed and chosen != dtype:
            raise ConfigError(f"compute_dtype: {name} differs from dtype, but packed weights (weights.quantization) "
                              f"multiply in dtype; set compute_dtype: auto")
        return chosen
    if device.type != "cpu" or dtype == torch.float32 or packed:
        return dtype
    return torch.float32 if _cpu_matmul_s(dtype) > FLOAT32_MARGIN * _cpu_matmul_s(torch.float32) else dtype


@functools.cache
def _cpu_matmul_s(dtype: torch.dtype) -> float:
    """Best of 3: 64 rows times a [2816, 1024] weight on this CPU (once per process; ~10 ms)."""
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
    return 3 * group_layout(ModelConfig.from_dict(shape), "layer.0", wide).nbytes


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
    return cal



def why_measure(path: Path) -> str | None:
    """Why the calibration file at `path` is to be measured (again): missing, not a calibration, or measured with
    other CPU kernels than these (`Calibration.stale`); None when it can be reused."""
    if not path.is_file():
        return "there is none"
    try:
        return "it measured older CPU kernels" if Calibration.load(path).stale else None
    except CalibrationError:
        return "it was not a calibration file"

_warned: set[str] = set()  # stale calibration files already named in a warning


def measure_compute(device: torch.device, dtype: torch.dtype, tokens: tuple[int, ...] = (1, 8, 64, 512),
                    context: int = 64, compute: torch.dtype | None = None,
                    quantization: str = "none", shape: dict[str, Any] = REFERENCE) -> dict[str, list[float]]:
    """One decoder layer's time per pass of n tokens, as a fixed cost per layer and weight bytes per second.

    The layer is computed as a run computes it: weights stored in `dtype` (group-wise packed with
    `quantization`), activations and KV in `compute` (default `dtype`). At decode-like token counts (up to
    SPLIT_TOKENS) two shapes (`shape`: REFERENCE unless RAM is short; SMALL) give two times t = overhead + bytes /
    rate, solved for both (a rate alone where timing noise makes the overhead come out negative); past them,
    where a pass's work grows with its tokens and attention, the large layer's rate alone.
    The bytes are a layer's dense bytes at `dtype` whatever the format, so a packed format's table says how fast
    its kernels go through the same matrices (the planner's `compute_sizes` are dense bytes)."""
    big_bytes, big = _layer_seconds(shape, device, dtype, tokens, context, compute or dtype, quantization)
    small_bytes, small = _layer_seconds(SMALL, device, dtype, tokens, context, compute or dtype, quantization)
    rates, overheads = [], []
    for n, tb, ts in zip(tokens, big, small):
        rate = (big_bytes - small_bytes) / (tb - ts) if tb > ts else big_bytes / tb
        overhead = ts - small_bytes / rate
        if overhead <= 0 or n > SPLIT_TOKENS:
            rate, overhead = big_bytes / tb, 0.0
        rates.append(rate)
        overheads.append(overhead)
    return {"tokens": list(tokens), "weight_bytes_per_s": rates, "layer_overhead_s": overheads}


def _layer_seconds(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, tokens: tuple[int, ...],
                   context: int, compute: torch.dtype, quantization: str) -> tuple[int, list[float]]:
    """(the layer's dense bytes at `dtype`, the best of 5 times of one layer of `shape` at each token count)."""
    cfg = ModelConfig.from_dict(shape)
    fmt = WeightFormat(quantization)
    layout = group_layout(cfg, "layer.0", dtype, fmt)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    views = layout.views(buf)
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, t in views.items():
        if t.dtype == torch.uint8:  # packed codes
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
        elif name.endswith(".sz"):  # (scale, zero) pairs of weights ~ N(0, 1 / in)
            t.copy_((torch.rand(t.shape, generator=g) * 0.01).to(dtype))
        else:
            t.copy_((torch.randn(t.shape, generator=g) / max(t.shape[-1], 1) ** 0.5).to(dtype))
    # upcast after the transfer as the run does: all but the matrices a CPU kernel widens as it multiplies
    views = {k: v if v.dtype == torch.uint8 or kernels.widens(v, compute) else v.to(compute) for k, v in views.items()}
    w = M.LayerWeights.from_views(weight_views(cfg, "layer.0", views, Scratch(), fmt))
    rope = M.Rope(cfg, device, compute)
    seconds = []
    for n in tokens:
        batch = max(1, min(n, 8)) if n <= 8 else 1  # decode-like for small n, one prefill chunk for large
        per_seq = n // batch
        kv = PagedKVCache(cfg, 16, batch * blocks_for(context + per_seq, 16), compute, device)
        sids = [kv.add_sequence() for _ in range(batch)]
        kv.prepare(sids, [context] * batch)
        times = []
        for _ in range(5):
            for s in sids:
                kv.seqs[s].length = context
            layout_, step = kv.prepare(sids, [per_seq] * batch)
            x = torch.randn(batch * per_seq, cfg.hidden_size, generator=g).to(device=device, dtype=compute)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            M.decoder_layer(x, w, kv.view(0, layout_, step), layout_, rope(layout_.positions), cfg, None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        seconds.append(min(times))
    return group_layout(cfg, "layer.0", dtype).nbytes, seconds


def compute_sizes(cfg: ModelConfig, dtype: torch.dtype, fmt: WeightFormat, cal: Calibration,
                  device_type: str) -> dict[str, int]:
    """Per group, the dense bytes at `dtype` that the cost model divides by the calibrated compute rate, a
    packed format's layers scaled by how much slower (or faster) its kernels went than the dense ones at one
    token, where the calibration measured the format (`compute["cpu/int4"]`); else at dense speed."""
    sizes = {name: layout.nbytes for name, layout in model_layouts(cfg, dtype).items()}
    if fmt.prequant is not None or fmt.quantization == "none" or device_type not in cal.compute:
        return sizes

    def factor(bits: int) -> float:
        key = f"{device_type}/int{bits}"
        return cal.weight_bytes_per_s(device_type, 1) / cal.weight_bytes_per_s(key, 1) if key in cal.compute else 1.0

    layers, head = factor(fmt.bits), factor(fmt.tensor_bits("lm_head")) if fmt.packs(cfg, "lm_head") else 1.0
    return {g: int(n * layers) if g.startswith("layer.") else int(n * head) if g == "head" else n
            for g, n in sizes.items()}


def kernels_id() -> str:
    """The CPU kernels a run uses: their version and which ones (row-invariant or the library's)."""
    return f"{kernels.VERSION}-{'invariant' if kernels.ROW_INVARIANT else 'library'}"


def calibrate(device: torch.device, dtype: torch.dtype, disk_path: Path | None) -> Calibration:
    """This machine, each probe (buffers, test layers) within PROBE_SHARE of the RAM the process may still fill."""
    budget = int(ram_available() * PROBE_SHARE)
    links = measure_links(device, disk_path, budget)
    run_dtype = compute_dtype("auto", dtype, device, False)  # what an all-in-memory dense run computes in
    shape = REFERENCE if device.type == "cuda" else reference_shape(budget, dtype, run_dtype)  # CUDA's: GPU memory
    compute = {} if shape is None else {device.type: measure_compute(device, dtype, compute=run_dtype, shape=shape)}
    if shape is None:
        log.warning("calibration: a %s probe budget fits no test layer: default compute tables", fmt_bytes(budget))
    elif device.type == "cpu":  # packed kernels differ from dense ones there (and multiply in dtype)
        for scheme in ("int8", "int4"):
            compute[f"cpu/{scheme}"] = measure_compute(device, dtype, (1, 8, 64), quantization=scheme, shape=shape)
    meta = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": str(device),
            "kernels": kernels_id(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpus": os.cpu_count(), "dtype": str(dtype).removeprefix("torch."),
            "compute_dtype": str(run_dtype).removeprefix("torch."),
            "reference_hidden_size": shape and shape["hidden_size"],
            "disk_path": str(disk_path) if disk_path else None}
    return Calibration(links, compute, "measured", meta)
