"""The placement plan, as the prefetcher executes it: each group's home tier, the ring that streams the rest.

A `Plan` is a value you can print and test: the groups in pass order and their sizes, each
group's home ("gpu" | "cpu" | "disk"), the ring of `depth + 1` device slots streamed groups
pass through, the pinned staging slots disk reads land in on their way to a CUDA device, and
the bytes each tier keeps for other uses (the KV pool, the workspace, cold KV blocks and their
staging, the KV slot file). It answers what executing it implies: each group's route to
compute, which groups stream, each tier's use, the pinned bytes, the bytes per link per pass.

Deciding a plan is `offload.plan` (`offload.plan.placement.make_plan`: the placement algorithm;
`offload.plan.planner`: every `auto` of a config); `schedulers.prefetch` executes it. Plans
know group names, sizes and tiers; they know nothing about models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from storage.arena import PAGE, round_up
from storage.tiers import TIERS
from storage.units import fmt_bytes


@dataclass(frozen=True)
class Capacities:
    gpu: int | None  # None: unlimited
    cpu: int | None
    disk: int | None  # None with has_disk: unlimited
    has_disk: bool = False
    kv_blocks: int | None = None  # the most KV blocks in all tiers (a speculative draft mirrors each one); None: any
    held: int = 0  # RAM the auto tiers left free for something else (a first run's compiling): tier bytes they gave up


@dataclass(frozen=True)
class Plan:
    order: tuple[str, ...]  # every group, in forward-pass order
    sizes: dict[str, int]
    homes: dict[str, str]  # group -> "gpu" | "cpu" | "disk"
    depth: int
    ring_slots: int  # device slots groups stream through (0 when nothing streams)
    ring_slot_bytes: int
    stage_slots: int  # pinned host slots that disk reads land in before a host->device copy
    stage_slot_bytes: int  # one piece of a group (<= ring_slot_bytes): larger groups cross in several pieces
    copy_to_device: bool  # False on a CPU compute device: host memory is device memory
    capacities: Capacities
    reserved_gpu: dict[str, int] = field(default_factory=dict)  # kv, workspace, ring
    rows_only: frozenset[str] = frozenset()
    lent: int = 0  # device capacity lent to the host tier (a CPU compute device: the same RAM)
    host_reserve: int = 0  # host bytes kept for other uses (cold KV blocks and their staging)
    disk_reserve: int = 0  # disk bytes kept for other uses (the KV slot file)
    kv_stage_bytes: int = 0  # of host_reserve: pinned buffers cold KV blocks cross to a CUDA device through
    # mixtures of experts: routed experts homed off the device load on demand into the expert cache
    # (`schedulers.expert_cache`, `cache_slots` device slots) instead of streaming through the ring, and those
    # in `host_compute` are computed on the host where they lie (their input moves, not their bytes)
    on_demand: frozenset[str] = frozenset()
    cache_slots: int = 0
    cache_slot_bytes: int = 0
    host_compute: frozenset[str] = frozenset()
    routed_share: float = 1.0  # of the on-demand / host-computed experts, the share a pass routes (expected)
    hit_rate: float = 0.0  # of routed on-demand experts, the share the cache is assumed to hold already

    def capacity(self, tier: str) -> int | None:
        """A tier's capacity under this plan (the host's includes what the device lent it)."""
        cap = {"gpu": self.capacities.gpu, "cpu": self.capacities.cpu, "disk": self.capacities.disk}[tier]
        if tier == "gpu" and cap is not None:
            return cap - self.lent
        if tier == "cpu" and cap is not None:
            return cap + self.lent
        return cap

    # -- routes -------------------------------------------------------------------------------
    def route(self, group: str) -> tuple[str, ...]:
        """The tiers a group's bytes pass through on their way to compute, home first."""
        home = self.homes[group]
        if home == "gpu" or (home == "cpu" and (not self.copy_to_device or group in self.host_compute)):
            return (home,)
        if home == "cpu":
            return ("cpu", "gpu")
        return ("disk", "cpu", "gpu") if self.copy_to_device else ("disk", "gpu")

    def is_resident(self, group: str) -> bool:
        """Compute reads this group in place, from its home."""
        return len(self.route(group)) == 1

    @property
    def streamed(self) -> list[str]:
        """Groups that flow through the ring, in pass order (not the experts loaded on demand)."""
        return [g for g in self.order if g not in self.rows_only and g not in self.on_demand
                and not self.is_resident(g)]

    # -- accounting ---------------------------------------------------------------------------
    def used(self, tier: str) -> int:
        homed = sum(self.sizes[g] for g in self.order if self.homes[g] == tier)
        if tier == "gpu":
            return homed + sum(self.reserved_gpu.values())
        if tier == "cpu":
            return homed + self.stage_slots * self.stage_slot_bytes + self.host_reserve
        return sum(self.sizes.values()) + self.disk_reserve  # the store holds every group

    def pinned_bytes(self) -> int:
        """Host bytes page-locked for CUDA: every region of the cpu tier (homes, staging slots, cold KV blocks and
        their staging), each rounded up to whole pages; 0 on a CPU device. This is the size of the cpu tier's
        pinned arena."""
        if not self.copy_to_device:
            return 0
        homes = sum(round_up(self.sizes[g], PAGE) for g in self.order if self.homes[g] == "cpu")
        return homes + self.stage_slots * round_up(self.stage_slot_bytes, PAGE) + round_up(self.host_reserve, PAGE)

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes each link moves per forward pass (rows-only reads are a few rows and not counted; experts loaded on
        demand count their expected share: routed and not cached)."""
        links = {"disk->cpu": 0, "disk->gpu": 0, "cpu->gpu": 0}
        miss = self.routed_share * (1.0 - self.hit_rate)
        for g in self.streamed + sorted(self.on_demand, key=self.order.index):
            r = self.route(g)
            n = self.sizes[g] if g not in self.on_demand else int(self.sizes[g] * miss)
            for a, b in zip(r, r[1:]):
                links[f"{a}->{b}"] += n
        return {k: v for k, v in links.items() if v}

    def describe(self) -> str:
        lines = [f"placement plan: {len(self.order)} groups, {fmt_bytes(sum(self.sizes.values()))}, "
                 f"prefetch depth {self.depth}"]
        for tier in TIERS:
            if tier == "disk" and not self.capacities.has_disk:
                continue
            groups = [g for g in self.order if self.homes[g] == tier]
            cap = self.capacity(tier)
            cap_text = "unlimited" if cap is None else fmt_bytes(cap)
            name = tier if self.copy_to_device or tier == "disk" else f"{tier} (RAM)"  # a CPU device: one RAM
            lines.append(f"  {name:<9} {fmt_bytes(self.used(tier)):>11} of {cap_text:>11}"
                         f"  homes {len(groups):>3} groups: {_compact(groups)}")
        ring = f" ({self.ring_slots} ring slots x {fmt_bytes(self.ring_slot_bytes)})" if self.ring_slots else ""
        extras = [f"{k} {fmt_bytes(v)}" + (ring if k == "ring" else "") for k, v in self.reserved_gpu.items() if v]
        if extras:
            lines.append(f"  gpu reserves: {', '.join(extras)}")
        host = ([f"staging {self.stage_slots} x {fmt_bytes(self.stage_slot_bytes)}"] if self.stage_slots else []) + (
            [f"cold KV blocks {fmt_bytes(self.host_reserve - self.kv_stage_bytes)}"]
            if self.host_reserve - self.kv_stage_bytes else []) + (
            [f"cold KV staging {fmt_bytes(self.kv_stage_bytes)}"] if self.kv_stage_bytes else [])
        if host:
            lines.append(f"  cpu reserves: {', '.join(host)}")
        if self.disk_reserve:
            lines.append(f"  disk reserves: KV slot file {fmt_bytes(self.disk_reserve)}")
        if self.on_demand or self.host_compute:
            lines.append(f"  experts: {len(self.on_demand)} loaded on demand into an expert cache of "
                         f"{self.cache_slots} slots x {fmt_bytes(self.cache_slot_bytes)} "
                         f"(assumed hit rate {100 * self.hit_rate:.0f}%, "
                         f"{100 * self.routed_share:.0f}% routed per pass)"
                         + (f"; {len(self.host_compute)} computed on the host where they lie"
                            if self.host_compute else ""))
        if self.copy_to_device and self.used("cpu"):
            lines.append(f"  pinned host memory: {fmt_bytes(self.pinned_bytes())} (one page-locked arena for the cpu "
                         "tier)")
        if not self.copy_to_device:
            lines.append(f"  on a CPU device the gpu and cpu tiers are both this machine's RAM: "
                         f"{fmt_bytes(self.used('gpu') + self.used('cpu'))} of it in all"
                         + (f" (the gpu tier lends its unused {fmt_bytes(self.lent)} to the cpu tier)" if self.lent
                            else ""))
        moved = self.bytes_per_step()
        lines.append("  per forward pass: " + (", ".join(f"{k} {fmt_bytes(v)}" for k, v in moved.items())
                                               if moved else "nothing moves (all resident)"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "depth": self.depth, "homes": dict(self.homes), "ring_slots": self.ring_slots,
            "ring_slot_bytes": self.ring_slot_bytes, "stage_slots": self.stage_slots,
            "stage_slot_bytes": self.stage_slot_bytes, "reserved_gpu": dict(self.reserved_gpu),
            "used": {t: self.used(t) for t in TIERS}, "bytes_per_step": self.bytes_per_step(), "lent": self.lent,
            "pinned_bytes": self.pinned_bytes(),
            **({"experts": {"on_demand": len(self.on_demand), "cache_slots": self.cache_slots,
                            "cache_slot_bytes": self.cache_slot_bytes, "host_compute": len(self.host_compute),
                            "routed_share": self.routed_share, "hit_rate": self.hit_rate}}
               if self.on_demand or self.host_compute else {}),
        }


def _compact(groups: list[str]) -> str:
    """layer.0, layer.1, layer.2, layer.5 -> 'layer.0-2, layer.5' (and layer.3.expert.0-7 for numbered
    groups inside a layer)."""
    out, run, prefix = [], [], None
    for g in groups + [None]:  # type: ignore[list-item]
        head, _, tail = (g or "").rpartition(".")
        idx = int(tail) if g and g.startswith("layer.") and tail.isdigit() else None
        if idx is not None and run and head == prefix and idx == run[-1] + 1:
            run.append(idx)
            continue
        if run:
            out.append(f"{prefix}.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
            run = []
        if idx is not None:
            run, prefix = [idx], head
        elif g is not None:
            out.append(g)
    return ", ".join(out) if out else "-"


