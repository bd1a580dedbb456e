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

import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch

from offload.config import cache_dir
from offload.errors import OffloadError
from offload.model import fused
from offload.model.kernels import packed_linear
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


def _compile(stages: list[str], dtype: torch.dtype, packed: Sequence[str], say: Callable[[str], None]) -> bool:
    if not stages:
        return True
    say(f"kernels: this install's CPU kernels are not compiled yet: compiling them once, {len(stages)} child "
        "process(es) one after another (a minute or more each), so that this process keeps none of the compiler's "
        "memory")
    name = str(dtype).removeprefix("torch.")
    for stage in stages:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", __name__, stage, name, *packed[:1]],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            why = (f"stopped by signal {-proc.returncode}{', for memory?' if proc.returncode == -9 else ''}"
                   if proc.returncode < 0 else
                   (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
            say(f"kernels: compiling {STAGES[stage]} in a child process failed ({why}): this process compiles "
                "what is left as it runs (later starts find it compiled)" + (
                    "; if memory stopped it, give this one start about 1 GiB (a stage's child takes up to ~0.7 GiB "
                    "beside this process): later starts fit in less" if proc.returncode == -9 else ""))
            return False
        say(f"kernels: {STAGES[stage]} compiled in {time.perf_counter() - t0:.0f}s")
    return True


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
