"""Host memory that matches the budget: one page-aligned arena per tier, regions carved from it, pinned bytes
accounted by the plan. Pinning itself needs CUDA (tests/test_cuda.py); the accounting is checked here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload.plan.placement import GroupSpec, make_plan
from schedulers.plan import Capacities
from storage.arena import FILL, HUGE, PAGE, HostArena, PageRuns, aligned_empty, check_pinnable
from storage.errors import CapacityError
from storage.slots import MemorySlots
from storage.tiers import DeviceTier, HostTier

MiB = 2**20
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_THP = pytest.mark.skipif(not _THP_SETTING.exists() or "[never]" in _THP_SETTING.read_text(),
                          reason="needs Linux with transparent huge pages")


def test_regions_are_page_aligned_and_freed_runs_coalesce():
    arena = HostArena(10 * PAGE)
    a, b, c = arena.carve(3 * PAGE), arena.carve(PAGE + 1), arena.carve(PAGE)  # b takes two pages
    assert [t.data_ptr() % PAGE for t in (a, b, c)] == [0, 0, 0]
    assert arena.free == 4 * PAGE and arena.carve(5 * PAGE) is None
    arena.give_back(b)
    arena.give_back(a)
    assert arena.carve(5 * PAGE).data_ptr() == a.data_ptr()  # a and b's pages came back as one run
    assert arena.free == 4 * PAGE


def test_a_cpu_tier_from_an_arena_refuses_what_the_arena_cannot_hold():
    tier = HostTier(None, pinned=False)
    tier.arena = HostArena(2 * PAGE)
    tier.allocate("a", PAGE)
    with pytest.raises(CapacityError, match=r"arena has no free run .* raise tiers\.cpu\.capacity"):
        tier.allocate("b", 2 * PAGE)


def test_unpinned_host_and_cpu_device_regions_are_page_aligned():
    """Disk reads can bypass the page cache (O_DIRECT) into any slot."""
    for tier in (HostTier(None, pinned=False), DeviceTier(None, "cpu")):
        for i, n in enumerate((5000, 88 * 4096, 12)):
            tier.allocate(f"r{i}", n)
            assert tier.view(f"r{i}").data_ptr() % PAGE == 0 and tier.view(f"r{i}").numel() == n


@pytest.mark.parametrize("cpu", [300 * MiB, 56 * 2**30])
def test_the_pinned_arena_holds_every_planned_host_region_and_is_the_budget_to_a_page_per_region(cpu):
    """A 70B-shaped plan (1.6 GiB layers): per-region pinning rounded each layer up to 2 GiB; the arena does not."""
    layer = 1632 * MiB
    groups = [GroupSpec("embed", 1000 * MiB, rows_only=True)] + [GroupSpec(f"layer.{i}", layer) for i in range(80)]
    groups.append(GroupSpec("head", 1000 * MiB))
    caps = Capacities(24 * 2**30, cpu, None, has_disk=True)
    plan = make_plan(groups, caps, depth=1, kv_bytes=2 * 2**30, copy_to_device=True, host_reserve=7 * MiB + 5)
    arena = PageRuns(plan.pinned_bytes())  # the allocator of the arena HostTier(arena_bytes=...) pins on CUDA
    regions = [plan.sizes[g] for g in plan.order if plan.homes[g] == "cpu"]
    regions += [plan.stage_slot_bytes] * plan.stage_slots + [plan.host_reserve]
    assert all(arena.take(n) is not None for n in regions)
    assert arena.free < PAGE  # nothing pinned beyond the regions
    assert plan.used("cpu") <= arena.nbytes <= min(cpu, plan.used("cpu") + len(regions) * PAGE)


def test_pinning_more_than_the_machine_has_available_is_refused():
    with pytest.raises(CapacityError, match=r"page-lock 8\.00 GiB but this machine has only 4\.00 GiB .* lower "
                                            r"tiers\.cpu\.capacity .* tiers\.cpu\.pinned: false"):
        check_pinnable(8 * 2**30, available=4 * 2**30)
    check_pinnable(2 * 2**30, available=4 * 2**30)


def _thp_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= address < hi:
                for rest in lines[i + 1:]:
                    if rest.startswith("VmFlags:"):
                        return rest.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@_THP
def test_host_memory_starts_on_a_huge_page_and_asks_for_huge_pages_on_the_spans_it_fills():
    """Weights stream from host memory with one TLB entry per 2 MiB: an arena's (and an unpinned tier's) memory of
    nearly 2 MiB or more starts at a 2 MiB boundary and is advised MADV_HUGEPAGE ("hg" in its flags) on its spans,
    the last one too where the tensor fills at least `FILL` of it (a SmolLM2-135M int4 layer's 1.99 MB had no whole
    span at a page-aligned start); a tensor that fills too little of its last span, or of the one span it has, is
    left alone there. The bytes are the tensor's own (written and read back)."""
    big = aligned_empty(5 * HUGE + 3 * PAGE)
    big.fill_(1)
    assert big.data_ptr() % HUGE == 0
    assert "hg" in _thp_flags(big.data_ptr()) and "hg" in _thp_flags(big.data_ptr() + 5 * HUGE - 1)
    assert "hg" not in _thp_flags(big.data_ptr() + 5 * HUGE)  # 3 pages of the sixth span: not RAM for a huge page
    layer = aligned_empty(int(FILL * HUGE) + PAGE)  # fills its span enough: one huge page
    assert layer.data_ptr() % HUGE == 0 and "hg" in _thp_flags(layer.data_ptr() + layer.numel() - 1)
    for n in (HUGE // 2, PAGE):
        small = aligned_empty(n)
        assert small.data_ptr() % PAGE == 0 and "hg" not in _thp_flags(small.data_ptr())
    layer.fill_(2)
    assert bool((big == 1).all()) and bool((layer == 2).all())


@_THP
def test_a_cpu_kv_pool_lies_in_huge_pages_and_starts_zeroed():
    """Attention reads a CPU KV pool's blocks where they lie, after a layer's weights went through the TLB: the pool
    (8 MiB here) is host memory advised for huge pages from a 2 MiB boundary, every slot zero and writable."""
    pool = MemorySlots(4, 64, (2, 16, 8, 64), torch.bfloat16)
    assert pool.data.data_ptr() % HUGE == 0 and "hg" in _thp_flags(pool.data.data_ptr() + pool.nbytes - 1)
    assert not pool.data.any()
    pool.write(3, torch.ones(4, 2, 16, 8, 64, dtype=torch.bfloat16))
    assert bool((pool.read(3) == 1).all()) and not pool.data[:, :3].any()
