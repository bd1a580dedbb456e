"""The prefetch scheduler on the CPU: every route, every depth, order and slot safety from the spans.

Synthetic groups of random bytes (the scheduler knows nothing about models), homed on the
device, host and disk tiers. `copy_to_device=True` runs the CUDA-shaped routes (disk ->
staging -> ring, host -> ring) through the thread engine, so the same scheduler code that
drives a GPU is exercised here.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from schedulers.plan import Capacities, Plan
from schedulers.prefetch import Prefetcher
from schedulers.timeline import Span, Timeline
from schedulers.transfer import ThreadEngine
from storage.disk import DiskTier
from storage.errors import StoreError
from storage.tiers import DeviceTier, HostTier

SIZES = {"g0": 40_000, "g1": 65_536, "g2": 12_288, "g3": 65_536, "g4": 30_000, "g5": 50_000}


def manual_plan(homes: dict[str, str], depth: int, copy_to_device: bool, stage_bytes: int | None = None) -> Plan:
    order = tuple(SIZES)
    probe = Plan(order, SIZES, homes, depth, 0, 0, 0, 0, copy_to_device, Capacities(None, None, None, True))
    streamed = probe.streamed
    slot = max((SIZES[g] for g in streamed), default=0)
    stage = 2 if copy_to_device and any(homes[g] == "disk" for g in streamed) else 0
    return Plan(order, SIZES, homes, depth, depth + 1 if streamed else 0, slot, stage,
                (stage_bytes or slot) if stage else 0, copy_to_device, Capacities(None, None, None, True))


@pytest.fixture
def world(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = {name: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for name, n in SIZES.items()}
    disk = DiskTier(tmp_path / "store")
    for name, d in data.items():
        disk.allocate(name, d.numel())
        disk.write(name, d)
    yield data, disk
    disk.close()


def build(world, homes, depth, copy_to_device, prefetcher_cls=Prefetcher, stage_bytes=None, engine=None):
    data, disk = world
    plan = manual_plan(homes, depth, copy_to_device, stage_bytes)
    tiers = {"gpu": DeviceTier(None, "cpu"), "cpu": HostTier(None), "disk": disk}
    for name, home in homes.items():
        if home in ("gpu", "cpu"):
            tiers[home].allocate(name, SIZES[name])
            tiers[home].write(name, data[name])
    ring = []
    for i in range(plan.ring_slots):
        tiers["gpu"].allocate(f"ring.{i}", plan.ring_slot_bytes)
        ring.append(tiers["gpu"].view(f"ring.{i}"))
    stage = []
    for i in range(plan.stage_slots):
        tiers["cpu"].allocate(f"stage.{i}", plan.stage_slot_bytes)
        stage.append(tiers["cpu"].view(f"stage.{i}"))
    timeline = Timeline()
    return plan, prefetcher_cls(plan, tiers, engine or ThreadEngine("cpu"), timeline, ring, stage), timeline


def run_passes(pf, plan, data, passes=3, compute_s=0.0, check=True) -> int:
    """Acquire/compute/release every group for `passes` passes; returns how many came back wrong."""
    wrong = 0
    for p in range(passes):
        for name in plan.order:
            buf = pf.acquire(name)
            if compute_s:
                time.sleep(compute_s)
            ok = torch.equal(buf, data[name])  # after the "compute": an overwrite during it shows here
            assert ok or not check, f"pass {p}: {name} came back with other bytes"
            wrong += not ok
            pf.release(name)
        pf.timeline.next_step()
    return wrong


HOMES = {
    "all-gpu": dict.fromkeys(SIZES, "gpu"),
    "all-cpu": dict.fromkeys(SIZES, "cpu"),
    "all-disk": dict.fromkeys(SIZES, "disk"),
    "mixed": {"g0": "disk", "g1": "gpu", "g2": "cpu", "g3": "disk", "g4": "cpu", "g5": "disk"},
}


@pytest.mark.parametrize("copy_to_device", [False, True], ids=["cpu-device", "copy-routes"])
@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("homes", list(HOMES), ids=list(HOMES))
def test_every_route_and_depth_returns_the_right_bytes(world, homes, depth, copy_to_device):
    plan, pf, timeline = build(world, HOMES[homes], depth, copy_to_device)
    try:
        run_passes(pf, plan, world[0])
    finally:
        pf.close()
    moved = pf.traffic.routes("weights")
    disk_bytes = sum(SIZES[g] for g in plan.streamed if plan.homes[g] == "disk")
    if disk_bytes:
        link = "disk->cpu" if copy_to_device else "disk->gpu"
        assert moved[link] >= 3 * disk_bytes  # at least every pass; prefetching ahead may add the next one
    if not plan.streamed:
        assert moved == {} and not timeline.on("disk-read")


def ring_writes_and_reads(spans: list[Span]):
    writes = [s for s in spans if s.args.get("into") == "ring"]
    reads = [s for s in spans if s.track == "compute" and s.slot is not None]
    return writes, reads


def overwrites(spans: list[Span]) -> list[tuple[Span, Span]]:
    """Pairs (write, compute): another load wrote into a ring slot between the moment load k started landing
    in it and the end of the compute that read load k from it."""
    writes, reads = ring_writes_and_reads(spans)
    own = {w.args["k"]: w for w in writes}
    bad = []
    for r in reads:
        mine = own.get(r.args["k"])
        held_from = mine.start if mine is not None else r.start
        bad += [(w, r) for w in writes
                if w.slot == r.slot and w.args["k"] != r.args["k"] and w.start < r.end and w.end > held_from]
    return bad


@pytest.mark.parametrize("copy_to_device", [False, True], ids=["cpu-device", "copy-routes"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_no_slot_is_overwritten_while_compute_reads_it(world, depth, copy_to_device):
    plan, pf, timeline = build(world, HOMES["mixed"], depth, copy_to_device)
    try:
        run_passes(pf, plan, world[0], passes=3, compute_s=0.01)
    finally:
        pf.close()
    writes, reads = ring_writes_and_reads(timeline.spans)
    assert len(writes) >= 9 and len(reads) >= 9
    assert overwrites(timeline.spans) == []


class EagerPrefetcher(Prefetcher):
    """A broken scheduler: it reuses a ring slot without waiting for compute to release it."""

    def _wait_slot(self, slot: int) -> bool:
        return not self._stop


def test_the_overwrite_check_catches_a_scheduler_that_does_not_wait(world):
    plan, pf, timeline = build(world, dict.fromkeys(SIZES, "disk"), 1, False, EagerPrefetcher)
    try:
        wrong = run_passes(pf, plan, world[0], passes=2, compute_s=0.02, check=False)
    finally:
        pf.close()
    assert wrong > 0  # the bug is real: compute saw other bytes
    assert overwrites(timeline.spans), "the broken scheduler wrote into a slot in use, the check must see it"


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_reads_run_depth_loads_ahead_of_compute(world, depth):
    """The read of load k + depth starts before the compute of load k ends (from the spans)."""
    plan, pf, timeline = build(world, dict.fromkeys(SIZES, "disk"), depth, False)
    try:
        run_passes(pf, plan, world[0], passes=2, compute_s=0.05)  # long enough to hide thread wake-ups
    finally:
        pf.close()
    reads = {s.args["k"]: s for s in timeline.on("disk-read")}
    computes = {s.args["k"]: s for s in timeline.on("compute") if "k" in s.args}
    checked = 0
    for k, comp in computes.items():
        ahead = reads.get(k + depth)
        if ahead is not None:
            assert ahead.start < comp.end, f"read of load {k + depth} started after compute of load {k} ended"
            checked += 1
        # never more than depth loads ahead: load k + depth + 1 needs the slot load k still holds
        beyond = reads.get(k + depth + 1)
        if beyond is not None:
            assert beyond.start >= comp.end - 1e-3
    assert checked >= len(SIZES)


def test_depth_zero_loads_then_computes(world):
    plan, pf, timeline = build(world, dict.fromkeys(SIZES, "disk"), 0, False)
    try:
        run_passes(pf, plan, world[0], passes=2, compute_s=0.005)
    finally:
        pf.close()
    reads = {s.args["k"]: s for s in timeline.on("disk-read")}
    pairs = [(comp, reads[comp.args["k"] + 1]) for comp in timeline.on("compute")
             if "k" in comp.args and comp.args["k"] + 1 in reads]
    assert len(pairs) >= 2 * len(plan.streamed) - 1  # every load but the last is followed by the next read
    for comp, nxt in pairs:
        assert nxt.start >= comp.end - 1e-3  # no overlap at depth 0


def test_acquiring_out_of_order_is_refused_and_reset_recovers(world):
    plan, pf, _ = build(world, dict.fromkeys(SIZES, "disk"), 2, False)
    try:
        pf.acquire("g0")
        pf.release("g0")
        with pytest.raises(RuntimeError, match="plan streams 'g1' next"):
            pf.acquire("g2")
        pf.reset()
        run_passes(pf, plan, world[0], passes=1)
    finally:
        pf.close()


def test_a_failed_read_reaches_compute_as_the_error(world, tmp_path):
    data, disk = world
    chunk = disk._chunks["g3"].path
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    plan, pf, _ = build(world, dict.fromkeys(SIZES, "disk"), 2, False)
    try:
        for name in ("g0", "g1", "g2"):
            pf.acquire(name)
            pf.release(name)
        with pytest.raises(StoreError, match="checksum mismatch"):
            pf.acquire("g3")
    finally:
        pf.close()


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_groups_larger_than_a_staging_slot_cross_in_pieces(world, depth):
    """Staging slots of 16 KiB (a cpu tier short of RAM): each disk-homed group is read and copied in pieces."""
    plan, pf, timeline = build(world, HOMES["mixed"], depth, True, stage_bytes=16384)
    try:
        run_passes(pf, plan, world[0], passes=3, compute_s=0.002)
    finally:
        pf.close()
    reads = [s for s in timeline.on("disk-read") if s.name == "g3"]  # 65536 bytes: 4 pieces a pass
    assert len(reads) >= 12 and max(s.nbytes for s in reads) == 16384
    assert sorted({s.args["piece"] for s in reads}) == [0, 1, 2, 3]
    assert overwrites(timeline.spans) == []


class RecordingEngine(ThreadEngine):
    def __init__(self, log: list[str]) -> None:
        super().__init__("cpu")
        self.log = log

    def synchronize(self) -> None:  # which of the prefetcher's threads could still queue a copy?
        self.log.append(sorted(t.name for t in threading.enumerate() if t.name in ("offload-loader", "offload-stager")))


def test_close_waits_for_queued_copies_before_anyone_frees_the_slots(world):
    log: list = []
    plan, pf, _ = build(world, HOMES["mixed"], 2, True, engine=RecordingEngine(log))
    run_passes(pf, plan, world[0], passes=1)
    log.clear()
    pf.close()
    assert log == [[]]  # synchronised once, after the threads that queue copies have stopped


def test_close_never_hangs_when_the_loader_asks_for_a_staged_piece_after_it(world):
    """The race: close() collected the staged events, then the loader created a fresh one and waited on it."""
    plan, pf, _ = build(world, dict.fromkeys(SIZES, "disk"), 1, True)
    pf.close()
    event = pf._staged_event((10**6, 0))  # what a loader that lost the race asks for
    assert event.is_set() and (10**6, 0) not in pf._staged_events
