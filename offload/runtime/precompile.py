"""A fresh install's CPU kernels compiled in child processes, one stage each, before the first run uses them.

    python -m offload.runtime.precompile STAGE DTYPE [FORMAT]     (what `compile_kernels` starts)

numba keeps every kernel it compiles, with its compiler's state, for the life of the process that compiled it: a
fresh install's first `offload chat --auto SmolLM2-135M --weights int4` compiled its kernels while it calibrated
and grew from 0.29 to 1.1 GB (a warm cache's calibration peaks at 0.48), so in a 1 GiB memory cgroup it was stopped
for memory minutes into its calibration. A child process writes numba's cache and exits, giving all of that back;
each later stage's child links what the earlier ones cached (numba caches a kernel's bitcode beside its code, so a
caller compiled later inlines it as one process would), and the calibration and the run then compile nothing.
Peaks of the stages (SmolLM2's first start, a 2-core Xeon, numba 0.68.1): the dense layers 694 MiB, the packed
products 707, the packed layers around them 581, where the packed layers with their products in one child took 877.

The stages run a tiny Llama-shaped model through the real engine (every kernel a run of that shape calls: prefill,
decode, the head), in the run's dtype; other shapes' variants (a bias, experts) still compile in the run, around
the cached kernels they call (much less: a decoder layer's variant around cached products ~60 MiB).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload.config import cache_dir
from offload.errors import OffloadError
from offload.model import fused
from offload.model.kernels import packed_linear
from offload.plan.machine import cpus
from offload.plan.memory import ram_available
from offload.runtime.overhead import TINY_PROMPT, tiny_runner
from offload.weights.quant import quantize
from storage.lock import FileLock

#: what each stage's child compiles, in the order they run
STAGES = {"dense": "the dense layers", "products": "the packed products", "packed": "the packed layers"}


def stages_needed(packed: bool, dtype: torch.dtype | None = None) -> list[str]:
    """The stages whose kernels numba's cache does not hold yet for activations of `dtype` (any: None;
    `fused.layers_compiled`): the dense layers (every CPU run and its calibration calls them), and where the run
    multiplies packed matrices their products and layers. No stage where it cannot tell (no numba, another cache
    layout): those compile in the run as before, if at all."""
    need = ["dense"] if fused.layers_compiled(False, dtype) is False else []
    return need + (["products", "packed"] if packed and fused.layers_compiled(True, dtype) is False else [])


def compile_kernels(dtype: torch.dtype, packed: Sequence[str], say: Callable[[str], None] = print) -> bool:
    """Compile the CPU kernels a run in `dtype` with these packed formats (int8, int4) computes with, where numba's
    cache lacks them, each stage in its own child process (`STAGES`). True where the cache holds them after (or
    did before); False where a child failed, which is said in one sentence: the run then compiles what is left in
    its own process, as it did before this existed (the memory planner keeps room for that: `compile_reserve`).
    Processes starting at once take turns (a lock in `cache_dir()`): the next finds the kernels cached."""
    stages = stages_needed(bool(packed), dtype)
    if not stages:
        return True
    try:  # one process compiles at a time; the others wait, then find the kernels cached
        cache_dir().mkdir(parents=True, exist_ok=True)
        lock = FileLock(cache_dir() / ".kernels.lock")
    except (OSError, OffloadError):  # (a cache directory it cannot write: each compiles for itself)
        lock = None
    try:
        if lock is not None:
            lock.exclusive(on_wait=lambda holder: say(f"kernels: waiting for {holder} to finish compiling them"))
            lock.announce("compiling the CPU kernels")
        return _compile(stages_needed(bool(packed), dtype), dtype, packed, say)
    finally:
        if lock is not None:
            lock.close()


#: RAM one stage's child holds at its peak (0.58-0.77 GB measured: the docstring's Xeon figures; a 2-core Zen 3:
#: dense 697, products 771, packed 593 MB): two children at once where the process may fill twice that
STAGE_PEAK = 800 * 2**20
#: how often the children are looked at while they compile
POLL_S = 0.05
#: stages whose children run at the same time where there is room (`rounds`): neither links the other's code (the
#: packed layers, last, link both)
TOGETHER = ("dense", "products")


def rounds(stages: list[str], cores: int, room: int) -> list[list[str]]:
    """The stages in rounds, each round's children started at once: the dense layers beside the packed products
    (`TOGETHER`) where this process may use two cores and fill two children's peaks (`STAGE_PEAK`), then the rest;
    one at a time elsewhere. (numba compiles on one core: a fresh install's first bf16 int4 start, a 2-core Zen 3,
    three children one after another 238 / 284 s, the first two at once 166 / 178 s, each pair minutes apart.)"""
    if all(s in stages for s in TOGETHER) and cores >= 2 and room >= 2 * STAGE_PEAK:
        return [list(TOGETHER)] + [[s] for s in stages if s not in TOGETHER]
    return [[s] for s in stages]


def _compile(stages: list[str], dtype: torch.dtype, packed: Sequence[str], say: Callable[[str], None]) -> bool:
    if not stages:
        return True
    plan = rounds(stages, cpus(), ram_available())
    say(f"kernels: this install's CPU kernels are not compiled yet: compiling them once, {len(stages)} child "
        f"process(es){', the first two at once' if len(plan) < len(stages) else ' one after another'} (a minute "
        "or more each), so that this process keeps none of the compiler's memory")
    name = str(dtype).removeprefix("torch.")
    for together in plan:
        for stage, status, err, took in _children(together, [name, *packed[:1]]):
            if status != 0:
                why = (f"stopped by signal {-status}{', for memory?' if status == -9 else ''}" if status < 0 else
                       (err.strip().splitlines() or [f"exit status {status}"])[-1])
                say(f"kernels: compiling {STAGES[stage]} in a child process failed ({why}): this process compiles "
                    "what is left as it runs (later starts find it compiled)" + (
                        "; if memory stopped it, give this one start about 1 GiB (a stage's child takes up to ~0.7 "
                        "GiB beside this process): later starts fit in less" if status == -9 else ""))
                return False
            say(f"kernels: {STAGES[stage]} compiled in {took:.0f}s")
    return True


def _children(stages: list[str], args: list[str]) -> list[tuple[str, int, str, float]]:
    """Each stage's child started at once, then waited for: (stage, exit status, stderr, seconds) each. Stopped (Ctrl-C,
    SIGTERM: an exception here), the children are killed with it, not left compiling for minutes."""
    started: list[tuple[str, subprocess.Popen, Any, float]] = []
    with contextlib.ExitStack() as files:
        try:
            for stage in stages:  # (stderr into a file, not a pipe: two children's output read one after the other)
                err = files.enter_context(tempfile.TemporaryFile("w+"))
                started.append((stage, subprocess.Popen([sys.executable, "-m", __name__, stage, *args],
                                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                        stderr=err), err, time.perf_counter()))
            ended: dict[str, float] = {}
            while True:
                for stage, proc, _, t0 in started:
                    if stage not in ended and proc.poll() is not None:
                        ended[stage] = time.perf_counter() - t0
                if len(ended) == len(started):
                    break
                time.sleep(POLL_S)
        except BaseException:
            for _, proc, _, _ in started:
                proc.kill()
                proc.wait()
            raise
        out = []
        for stage, proc, err, _ in started:
            err.seek(0)
            out.append((stage, proc.returncode, err.read(), ended[stage]))
        return out


def _tiny_run(dtype: str, quantization: str) -> None:
    """Prefill and decode with a tiny Llama-shaped model in `dtype`, its matrices dense ("none") or packed."""
    with tiny_runner("cpu", dtype, quantization) as (runner, _):
        runner.generate([TINY_PROMPT], max_new_tokens=3, stop_on_eos=False)


def _products(dtype: str) -> None:
    """int4 and int8 products of activations in `dtype` at the row counts whose paths differ (one row, a verify
    pass's few, a prefill chunk's many)."""
    dt = getattr(torch, dtype)
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    for bits in (4, 8):
        packed = quantize(w, bits, 64, dt)
        for rows in (1, 9, 64):
            packed_linear(torch.randn(rows, 128).to(dt), packed["q"], packed["sz"])


def run_stage(stage: str, dtype: str, quantization: str = "int4") -> None:
    """What one stage's child does (in this process where called directly)."""
    if stage == "dense":
        _tiny_run(dtype, "none")
    elif stage == "products":
        _products(dtype)
    elif stage == "packed":
        _tiny_run(dtype, quantization)
    else:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, not {stage!r}")


if __name__ == "__main__":
    run_stage(*sys.argv[1:4])
