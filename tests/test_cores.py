"""The kernels take the cores other work leaves this process (`offload.runtime.cores`), decided again as a run goes
on, and a run's tokens do not depend on how many threads computed them."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from offload.plan import machine
from offload.runtime import cores
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling
from tests.conftest import run_config

WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_hidden_layers": 3}  # products big enough to run on several threads (`kernels.PARALLEL_WORK`)


def in_thread(fn):
    """fn() in a thread of its own: a first look of its own, its own OpenMP thread count (both are per thread)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # (re-raised in the test's thread)
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_the_thread_count_follows_the_cores_others_leave(monkeypatch):
    """Readings of /proc/stat (busy seconds on our CPUs, ours) a second apart: another process taking a core takes
    a thread away, its end gives it back, a look too soon decides nothing; the caller's own count is left alone."""
    clock, readings = [0.0], []
    monkeypatch.setattr(cores, "cpus", lambda: 2)
    monkeypatch.setattr(machine, "cpus", lambda: 2)
    monkeypatch.setattr(cores.time, "monotonic", lambda: clock[0])  # (the module's: machine's readings too)
    monkeypatch.setattr(machine, "cpu_seconds", lambda: readings.pop(0))

    def look(at: float, busy: float, ours: float) -> int | None:
        clock[0] = at
        readings.append((busy, ours))
        return cores.share_cores()

    def run():
        torch.set_num_threads(2)
        seen = [look(0.0, 100.0, 10.0)]  # the first look: the window starts
        seen.append(look(1.0, 102.0, 11.0))  # others took a core: one thread
        seen.append(torch.get_num_threads())
        seen.append(look(1.2, 102.5, 11.2))  # too soon: nothing decided (the reading is not taken)
        readings.clear()
        seen.append(look(2.0, 103.7, 11.9))  # others took 0.8 of a core: still one
        seen.append(look(3.0, 104.7, 12.9))  # others took nothing: both again
        seen.append(torch.get_num_threads())
        torch.set_num_threads(1)  # the caller decides from now on
        seen.append(look(4.0, 104.8, 13.0))
        seen.append(look(5.0, 104.9, 13.1))
        seen.append(torch.get_num_threads())
        return seen

    assert in_thread(run) == [None, 1, 1, None, 1, 2, 2, None, None, 1]


def test_omp_num_threads_is_the_most_it_takes_and_no_proc_stat_decides_nothing(monkeypatch):
    monkeypatch.setattr(cores, "cpus", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def told():
        torch.set_num_threads(2)  # (as numba's pool sets it when it starts)
        first = cores.share_cores()
        return first, torch.get_num_threads()

    assert in_thread(told) == (None, 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(machine, "cpu_seconds", lambda: None)
    monkeypatch.setattr(cores, "CHECK_S", 0.0)

    def blind():
        torch.set_num_threads(2)
        return [cores.share_cores(), cores.share_cores(), torch.get_num_threads()]

    assert in_thread(blind) == [None, None, 2]


@pytest.mark.skipif(machine.cpu_seconds() is None or machine.cpus() < 2, reason="needs /proc/stat and 2 CPUs")
def test_a_busy_process_beside_takes_a_thread_and_gives_it_back_when_it_ends(monkeypatch):
    """The real readings: a process spinning on a core beside a loop of 2-thread products and looks (every 0.2 s)
    takes a thread within seconds; once it is killed the thread comes back."""
    monkeypatch.setattr(cores, "CHECK_S", 0.2)
    n = machine.cpus()
    x = torch.randn(384, 384)

    def until(pred, seconds: float) -> list[int]:
        seen, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(20):
                x @ x
            if (got := cores.share_cores()) is not None:
                seen.append(got)
                if pred(got):
                    break
        return seen

    def run():
        torch.set_num_threads(n)
        cores.share_cores()
        spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(1, n // 2))]
        try:
            busy = until(lambda t: t < n, 8.0)
        finally:
            for p in spin:
                p.kill()
                p.wait()
        return busy, until(lambda t: t == n, 8.0)

    busy, free = in_thread(run)
    assert busy and busy[-1] < n, busy
    assert free and free[-1] == n, free


@pytest.mark.skipif(machine.cpu_seconds() is None, reason="needs /proc/stat")
def test_busy_share_counts_other_processes_work_and_not_this_ones():
    """`machine.busy_share` (what a calibration records: `Calibration.busy`): a process spinning beside for a second
    shows as about one core of the CPUs; this process's own spinning does not show."""
    def share(work) -> float:
        start = machine.busy_mark()
        work()
        return machine.busy_share(start, machine.busy_mark()) * machine.cpus()  # (cores)

    def spin(seconds: float = 1.0) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    other = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # (started)
        beside = share(lambda: time.sleep(1.0))
    finally:
        other.kill()
        other.wait()
    assert beside > 0.6, beside
    assert share(spin) < 0.5


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_tokens_do_not_depend_on_the_thread_count(model_factory, quantization):
    """What the thread count may change (`share_cores`) must not change a run: the same greedy tokens computed on
    one thread and on two (products wide enough to split), bf16 dense and packed int4."""
    model = model_factory("llama", overrides=WIDE)
    config = run_config(model, dtype="bfloat16")
    if quantization:
        config["weights"] = {"quantization": quantization}
    prompts = [[5, 9, 13, 200, 31, 7, 77, 41, 3, 18, 250, 60], [11, 12]]

    def tokens(threads: int):
        def run():
            torch.set_num_threads(threads)
            with Runner.from_config(config) as r:
                return [c.token_ids for c in r.generate(prompts, sampling=Sampling(max_new_tokens=10,
                                                                                     stop_token_ids=frozenset()))]
        return in_thread(run)

    assert tokens(1) == tokens(2)
