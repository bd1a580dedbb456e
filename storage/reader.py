"""The one way bytes come off the disk: positional reads straight into tensors, checksummed.

    reader = DiskReader(threads=4, direct_io=True, page_cache=False)
    crc = reader.read(path, dest, offset, checksum=True)   # dest: a contiguous CPU tensor; crc32c of its bytes
    reader.read_all(path, [(dest, offset), ...])           # many ranges of one file, all in flight at once
    reader.forget(path)                                    # close the file's descriptors
    reader.close()

Every read is split into pieces of `READ_PIECE` bytes, `threads` of them in flight (deeper disk
queues read faster); with `checksum` each piece is folded into a crc32c as soon as it lands, so
checking overlaps reading. With `direct_io`, a read whose destination address, file offset and
length are whole pages (every ring, staging and pinned KV staging slot is page-aligned) goes
through an `O_DIRECT` descriptor: the disk writes into the buffer, the kernel copies nothing and
there is no page cache to drop. The rest (a row of the embeddings, a KV slot smaller than a page,
a file system that refuses `O_DIRECT`) read through the page cache, whose pages are dropped after
the read unless `page_cache`. The weights' disk tier (`storage.disk`: zarr chunk files, crc32c
trailers) and the KV slot files (`storage.slots`: a crc32c per block) both read here; what a
checksum is compared with is theirs to know. This module knows files, offsets and bytes.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from storage import interrupts, io
from storage.arena import PAGE

#: Reads are split into pieces of this size, several in flight at once.
READ_PIECE = 8 * 2**20


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a 1-D uint8 view."""
    assert t.device.type == "cpu" and t.is_contiguous(), "disk reads land in contiguous CPU tensors"
    return t.view(torch.uint8).reshape(-1)


def direct_ok(dest: torch.Tensor, offset: int) -> bool:
    """Can `dest` be read at `offset` with O_DIRECT (address, offset and length all whole pages)?"""
    n = dest.numel() * dest.element_size()
    return dest.data_ptr() % PAGE == 0 and offset % PAGE == 0 and n % PAGE == 0


class DiskReader:
    """Descriptors per file (buffered and, where allowed, O_DIRECT) and a small pool of reading threads."""

    def __init__(self, threads: int = 4, direct_io: bool = False, page_cache: bool = False,
                 name: str = "disk-read") -> None:
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self.page_cache = page_cache
        self._fds: dict[Path, int] = {}
        self._direct: dict[Path, int | None] = {}  # None: the file system refused O_DIRECT
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name) if threads > 1 else None

    # -- descriptors --------------------------------------------------------------------------
    def fd(self, path: Path) -> int:
        """The file's buffered read descriptor (opened once, with sequential read-ahead advised)."""
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = os.open(path, os.O_RDONLY)
                    io.advise_sequential(fd)
                    self._fds[path] = fd
        return fd

    def _direct_fd(self, path: Path) -> int | None:
        if path not in self._direct:
            with self._lock:
                if path not in self._direct:
                    try:
                        self._direct[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    except OSError:
                        self._direct[path] = None
        return self._direct[path]

    def direct(self, path: Path) -> bool:
        """Did reads of this file go through an O_DIRECT descriptor (False: none yet, or refused)?"""
        return self._direct.get(path) is not None

    def forget(self, path: Path) -> None:
        """Close the file's descriptors (it is released, or about to be replaced)."""
        with self._lock:
            for fds in (self._fds, self._direct):
                fd = fds.pop(path, None)
                if fd is not None:
                    os.close(fd)

    # -- reads --------------------------------------------------------------------------------
    def read(self, path: Path, dest: torch.Tensor, offset: int = 0, checksum: bool = False, crc: int = 0) -> int:
        """Read `dest`'s bytes from `path` at `offset`. With `checksum`, returns the crc32c of (what `crc`
        covered) + the bytes read; else 0."""
        flat = flat_bytes(dest)
        fd = self._descriptor(path, flat, offset)
        pieces = [(flat[s : s + READ_PIECE], offset + s) for s in range(0, flat.numel(), READ_PIECE)]
        if not checksum:
            crc = 0
        for piece in self._run(fd, pieces, path):
            if checksum:
                crc = io.crc32c_extend(crc, piece)
        self._drop(path, fd, offset, flat.numel())
        return crc

    def read_all(self, path: Path, ranges: list[tuple[torch.Tensor, int]]) -> None:
        """Read every (dest, offset) of one file, all of them in flight on the pool at once."""
        jobs, fds = [], []
        for dest, offset in ranges:
            flat = flat_bytes(dest)
            fds.append(fd := self._descriptor(path, flat, offset))
            for s in range(0, flat.numel(), READ_PIECE):
                jobs.append((fd, flat[s : s + READ_PIECE], offset + s))
        for _ in self._run_jobs(jobs, path):
            pass
        for (dest, offset), fd in zip(ranges, fds):  # (an O_DIRECT read brought no pages to drop)
            self._drop(path, fd, offset, dest.numel() * dest.element_size())

    def _descriptor(self, path: Path, flat: torch.Tensor, offset: int) -> int:
        direct = self._direct_fd(path) if self.direct_io and direct_ok(flat, offset) else None
        return self.fd(path) if direct is None else direct

    def _drop(self, path: Path, fd: int | None, offset: int, n: int) -> None:
        """Drop the pages a buffered read brought in (an O_DIRECT read brought none)."""
        if self.page_cache or (fd is not None and fd == self._direct.get(path)):
            return
        io.drop_page_cache(self.fd(path), offset, n)

    def _run(self, fd: int, pieces: list[tuple[torch.Tensor, int]], path: Path):
        return self._run_jobs([(fd, dest, off) for dest, off in pieces], path)

    def _run_jobs(self, jobs: list[tuple[int, torch.Tensor, int]], path: Path):
        """Yield each piece's destination, in order, once its bytes are there."""
        if self._pool is None or len(jobs) == 1:
            for fd, dest, off in jobs:
                io.preadv_into(fd, dest, off, path)
                yield dest
            return
        with interrupts.critical:  # the pool's semaphore and each future's condition: no Ctrl-C inside
            futures = [self._pool.submit(io.preadv_into, fd, dest, off, path) for fd, dest, off in jobs]
        try:
            for f, (_, dest, _) in zip(futures, jobs):
                interrupts.result(f)
                yield dest
        finally:
            with interrupts.critical:
                for f in futures:
                    f.cancel()

    def drop_cache(self, path: Path) -> None:
        """Evict the whole file's pages from the OS page cache (for honest cold-disk measurements)."""
        io.drop_page_cache(self.fd(path))

    def close(self) -> None:
        for path in list(self._fds) + list(self._direct):
            self.forget(path)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
