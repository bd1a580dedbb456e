"""What every benchmark records about the machine it ran on, and how its results are written.

`Result` notes the command line, the time, the machine (CPUs, vector flags, torch) and the load when a
script starts; `Result.write(dir, name, markdown, data)` writes NAME.md (a header with all of that, then the
script's own text) and NAME.json (the same header fields plus the data) side by side. So a file in
scripts/results is exactly what a script wrote, and says which command on which machine wrote it.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from offload.plan.machine import cpu_info

ROOT = Path(__file__).resolve().parents[1]
#: the flags that decide matmul and checksum speed (bf16, AVX-512, AMX, FMA, half-precision conversion)
PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


def cpu_flags() -> str:
    """The CPU's vector flags, space-separated (the processor name where /proc/cpuinfo is absent)."""
    flags = cpu_info()[1]
    return " ".join(f for f in flags if f.startswith(PREFIXES)) if flags else platform.processor() or platform.machine()


def load() -> str:
    """The 1/5/15-minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def command_line() -> str:
    """How this process was started, as one would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        rel = script.relative_to(ROOT)
        head = ["python", "-m", ".".join(rel.with_suffix("").parts)]
    except ValueError:
        head = ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


@dataclass
class Result:
    """The header every result carries; create it when the script starts (the load before the run)."""

    command: str = field(default_factory=command_line)
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    load_before: str = field(default_factory=load)

    def machine(self) -> dict[str, Any]:
        return {"cpus": os.cpu_count(), "cpu": platform.machine(), "cpu_flags": cpu_flags(),
                "python": sys.version.split()[0], "torch": torch.__version__}

    def write(self, directory: str | Path, name: str, markdown: str, data: Any) -> Path:
        """NAME.md (this header, then `markdown`) and NAME.json (the header's fields and `data`)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"command": self.command, "started": self.started, "machine": self.machine(),
                "load_before": self.load_before, "load_after": load()}
        m = meta["machine"]
        head = (f"Command: `{self.command}` (from the repository root), started {self.started}.  \n"
                f"Machine: {m['cpus']} CPUs ({m['cpu']}; flags {m['cpu_flags']}), Python {m['python']}, torch "
                f"{m['torch']}; load average (1/5/15 min) {meta['load_before']} before, {meta['load_after']} after.  \n"
                f"Written by the script, with its data in `{name}.json`.\n\n")
        (directory / f"{name}.md").write_text(head + markdown.rstrip("\n") + "\n")
        (directory / f"{name}.json").write_text(json.dumps(meta | {"data": data}, indent=2) + "\n")
        return directory / f"{name}.md"
