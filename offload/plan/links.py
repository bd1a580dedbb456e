"""Link speeds, measured: a cold disk read in the prefetcher's pattern, memcpy, and CUDA's copies (CUDA events).
`offload.plan.calibrate` sizes the probes and keeps the numbers."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from storage import io

#: Used when no calibration file exists: slow but real hardware (a SATA-class disk, PCIe 3 x8).
DEFAULT_LINKS = {"disk read": 0.5e9, "host->device": 6e9, "host->device pageable": 3e9, "device->host": 6e9,
                 "memcpy": 4e9, "device memory": 4e9}


def measure_disk(directory: Path, nbytes: int = 512 * 2**20, threads: int = 4, piece: int = 8 * 2**20) -> float:
    """Cold read of a fresh test file with `threads` preadv pieces in flight (the prefetcher's pattern). The file is
    this call's own (two processes calibrating into one directory at once each truncated and removed the other's)."""
    directory.mkdir(parents=True, exist_ok=True)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    fd, name = tempfile.mkstemp(dir=directory, prefix=".offload-calibrate-", suffix=".bin")
    path = Path(name)
    try:
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
    return DEFAULT_LINKS | links
