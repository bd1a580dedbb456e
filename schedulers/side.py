"""Side jobs: per-pass work that rides with the weights (a layer's cold KV blocks), on one persistent thread.

    side = SideWorker(lead=depth + 1)
    side.submit(jobs, position)     # the coming pass's jobs, keyed by group; runs them in pass order
    side.advance()                  # compute finished one more group (the prefetcher calls it on release)
    result = side.result(group)     # compute takes a job's result (waits for it; re-raises its error)
    side.cancel()                   # a pass cut short: drop what is left, wait until no job runs
    side.close()                    # the thread ends (with the runner)

One thread, started at the first `submit` and ended by `close`, runs every pass's jobs: no
thread per pass. It runs a group's job only while that group is at most `lead` groups ahead
of compute, so the job's buffers are bounded like the ring's. A job records its own span and
counts its own traffic (where the bytes are known). Knows groups and order; nothing about what
a job does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from storage import interrupts

log = logging.getLogger(__name__)

#: How long `close` waits for a job in the middle of a read; a thread still busy after that (a hung disk)
#: is left behind, a daemon, rather than blocking the program's exit.
JOIN_TIMEOUT_S = 10.0

Job = Callable[[], tuple[Any, int]]


class SideWorker:
    def __init__(self, lead: int) -> None:
        self.lead = lead
        self._cond = threading.Condition()
        self._gen = 0  # the pass being served; a job of an older pass never delivers
        self._pending: tuple[int, list[str], dict[str, int], dict[str, Job]] | None = None
        self._results: dict[str, tuple[Any, BaseException | None]] = {}
        self._progress = 0  # groups compute finished in this pass
        self._busy = False  # a pass's jobs are running
        self._stop = False
        self._thread: threading.Thread | None = None
        self.threads_started = 0  # for tests and reports: stays 1 however many passes run

    # -- compute side -------------------------------------------------------------------------
    @interrupts.deferring
    def submit(self, jobs: dict[str, Job], position: dict[str, int]) -> None:
        """The coming pass's jobs; `position[g]`: g's index among the groups compute will release in order."""
        order = sorted(jobs, key=position.__getitem__)
        self.cancel()  # a previous pass is finished (or abandoned): its jobs never touch what comes next
        with self._cond:
            self._gen += 1
            self._pending = (self._gen, order, position, jobs)
            self._results = {}
            self._progress = 0
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="offload-side", daemon=True)
                self.threads_started += 1
                self._thread.start()

    @interrupts.deferring
    def advance(self, groups: int = 1) -> None:
        if self._thread is None:  # no job was ever submitted: nothing waits on the count (a resident CPU run)
            self._progress += groups
            return
        with self._cond:
            self._progress += groups
            self._cond.notify_all()

    @interrupts.deferring
    def result(self, group: str) -> Any:
        with self._cond:
            interrupts.wait_for(self._cond, lambda: group in self._results or self._stop)
            if group not in self._results:
                raise RuntimeError("the side worker was closed while compute waited on it")
            result, error = self._results.pop(group)
        if error is not None:
            raise error
        return result

    @interrupts.deferring
    def cancel(self) -> None:
        """Drop the jobs not yet run and wait for the one running (if any) to end; one still running after
        `JOIN_TIMEOUT_S` (a hung disk) is left to finish on its own, its result never delivered."""
        with self._cond:
            self._gen += 1
            self._pending = None
            self._cond.notify_all()
            if self._busy and not self._cond.wait_for(lambda: not self._busy, JOIN_TIMEOUT_S):
                log.warning("a side job is still busy after %.0f s (a hung disk?); going on without it",
                            JOIN_TIMEOUT_S)

    @interrupts.deferring
    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._gen += 1
            self._cond.notify_all()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(JOIN_TIMEOUT_S)
            if t.is_alive():
                log.warning("%s is still busy after %.0f s (a hung disk?); leaving it behind", t.name,
                            JOIN_TIMEOUT_S)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._pending is None:
                    self._cond.wait()
                if self._stop:
                    return
                gen, order, position, jobs = self._pending
                self._pending = None
                self._busy = True
            try:
                self._run_pass(gen, order, position, jobs)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _run_pass(self, gen: int, order: list[str], position: dict[str, int], jobs: dict[str, Job]) -> None:
        for g in order:
            with self._cond:  # do not run further ahead than the ring would
                while self._progress < position[g] - self.lead and gen == self._gen and not self._stop:
                    self._cond.wait()
                if gen != self._gen or self._stop:
                    return
            try:
                outcome: tuple[Any, BaseException | None] = (jobs[g]()[0], None)
            except BaseException as e:  # handed to compute
                outcome = (None, e)
            with self._cond:
                if gen != self._gen:
                    return
                self._results[g] = outcome
                self._cond.notify_all()
            if outcome[1] is not None:
                return
