"""Calibration: this machine's links and layer kernels, as numbers the cost model uses.

    links     bytes per second of each link: cold disk reads (the prefetcher's pattern), memcpy,
              and on CUDA pinned and pageable host->device and device->host copies (CUDA events)
    compute   per device type, the layer kernels' throughput at a few token counts, as weight
              bytes per second so it scales to any layer size (measured by the model side and
              handed in as data)

A `Calibration` is saved as JSON and loaded back; with no file, conservative defaults stand
in and say so. This module measures links and stores numbers; it knows nothing about models.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from storage import io
from storage.errors import OffloadError


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

    def weight_bytes_per_s(self, device_type: str, tokens: int) -> float:
        """Layer-kernel throughput for a pass of `tokens` rows, interpolated in log(tokens)."""
        table = self.compute.get(device_type) or DEFAULTS["compute"]["cuda" if device_type == "cuda" else "cpu"]
        xs, ys = table["tokens"], table["weight_bytes_per_s"]
        if tokens <= xs[0]:
            return ys[0]
        if tokens >= xs[-1]:
            return ys[-1] * xs[-1] / tokens  # past the last point: time grows linearly with tokens
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if x0 <= tokens <= x1:
                w = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
        return ys[-1]


# ----------------------------------------------------------------------------- measurements
def measure_disk(directory: Path, nbytes: int = 512 * 2**20, threads: int = 4, piece: int = 8 * 2**20) -> float:
    """Cold read of a fresh test file with `threads` preadv pieces in flight (the prefetcher's pattern)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".offload-calibrate.bin"
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            io.pwrite_from(fd, buf, 0, path)
            os.fsync(fd)
        finally:
            os.close(fd)
        rates = []
        for _ in range(2):
            fd = os.open(path, os.O_RDONLY)
            try:
                io.drop_page_cache(fd)
                io.advise_sequential(fd)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda s, fd=fd: io.preadv_into(fd, buf[s : s + piece], s),
                                  range(0, nbytes, piece)))
                rates.append(nbytes / (time.perf_counter() - t0))
                io.drop_page_cache(fd)
            finally:
                os.close(fd)
        return sum(rates) / len(rates)
    finally:
        path.unlink(missing_ok=True)


def measure_memcpy(nbytes: int = 256 * 2**20) -> float:
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    return 3 * nbytes / (time.perf_counter() - t0)


def measure_cuda_links(device: torch.device, nbytes: int = 256 * 2**20) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(dev)
    other.copy_(dev)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        other.copy_(dev)
    end.record()
    end.synchronize()
    out = {"device memory": 2 * 3 * nbytes / (start.elapsed_time(end) / 1000)}  # a copy reads and writes
    for name, pinned, to_device in (("host->device", True, True), ("host->device pageable", False, True),
                                    ("device->host", True, False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        src, dst = (host, dev) if to_device else (dev, host)
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=pinned)
        end.record()
        end.synchronize()
        out[name] = 3 * nbytes / (start.elapsed_time(end) / 1000)
    return out


def measure_links(device: torch.device, disk_path: Path | None) -> dict[str, float]:
    """Every link this machine has, in bytes per second (defaults for the ones it cannot measure)."""
    links: dict[str, float] = {"memcpy": measure_memcpy()}
    if disk_path is not None:
        links["disk read"] = measure_disk(disk_path)
    if device.type == "cuda":
        links |= measure_cuda_links(device)
    else:
        # a CPU compute device reads host memory in place: "copies" to it are memcpy-speed at worst
        links["host->device"] = links["device->host"] = links["host->device pageable"] = links["memcpy"]
        links["device memory"] = links["memcpy"]
    return DEFAULTS["links"] | links
