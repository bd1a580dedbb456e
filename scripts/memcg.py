"""Run a command inside a fresh memory cgroup: the peers' comparisons at equal memory.

    python -m scripts.memcg 2G -- python scripts/bench.py --worker offload --spec '{...}'
    python -m scripts.memcg 2G --drop-caches -- llama-bench -m model.gguf

A memory cgroup counts the page cache its processes fill, so an engine that memory-maps its weights (llama.cpp)
and one that reads them (Offload, Accelerate's disk offload) get the same room: what does not fit is read
again from disk. Backends, the first that works: the cgroup-v2 `memory` controller, the cgroup-v1 memory
hierarchy (both need write access to /sys/fs/cgroup, i.e. root), `systemd-run --user --scope` (no peak
figure then). `--drop-caches` empties the page cache first (root), so a run cannot find what an earlier one
read, charged to another cgroup. The cgroup's peak use and OOM kills go to stderr as one JSON line starting
`memcg ` (and to `--report FILE`); `run()` returns them to a Python caller.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """'2G', '1536M', '2GiB' or bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in UNITS else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * UNITS[unit])
    except ValueError:
        raise SystemExit(f"memcg: {text!r} is not a size: give bytes or a number with K, M or G (e.g. 2G).") from None


def _v2_root() -> Path | None:
    for root in (V2, V2 / "unified"):
        ctl = root / "cgroup.subtree_control"
        if ctl.is_file() and "memory" in (root / "cgroup.controllers").read_text().split() and os.access(ctl, os.W_OK):
            return root
    return None


def backend() -> str | None:
    """'v2', 'v1', 'systemd' or None (no way to limit memory here)."""
    if _v2_root() is not None:
        return "v2"
    if (V1 / "memory.limit_in_bytes").is_file() and os.access(V1, os.W_OK):
        return "v1"
    if shutil.which("systemd-run") and subprocess.run(
            ["systemd-run", "--user", "--scope", "-q", "true"], capture_output=True).returncode == 0:
        return "systemd"
    return None


def limit_arg(value: str | None, default: str | None) -> int | None:
    """A script's --memory-max: None takes the profile's default, "none" turns the cgroup off; bytes."""
    chosen = default if value is None else None if value.lower() == "none" else value
    return None if chosen is None else parse_size(chosen)


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False where that is not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


class Group:
    """One cgroup with a hard memory limit; `join` is a Popen preexec_fn that moves the child into it."""

    def __init__(self, limit: int, kind: str):
        self.kind, self.limit = kind, limit
        parent = _v2_root() if kind == "v2" else V1
        self.path = parent / f"offload-bench-{os.getpid()}-{time.monotonic_ns()}"
        self.path.mkdir()
        if kind == "v2":
            (parent / "cgroup.subtree_control").write_text("+memory\n")
            (self.path / "memory.max").write_text(f"{limit}\n")
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0\n")
        else:
            (self.path / "memory.limit_in_bytes").write_text(f"{limit}\n")

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def stats(self) -> dict:
        def read(name: str) -> str:
            try:
                return (self.path / name).read_text()
            except OSError:
                return ""
        if self.kind == "v2":
            peak = read("memory.peak").strip()
            events = dict(line.split() for line in read("memory.events").splitlines() if line.strip())
            return {"limit": self.limit, "peak": int(peak) if peak else None,
                    "oom_kills": int(events.get("oom_kill", 0))}
        oom = dict(line.split() for line in read("memory.oom_control").splitlines() if line.strip())
        return {"limit": self.limit, "peak": int(read("memory.max_usage_in_bytes") or 0),
                "oom_kills": int(oom.get("oom_kill", 0)), "limit_hits": int(read("memory.failcnt") or 0)}

    def remove(self) -> None:
        for _ in range(50):  # the last task may take a moment to leave after it exits
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def run(cmd: list[str], limit: int | str | None, *, drop: bool = False,
        **popen) -> tuple[subprocess.CompletedProcess, dict]:
    """`subprocess.run(cmd, **popen)` inside a new cgroup of `limit` bytes (None: no limit); returns the cgroup's
    stats beside the result ({"limit": None} without a limit, {"backend": "systemd"} without figures)."""
    if drop:
        drop_caches()
    if limit is None:
        return subprocess.run(cmd, **popen), {"limit": None}
    limit = parse_size(limit) if isinstance(limit, str) else int(limit)
    kind = backend()
    if kind is None:
        raise SystemExit("memcg: no memory cgroup can be made here: run as root on a cgroup-v1/v2 machine, or "
                         "where `systemd-run --user --scope` works.")
    if kind == "systemd":
        wrapped = ["systemd-run", "--user", "--scope", "-q", "-p", f"MemoryMax={limit}", "-p", "MemorySwapMax=0", *cmd]
        return subprocess.run(wrapped, **popen), {"limit": limit, "backend": "systemd"}
    group = Group(limit, kind)
    try:
        proc = subprocess.run(cmd, preexec_fn=group.join, **popen)
        return proc, {"backend": kind, **group.stats()}
    finally:
        group.remove()


def why_failed(proc: subprocess.CompletedProcess, stats: dict) -> str:
    """One line on why a run that `run` captured failed: the cgroup's OOM killer, else its last stderr line."""
    if stats.get("oom_kills"):
        return f"killed by the memory cgroup's OOM killer at {stats['peak'] / 2**20:.0f} MiB"
    tail = (proc.stderr or "").strip().splitlines()
    return tail[-1][:300] if tail else f"exit status {proc.returncode}"


def run_json(cmd: list[str], limit: int | str | None = None, *, timeout: int = 7200, drop: bool = False,
             check: bool = False) -> dict:
    """A worker that prints one JSON line last, run inside `limit`: that line's object, with the cgroup's stats
    under "memcg" when limited; a failed worker gives {"error": why_failed, "stderr": its tail}, or raises
    RuntimeError with both when `check`."""
    proc, stats = run(cmd, limit, drop=drop, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    extra = {"memcg": stats} if limit is not None else {}
    if proc.returncode != 0:
        if check:
            raise RuntimeError(f"worker failed: {why_failed(proc, stats)}\n{proc.stderr[-4000:]}")
        return {"error": why_failed(proc, stats), "stderr": proc.stderr[-4000:], **extra}
    return json.loads(proc.stdout.strip().splitlines()[-1]) | extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m scripts.memcg LIMIT [--drop-caches] [--report FILE] -- COMMAND ...")
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m scripts.memcg", description=__doc__.split("\n")[0])
    ap.add_argument("limit", help="the cgroup's memory limit (2G, 1536M, bytes)")
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache first (root)")
    ap.add_argument("--report", type=Path, default=None, help="also write the cgroup's stats to this JSON file")
    args = ap.parse_args(argv[:split])
    proc, stats = run(argv[split + 1:], args.limit, drop=args.drop_caches)
    print("memcg " + json.dumps(stats), file=sys.stderr)
    if args.report:
        args.report.write_text(json.dumps(stats))
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # killed: as a shell says it


if __name__ == "__main__":
    raise SystemExit(main())
