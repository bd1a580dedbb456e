"""Ctrl-C and the threads: an interrupt is raised where it cannot wedge a lock, and never lost.

Python raises `KeyboardInterrupt` wherever the main thread is when SIGINT arrives. Two places are bad:

- inside `threading.Condition.__enter__` (every `Event`, `Condition`, `queue` and `Future` takes one), right
  after the lock is acquired and before the `with` holds it (CPython runs signal handlers after a C call
  returns): the lock stays held, and the worker thread that next needs it blocks for ever (seen: the
  prefetcher's loader still busy 10 s after Ctrl-C, when closing gave up on it);
- inside a callback from C (a ctypes callback during numba's compilation, a `__del__`, a GC callback):
  Python prints "Exception ignored" and drops it, and the command runs on as if nobody pressed Ctrl-C
  (seen: a run that went on for its 3500 tokens).

So the command line's handlers (`offload.cli.signals`) call `interrupt(kind)` instead of raising:

    interrupt(KeyboardInterrupt)   # the handler: remembered; raised now unless the main thread is `critical`
    with critical: ...             # compute's calls into the scheduler's threads: an interrupt waits for the end
    wait(event) / result(future)   # blocking waits that stay interruptible (they poll, inside `critical`)
    check()                        # every engine step, and the end of every critical section (each layer's
                                   # acquire and release): raises an interrupt that was raised and lost
    delivered()                    # whoever catches it and goes on (chat's "stop this reply")

Without those handlers (a library user's own), nothing is remembered, `critical` is a counter and `check`
one global read. Worker threads never count: signals are delivered to the main thread only.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, TimeoutError
from typing import Any

#: How often a blocking wait inside a critical section looks for an interrupt that waits to be raised.
POLL_S = 0.05

_pending: type[BaseException] | None = None
_depth = 0  # critical sections the main thread is in
_main = threading.main_thread().ident


def interrupt(kind: type[BaseException]) -> None:
    """A signal handler's whole work: remember `kind` and raise it, unless the main thread is in a critical
    section (then its end raises it)."""
    global _pending
    _pending = kind
    if _depth == 0:
        raise kind()


def delivered() -> None:
    """The interrupt reached a handler that goes on (it was not lost): forget it."""
    global _pending
    _pending = None


def check() -> None:
    """Raise an interrupt that was raised and not yet delivered (lost in a callback, or deferred)."""
    if _pending is not None:
        raise _pending()


class _Critical:
    """`with critical:` on the main thread defers an interrupt to the section's end (nests)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _depth
        if threading.get_ident() == _main:
            _depth += 1

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        global _depth
        if threading.get_ident() == _main:
            _depth -= 1
            if _depth == 0 and kind is None:
                check()


critical = _Critical()


def wait(event: threading.Event) -> None:
    """`event.wait()`, interruptible and safe on the main thread."""
    with critical:
        while not event.wait(POLL_S):
            check()


def wait_for(cond: threading.Condition, predicate: Any) -> None:
    """`cond.wait_for(predicate)` (the caller holds `cond`), interruptible."""
    with critical:
        while not cond.wait_for(predicate, POLL_S):
            check()


def result(future: Future) -> Any:
    """`future.result()`, interruptible and safe on the main thread."""
    with critical:
        while True:
            try:
                return future.result(POLL_S)
            except TimeoutError:
                check()


def deferring(method: Any) -> Any:
    """A method whose whole body is a critical section (compute's entry points into a thread's state)."""

    @functools.wraps(method)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with critical:
            return method(*args, **kwargs)
    return inner
