"""How many threads the kernels take: the cores other work leaves this process, decided again as a run goes on.

torch and numba run each parallel region on a team of OpenMP threads that spin a while at its end, waiting for the
next (a decode step has ~150 regions; a sleeping worker's wake-up costs more than a small region). On free cores that
is the fast way; where another process takes a core, each region waits for a team member the kernel has not
scheduled. Measured on 2 cores (the trained SmolLM2-135M int4, `offload run --chat`, 128 new tokens, tok/s; each
column a fixed thread count and wait policy):

| beside                           | 2 threads spinning | 1 thread | 2 threads, OMP_WAIT_POLICY=PASSIVE |
|----------------------------------|--------------------|----------|------------------------------------|
| nothing                          | 153                | 123      | 52                                 |
| one process busy half the time   | 94                 | 95       | -                                  |
| one busy process                 | 35                 | 93       | -                                  |
| two busy processes               | 13                 | 71       | 80                                 |
| the same run started beside it   | 7 / 7              | 117 / 117| 88 / 88                            |

So: every `CHECK_S` (at the start of a forward pass, in the thread that runs it) `share_cores` reads how much CPU
time other work took on this process's CPUs since the last check and gives torch (and so numba, which follows it:
`kernels._threads`) the cores it left: a thread a core of which at least half is free, at least one, at most the
threads this thread had at its first look. Two runs started together each see the other take a core and settle at
one thread each; when one ends the other takes both again. Tokens do not depend on the thread count (the kernels
compute each output whole on one thread: `tests/test_cores.py`). An explicit `OMP_NUM_THREADS` is the most it takes;
a count the caller set since the last look (`torch.set_num_threads`) is theirs: left alone from then on. Each change
is logged (`-v`) and a sample on the timeline's `offload/threads` counter. With it (400 new tokens): alone 165
tok/s, two started together 92 + 90, beside one busy process 88, beside two 59. Reading the CPU time others took,
not the load average or the tasks runnable at one moment: a disk-bound run's own page-cache reads and reclaim count
as ~0.0 of a core (the 1.7B int4 streaming in a 1 GiB cgroup, 22 looks).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from offload.plan.machine import busy_mark, busy_share, cpus
from schedulers.timeline import Timeline

log = logging.getLogger(__name__)

#: seconds between two looks at what other work takes (a look reads /proc/stat: ~50 us)
CHECK_S = 0.5
#: the share of a core other work may take before a thread of ours gives it up (the table above: even at half)
SPARE = 0.5

_state = threading.local()  # per thread, as OpenMP's thread count is: full, ours, mark


def share_cores(timeline: Timeline | None = None) -> int | None:
    """Give this thread's kernels the cores other work left them since the last look (see the module's doc); the
    thread count set, None where nothing was decided (too soon, a first look, the caller's choice, no /proc/stat).
    The first look (an executor calls it when it is made) marks the start of the first window."""
    now, s = time.monotonic(), _state
    if not hasattr(s, "full"):
        _start_pools()
        s.full, s.mark = _most_threads(), None
        if s.full < torch.get_num_threads():
            torch.set_num_threads(s.full)
        s.ours = torch.get_num_threads()
    if s.full is None or (s.mark is not None and now - s.mark[0] < CHECK_S):
        return None
    if torch.get_num_threads() != s.ours:  # set by the caller since: theirs to decide from now on
        s.full = None
        return None
    mark, s.mark = s.mark, busy_mark()
    share = busy_share(mark, s.mark)
    if share is None:
        return None
    others = share * cpus()  # (cores)
    want = min(s.full, max(1, int(cpus() - others + SPARE)))
    if want != s.ours:
        torch.set_num_threads(want)
        s.ours = want
        log.info("other work took %.1f of this process's %d CPUs: the kernels run on %d thread(s)", others, cpus(),
                 want)
        if timeline is not None:
            timeline.count("offload/threads", threads=want, others=round(others, 2))
    return want


def _most_threads() -> int:
    """The threads a pass may take at most: torch's count, or fewer where `OMP_NUM_THREADS` says so."""
    told = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return min(torch.get_num_threads(), int(told)) if told.isdigit() and int(told) > 0 else torch.get_num_threads()


def _start_pools() -> None:
    """Start numba's thread pool now: starting, it sets OpenMP's thread count to its own (`NUMBA_NUM_THREADS`, the
    CPUs), which a look after would take for the caller's choice."""
    try:
        from numba.np.ufunc.parallel import _launch_threads
    except ImportError:  # (no numba: the kernels are torch's, whose count this is)
        return
    _launch_threads()
