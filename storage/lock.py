"""Inter-process locks on files (`fcntl.flock`), and per-process scratch directories built on them.

    lock = FileLock(STORE / ".offload-lock")
    lock.exclusive()        # one writer: converting a store; waits while anyone else holds the lock
    lock.shared()           # readers of a complete store share it; waits while a writer holds it
    lock.holder()           # "pid 4242 (converting since 20:14:03)": what the writer wrote into the file
    lock.close()            # releases it (so does the process dying, even by SIGKILL)

`flock` locks belong to an open file, and the kernel drops them when their process dies,
so a lock held by a dead process is simply free: nothing is ever stale, and nothing reads
a pid to decide. Changing a held lock's mode (shared <-> exclusive) is not atomic: callers
re-check what they protect after each change. A `ScratchDir` is a directory that one live
process owns (an exclusive lock inside it); creating one removes the directories of
processes that died. This module knows files and processes, never what is stored.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from storage import io
from storage.errors import StoreError

log = logging.getLogger(__name__)


class FileLock:
    """An flock on one file: unlocked, shared or exclusive. Blocking waits can be interrupted (Ctrl-C)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.mode: str | None = None  # None | "shared" | "exclusive"
        self.fd: int | None = None
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise io.disk_error(e, self.path) from None
            try:  # read-only media or someone else's store: flock works on a read-only descriptor too
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = -1  # no lock file and no way to make one: nobody can write here, nothing to guard
                log.debug("%s: cannot create the lock file; using the store unlocked", self.path)

    def _flock(self, op: int, wait: bool) -> bool:
        assert self.fd is not None, "the lock is closed"
        if self.fd < 0:
            return True
        try:
            fcntl.flock(self.fd, op | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def try_exclusive(self) -> bool:
        if self._flock(fcntl.LOCK_EX, wait=False):
            self.mode = "exclusive"
            return True
        return False

    def try_shared(self) -> bool:
        if self._flock(fcntl.LOCK_SH, wait=False):
            self.mode = "shared"
            return True
        return False

    def exclusive(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the lock alone, waiting for every other holder; `on_wait(holder)` is called once if we wait."""
        if not self.try_exclusive():
            if on_wait is not None:
                on_wait(self.holder())
            self._flock(fcntl.LOCK_EX, wait=True)
            self.mode = "exclusive"

    def shared(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Share the lock with other readers, waiting while a writer holds it (also downgrades our own)."""
        if self.mode == "exclusive" and self.fd is not None and self.fd >= 0:
            os.ftruncate(self.fd, 0)  # the announcement is over
        if not self.try_shared():
            if on_wait is not None:
                on_wait(self.holder())
            self._flock(fcntl.LOCK_SH, wait=True)
            self.mode = "shared"

    def unlock(self) -> None:
        if self.fd is not None and self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.mode = None

    def announce(self, what: str) -> None:
        """Write who holds the lock and why (read by those who wait); only the exclusive holder writes. Without a lock
        file (one it could not make: read-only media) there is nothing to write in, nor anyone who could read it."""
        assert self.mode == "exclusive" and self.fd is not None
        if self.fd < 0:
            return
        text = f"pid {os.getpid()} ({what} since {time.strftime('%H:%M:%S')})".encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)

    def holder(self) -> str:
        """What the exclusive holder announced (or 'another process' when it said nothing yet)."""
        try:
            with open(self.path, "rb") as f:
                text = f.read(200).decode(errors="replace").strip()
        except OSError:
            text = ""
        return text or "another process"

    def close(self) -> None:
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)  # releases the lock
        self.fd = None
        self.mode = None

    def __del__(self) -> None:
        self.close()


SCRATCH_LOCK = ".owner"


class ScratchDir:
    """A directory under `parent` owned by this process for its life; removed on close, or by the next
    process that creates one if this one died (its lock is then free)."""

    def __init__(self, parent: str | Path) -> None:
        parent = Path(parent)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            sweep_scratch(parent)
            # made under a dot name, locked, then renamed: a sweeper never sees it unlocked
            tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{os.getpid()}-"))
            self._lock = FileLock(tmp / SCRATCH_LOCK)
            self._lock.exclusive()
            self.path = parent / tmp.name[1:]
            os.rename(tmp, self.path)
        except OSError as e:
            raise io.disk_error(e, parent) from None
        self._lock.path = self.path / SCRATCH_LOCK

    def close(self) -> None:
        if self._lock.fd is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self._lock.close()


def sweep_scratch(parent: Path) -> list[Path]:
    """Remove the scratch directories under `parent` whose owner is gone; returns what was removed."""
    removed = []
    for d in parent.iterdir():
        if d.name.startswith(".") or not d.is_dir() or not (d / SCRATCH_LOCK).is_file():
            continue
        try:
            lock = FileLock(d / SCRATCH_LOCK)
        except StoreError:  # removed under our feet by its owner or another sweeper
            continue
        try:
            if lock.try_exclusive():  # nobody alive holds it
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
                log.info("removed %s, the scratch space of a process that ended without cleaning up", d)
        finally:
            lock.close()
    return removed
