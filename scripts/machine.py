"""What every benchmark records about the machine it ran on: the CPU's vector flags and the load."""

from __future__ import annotations

import os
import platform
from pathlib import Path

#: the flags that decide matmul and checksum speed (bf16, AVX-512, AMX, FMA, half-precision conversion)
PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


def cpu_flags() -> str:
    """The CPU's vector flags, space-separated (the processor name where /proc/cpuinfo is absent)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(PREFIXES))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> str:
    """The 1/5/15-minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
