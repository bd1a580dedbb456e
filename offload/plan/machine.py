"""Which machine a calibration measured, as far as its speeds depend on it: the CPU's name, the vector features the
CPU kernels choose their paths by, and the CPUs this process may use. `calibrate` records it; a file that records
another machine is measured again by `offload chat --auto` and scripts/bench_cpu.py, and named in a warning where a
run or a plan reads it (its times are that machine's: a Zen 3 file read on a Zen 4 put `offload plan` 18-38% off).
Reads /proc/cpuinfo (Linux); elsewhere the platform's processor name and no features. Also the CPU time this
process and everything else on its CPUs have run (`cpu_seconds`, `busy_share`: how many threads
`offload.runtime.cores` gives the kernels, and how busy other work kept the CPUs while a calibration measured them),
and the one lock every calibration of this machine takes (`calibration_lock`). Knows nothing else.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path
from typing import Any

from offload.config import cache_dir
from storage.errors import OffloadError
from storage.lock import FileLock

#: The CPU features the kernels' paths and speeds follow: AVX2 / AVX-512 vector widths, AVX-512 BF16's vdpbf16ps
#: (`offload.model.cpu_bf16`), VNNI's vpdpwssds (`offload.model.cpu_packed16`), and AMX (`offload.model.simd_amx`).
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


@functools.cache
def cpu_info() -> tuple[str, list[str]]:
    """(the CPU's model name, all its flags) from /proc/cpuinfo's first CPU (read once a process); elsewhere (the
    platform's processor name, [])."""
    name, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.split()
            elif not line.strip() and (name or flags):  # the first CPU's entries end at a blank line
                break
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


#: the kernel's CPU time counters: "cpu" (all), then a line a CPU: "cpuN user nice system idle iowait irq softirq ..."
PROC_STAT = Path("/proc/stat")
TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every task has run on the CPUs this process may use, CPU seconds this process has run), both
    since boot, or None where the kernel does not say (not Linux). Two readings' differences over the wall time
    between them: how many cores other work took meanwhile (waiting for a disk is not work; a hypervisor's steal is
    not counted either)."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    ticks = 0
    for line in lines[1:]:
        name, *fields = line.split()
        if not name.startswith("cpu"):
            break
        if mine is None or int(name[3:]) in mine:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
            ticks += user + nice + system + irq + softirq
    t = os.times()
    return ticks * TICK_S, t.user + t.system


def busy_mark() -> tuple[float, float, float] | None:
    """A reading for `busy_share`: (monotonic seconds, `cpu_seconds()`), None where the kernel does not say."""
    seconds = cpu_seconds()
    return None if seconds is None else (time.monotonic(), *seconds)


def busy_share(before: tuple[float, float, float] | None, after: tuple[float, float, float] | None) -> float | None:
    """The share of this process's CPUs that other work kept busy between two `busy_mark` readings (0: none of
    them, 1: all), or None where either is missing."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / ((after[0] - before[0]) * cpus())


def identity() -> dict[str, Any]:
    """This machine as a calibration records it: {"cpu": name, "features": the SPEED_FLAGS it has, "cpus": n}."""
    name, flags = cpu_info()
    return {"cpu": name, "features": [f for f in SPEED_FLAGS if f in flags], "cpus": cpus()}


def other_machine(recorded: Any) -> str | None:
    """How a recorded `identity` differs from this machine's, in words (None: the same, or nothing recorded: files
    written before calibrations recorded it)."""
    if not isinstance(recorded, dict):
        return None
    ours = identity()
    if recorded.get("cpu") != ours["cpu"]:
        return f"a {recorded.get('cpu')!r} CPU, this is a {ours['cpu']!r}"
    theirs = recorded.get("features")
    if isinstance(theirs, list) and theirs != ours["features"]:
        return f"a CPU with [{' '.join(theirs)}], this one has [{' '.join(ours['features'])}]"
    if recorded.get("cpus") != ours["cpus"]:
        return f"{recorded.get('cpus')} CPUs, this process may use {ours['cpus']}"
    return None


def calibration_lock(near: Path) -> FileLock:
    """The lock every calibration of this machine takes, whoever calls it (`offload chat --auto`, `offload
    calibrate`, the scripts), in `cache_dir()`; in the directory `near` where that cannot be made. Two first starts
    at once with separate --disk directories, 2 cores, each measured while the other did, and each planned a step
    of 8 ms at 20-23 ms."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        return FileLock(cache_dir() / ".calibration.lock")
    except (OSError, OffloadError):
        return FileLock(Path(near) / ".calibration.lock")
