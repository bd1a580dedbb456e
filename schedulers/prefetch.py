"""The prefetch scheduler: executes a `Plan`, keeping `depth` streamed groups in flight.

Compute calls, in pass order, for every group:

    buf = prefetch.acquire(group)   # the group's bytes, on the compute device (waits if not there yet)
    ... compute with views into buf ...
    prefetch.release(group)         # the slot may be reused once the compute that read it is done

Groups homed where compute can read them in place are returned at once. The others flow
through a ring of `depth + 1` device slots: the k-th streamed load (counting across passes;
the schedule is the plan's streamed groups, repeated) goes to slot `k % (depth + 1)`, so it
can only start after the compute of load `k - depth - 1` released that slot. Two threads:

    stager (CUDA)           reads disk chunks into the pinned staging slots, as far ahead as
                            the staging slots allow: the disk never waits for a ring slot
    loader                  lands every load in order in its ring slot: a copy on the transfer
                            engine's copy stream after the slot's "compute done" marker (CUDA
                            event), never earlier; on a CPU, disk reads go straight into the
                            ring slot (host memory is device memory) once the slot is free

and records a span per read and copy. Compute waits only for the load it needs (an event
on CUDA, a future-like flag on CPU). The scheduler knows groups, slots and tiers; it knows
nothing about what the bytes mean.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from schedulers.plan import Plan
from schedulers.side import JOIN_TIMEOUT_S, SideWorker
from schedulers.timeline import Timeline
from schedulers.traffic import COMPUTE, Traffic
from schedulers.transfer import DONE, Marker, TransferEngine
from storage import interrupts
from storage.tiers import MemoryTier, Tier
from storage.units import ceil_div

log = logging.getLogger(__name__)


def _join(t: threading.Thread) -> None:
    t.join(JOIN_TIMEOUT_S)
    if t.is_alive():
        log.warning("%s is still busy after %.0f s (a hung disk?); leaving it behind", t.name, JOIN_TIMEOUT_S)


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
                 ring: list[torch.Tensor], stage: list[torch.Tensor], traffic: Traffic | None = None) -> None:
        assert len(ring) == plan.ring_slots and len(stage) == plan.stage_slots
        self.plan, self.tiers, self.engine, self.timeline = plan, tiers, engine, timeline
        self.ring, self.stage = ring, stage
        self.schedule = plan.streamed
        self.traffic = traffic or Traffic()  # weights: every link's bytes, and each home's bytes handed to compute
        self._homed = {t: sum(plan.sizes[g] for g in plan.order if plan.homes[g] == t) for t in ("gpu", "cpu")}
        self._in_ring = 0  # bytes of streamed groups sitting in ring slots (for the resident-bytes counter)
        self._loads: deque[Load] = deque()
        self._cond = threading.Condition()
        self._slot_free: list[threading.Event] = []
        self._free_marker: list[Marker] = []
        self._stage_marker: list[Marker] = []
        self._stop = False
        self._current: dict[str, tuple[Load | None, float, Marker | None]] = {}
        self._runs: dict[tuple[str, ...], tuple[list[torch.Tensor], dict[str, int]]] = {}  # `acquire_resident`'s
        self._taken: dict[tuple[str, ...], tuple[float, Marker | None]] = {}  # runs acquired: when, the marker
        self._stage_free: list[threading.Event] = []
        self._staged_events: dict[tuple[int, int], threading.Event] = {}
        self._threads: list[threading.Thread] = []
        self.side = SideWorker(lead=plan.depth + 1)  # one thread for every pass's side jobs
        self.reset()

    # -- compute side (critical: Ctrl-C lands between these calls, never inside a lock they take) ---------
    @interrupts.deferring
    def acquire(self, group: str) -> torch.Tensor:
        """The group's bytes on the compute device (1-D uint8, exactly its size)."""
        if self.plan.is_resident(group):  # (released by `release`, as a streamed group is)
            self._current[group] = (None, self.timeline.now(), self._compute_marker())
            return self._served((group,))[0]
        size = self.plan.sizes[group]
        self.traffic.add("weights", self.plan.homes[group], COMPUTE, size)
        with self._cond:
            interrupts.wait_for(self._cond, lambda: self._loads)
            load = self._loads[0]
        if load.group != group:
            raise RuntimeError(f"compute asked for {group!r} but the plan streams {load.group!r} next")
        start = self.timeline.now()
        interrupts.wait(load.ready)
        waited = self.timeline.now()
        if load.error is not None:
            raise load.error
        if waited - start > 1e-4:
            self.timeline.add("stall", group, start, waited, slot=load.slot, k=load.k)
        self.engine.compute_wait(load.marker)
        self._current[group] = (load, waited, self._compute_marker())
        return self.ring[load.slot][:size]

    @interrupts.deferring
    def release(self, group: str, span: tuple[float, float] | None = None) -> None:
        """Compute is done with the group. span: when its computation ran (timeline times), where the caller timed it
        itself (layers in one call, each timed inside it); else from its acquire to now."""
        done = self.engine.mark_compute()
        load = self._computed(group, done, span)
        self.side.advance()
        if load is None:
            return
        with self._cond:
            assert self._loads[0] is load
            self._loads.popleft()
            self._in_ring -= self.plan.sizes[group]
            self._released += 1
            self._count_resident()
            self._cond.notify_all()
        self._free_marker[load.slot] = done
        self._slot_free[load.slot].set()

    @interrupts.deferring
    def acquire_resident(self, groups: list[str]) -> list[torch.Tensor]:
        """`acquire` of a run of resident groups (read in place where they live) in one call: their bytes in order.
        A CPU pass over resident layers takes them all at once, and its bookkeeping is a few calls whatever the
        number of layers (its views and bytes per home are made once a run: a plan's homes do not move). Each step
        streams the weights through the caches, so its Python runs cold: SmolLM2-135M's 30 layers one call each
        cost ~0.3 ms of a ~12 ms bf16 step."""
        self._taken[key := tuple(groups)] = (self.timeline.now(), self._compute_marker())
        return self._served(key)

    def _served(self, groups: tuple[str, ...]) -> list[torch.Tensor]:
        """The bytes of resident groups where they live, counted as handed to compute (made once a run)."""
        run = self._runs.get(groups)
        if run is None:
            served: dict[str, int] = {}
            for group in groups:
                if not self.plan.is_resident(group):
                    raise RuntimeError(f"acquire_resident: {group!r} is streamed, not resident")
                home = self.plan.homes[group]
                served[home] = served.get(home, 0) + self.plan.sizes[group]
            run = self._runs[groups] = ([self._home_view(g) for g in groups], served)
        for home, nbytes in run[1].items():
            self.traffic.add("weights", home, COMPUTE, nbytes)
        return run[0]

    @interrupts.deferring
    def release_resident(self, groups: list[str], spans: list[tuple[float, float] | None] | Callable[[], list]
                         ) -> None:
        """`release` of groups taken by `acquire_resident`, each with its compute span (as `release`'s; or a function
        that gives them all, called when the timeline is read: `Timeline.add_many`)."""
        start, marker = self._taken.pop(tuple(groups))
        if marker is None:  # host clocks: every span in one call (or made when read)
            now = self.timeline.now()
            self.timeline.add_many("compute", groups, spans if callable(spans) else
                                   [span or (start, now) for span in spans])
        else:
            done = self.engine.mark_compute()
            for group, span in zip(groups, spans() if callable(spans) else spans):
                self._record_compute(group, start, marker, done, None, span)
        self.side.advance(len(groups))

    def _computed(self, group: str, done: Marker, span: tuple[float, float] | None) -> Load | None:
        """Compute is done with an acquired group: its compute span recorded; its load (None: resident)."""
        load, start, start_marker = self._current.pop(group)
        self._record_compute(group, start, start_marker, done, load, span)
        return load

    # -- side jobs: per-pass work that rides with the weights (cold KV for each layer) --------------
    def submit_side(self, jobs: dict[str, Callable[[], tuple[Any, int]]]) -> None:
        """Jobs for the coming pass, keyed by group, run in pass order by the one side thread (`schedulers.side`),
        at most `depth + 1` groups ahead of compute; each returns (result, bytes moved) and records its own span."""
        computed = [g for g in self.plan.order if g not in self.plan.rows_only  # every one is acquired, released
                    and g not in self.plan.on_demand]  # (on-demand experts go through the expert cache)
        self.side.submit(jobs, {g: i for i, g in enumerate(computed)})

    def side_result(self, group: str) -> Any:
        return self.side.result(group)

    def _count_resident(self) -> None:
        self.timeline.count("bytes resident", gpu=self._homed["gpu"] + self._in_ring, cpu=self._homed["cpu"])

    def _compute_marker(self) -> Marker | None:
        return self.engine.mark_compute() if self.engine.device.type == "cuda" else None

    def _record_compute(self, group: str, start: float, start_marker: Marker | None, done: Marker,
                        load: Load | None, span: tuple[float, float] | None = None) -> None:
        if not self.timeline.enabled:
            return
        slot, args = (None, {}) if load is None else (load.slot, {"k": load.k})
        if start_marker is not None:
            self.timeline.add_cuda("compute", group, start_marker.event, done.event, slot=slot,  # type: ignore
                                   device=self.engine.device, **args)
        else:
            start, end = span or (start, self.timeline.now())
            self.timeline.add("compute", group, start, end, slot=slot, **args)

    def _home_view(self, group: str) -> torch.Tensor:
        tier = self.tiers[self.plan.homes[group]]
        assert isinstance(tier, MemoryTier)
        return tier.view(group)

    # -- worker threads -----------------------------------------------------------------------
    def _staged_loads(self):
        """(k, piece, stage slot) of every piece of every load that goes disk -> stage -> device, in schedule
        order, forever. A group larger than a staging slot crosses in pieces of the slot's size."""
        n, j, k = len(self.schedule), 0, 0
        while True:
            group = self.schedule[k % n]
            if self.plan.route(group)[:2] == ("disk", "cpu"):
                for p in range(self._pieces(group)):
                    yield k, p, j % len(self.stage)
                    j += 1
            k += 1

    def _pieces(self, group: str) -> int:
        return ceil_div(self.plan.sizes[group], self.plan.stage_slot_bytes)

    def _piece(self, group: str, p: int) -> tuple[int, int]:
        """Byte range [start, start + n) of a group's p-th staging piece."""
        start = p * self.plan.stage_slot_bytes
        return start, min(self.plan.stage_slot_bytes, self.plan.sizes[group] - start)

    def _stager(self) -> None:
        """Reads disk chunks into the pinned staging slots, running ahead of the loader (and of the ring):
        the disk never waits for a ring slot, only for a staging slot whose copy to the device is done."""
        n, ring = len(self.schedule), len(self.ring)
        for k, p, s in self._staged_loads():
            self._stage_free[s].wait()
            self._stage_free[s].clear()
            if self.plan.depth == 0:  # depth 0 is "no prefetch": read only once the slot is free
                with self._cond:
                    while self._released < k - ring + 1 and not self._stop:
                        self._cond.wait()
            if self._stop:
                return
            group = self.schedule[k % n]
            start, size = self._piece(group, p)
            try:
                self._stage_marker[s].wait()  # the copy out of this slot has finished on the device
                with self.timeline.span("disk-read", group, nbytes=size, slot=s, step=self._base_step + k // n,
                                        k=k, into="stage", piece=p):
                    self.tiers["disk"].read_into(group, self.stage[s][:size], offset=start)
                self.traffic.add("weights", "disk", "cpu", size)
            except BaseException as e:  # handed to the loader, then to compute
                self._staged[(k, p)] = (s, e)
                self._staged_event((k, p)).set()
                return
            self._staged[(k, p)] = (s, None)
            self._staged_event((k, p)).set()

    def _staged_event(self, key: tuple[int, int]) -> threading.Event:
        """The event that says piece `key` = (k, piece) is staged; once closing, an event already set (a thread
        that asks after `close` collected the events must not wait on one nobody will set)."""
        with self._cond:
            if self._stop:
                done = threading.Event()
                done.set()
                return done
            return self._staged_events.setdefault(key, threading.Event())

    def _loader(self) -> None:
        """Walks the schedule in order and lands every load in its ring slot."""
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
            if self._stop:
                return
            with self._cond:
                self._in_ring += self.plan.sizes[load.group]
                self._count_resident()
            load.ready.set()
            k += 1

    def _wait_slot(self, slot: int) -> bool:
        self._slot_free[slot].wait()
        self._slot_free[slot].clear()
        return not self._stop

    def _load(self, load: Load, step: int) -> None:
        group, size = load.group, self.plan.sizes[load.group]
        route = self.plan.route(group)
        if route[:2] == ("disk", "cpu"):  # CUDA: the stager read it, piece by piece, into pinned slots
            for p in range(self._pieces(group)):
                event = self._staged_event((load.k, p))
                event.wait()
                if self._stop:
                    return
                with self._cond:
                    del self._staged_events[(load.k, p)]
                s, error = self._staged.pop((load.k, p))
                if error is not None:
                    raise error
                if p == 0 and not self._wait_slot(load.slot):
                    return
                start, m = self._piece(group, p)
                load.marker = self._copy(load, self.ring[load.slot][start : start + m], self.stage[s][:m], step)
                self._stage_marker[s] = load.marker
                self._stage_free[s].set()
        elif route[0] == "disk":  # CPU: disk -> device slot directly
            if not self._wait_slot(load.slot):
                return
            self._free_marker[load.slot].wait()
            with self.timeline.span("disk-read", group, nbytes=size, slot=load.slot, step=step, k=load.k,
                                    into="ring"):
                self.tiers["disk"].read_into(group, self.ring[load.slot][:size])
            self.traffic.add("weights", "disk", "gpu", size)
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
                                   device=self.engine.device, k=load.k, into="ring")
        else:
            with self.timeline.span("h2d", load.group, nbytes=dst.numel(), slot=load.slot, step=step, k=load.k,
                                    into="ring"):
                marker = self.engine.copy(dst, src, after=[free])
        self.traffic.add("weights", "cpu", "gpu", dst.numel())
        return marker

    @interrupts.deferring
    def close(self) -> None:
        """Stop every thread (the side thread too), then wait for every copy they queued (the slots may be freed
        right after)."""
        self.side.close()
        self._stop_loaders()

    def _stop_loaders(self) -> None:
        with self._cond:
            self._stop = True  # under the lock: no thread creates an event to wait on after this
            events = list(self._staged_events.values())
            self._cond.notify_all()
        for e in self._slot_free + self._stage_free + events:
            e.set()
        for t in self._threads:
            _join(t)
        self._threads = []
        self.engine.synchronize()  # copies still in flight on the copy stream read and write the slots

    @interrupts.deferring
    def reset(self) -> None:
        """(Re)start the schedule at its first load; also abandons a pass cut short by an exception (its side jobs
        are dropped; the side thread stays for the next pass)."""
        self.side.cancel()
        self._stop_loaders()
        for m in self._stage_marker + self._free_marker:
            m.wait()
        self._loads.clear()
        self._current.clear()
        self._taken.clear()
        self._in_ring = 0
        self._released = 0  # streamed loads whose compute is done
        self._slot_free = [threading.Event() for _ in self.ring]
        self._stage_free = [threading.Event() for _ in self.stage]
        for e in self._slot_free + self._stage_free:
            e.set()
        self._free_marker = [DONE for _ in self.ring]
        self._stage_marker = [DONE for _ in self.stage]
        self._staged: dict[tuple[int, int], tuple[int, BaseException | None]] = {}
        self._staged_events: dict[tuple[int, int], threading.Event] = {}
        self._stop = False
        self._base_step = self.timeline.step
        if self.schedule:
            workers = [self._loader] + ([self._stager] if self.stage else [])
            self._threads = [threading.Thread(target=w, name=f"offload-{w.__name__.strip('_')}", daemon=True)
                             for w in workers]
            for t in self._threads:
                t.start()
