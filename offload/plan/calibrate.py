"""Calibrating the model side: layer-kernel throughput, and where the saved calibration lives.

    offload calibrate [--disk-path DIR] [-o FILE]

measures the links (`schedulers.calibration`) and the compute throughput of a decoder layer
(TinyLlama shape, the run's dtype) at a few token counts, and saves both. The planner uses
the saved file (default: `$OFFLOAD_CACHE/calibration.json`) or conservative defaults, and
says which. Example files for machines we do not have live in `scripts/calibrations/`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from offload.config import cache_dir
from offload.errors import ConfigError
from offload.kv.cache import PagedKVCache
from offload.model import functional as M
from offload.model.config import ModelConfig
from offload.weights.groups import group_layout
from schedulers.calibration import Calibration, CalibrationError, measure_links

log = logging.getLogger(__name__)

REFERENCE = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
             "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 32000}


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
                    context: int = 64) -> dict[str, list[float]]:
    """Seconds of one decoder layer (TinyLlama shape) per pass of n tokens, as weight bytes per second."""
    cfg = ModelConfig.from_dict(REFERENCE)
    layout = group_layout(cfg, "layer.0", dtype)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    views = layout.views(buf)
    g = torch.Generator(device="cpu").manual_seed(0)
    for t in views.values():
        t.copy_((torch.randn(t.shape, generator=g) / max(t.shape[-1], 1) ** 0.5).to(dtype))
    w = M.LayerWeights.from_views(views)
    rope = M.Rope(cfg, device, dtype)
    rates = []
    for n in tokens:
        batch = max(1, min(n, 8)) if n <= 8 else 1  # decode-like for small n, one prefill chunk for large
        per_seq = n // batch
        kv = PagedKVCache(cfg, 16, batch * -(-(context + per_seq) // 16), dtype, device)
        sids = [kv.add_sequence() for _ in range(batch)]
        kv.prepare(sids, [context] * batch)
        times = []
        for _ in range(3):
            for s in sids:
                kv.seqs[s].length = context
            layout_, step = kv.prepare(sids, [per_seq] * batch)
            x = torch.randn(batch * per_seq, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            M.decoder_layer(x, w, kv.view(0, layout_, step), layout_, rope(layout_.positions), cfg, None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        rates.append(layout.nbytes / min(times))
    return {"tokens": list(tokens), "weight_bytes_per_s": rates}


def calibrate(device: torch.device, dtype: torch.dtype, disk_path: Path | None) -> Calibration:
    links = measure_links(device, disk_path)
    compute = {device.type: measure_compute(device, dtype)}
    meta = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpus": os.cpu_count(), "dtype": str(dtype).removeprefix("torch."),
            "disk_path": str(disk_path) if disk_path else None}
    return Calibration(links, compute, "measured", meta)
