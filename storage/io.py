"""Pure module-level I/O helpers: positional reads into tensors, page-cache control, checksums,
atomic writes. Thin classes elsewhere wrap these; nothing here keeps state.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import crc32c as _crc32c
import numpy as np
import torch

from storage.errors import StoreError


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes."""
    assert t.device.type == "cpu" and t.is_contiguous(), "positional I/O needs a contiguous CPU tensor"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # (flat first: a scalar cannot view its bytes)


def preadv_into(fd: int, dest: torch.Tensor, offset: int, path: str | os.PathLike = "") -> None:
    """Read exactly `dest.nbytes` bytes at `offset` into `dest` (no intermediate copy)."""
    view = byte_view(dest)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise StoreError(
                f"{path}: file ends at byte {offset + done}, expected {offset + len(view)}; "
                "it is truncated, restore or re-create it"
            )
        done += n


def pwrite_from(fd: int, src: torch.Tensor, offset: int, path: str | os.PathLike = "") -> None:
    view = byte_view(src)
    done = 0
    try:
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    except OSError as e:
        raise disk_error(e, path) from None


def preallocate(fd: int, nbytes: int) -> None:
    """Size the file to `nbytes` with its blocks reserved (ENOSPC now, not on a later write); where the
    file system cannot reserve, a sparse file of that size."""
    os.ftruncate(fd, nbytes)
    if nbytes and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise


def drop_page_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Tell the kernel we will not read these pages again (keeps a RAM-short machine's cache clean)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def advise_sequential(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def crc32c(data: torch.Tensor | np.ndarray | bytes) -> int:
    """CRC-32C (Castagnoli), the checksum zarr's crc32c codec appends; releases the GIL on large buffers."""
    return crc32c_extend(0, data)


def crc32c_extend(crc: int, data: torch.Tensor | np.ndarray | bytes) -> int:
    """The crc32c of (what `crc` covered) + `data`."""
    if isinstance(data, torch.Tensor):
        data = data.contiguous().view(torch.uint8).reshape(-1).numpy()
    return _crc32c.crc32c(data, crc)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise disk_error(e, path) from None


def disk_error(e: OSError, path: str | os.PathLike) -> StoreError:
    if e.errno == errno.ENOSPC:
        return StoreError(f"{path}: the disk is full; free space there or choose another directory")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StoreError(f"{path}: not writable ({e.strerror}); choose a directory you can write to")
    return StoreError(f"{path}: {e.strerror or e}; check the disk and try again")
