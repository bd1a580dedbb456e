"""The three tiers bytes can live in: device memory, host RAM, and zarr arrays on disk.

Every tier is a capacity-limited set of named, fixed-size byte regions, with the same small
interface (zarr-python's store ABC is the model: a handful of primitives, capability
properties, a read-only guard):

    allocate(key, nbytes)       reserve a region once; refused with what would fit
    write(key, src)             fill a region from a uint8 tensor
    read_into(key, dest, off)   copy bytes [off, off + dest.nbytes) of a region into dest
    release(key)                give the capacity back

Memory tiers also hand out `view(key)`, a uint8 tensor other code can compute on. The disk
tier keeps each region as a zarr array of raw bytes, one chunk, with a crc32c codec; it
reads chunks with `preadv` straight into the destination and verifies the checksum: the
format-respecting fast path (zarr itself copies each chunk through a fresh `bytes` object and
read ~1.3 GB/s cold where `preadv` into the chunk file read ~2 GB/s on the same disk; zarr
stays for metadata, writing and a checked fallback read). Tiers know bytes and names only.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from storage import io
from storage.arena import PAGE, HostArena, aligned_empty
from storage.errors import CapacityError, StoreError
from storage.layout import check_name

#: The tiers, fastest first, named as in the YAML `tiers:` section.
TIERS = ("gpu", "cpu", "disk")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Tier(ABC):
    """A capacity-limited set of named byte regions."""

    kind: str  # "gpu" | "cpu" | "disk", as in the YAML `tiers:` section

    def __init__(self, capacity: int | None, read_only: bool = False) -> None:
        self.capacity = capacity  # None: no limit set
        self.read_only = read_only
        self.sizes: dict[str, int] = {}
        self.bytes_read = 0  # bytes served out of this tier (read_into), for reports
        self._lock = threading.Lock()

    # -- capability properties ----------------------------------------------------------------
    @property
    def is_memory(self) -> bool:
        return False

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    @property
    def free(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.used

    def keys(self) -> list[str]:
        return list(self.sizes)

    def __contains__(self, key: str) -> bool:
        return key in self.sizes

    # -- primitives ---------------------------------------------------------------------------
    def allocate(self, key: str, nbytes: int) -> None:
        self._check_writable()
        if key in self.sizes:
            raise KeyError(f"{self.kind} tier already holds {key!r}")
        if self.capacity is not None and self.used + nbytes > self.capacity:
            raise CapacityError(
                f"the {self.kind} tier cannot hold {key!r} ({_mib(nbytes)}): {_mib(self.used)} of "
                f"{_mib(self.capacity)} is in use and only {_mib(self.capacity - self.used)} is free; "
                f"raise tiers.{self.kind}.capacity to at least {_mib(self.used + nbytes)}"
            )
        self._allocate(key, nbytes)
        self.sizes[key] = nbytes

    def release(self, key: str) -> None:
        self._release(key)
        del self.sizes[key]

    def write(self, key: str, src: torch.Tensor) -> None:
        self._check_writable()
        self._check_range(key, 0, src.numel())
        self._write(key, src.view(torch.uint8).reshape(-1))

    def read_into(self, key: str, dest: torch.Tensor, offset: int = 0) -> None:
        n = dest.numel() * dest.element_size()
        self._check_range(key, offset, n)
        self._read_into(key, dest.view(torch.uint8).reshape(-1), offset)
        with self._lock:
            self.bytes_read += n

    def close(self) -> None:
        for key in list(self.sizes):
            self.release(key)

    # -- helpers ------------------------------------------------------------------------------
    def _check_writable(self) -> None:
        if self.read_only:
            raise StoreError(f"the {self.kind} tier is open read-only; writes are refused")

    def _check_range(self, key: str, offset: int, n: int) -> None:
        size = self.sizes.get(key)
        if size is None:
            raise KeyError(f"{self.kind} tier holds no {key!r}")
        if offset < 0 or offset + n > size:
            raise ValueError(f"{key!r}: bytes [{offset}, {offset + n}) are outside its {size} bytes")

    @abstractmethod
    def _allocate(self, key: str, nbytes: int) -> None: ...

    @abstractmethod
    def _release(self, key: str) -> None: ...

    @abstractmethod
    def _write(self, key: str, src: torch.Tensor) -> None: ...

    @abstractmethod
    def _read_into(self, key: str, dest: torch.Tensor, offset: int) -> None: ...


class MemoryTier(Tier):
    """Regions are uint8 tensors on one torch device, allocated once. Host regions are page-aligned (disk reads
    can bypass the page cache into them); with an arena they are carved from it (one pinned block)."""

    def __init__(self, capacity: int | None, device: torch.device | str, pin_memory: bool = False,
                 arena: HostArena | None = None) -> None:
        super().__init__(capacity)
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.arena = arena
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def is_memory(self) -> bool:
        return True

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked for this tier (the arena's, or each pinned region's allocation)."""
        if self.arena is not None:
            return self.arena.pinned
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values()) if self.pin_memory else 0

    def view(self, key: str) -> torch.Tensor:
        """The region itself (1-D uint8 on this tier's device); compute may read it in place."""
        return self._buffers[key]

    def _allocate(self, key: str, nbytes: int) -> None:
        if self.arena is not None:
            region = self.arena.carve(nbytes)
            if region is None:
                raise CapacityError(
                    f"the {self.kind} tier's arena has no free run of {_mib(nbytes)} for {key!r} "
                    f"({_mib(self.arena.free)} free in pieces); raise tiers.{self.kind}.capacity"
                )
            self._buffers[key] = region
        elif self.device.type == "cpu" and not self.pin_memory:
            self._buffers[key] = aligned_empty(nbytes)
        else:
            self._buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device,
                                             pin_memory=self.pin_memory)

    def _release(self, key: str) -> None:
        region = self._buffers.pop(key)
        if self.arena is not None:
            self.arena.give_back(region)

    def _write(self, key: str, src: torch.Tensor) -> None:
        self._buffers[key][: src.numel()].copy_(src)

    def _read_into(self, key: str, dest: torch.Tensor, offset: int) -> None:
        dest.copy_(self._buffers[key][offset : offset + dest.numel()])

    def close(self) -> None:
        super().close()
        if self.arena is not None:
            self.arena.close()


