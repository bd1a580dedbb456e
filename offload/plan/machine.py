"""Which machine a calibration measured, as far as its speeds depend on it: the CPU's name, the vector features the
CPU kernels choose their paths by, and the CPUs this process may use. `calibrate` records it; a file that records
another machine is measured again by `offload chat --auto` and scripts/bench_cpu.py, and named in a warning where a
run or a plan reads it (its times are that machine's: a Zen 3 file read on a Zen 4 put `offload plan` 18-38% off).
Reads /proc/cpuinfo (Linux); elsewhere the platform's processor name and no features. Also whether the machine is
busy with other work now (`busy`: the OpenMP wait policy `offload` picks at import). Knows nothing else.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path
from typing import Any

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


#: the kernel's load figures: 1-, 5-, 15-minute averages, then "runnable/all" tasks now
LOADAVG = Path("/proc/loadavg")


def runnable_others(samples: int = 5, gap_s: float = 0.004) -> int | None:
    """The fewest tasks besides this one the kernel had runnable over a few samples a few ms apart (LOADAVG's
    count, which counts the reader), None where it cannot say: a load that lasts shows in every sample, a task that
    just ran in one."""
    fewest = None
    for i in range(samples):
        try:
            running = int(LOADAVG.read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        fewest = running - 1 if fewest is None else min(fewest, running - 1)
        if fewest <= 0 or i == samples - 1:
            return fewest
        time.sleep(gap_s)
    return fewest


def busy() -> bool:
    """Is other work taking this machine's cores now: a 1-minute load average at or above its cores, and other tasks
    still runnable on at least half of them (`runnable_others`)? The average trails by a minute, so a run started
    on an idle machine just after a build, a conversion or another run would look busy by it alone. Where no load
    average is known: busy (the safe choice for a wait policy)."""
    try:
        if os.getloadavg()[0] < cpus():
            return False
    except OSError:
        return True
    others = runnable_others()
    return others is None or others >= max(1, cpus() // 2)


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
