"""Page-aligned host memory: one arena per tier, regions carved from it, page-locked for CUDA in one call.

    arena = HostArena(nbytes, pin=True)   # one mmap of whole pages; registered with CUDA when `pin`
    region = arena.carve(nbytes)          # a uint8 view, page-aligned; None when it does not fit
    arena.give_back(region)
    arena.close()                         # unregisters (the caller synchronised the copies first)

Why not `torch.empty(..., pin_memory=True)` per region: the caching host allocator rounds each
allocation up to a power of two, so a 1.6 GiB layer pins 2 GiB and a 56 GiB tier asks for ~70;
here the pinned bytes are the arena's, the tier's budget rounded up to a page. Page alignment
also lets disk reads bypass the page cache (`O_DIRECT`) straight into any region.
`aligned_empty` is the same memory for one region without an arena (unpinned tiers). This
module knows bytes and pages, nothing about what the regions hold.
"""

from __future__ import annotations

import logging
import mmap
import resource

import psutil
import torch

from storage.errors import CapacityError
from storage.units import ceil_div, fmt_bytes

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
HUGE = 2 * 2**20  # an x86-64 / arm64 transparent huge page
#: how full a tensor's last 2 MiB span must be to be asked for as a huge page too (`aligned_empty`)
FILL = 7 / 8


def round_up(n: int, multiple: int = PAGE) -> int:
    return ceil_div(n, multiple) * multiple


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor of `nbytes` (anonymous memory: untouched pages cost no RAM), asked to be in
    transparent huge pages (`huge_pages`). One of nearly 2 MiB or more starts at a 2 MiB boundary (its mapping up to
    a span longer, the slack never touched: address space, not RAM), so that its spans are whole but its last, which
    is advised too where the tensor fills at least `FILL` of it (the rest of that span becomes RAM: at most an eighth
    of 2 MiB a tensor). A SmolLM2-135M int4 layer (1.99 MB) had no whole span at a page-aligned start: the kernels
    read its codes through ~490 TLB entries of 4 KiB, now one of 2 MiB."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)  # pages come when touched
    spans = nbytes // HUGE + (nbytes % HUGE >= FILL * HUGE)  # the 2 MiB spans asked to be huge pages
    slack = HUGE - PAGE if spans else 0
    buf = mmap.mmap(-1, max(round_up(nbytes), spans * HUGE, PAGE) + slack, flags=flags)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # (the tensor keeps the mapping alive)
    start = -whole.data_ptr() % HUGE if spans else 0
    huge_pages(buf, start, spans * HUGE)
    return whole[start : start + nbytes]


def heap_aligned(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor of `nbytes` from the C heap (a page more, the view starting at the first
    page boundary): memory a later call takes again once this is freed, where `aligned_empty` maps (and faults in)
    fresh pages each time. For the destinations of O_DIRECT reads made again and again (the KV slot file's)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start : start + nbytes]


def huge_pages(buf: mmap.mmap, offset: int, length: int) -> None:
    """Ask for transparent huge pages (MADV_HUGEPAGE) on buf[offset : offset + length] (2 MiB aligned), so that the
    weights streamed from it walk one TLB entry per 2 MiB, not per 4 KiB (Linux's default THP setting, `madvise`,
    gives them to no one else). A 2-core Zen 4 VM, a bf16 [131072, 2048] product from DRAM: 41 -> 49 GB/s (28 -> 29
    in a slow minute). A kernel without THP (or another OS) says no: nothing changes."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or length <= 0:
        return
    try:
        buf.madvise(advice, offset, length)
    except OSError:  # (THP compiled out: EINVAL)
        pass


def pinnable_bytes() -> int:
    """What this machine lets a process page-lock now: the RAM available (CUDA's registration pins pages in the
    driver and is not bounded by RLIMIT_MEMLOCK, which only `mlock` counts; a finite one is logged)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY:
        log.debug("RLIMIT_MEMLOCK is %d bytes; CUDA host registration does not count against it", soft)
    return int(psutil.virtual_memory().available)


def check_pinnable(nbytes: int, available: int | None = None) -> None:
    """Refuse to page-lock more than the machine has available (the OS would swap or kill everything else)."""
    available = pinnable_bytes() if available is None else available
    if nbytes > available:
        raise CapacityError(
            f"the cpu tier would page-lock {fmt_bytes(nbytes, 'GiB')} but this machine has only "
            f"{fmt_bytes(available, 'GiB')} of RAM available; lower tiers.cpu.capacity (or kv_cache.cpu_blocks) "
            "to fit, or set tiers.cpu.pinned: false"
        )


class PageRuns:
    """First-fit bookkeeping of free page runs in [0, nbytes): the arena's allocator, without the memory."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = round_up(max(nbytes, 1))
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted, coalesced

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """(offset, page-rounded size) of a free run that holds `nbytes`, or None."""
        size = round_up(max(nbytes, 1))
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                self._free[i : i + 1] = [(off + size, free - size)] if free > size else []
                return off, size
        return None

    def put(self, offset: int, size: int) -> None:
        merged: list[tuple[int, int]] = []
        for o, s in sorted(self._free + [(offset, size)]):
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._free = merged

    @property
    def free(self) -> int:
        return sum(s for _, s in self._free)


class HostArena:
    """One page-aligned block of host memory, carved into regions first-fit; page-locked with CUDA when `pin`."""

    def __init__(self, nbytes: int, pin: bool = False) -> None:
        self.runs = PageRuns(nbytes)
        self.nbytes = self.runs.nbytes
        self.data = aligned_empty(self.nbytes)  # [nbytes] uint8
        self.pinned = 0  # bytes registered with CUDA
        self._carved: dict[int, tuple[int, int]] = {}  # data_ptr of a region -> (offset, page-rounded size)
        if pin:
            self._register()

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.data.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            raise CapacityError(
                f"CUDA refused to page-lock {fmt_bytes(self.nbytes, 'GiB')} of host memory (error {int(err)}); "
                "lower tiers.cpu.capacity or set tiers.cpu.pinned: false"
            )
        self.pinned = self.nbytes

    def carve(self, nbytes: int) -> torch.Tensor | None:
        """A page-aligned region of `nbytes` (a uint8 view into the arena), or None if no free run holds it."""
        run = self.runs.take(nbytes)
        if run is None:
            return None
        region = self.data[run[0] : run[0] + nbytes]
        self._carved[region.data_ptr()] = run
        return region

    def give_back(self, region: torch.Tensor) -> None:
        self.runs.put(*self._carved.pop(region.data_ptr()))

    @property
    def free(self) -> int:
        return self.runs.free

    def close(self) -> None:
        """Unregister from CUDA; the memory goes when the last view of it does. Copies touching the arena must
        have finished (the prefetcher synchronises its copy stream on close)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = 0