class DeviceTier(MemoryTier):
    """The compute device's memory (GPU HBM; on a CPU-only run, the compute working set in RAM)."""

    kind = "gpu"

    def __init__(self, capacity: int | None, device: torch.device | str) -> None:
        super().__init__(capacity, device)


class HostTier(MemoryTier):
    """Host RAM; page-locked when CUDA is present and `pinned`, so copies to the GPU are asynchronous.

    `arena_bytes`: pin one arena of this size (the plan's pinned bytes) and carve every region from it,
    so what is pinned is the budget rounded to pages; without it each region is pinned on its own."""

    kind = "cpu"

    def __init__(self, capacity: int | None, pinned: bool = True, arena_bytes: int | None = None) -> None:
        pin = pinned and torch.cuda.is_available()
        arena = HostArena(arena_bytes, pin=True) if pin and arena_bytes else None
        super().__init__(capacity, "cpu", pin_memory=pin, arena=arena)


# ----------------------------------------------------------------------------- disk
CHUNK_KEY_ENCODING = {"name": "default", "separator": "."}
#: Disk reads are split into pieces of this size, several in flight at once.
READ_PIECE = 8 * 2**20


@dataclass(frozen=True, slots=True)
class ChunkFile:
    """Where a region's bytes sit: a zarr chunk file holding the raw bytes, then a 4-byte crc32c."""

    path: Path
    nbytes: int


