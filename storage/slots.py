"""Arrays of fixed-size slots in planes: the storage under cold KV blocks.

    data  # [planes, slots, *slot_shape]   (plane = a layer; slot = one block's bytes for that layer)

Plane-major, so everything one plane (layer) needs from many slots is one gather in memory,
or a few long reads on disk when slots are adjacent. Two implementations, one interface:

    write(slot, values)            values: [planes, *slot_shape], one whole slot
    read(slot) -> values           the whole slot, every plane
    read_plane(plane, slots, out)  [len(slots), *slot_shape] of one plane (into `out` when given)
    valid(slot)                    has the slot been written since it was last freed?

`MemorySlots` is a tensor on a device (pinned host memory on CUDA machines). `DiskSlots` is
one preallocated file described by a zarr array of raw bytes — shape (planes, slots,
slot_bytes), one chunk, no compression — written with `pwrite` and read through the one disk
read path (`storage.reader`: `preadv` straight into the destination, `O_DIRECT` where a slot is
whole pages, several reads in flight), with its own validity map: never a zarr write per slot
(measured here: one zarr chunk per block writes at 50-60 MB/s, `pwrite` into one preallocated
file at ~2.9 GB/s; random block reads through zarr 60-80 MB/s, `preadv` at queue depth 16
~1 GB/s cold). Every slot of every plane carries the crc32c of what was written there, kept in
memory beside the validity map (the file is this process's scratch), and every read checks it:
a disk that returns other bytes than it was given is a StoreError, never a wrong token. The file
is removed when closed; its blocks are reserved when it is made (`posix_fallocate`), so a disk
too full for it is refused before the run starts rather than during a spill. This module knows
shapes and bytes, not what a slot holds.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch

from storage import io
from storage.arena import aligned_empty, heap_aligned
from storage.errors import StoreError
from storage.reader import DiskReader


class SlotArray(ABC):
    def __init__(self, planes: int, slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.planes, self.slots, self.slot_shape, self.dtype = planes, slots, tuple(slot_shape), dtype
        self._valid = bytearray(slots)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot in one plane."""
        return math.prod(self.slot_shape) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.planes * self.slots * self.slot_nbytes

    def valid(self, slot: int) -> bool:
        return bool(self._valid[slot])

    def invalidate(self, slot: int) -> None:
        self._valid[slot] = 0

    def _check(self, slots) -> None:
        for s in slots:
            if not self._valid[s]:
                raise StoreError(f"slot {s} was read before it was written; the block map is inconsistent")

    @abstractmethod
    def write(self, slot: int, values: torch.Tensor) -> None: ...

    @abstractmethod
    def read(self, slot: int) -> torch.Tensor: ...

    @abstractmethod
    def read_plane(self, plane: int, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """[len(slots), *slot_shape] of one plane, in the order asked; written into `out` when given."""

    def close(self) -> None:  # noqa: B027 - memory needs no closing; files do
        pass


class MemorySlots(SlotArray):
    def __init__(self, planes: int, slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 memory: torch.Tensor | None = None) -> None:
        """`memory`: an allocated uint8 region (a tier's) to lay the slots over, instead of a new tensor."""
        super().__init__(planes, slots, slot_shape, dtype)
        self.device = torch.device(device)
        shape = (planes, slots, *self.slot_shape)
        if memory is None and self.device.type == "cpu" and not pin_memory:
            # (host memory in huge pages where it spans them, `aligned_empty`: attention reads the blocks where they
            # lie after a layer's weights went through the TLB; 2-core Zen 4, one query over 2048 / 8192 keys in
            # blocks scattered over a 50 MB pool, 0.93 / 0.96 of the time. Zeroed: its pages RAM from the start)
            self.data = aligned_empty(self.nbytes).view(dtype).view(shape)
            self.data.zero_()
        elif memory is None:
            self.data = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
        else:
            assert memory.dtype == torch.uint8 and memory.numel() >= self.nbytes, "the region is too small"
            self.data = memory[: self.nbytes].view(dtype).view(shape)  # [planes, slots, *slot_shape]
            self.data.zero_()

    def write(self, slot: int, values: torch.Tensor) -> None:
        """values [planes, *slot_shape] from any device. A copy *into* device memory is queued on the current
        stream (what reads the slot later runs after it); a copy out of a device into host memory completes
        before this returns, since the host may read the slot at once (a `non_blocking` device->host copy
        would leave stale bytes there until the device caught up)."""
        dst = self.data[:, slot]
        dst.copy_(values, non_blocking=self.device.type != "cpu" and values.device.type == "cpu")
        self._valid[slot] = 1

    def clear(self, slot: int) -> None:
        """Zero a slot and count it as written (it is then filled in place, a token at a time)."""
        self.data[:, slot] = 0
        self._valid[slot] = 1

    def read(self, slot: int) -> torch.Tensor:
        self._check([slot])
        return self.data[:, slot]

    def plane(self, plane: int, slots: list[int]) -> torch.Tensor:
        """One plane [slots, *slot_shape] where it lies, for a caller that reads `slots` of it in place (checked
        written; the caller reads them before any is written again)."""
        self._check(slots)
        return self.data[plane]

    def read_plane(self, plane: int, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        self._check(slots)
        index = torch.tensor(slots, device=self.device, dtype=torch.long)
        if out is None:
            return self.data[plane].index_select(0, index)
        return torch.index_select(self.data[plane], 0, index, out=out)


def _rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as [rows, bytes a row] (numpy, the same memory): copies by the calling thread
    alone, where torch's would start a second thread (a side thread's beside compute's busy cores waits for one:
    `offload.kv.fetch`)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


class DiskSlots(SlotArray):
    """A scratch file of planes x slots x slot_bytes, described by zarr metadata, read and written positionally.

    `reader`: the disk read path to share (several arrays of one tier); by default one of its own."""

    def __init__(self, directory: str | Path, name: str, planes: int, slots: int, slot_shape: tuple[int, ...],
                 dtype: torch.dtype, threads: int = 4, page_cache: bool = False, direct_io: bool = False,
                 reader: DiskReader | None = None) -> None:
        super().__init__(planes, slots, slot_shape, dtype)
        import zarr
        from zarr.codecs import BytesCodec

        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.page_cache = page_cache
        self._own_reader = reader is None
        self.reader = reader or DiskReader(threads, direct_io=direct_io, page_cache=page_cache, name="kv-disk")
        self._crc = np.zeros((planes, slots), dtype=np.uint32)  # crc32c of each slot of each plane, as written
        group = zarr.open_group(str(self.dir), mode="a")
        shape = (planes, slots, self.slot_nbytes)
        try:
            arr = group.create_array(name, shape=shape, chunks=shape, dtype="uint8", serializer=BytesCodec(),
                                     compressors=None, filters=None, fill_value=0,
                                     chunk_key_encoding={"name": "default", "separator": "."}, overwrite=True,
                                     attributes={"dtype": str(dtype).removeprefix("torch."),
                                                 "slot_shape": list(self.slot_shape)})
        except OSError as e:
            raise io.disk_error(e, self.dir) from None
        self.path = self.dir / name / arr.metadata.encode_chunk_key((0, 0, 0))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            io.preallocate(self.fd, self.nbytes)  # a full disk is refused now, not half way through a spill
        except OSError as e:
            if getattr(self, "fd", None) is not None:
                os.close(self.fd)
                self.fd = None
            self.path.unlink(missing_ok=True)
            if self._own_reader:
                self.reader.close()
            raise io.disk_error(e, self.path) from None

    def _offset(self, plane: int, slot: int) -> int:
        return (plane * self.slots + slot) * self.slot_nbytes

    def write(self, slot: int, values: torch.Tensor) -> None:
        values = values.detach().to("cpu", self.dtype).contiguous()  # [planes, *slot_shape]
        self._valid[slot] = 0  # until every plane and its checksum are written
        for plane in range(self.planes):
            io.pwrite_from(self.fd, values[plane], self._offset(plane, slot), self.path)
            self._crc[plane, slot] = io.crc32c(values[plane])
        self._valid[slot] = 1

    def read(self, slot: int) -> torch.Tensor:
        self._check([slot])
        out = self._destination(self.planes)
        self.reader.read_all(self.path, [(out[p], self._offset(p, slot)) for p in range(self.planes)])
        for plane in range(self.planes):
            self._verify(plane, slot, out[plane])
        return out

    def read_plane(self, plane: int, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The slots' plane-`plane` bytes, in the order asked: read in the file's order, slots adjacent in the file
        in one request (all requests in flight together), each slot checked against its crc32c, then put in the
        order asked (one copy, where it is not the file's: blocks demoted newest first sit in descending slots; read
        slot by slot, the 1.7B's 62 cold blocks of a layer were 62 requests of 128 KiB, at 0.33 GB/s)."""
        self._check(slots)
        if out is None:
            out = self._destination(len(slots))
        assert out.shape == (len(slots), *self.slot_shape) and out.dtype == self.dtype and out.is_contiguous()
        order = sorted(range(len(slots)), key=slots.__getitem__)
        in_order = all(i == k for k, i in enumerate(order))
        dest = out if in_order else self._destination(len(slots))
        ordered = [slots[i] for i in order]
        runs: list[tuple[int, int]] = []  # (first position in `dest`, count)
        for i, s in enumerate(ordered):
            if runs and s == ordered[runs[-1][0]] + runs[-1][1]:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        self.reader.read_all(self.path, [(dest[i : i + n], self._offset(plane, ordered[i])) for i, n in runs])
        for i, s in enumerate(ordered):
            self._verify(plane, s, dest[i])
        if not in_order:  # out[order[k]] = dest[k], by this thread alone (`_rows`)
            np.take(_rows(dest), np.argsort(order), axis=0, out=_rows(out))
        return out

    def _destination(self, n: int) -> torch.Tensor:
        """[n, *slot_shape] to read n slots into: page-aligned where the reader uses O_DIRECT (a slot of whole pages
        is then read with no page-cache copy, no reclaim for it in a full memory cgroup and no pages to drop after:
        the 1.7B int4's cold blocks, 1 GiB, a 1563-token context: 198 MiB a step, fetched at 0.3 GB/s buffered)."""
        if not self.reader.direct_io:
            return torch.empty((n, *self.slot_shape), dtype=self.dtype)
        return heap_aligned(n * self.slot_nbytes).view(self.dtype).view(n, *self.slot_shape)

    def _verify(self, plane: int, slot: int, values: torch.Tensor) -> None:
        stored, actual = int(self._crc[plane, slot]), io.crc32c(values)
        if actual != stored:
            raise StoreError(
                f"{self.path}: the KV block in slot {slot} (layer {plane}) does not match the checksum written with "
                f"it (written {stored:#010x}, read {actual:#010x}); the disk returned other bytes than it was given: "
                "check the disk, or move tiers.disk.path (or set kv_cache.disk_blocks: 0)"
            )

    def close(self) -> None:
        if self._own_reader:
            self.reader.close()
        else:
            self.reader.forget(self.path)
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
            self.path.unlink(missing_ok=True)
