"""The prefetch scheduler: executes a `Plan`, keeping `depth` streamed groups in flight.

Compute calls, in pass order, for every group:

    buf = prefetch.acquire(group)   # the group's bytes, on the compute device (waits if not there yet)
    ... compute with views into buf ...
    prefetch.release(group)         # the slot may be reused once the compute that read it is done

Groups homed where compute can read them in place are returned at once. The others flow
through a ring of `depth + 1` device slots: the k-th streamed load (counting across passes;
the schedule is the plan's streamed groups, repeated) goes to slot `k % (depth + 1)`, so it
can only start after the compute of load `k - depth - 1` released that slot. One loader
thread walks the schedule; for each load it

    disk -> host stage      reads the chunk into a pinned staging slot (CUDA), or straight
                            into the device slot (CPU: host memory is device memory)
    host -> device          copies on the transfer engine's copy stream after the slot's
                            "compute done" marker (CUDA event), never earlier

and records a span per read and copy. Compute waits only for the load it needs (an event
on CUDA, a future-like flag on CPU). The scheduler knows groups, slots and tiers; it knows
nothing about what the bytes mean.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from schedulers.placement import Plan
from schedulers.timeline import Timeline
from schedulers.transfer import DONE, Marker, TransferEngine
from storage.tiers import MemoryTier, Tier

log = logging.getLogger(__name__)


@dataclass
class Load:
    """One streamed load: the k-th entry of the repeating schedule."""

    k: int
    group: str
    slot: int
    ready: threading.Event = field(default_factory=threading.Event)
    marker: Marker = DONE
    error: BaseException | None = None


class Prefetcher:
    def __init__(self, plan: Plan, tiers: dict[str, Tier], engine: TransferEngine, timeline: Timeline,
                 ring: list[torch.Tensor], stage: list[torch.Tensor]) -> None:
        assert len(ring) == plan.ring_slots and len(stage) == plan.stage_slots
        self.plan, self.tiers, self.engine, self.timeline = plan, tiers, engine, timeline
        self.ring, self.stage = ring, stage
        self.schedule = plan.streamed
        self.bytes_moved: dict[str, int] = {}  # per link: disk->cpu, disk->gpu, cpu->gpu
        self.served: dict[str, int] = {}  # per home tier: bytes of groups handed to compute
        self._loads: deque[Load] = deque()
        self._cond = threading.Condition()
        self._slot_free: list[threading.Event] = []
        self._free_marker: list[Marker] = []
        self._stage_marker: list[Marker] = []
        self._stop = False
        self._current: dict[str, tuple[Load | None, float, Marker | None]] = {}
        self._thread: threading.Thread | None = None
        self.reset()

    # -- compute side -------------------------------------------------------------------------
    def acquire(self, group: str) -> torch.Tensor:
        """The group's bytes on the compute device (1-D uint8, exactly its size)."""
        size = self.plan.sizes[group]
        home = self.plan.homes[group]
        self.served[home] = self.served.get(home, 0) + size
        if self.plan.is_resident(group):
            buf = self._home_view(group)
            self._current[group] = (None, self.timeline.now(), self._compute_marker())
            return buf
        with self._cond:
            while not self._loads:
                self._cond.wait()
            load = self._loads[0]
        if load.group != group:
            raise RuntimeError(f"compute asked for {group!r} but the plan streams {load.group!r} next")
        start = self.timeline.now()
        load.ready.wait()
        waited = self.timeline.now()
        if load.error is not None:
            raise load.error
        if waited - start > 1e-4:
            self.timeline.add("stall", group, start, waited, slot=load.slot, k=load.k)
        self.engine.compute_wait(load.marker)
        self._current[group] = (load, waited, self._compute_marker())
        return self.ring[load.slot][:size]

    def release(self, group: str) -> None:
        load, start, start_marker = self._current.pop(group)
        done = self.engine.mark_compute()
        self._record_compute(group, start, start_marker, done, load)
        if load is None:
            return
        with self._cond:
            assert self._loads[0] is load
            self._loads.popleft()
        self._free_marker[load.slot] = done
        self._slot_free[load.slot].set()

    def _compute_marker(self) -> Marker | None:
        return self.engine.mark_compute() if self.engine.device.type == "cuda" else None

    def _record_compute(self, group: str, start: float, start_marker: Marker | None, done: Marker,
                        load: Load | None) -> None:
        if not self.timeline.enabled:
            return
        slot, args = (None, {}) if load is None else (load.slot, {"k": load.k})
        if start_marker is not None:
            self.timeline.add_cuda("compute", group, start_marker.event, done.event, slot=slot,  # type: ignore
                                   **args)
        else:
            self.timeline.add("compute", group, start, self.timeline.now(), slot=slot, **args)

    def _home_view(self, group: str) -> torch.Tensor:
        tier = self.tiers[self.plan.homes[group]]
        assert isinstance(tier, MemoryTier)
        return tier.view(group)

    # -- loader thread ------------------------------------------------------------------------
    def _loader(self) -> None:
        n, slots = len(self.schedule), len(self.ring)
        k = 0
        while not self._stop:
            load = Load(k, self.schedule[k % n], k % slots)
            with self._cond:
                self._loads.append(load)
                self._cond.notify_all()
            try:
                self._load(load, step=self._base_step + k // n)
            except BaseException as e:  # handed to compute, which raises it
                log.debug("prefetch of %s failed: %s", load.group, e)
                load.error = e
                load.ready.set()
                return
            load.ready.set()
            k += 1

    def _wait_slot(self, slot: int) -> bool:
        self._slot_free[slot].wait()
        self._slot_free[slot].clear()
        return not self._stop

    def _load(self, load: Load, step: int) -> None:
        group, size = load.group, self.plan.sizes[load.group]
        route = self.plan.route(group)
        tl = self.timeline
        if route[0] == "disk":
            disk = self.tiers["disk"]
            if route[1] == "cpu":  # CUDA: disk -> pinned stage -> device slot
                s = load.k % len(self.stage)
                self._stage_marker[s].wait()  # the previous copy out of this stage slot is done
                dest = self.stage[s][:size]
                with tl.span("disk-read", group, nbytes=size, slot=s, step=step, k=load.k, into="stage"):
                    disk.read_into(group, dest)
                self._count("disk->cpu", size)
                if not self._wait_slot(load.slot):
                    return
                load.marker = self._copy(load, self.ring[load.slot][:size], dest, step)
                self._stage_marker[s] = load.marker
            else:  # CPU: disk -> device slot directly
                if not self._wait_slot(load.slot):
                    return
                self._free_marker[load.slot].wait()
                with tl.span("disk-read", group, nbytes=size, slot=load.slot, step=step, k=load.k, into="ring"):
                    disk.read_into(group, self.ring[load.slot][:size])
                self._count("disk->gpu", size)
        else:  # host -> device
            if not self._wait_slot(load.slot):
                return
            src = self._home_view(group)
            load.marker = self._copy(load, self.ring[load.slot][:size], src, step)

    def _copy(self, load: Load, dst: torch.Tensor, src: torch.Tensor, step: int) -> Marker:
        free = self._free_marker[load.slot]
        if self.engine.device.type == "cuda":
            marker, events = self.engine.timed_copy(dst, src, after=[free])
            self.timeline.add_cuda("h2d", load.group, *events, nbytes=dst.numel(), slot=load.slot, step=step,
                                   k=load.k, into="ring")
        else:
            with self.timeline.span("h2d", load.group, nbytes=dst.numel(), slot=load.slot, step=step, k=load.k,
                                    into="ring"):
                marker = self.engine.copy(dst, src, after=[free])
        self._count("cpu->gpu", dst.numel())
        return marker

    def _count(self, link: str, n: int) -> None:
        self.bytes_moved[link] = self.bytes_moved.get(link, 0) + n

    def close(self) -> None:
        self._stop = True
        for e in self._slot_free:
            e.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def reset(self) -> None:
        """(Re)start the schedule at its first load; also abandons a pass cut short by an exception."""
        self.close()
        for m in self._stage_marker + self._free_marker:
            m.wait()
        self._loads.clear()
        self._current.clear()
        self._slot_free = [threading.Event() for _ in self.ring]
        for e in self._slot_free:
            e.set()
        self._free_marker = [DONE for _ in self.ring]
        self._stage_marker = [DONE for _ in self.stage]
        self._stop = False
        self._base_step = self.timeline.step
        if self.schedule:
            self._thread = threading.Thread(target=self._loader, name="offload-prefetch", daemon=True)
            self._thread.start()