class DiskTier(Tier):
    """Regions are zarr arrays (uint8, one chunk, crc32c codec) in one zarr group on disk.

    Writes go through our own temp-file + rename in the exact chunk encoding zarr uses
    (bytes, then crc32c little-endian), so no region is ever copied whole in memory;
    `read_with_zarr` reads the same arrays through zarr itself, the checked fallback.
    Reads `preadv` straight into the destination, optionally drop the pages afterwards, and
    verify the crc32c on every whole-region read (`verify="always"`) or on the first one.
    With `direct_io`, reads whose destination, offset and length are page-aligned (every slot
    and staging piece is) go through an `O_DIRECT` descriptor: the disk writes into the slot,
    the kernel copies nothing and there is no page cache to drop; the rest (a row of the
    embeddings, a file system that refuses O_DIRECT) read through the page cache as before.
    """

    kind = "disk"

    def __init__(self, path: str | Path, capacity: int | None = None, read_only: bool = False,
                 page_cache: bool = False, verify: str = "always", read_threads: int = 4,
                 direct_io: bool = False) -> None:
        super().__init__(capacity, read_only)
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self._direct_fds: dict[str, int | None] = {}  # None: the file system refused O_DIRECT
        import zarr

        self.path = Path(path)
        self.page_cache = page_cache
        if verify not in ("always", "once"):
            raise ValueError(f"verify must be 'always' or 'once', not {verify!r}")
        self.verify = verify
        self._verified: set[str] = set()
        self._chunks: dict[str, ChunkFile] = {}
        self._fds: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="disk-read") if read_threads > 1 else None
        if read_only:
            if not (self.path / "zarr.json").is_file():
                raise StoreError(f"{self.path}: no zarr group here; the store is missing or was not finished")
            self._group = zarr.open_group(str(self.path), mode="r")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self._group = zarr.open_group(str(self.path), mode="a")

    # -- regions as zarr arrays ---------------------------------------------------------------
    def open_existing(self, key: str, nbytes: int) -> None:
        """Register an array that is already on disk (read-only stores), checking its metadata and chunk size."""
        self._check_key(key)
        try:
            arr = self._group[key]
        except KeyError:
            raise StoreError(f"{self.path}: array {key!r} is missing; the store is incomplete") from None
        if arr.shape != (nbytes,) or arr.chunks != (nbytes,) or str(arr.dtype) != "uint8":
            raise StoreError(
                f"{self.path}: array {key!r} has shape {arr.shape}, chunks {arr.chunks}, dtype {arr.dtype}, "
                f"expected ({nbytes},) uint8 in one chunk; the store is damaged"
            )
        chunk = self._chunk_file(key, arr)
        size = chunk.path.stat().st_size if chunk.path.is_file() else -1
        if size != nbytes + 4:
            got = "missing" if size < 0 else f"{size} bytes"
            raise StoreError(
                f"{chunk.path}: chunk is {got}, expected {nbytes + 4}; the store is damaged or truncated, "
                "convert it again with --force"
            )
        self._chunks[key] = chunk
        self.sizes[key] = nbytes

    def chunk_path(self, key: str) -> Path:
        """The chunk file holding a region's bytes and their crc32c."""
        return self._chunks[key].path

    def _check_key(self, key: str) -> None:
        try:
            check_name(key, f"{self.path}: array")
        except ValueError as e:
            raise StoreError(str(e)) from None

    def _chunk_file(self, key: str, arr) -> ChunkFile:
        names = [c.to_dict()["name"] for c in arr.metadata.codecs]
        if names != ["bytes", "crc32c"]:
            raise StoreError(f"{self.path}: array {key!r} uses codecs {names}; Offload stores use bytes + crc32c")
        rel = arr.metadata.encode_chunk_key((0,))
        return ChunkFile(self.path / key / rel, arr.shape[0])

    def _allocate(self, key: str, nbytes: int) -> None:
        from zarr.codecs import BytesCodec, Crc32cCodec

        self._check_key(key)
        arr = self._group.create_array(
            key, shape=(nbytes,), chunks=(nbytes,), dtype="uint8", serializer=BytesCodec(),
            compressors=[Crc32cCodec()], filters=None, fill_value=0,
            chunk_key_encoding=CHUNK_KEY_ENCODING, overwrite=True,
        )
        self._chunks[key] = self._chunk_file(key, arr)

    def _release(self, key: str) -> None:
        for fds in (self._fds, self._direct_fds):
            fd = fds.pop(key, None)
            if fd is not None:
                os.close(fd)
        self._chunks.pop(key, None)

    def _write(self, key: str, src: torch.Tensor) -> None:
        chunk = self._chunks[key]
        if src.numel() != chunk.nbytes:
            raise ValueError(f"{key!r}: a disk region is written whole ({chunk.nbytes} bytes), got {src.numel()}")
        src = src.cpu()
        checksum = np.uint32(io.crc32c(src)).tobytes()  # little-endian, as zarr's codec writes it
        chunk.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = chunk.path.with_name(chunk.path.name + ".partial")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                io.pwrite_from(fd, src, 0, chunk.path)
                os.pwrite(fd, checksum, chunk.nbytes)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, chunk.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise io.disk_error(e, chunk.path) from None
        except StoreError:
            tmp.unlink(missing_ok=True)
            raise
        self._verified.add(key)

    def _fd(self, key: str) -> int:
        fd = self._fds.get(key)
        if fd is None:
            with self._lock:
                fd = self._fds.get(key)
                if fd is None:
                    fd = os.open(self._chunks[key].path, os.O_RDONLY)
                    io.advise_sequential(fd)
                    self._fds[key] = fd
        return fd

    def _direct_fd(self, key: str) -> int | None:
        """An O_DIRECT descriptor of the region's chunk file (None where the file system refuses one)."""
        if key not in self._direct_fds:
            with self._lock:
                if key not in self._direct_fds:
                    try:
                        self._direct_fds[key] = os.open(self._chunks[key].path, os.O_RDONLY | os.O_DIRECT)
                    except OSError:
                        self._direct_fds[key] = None
        return self._direct_fds[key]

    def _read_into(self, key: str, dest: torch.Tensor, offset: int) -> None:
        chunk, fd = self._chunks[key], self._fd(key)
        whole = offset == 0 and dest.numel() == chunk.nbytes
        if not whole and key not in self._verified:
            self.verify_region(key)
        check = whole and (self.verify == "always" or key not in self._verified)
        cpu = dest if dest.device.type == "cpu" else aligned_empty(dest.numel())
        direct = self._direct_fd(key) if self.direct_io and _aligned(cpu, offset) else None
        crc = self._pread(fd if direct is None else direct, cpu, offset, chunk.path, check)
        if direct is None and not self.page_cache:
            io.drop_page_cache(fd, offset, cpu.numel())
        if check:
            self._check_crc(key, fd, crc)
        if cpu is not dest:
            dest.copy_(cpu)

    def _pread(self, fd: int, dest: torch.Tensor, offset: int, path: Path, checksum: bool) -> int:
        """Read `dest` in pieces, `read_threads` of them in flight (deeper disk queues read faster); when
        asked, fold each piece into a crc32c as soon as it lands, so checking overlaps the reads."""
        n = dest.numel()
        pieces = [(s, min(READ_PIECE, n - s)) for s in range(0, n, READ_PIECE)]
        crc = 0
        if self._pool is None or len(pieces) == 1:
            for s, m in pieces:
                io.preadv_into(fd, dest[s : s + m], offset + s, path)
                crc = io.crc32c_extend(crc, dest[s : s + m]) if checksum else 0
            return crc
        futures = [self._pool.submit(io.preadv_into, fd, dest[s : s + m], offset + s, path) for s, m in pieces]
        try:
            for f, (s, m) in zip(futures, pieces):
                f.result()
                if checksum:
                    crc = io.crc32c_extend(crc, dest[s : s + m])
        finally:
            for f in futures:
                f.cancel()
        return crc

    def _check_crc(self, key: str, fd: int, actual: int) -> None:
        stored = int(np.frombuffer(os.pread(fd, 4, self._chunks[key].nbytes), dtype="<u4")[0])
        if actual != stored:
            raise StoreError(
                f"{self._chunks[key].path}: checksum mismatch (stored {stored:#010x}, read {actual:#010x}); "
                "the store is corrupt, convert it again with --force"
            )
        self._verified.add(key)

    def verify_region(self, key: str, piece: int = 64 * 2**20) -> int:
        """Checksum a whole region in bounded pieces; returns its crc32c (raises StoreError on mismatch)."""
        chunk, fd = self._chunks[key], self._fd(key)
        buf = torch.empty(min(piece, chunk.nbytes), dtype=torch.uint8)
        crc = 0
        for start in range(0, chunk.nbytes, piece):
            part = buf[: min(piece, chunk.nbytes - start)]
            io.preadv_into(fd, part, start, chunk.path)
            crc = io.crc32c_extend(crc, part)
        if not self.page_cache:
            io.drop_page_cache(fd)
        with self._lock:
            self.bytes_read += chunk.nbytes
        self._check_crc(key, fd, crc)
        return crc

    def stored_crc(self, key: str) -> int:
        return int(np.frombuffer(os.pread(self._fd(key), 4, self._chunks[key].nbytes), dtype="<u4")[0])

    def read_with_zarr(self, key: str) -> np.ndarray:
        """The whole region through zarr itself (decodes and checks the crc32c codec): the checked fallback."""
        return self._group[key][:]

    def drop_cache(self) -> None:
        """Evict every region's pages from the OS page cache (for honest cold-disk measurements)."""
        for key in self._chunks:
            io.drop_page_cache(self._fd(key))

    def close(self) -> None:
        for key in list(self._chunks):
            self._release(key)
        self.sizes.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _aligned(dest: torch.Tensor, offset: int) -> bool:
    """Can `dest` be read at `offset` with O_DIRECT (address, offset and length all whole pages)?"""
    return dest.data_ptr() % PAGE == 0 and offset % PAGE == 0 and dest.numel() % PAGE == 0
