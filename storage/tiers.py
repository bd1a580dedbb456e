"""The tiers bytes can live in: the interface, and the two memory tiers (device memory, host RAM).

Every tier is a capacity-limited set of named, fixed-size byte regions, with the same small
interface (zarr-python's store ABC is the model: a handful of primitives, capability
properties, a read-only guard):

    allocate(key, nbytes)       reserve a region once; refused with what would fit
    write(key, src)             fill a region from a uint8 tensor
    read_into(key, dest, off)   copy bytes [off, off + dest.nbytes) of a region into dest
    release(key)                give the capacity back

Memory tiers also hand out `view(key)`, a uint8 tensor other code can compute on. The disk
tier (zarr arrays, crc32c-checked reads) is `storage.disk.DiskTier`. Tiers know bytes and
names only; they count nothing (bytes moved are counted once, by whoever moves them:
`schedulers.traffic`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from storage.arena import HostArena, aligned_empty
from storage.errors import CapacityError, StoreError
from storage.units import fmt_bytes

#: The tiers, fastest first, named as in the YAML `tiers:` section.
TIERS = ("gpu", "cpu", "disk")


def on(t: torch.Tensor, dev: torch.device | str) -> torch.Tensor:
    """t (made on the CPU) on dev: a `to` that changes nothing still costs a dispatch (~5 us a decode step's cold
    call: the weights streamed through the caches)."""
    return t if str(dev) == "cpu" else t.to(dev)


class Tier(ABC):
    """A capacity-limited set of named byte regions."""

    kind: str  # "gpu" | "cpu" | "disk", as in the YAML `tiers:` section

    def __init__(self, capacity: int | None, read_only: bool = False) -> None:
        self.capacity = capacity  # None: no limit set
        self.read_only = read_only
        self.sizes: dict[str, int] = {}

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
            mib = lambda n: fmt_bytes(n, "MiB")  # noqa: E731
            raise CapacityError(
                f"the {self.kind} tier cannot hold {key!r} ({mib(nbytes)}): {mib(self.used)} of "
                f"{mib(self.capacity)} is in use and only {mib(self.capacity - self.used)} is free; "
                f"raise tiers.{self.kind}.capacity to at least {mib(self.used + nbytes)}"
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
                    f"the {self.kind} tier's arena has no free run of {fmt_bytes(nbytes, 'MiB')} for {key!r} "
                    f"({fmt_bytes(self.arena.free, 'MiB')} free in pieces); raise tiers.{self.kind}.capacity"
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
