"""Benchmark: the CPU cost of streaming weights from disk, part by part (CPU-only machine).

    python -m scripts.stream_cost [--gib 1] [--group-mib 88] [--out scripts/results]

Writes `--gib` of random bytes as disk-tier regions the size of the medium model's layers
(88 MiB), then reads them all into page-aligned slots (as the prefetcher does) in each mode,
the page cache dropped before every pass:

    buffered+crc     preadv through the page cache, crc32c of every read, fadvise(DONTNEED) after
    buffered         the same without the checksum (tiers.disk.verify: once, after the first pass)
    direct+crc       O_DIRECT into the slots (no page-cache copy, nothing to drop), crc32c
    direct           O_DIRECT, no checksum: what a streamed pass costs with direct_io and verify: once

and times crc32c and fadvise alone. Reports wall seconds and CPU seconds (all threads) per GiB:
CPU seconds are what streaming takes from the matmuls. Writes OUT/stream-cost.{md,json} with the command,
the machine and the load (`scripts.machine.Result`).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from scripts.machine import Result
from storage import io
from storage.arena import aligned_empty
from storage.disk import DiskTier


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_mode(path: Path, keys: list[str], size: int, direct: bool, verify: str, slot: torch.Tensor) -> dict:
    tier = DiskTier(path, read_only=True, direct_io=direct, verify=verify)
    for k in keys:
        tier.open_existing(k, size)
    if verify == "once":
        tier._verified.update(keys)  # the first pass of a run checked them; this is every later pass
    tier.drop_cache()
    w0, c0 = time.perf_counter(), cpu_seconds()
    for k in keys:
        tier.read_into(k, slot)
    wall, cpu = time.perf_counter() - w0, cpu_seconds() - c0
    used_direct = all(tier.reader.direct(tier.chunk_path(k)) for k in keys) if direct else False
    tier.close()
    gib = len(keys) * size / 2**30
    return {"wall_s_per_gib": wall / gib, "cpu_s_per_gib": cpu / gib, "gb_per_s": len(keys) * size / wall / 1e9,
            "o_direct": used_direct}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--group-mib", type=int, default=88)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the test regions (a real disk)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    header = Result()
    size = args.group_mib * 2**20
    n = max(1, int(args.gib * 2**30 // size))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "store"
        writer = DiskTier(path, read_threads=1)
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        keys = [f"layer.{i}" for i in range(n)]
        for k in keys:
            writer.allocate(k, size)
            writer.write(k, data)
        writer.close()
        slot = aligned_empty(size)
        rows = {}
        for name, direct, verify in (("buffered+crc", False, "always"), ("buffered", False, "once"),
                                     ("direct+crc", True, "always"), ("direct", True, "once")):
            rows[name] = run_mode(path, keys, size, direct, verify, slot)
        c0, w0 = cpu_seconds(), time.perf_counter()
        for _ in range(n):
            io.crc32c(slot)
        rows["crc32c alone"] = {"cpu_s_per_gib": (cpu_seconds() - c0) / (n * size / 2**30),
                                "wall_s_per_gib": (time.perf_counter() - w0) / (n * size / 2**30)}
        fd = os.open(path / keys[0] / "c.0", os.O_RDONLY)
        c0, w0 = cpu_seconds(), time.perf_counter()
        for _ in range(n):
            io.drop_page_cache(fd, 0, size)
        os.close(fd)
        rows["fadvise alone (cached nothing)"] = {"cpu_s_per_gib": (cpu_seconds() - c0) / (n * size / 2**30),
                                                  "wall_s_per_gib": (time.perf_counter() - w0) / (n * size / 2**30)}
    result = {"gib": n * size / 2**30, "group_mib": args.group_mib, "modes": rows}
    lines = [f"Streaming's CPU cost per GiB read into page-aligned slots ({result['gib']:.2f} GiB in "
             f"{args.group_mib} MiB regions, page cache dropped before each pass).", "",
             "| mode | wall s/GiB | CPU s/GiB | GB/s | O_DIRECT |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['wall_s_per_gib']:.3f} | {r['cpu_s_per_gib']:.3f} | "
                     f"{r.get('gb_per_s', float('nan')):.2f} | {r.get('o_direct', '-')} |")
    print(header.write(args.out, "stream-cost", "\n".join(lines), result).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
