"""Ctrl-C and SIGTERM for every command: one exception, one exit status, and a prompt way out of the process.

SIGINT raises `KeyboardInterrupt` and SIGTERM raises `Terminated`, a subclass (through `storage.interrupts`:
never inside a lock the scheduler's threads need, never lost in a callback from C), so that the same clean-up
runs for both wherever they land: `with` blocks close the runner (threads joined, slot files removed), a
conversion keeps what it wrote, journaled, to resume. The commands turn them into exit status 130 / 143 and
one line on stderr (`cli.main`). `leave` then ends the process without the interpreter's teardown: once a
command has returned, everything it started is closed, and collecting torch's modules at exit alone takes
seconds on a loaded machine (12 s measured here at load 19), which
would hold up the exit that Ctrl-C asked for. The process being the command's own also lets `settle_heap` take
the loaded model's objects out of the cyclic collector's walks.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from typing import NoReturn

from storage import interrupts

INTERRUPTED, TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM
_OWN = {"process": False}  # `program` runs: the process is the command's own (not a test's or an embedder's)
#: set in the environment of a command that started itself again (`restart`): once at most
RESTARTED = "OFFLOAD_RESTARTED"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the same clean-up runs (threads joined, nothing half-written)."""


def _terminate(signum: int, frame: object) -> None:
    interrupts.interrupt(Terminated)


def _interrupt(signum: int, frame: object) -> None:
    interrupts.interrupt(KeyboardInterrupt)


def install() -> dict[int, object]:
    """Make SIGTERM raise `Terminated` and SIGINT `KeyboardInterrupt`, both remembered until caught (one lost
    in a callback from C is raised again at the next layer; one landing while compute is inside the
    scheduler's locks is raised as it leaves them: `storage.interrupts`); returns the handlers it replaced,
    for `restore`."""
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminate)}
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _interrupt):  # not where it is ignored
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _interrupt)
    return previous


def restore(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
    interrupts.delivered()  # whatever was raised has ended the command


def status_of(e: KeyboardInterrupt) -> tuple[int, str]:
    """The exit status and the word stderr says for an interrupt."""
    return (TERMINATED, "terminated") if isinstance(e, Terminated) else (INTERRUPTED, "interrupted")


def own_process() -> None:
    """This process runs one command and ends (`cli.main.program`): `settle_heap` may freeze its heap."""
    _OWN["process"] = True


def settle_heap() -> None:
    """Once a command has loaded its model: collect once, then exempt every object that exists from the cyclic
    collector (`gc.freeze`, as vLLM and SGLang do after start-up). A loaded model is ~400k objects that each full
    collection walks: 170-200 ms (SmolLM2-135M, a 2-core Zen 4), a stall of 20-40 decode steps, twice in 1500
    tokens generated; after the freeze those collections take 10-50 ms. Only in the command's own process
    (`own_process`): a test or an embedder calling `main` keeps its collector as it was."""
    if _OWN["process"]:
        gc.collect()
        gc.freeze()


def restart(why: str) -> None:
    """Start this command again in this process's place (`os.execv`: the same arguments, environment, stdin and
    stdout; nothing read from stdin yet), once, and only where the process is the command's own (`own_process`);
    otherwise nothing. For memory the process holds and cannot give back: `why` goes to stderr first."""
    if not _OWN["process"] or os.environ.get(RESTARTED):
        return
    print(why, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        stream.flush()
    os.environ[RESTARTED] = "1"
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def leave(status: int) -> NoReturn:
    """Flush what was written and end the process now, skipping the interpreter's teardown."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # on the way out already: a second signal changes nothing
        signal.signal(sig, signal.SIG_IGN)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            pass
    os._exit(status)
