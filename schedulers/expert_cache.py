"""The expert cache: device slots holding routed experts that are homed off the device, loaded on demand or ahead.

    cache = ExpertCache(plan, tiers, engine, timeline, slots, policy, traffic)
    cache.request(groups)          # this layer's routed groups not cached: loads queued now, in order
    cache.prefetch(groups)         # the next layer's predicted groups: queued behind them, into unpinned slots
    buf = cache.get(group)         # its bytes on the device (waits for its load; compute waits on its marker)
    cache.done(group)              # compute read it: its slot may be evicted once that compute is done
    cache.end_layer(layer, ...)    # one span per MoE layer per pass on the "experts" track (hits, misses, ...)

The plan's `on_demand` groups (routed experts homed in host RAM or on disk that do not stream through the
ring) come here instead of the prefetcher. Every load runs on one loader thread, in the order asked: a
host-homed group is copied on the transfer engine (the copy stream on CUDA) after the slot's last reader
finished; a disk-homed one is read into the slot (a CPU device) or through a host buffer (CUDA). A slot being
computed on, or holding a load not yet used, is never evicted; among the rest the policy
(`schedulers.expert_policy`) picks. Counts per layer: hits (cached before the layer asked), prefetched (brought
by the prediction), misses (loaded on demand). It knows groups, slots and tiers; nothing about models.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from schedulers.expert_policy import LFU, LRU
from schedulers.plan import Plan
from schedulers.timeline import Timeline
from schedulers.traffic import COMPUTE, Traffic
from schedulers.transfer import DONE, Marker, TransferEngine
from storage import interrupts
from storage.tiers import MemoryTier, Tier


@dataclass
class LayerCounts:
    hits: int = 0  # routed and cached before the layer asked
    prefetched: int = 0  # routed and brought by the prediction made at the layer before
    misses: int = 0  # routed and loaded on demand
    predicted: int = 0  # experts the prediction named for this layer
    correct: int = 0  # ... that were routed

    @property
    def routed(self) -> int:
        return self.hits + self.prefetched + self.misses

    def add(self, other: LayerCounts) -> None:
        for k in ("hits", "prefetched", "misses", "predicted", "correct"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class CacheStats:
    layers: dict[int, LayerCounts] = field(default_factory=dict)
    predicted_layers: int = 0  # layers whose routing a prediction was made for
    actual_routed: int = 0  # routed experts of those layers (the denominator of the prediction's recall)

    def total(self) -> LayerCounts:
        out = LayerCounts()
        for c in self.layers.values():
            out.add(c)
        return out

    def to_dict(self) -> dict:
        t = self.total()
        return {"routed": t.routed, "hits": t.hits, "prefetched": t.prefetched, "misses": t.misses,
                "hit_rate": round(t.hits / t.routed, 4) if t.routed else 0.0,
                "hit_rate_with_prefetch": round((t.hits + t.prefetched) / t.routed, 4) if t.routed else 0.0,
                "prediction_recall": round(t.correct / self.actual_routed, 4) if self.actual_routed else None,
                "prediction_precision": round(t.correct / t.predicted, 4) if t.predicted else None,
                "per_layer_hit_rate": {i: round((c.hits + c.prefetched) / c.routed, 4)
                                       for i, c in sorted(self.layers.items()) if c.routed}}


@dataclass
class _Entry:
    group: str
    slot: int
    load: Future
    prefetched: bool  # loaded ahead on a prediction, not yet used
    readers: int = 0


class ExpertCache:
    def __init__(self, plan: Plan, tiers: dict[str, Tier], engine: TransferEngine, timeline: Timeline,
                 slots: list[torch.Tensor], policy: LRU | LFU, traffic: Traffic | None = None) -> None:
        self.plan, self.tiers, self.engine, self.timeline = plan, tiers, engine, timeline
        self.slots, self.policy = slots, policy
        self.traffic = traffic or Traffic()
        self.stats = CacheStats()
        self._entries: dict[str, _Entry] = {}
        self._free = list(range(len(slots)))[::-1]
        self._after: list[Marker] = [DONE] * len(slots)  # the last compute that read each slot
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="offload-experts")
        self._host: torch.Tensor | None = None  # CUDA: disk reads land here before the copy
        self._layer = LayerCounts()
        self._t0 = 0.0
        self.trace: list[str] | None = None  # set to a list to record every routed use, in order (benchmarks)

    # -- compute side -------------------------------------------------------------------------
    @interrupts.deferring
    def request(self, groups: list[str]) -> None:
        """A layer's routed groups (in the order compute will use them): hits counted and pinned, misses queued
        (those that find no slot while the layer's others are pinned are loaded by `get`, as slots come free)."""
        self._t0 = self.timeline.now()
        with self._lock:
            missing = []
            for g in groups:
                e = self._entries.get(g)
                if e is None:
                    self._layer.misses += 1
                    missing.append(g)
                else:
                    if e.prefetched:
                        self._layer.prefetched += 1
                        e.prefetched = False
                    else:
                        self._layer.hits += 1
                    e.readers += 1  # pinned until `done`
                self.policy.touch(g)
            if self.trace is not None:
                self.trace += groups
            for g in missing:
                if self._claim(g, prefetched=False) is None:
                    break
                self._entries[g].readers += 1

    @interrupts.deferring
    def prefetch(self, groups: list[str]) -> int:
        """Queue loads of groups predicted for the next layer into free or evictable slots; how many were queued
        (none when every slot is pinned)."""
        queued = 0
        with self._lock:
            for g in groups:
                if g in self._entries:
                    continue
                if self._claim(g, prefetched=True) is None:
                    break
                queued += 1
        return queued

    @interrupts.deferring
    def get(self, group: str) -> torch.Tensor:
        """The group's bytes in its slot (1-D uint8, exactly its size), once its load is done."""
        start = self.timeline.now()
        with self._lock:
            e = self._entries.get(group)
            if e is None:  # no slot was free when the layer asked: one is now (the layer's earlier experts are done)
                if self._claim(group, prefetched=False) is None:
                    raise RuntimeError(f"the expert cache's {len(self.slots)} slots are all in use; {group} has none")
                e = self._entries[group]
                e.readers += 1
        marker = interrupts.result(e.load)
        waited = self.timeline.now()
        if waited - start > 1e-4:
            self.timeline.add("stall", group, start, waited, slot=e.slot, into="expert cache")
        self.engine.compute_wait(marker)
        self.traffic.add("weights", self.plan.homes[group], COMPUTE, self.plan.sizes[group])
        return self.slots[e.slot][: self.plan.sizes[group]]

    @interrupts.deferring
    def done(self, group: str) -> None:
        e = self._entries[group]
        self._after[e.slot] = self.engine.mark_compute()
        with self._lock:
            e.readers -= 1

    @interrupts.deferring
    def end_layer(self, layer: int, predicted: set[str] | None, routed: list[str]) -> None:
        """Record the layer's counts (and how well the prediction made for it did) on the timeline and in `stats`."""
        c, self._layer = self._layer, LayerCounts()
        if predicted is not None:
            c.predicted, c.correct = len(predicted), len(predicted & set(routed))
            self.stats.predicted_layers += 1
            self.stats.actual_routed += len(routed)
        self.stats.layers.setdefault(layer, LayerCounts()).add(c)
        self.timeline.add("experts", f"layer.{layer}", self._t0, self.timeline.now(), hits=c.hits,
                          prefetched=c.prefetched, misses=c.misses, predicted=c.predicted, correct=c.correct)

    @interrupts.deferring
    def reset(self) -> None:
        """After a pass cut short: wait for the loads in flight, unpin everything (the cached bytes stay valid)."""
        for e in list(self._entries.values()):
            try:
                interrupts.result(e.load)
            except BaseException:
                self._forget(e.group)
            e.readers = 0
        self._layer = LayerCounts()

    @interrupts.deferring
    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.engine.synchronize()

    # -- slots --------------------------------------------------------------------------------
    def _claim(self, group: str, prefetched: bool) -> int | None:
        """A slot for `group`, its load queued: a free one, else the policy's victim among the entries nobody
        reads (a prefetch evicts no other prefetch not yet used; a demand load does if it must); None when
        every slot is in use."""
        if self._free:
            slot = self._free.pop()
        else:
            idle = [g for g, e in self._entries.items() if e.readers == 0]
            movable = [g for g in idle if not self._entries[g].prefetched] or ([] if prefetched else idle)
            if not movable:
                return None
            slot = self._entries.pop(self.policy.victim(movable)).slot
        after = self._after[slot]
        self._entries[group] = _Entry(group, slot, self._pool.submit(self._load, group, slot, after), prefetched)
        return slot

    def _forget(self, group: str) -> None:
        e = self._entries.pop(group, None)
        if e is not None:
            self._free.append(e.slot)

    # -- the loader thread --------------------------------------------------------------------
    def _load(self, group: str, slot: int, after: Marker) -> Marker:
        size, home = self.plan.sizes[group], self.plan.homes[group]
        dst = self.slots[slot][:size]
        step = self.timeline.step
        if home == "disk" and not self.engine.copies_to_device:  # CPU: straight into the slot
            after.wait()
            with self.timeline.span("disk-read", group, nbytes=size, slot=slot, step=step, into="expert cache"):
                self.tiers["disk"].read_into(group, dst)
            self.traffic.add("weights", "disk", "gpu", size)
            return DONE
        if home == "disk":  # CUDA: through one host buffer, reused once its copy is done
            if self._host is None or self._host.numel() < size:
                self._host = torch.empty(max(s.numel() for s in self.slots), dtype=torch.uint8,
                                         pin_memory=torch.cuda.is_available())
            src = self._host[:size]
            with self.timeline.span("disk-read", group, nbytes=size, step=step, into="expert cache"):
                self.tiers["disk"].read_into(group, src)
            self.traffic.add("weights", "disk", "cpu", size)
        else:
            tier = self.tiers[home]
            assert isinstance(tier, MemoryTier)
            src = tier.view(group)
        with self.timeline.span("h2d", group, nbytes=size, slot=slot, step=step, into="expert cache"):
            marker = self.engine.copy(dst, src, after=[after])
        self.traffic.add("weights", "cpu", "gpu", size)
        if home == "disk":
            marker.wait()  # the host buffer is reused by the next load
        return marker
