"""Calibrating the model side: layer-kernel throughput, and where the saved calibration lives.

    offload calibrate [--disk-path DIR] [-o FILE]

measures the links (`schedulers.calibration`) and the compute throughput of a decoder layer
(TinyLlama shape, the run's dtype) at a few token counts, and saves both. The planner uses
the saved file (default: `$OFFLOAD_CACHE/calibration.json`) or conservative defaults, and
says which. Example files for machines we do not have live in `scripts/calibrations/`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch

from offload.config import cache_dir
from offload.errors import ConfigError
from offload.kv.cache import PagedKVCache
from offload.model import functional as M
from offload.model import kernels
from offload.model.config import ModelConfig
from offload.weights.groups import WeightFormat, group_layout, model_layouts, weight_views
from offload.weights.quant import Scratch
from schedulers.calibration import Calibration, CalibrationError, measure_links

log = logging.getLogger(__name__)

REFERENCE = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
             "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 32000}


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


def default_path() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration(path: str | Path | None = None) -> Calibration:
    """The file at `path`, else the saved one, else conservative defaults (an explicit missing file is an error)."""
    if path is None:
        path = default_path()
        if not path.is_file():
            return Calibration.defaults()
    try:
        return Calibration.load(path)
    except CalibrationError as e:
        raise ConfigError(str(e)) from None


def measure_compute(device: torch.device, dtype: torch.dtype, tokens: tuple[int, ...] = (1, 8, 64, 512),
                    context: int = 64, compute: torch.dtype | None = None,
                    quantization: str = "none") -> dict[str, list[float]]:
    """Seconds of one decoder layer (TinyLlama shape) per pass of n tokens, as weight bytes per second.

    The layer is computed as a run computes it: weights stored in `dtype` (group-wise packed with
    `quantization`), activations and KV in `compute` (default `dtype`). The bytes are the layer's dense
    bytes at `dtype` whatever the format, so a packed format's table says how fast its kernels go through
    the same matrices (the planner's `compute_sizes` are dense bytes)."""
    cfg = ModelConfig.from_dict(REFERENCE)
    compute = compute or dtype
    fmt = WeightFormat(quantization)
    layout = group_layout(cfg, "layer.0", dtype, fmt)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    views = layout.views(buf)
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, t in views.items():
        if t.dtype == torch.uint8:  # packed nibbles
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
        elif name.endswith(".sz"):  # (scale, zero) pairs of weights ~ N(0, 1 / in)
            t.copy_((torch.rand(t.shape, generator=g) * 0.01).to(dtype))
        else:
            t.copy_((torch.randn(t.shape, generator=g) / max(t.shape[-1], 1) ** 0.5).to(dtype))
    # upcast after the transfer as the run does: all but the matrices a CPU kernel widens as it multiplies
    views = {k: v if v.dtype == torch.uint8 or kernels.widens(v, compute) else v.to(compute) for k, v in views.items()}
    w = M.LayerWeights.from_views(weight_views(cfg, "layer.0", views, Scratch(), fmt))
    rope = M.Rope(cfg, device, compute)
    dense_bytes = group_layout(cfg, "layer.0", dtype).nbytes
    rates = []
    for n in tokens:
        batch = max(1, min(n, 8)) if n <= 8 else 1  # decode-like for small n, one prefill chunk for large
        per_seq = n // batch
        kv = PagedKVCache(cfg, 16, batch * -(-(context + per_seq) // 16), compute, device)
        sids = [kv.add_sequence() for _ in range(batch)]
        kv.prepare(sids, [context] * batch)
        times = []
        for _ in range(3):
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
        rates.append(dense_bytes / min(times))
    return {"tokens": list(tokens), "weight_bytes_per_s": rates}


def compute_sizes(cfg: ModelConfig, dtype: torch.dtype, fmt: WeightFormat, cal: Calibration,
                  device_type: str) -> dict[str, int]:
    """Per group, the dense bytes at `dtype` that the cost model divides by the calibrated compute rate, a
    packed format's layers scaled by how much slower (or faster) its kernels went than the dense ones at one
    token, where the calibration measured the format (`compute["cpu/int4"]`); else at dense speed."""
    sizes = {name: layout.nbytes for name, layout in model_layouts(cfg, dtype).items()}
    key = f"{device_type}/{fmt.quantization}"
    if fmt.prequant is None and key in cal.compute and device_type in cal.compute:
        factor = cal.weight_bytes_per_s(device_type, 1) / cal.weight_bytes_per_s(key, 1)
        sizes = {g: int(n * factor) if g.startswith("layer.") else n for g, n in sizes.items()}
    return sizes


def calibrate(device: torch.device, dtype: torch.dtype, disk_path: Path | None) -> Calibration:
    links = measure_links(device, disk_path)
    run_dtype = compute_dtype("auto", dtype, device, False)  # what an all-in-memory dense run computes in
    compute = {device.type: measure_compute(device, dtype, compute=run_dtype)}
    if device.type == "cpu":  # packed kernels differ from dense ones there (and multiply in dtype)
        for scheme in ("int8", "int4"):
            compute[f"cpu/{scheme}"] = measure_compute(device, dtype, (1, 8, 64), quantization=scheme)
    meta = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpus": os.cpu_count(), "dtype": str(dtype).removeprefix("torch."),
            "compute_dtype": str(run_dtype).removeprefix("torch."),
            "disk_path": str(disk_path) if disk_path else None}
    return Calibration(links, compute, "measured", meta)
