"""The placement plan: which tier is each group's home, and the ring that streams the rest.

`make_plan` returns a `Plan` (a value you can print and test); the prefetcher executes it.
Rules, in order:

1. The device keeps room for the KV blocks and the activation workspace it is given.
2. If every group fits in what is left, everything lives on the device: nothing streams.
3. Otherwise `depth + 1` ring slots are reserved, each as large as the largest group that
   streams, and the device homes as many bytes as still fit. The slot size is chosen among
   the group sizes so that a few large groups (an LM head) can be homed instead of sizing
   every slot for them. Homed groups are spread evenly over the pass so the link keeps
   working while device-homed layers compute.
4. Then the host homes what fits, then the disk holds the rest. When disk-homed groups must
   be copied to a CUDA device, two pinned staging slots come off the host's budget first:
   each a piece of at most `STAGE_PIECE` bytes (a group crosses in pieces; 64 MiB pieces
   already run PCIe at full speed), shrunk to what the host tier can hold, down to
   `MIN_STAGE`; a host tier that cannot hold two of those is refused, naming the capacity.
5. Groups read by rows only (token embeddings) take the slowest tier there is: a step
   reads a few rows of them, never the whole group.

A plan that cannot fit raises CapacityError naming the minimum capacities that would.
Plans know group names, sizes and tiers; they know nothing about models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from storage.arena import PAGE, round_up
from storage.errors import CapacityError
from storage.tiers import TIERS

STAGE_SLOTS = 2
#: The largest staging slot: a disk-homed group is read and copied to the device in pieces of this size.
STAGE_PIECE = 64 * 2**20
#: The smallest staging slot worth having (smaller pieces spend more time per copy than moving bytes).
MIN_STAGE = 2**20


@dataclass(frozen=True, slots=True)
class GroupSpec:
    name: str
    nbytes: int
    rows_only: bool = False  # read a few rows at a time (embeddings); never streamed whole


@dataclass(frozen=True)
class Capacities:
    gpu: int | None  # None: unlimited
    cpu: int | None
    disk: int | None  # None with has_disk: unlimited
    has_disk: bool = False


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
    host_reserve: int = 0  # host bytes kept for other uses (cold KV blocks)
    disk_reserve: int = 0  # disk bytes kept for other uses (the KV slot file)

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
        if home == "gpu" or (home == "cpu" and not self.copy_to_device):
            return (home,)
        if home == "cpu":
            return ("cpu", "gpu")
        return ("disk", "cpu", "gpu") if self.copy_to_device else ("disk", "gpu")

    def is_resident(self, group: str) -> bool:
        """Compute reads this group in place, from its home."""
        return len(self.route(group)) == 1

    @property
    def streamed(self) -> list[str]:
        """Groups that flow through the ring, in pass order."""
        return [g for g in self.order if g not in self.rows_only and not self.is_resident(g)]

    # -- accounting ---------------------------------------------------------------------------
    def used(self, tier: str) -> int:
        homed = sum(self.sizes[g] for g in self.order if self.homes[g] == tier)
        if tier == "gpu":
            return homed + sum(self.reserved_gpu.values())
        if tier == "cpu":
            return homed + self.stage_slots * self.stage_slot_bytes + self.host_reserve
        return sum(self.sizes.values()) + self.disk_reserve  # the store holds every group

    def pinned_bytes(self) -> int:
        """Host bytes page-locked for CUDA: every region of the cpu tier (homes, staging slots, cold KV blocks),
        each rounded up to whole pages; 0 on a CPU device. This is the size of the cpu tier's pinned arena."""
        if not self.copy_to_device:
            return 0
        homes = sum(round_up(self.sizes[g], PAGE) for g in self.order if self.homes[g] == "cpu")
        return homes + self.stage_slots * round_up(self.stage_slot_bytes, PAGE) + round_up(self.host_reserve, PAGE)

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes each link moves per forward pass (rows-only reads are a few rows and not counted)."""
        links = {"disk->cpu": 0, "disk->gpu": 0, "cpu->gpu": 0}
        for g in self.streamed:
            r = self.route(g)
            for a, b in zip(r, r[1:]):
                links[f"{a}->{b}"] += self.sizes[g]
        return {k: v for k, v in links.items() if v}

    def describe(self) -> str:
        lines = [f"placement plan: {len(self.order)} groups, {_gib(sum(self.sizes.values()))}, "
                 f"prefetch depth {self.depth}"]
        for tier in TIERS:
            if tier == "disk" and not self.capacities.has_disk:
                continue
            groups = [g for g in self.order if self.homes[g] == tier]
            cap = self.capacity(tier)
            cap_text = "unlimited" if cap is None else _gib(cap)
            lines.append(f"  {tier:<4} {_gib(self.used(tier)):>11} of {cap_text:>11}"
                         f"  homes {len(groups):>3} groups: {_compact(groups)}")
        extras = [f"{k} {_gib(v)}" for k, v in self.reserved_gpu.items() if v]
        if extras:
            ring = f" ({self.ring_slots} ring slots x {_gib(self.ring_slot_bytes)})" if self.ring_slots else ""
            lines.append(f"  gpu reserves: {', '.join(extras)}{ring}")
        host = ([f"staging {self.stage_slots} x {_gib(self.stage_slot_bytes)}"] if self.stage_slots else []) + (
            [f"cold KV blocks {_gib(self.host_reserve)}"] if self.host_reserve else [])
        if host:
            lines.append(f"  cpu reserves: {', '.join(host)}")
        if self.disk_reserve:
            lines.append(f"  disk reserves: KV slot file {_gib(self.disk_reserve)}")
        if self.copy_to_device and self.used("cpu"):
            lines.append(f"  pinned host memory: {_gib(self.pinned_bytes())} (one page-locked arena for the cpu tier)")
        if self.lent:
            lines.append(f"  the gpu tier lends its unused {_gib(self.lent)} to the cpu tier (on a CPU device they "
                         "are the same RAM)")
        moved = self.bytes_per_step()
        lines.append("  per forward pass: " + (", ".join(f"{k} {_gib(v)}" for k, v in moved.items())
                                               if moved else "nothing moves (all resident)"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "depth": self.depth, "homes": dict(self.homes), "ring_slots": self.ring_slots,
            "ring_slot_bytes": self.ring_slot_bytes, "stage_slots": self.stage_slots,
            "stage_slot_bytes": self.stage_slot_bytes, "reserved_gpu": dict(self.reserved_gpu),
            "used": {t: self.used(t) for t in TIERS}, "bytes_per_step": self.bytes_per_step(), "lent": self.lent,
            "pinned_bytes": self.pinned_bytes(),
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


def _spread(candidates: list[str], k: int) -> list[str]:
    """k of the candidates, evenly spaced over their order."""
    n = len(candidates)
    if k >= n:
        return list(candidates)
    return [candidates[int((i + 0.5) * n / k)] for i in range(k)]


def _fill(candidates: list[str], sizes: dict[str, int], budget: int) -> list[str]:
    """As many bytes of the candidates as fit in budget: largest size class first, spread within a class."""
    chosen: list[str] = []
    for size in sorted({sizes[g] for g in candidates}, reverse=True):
        same = [g for g in candidates if sizes[g] == size]
        k = min(len(same), max(budget, 0) // size)
        chosen += _spread(same, k)
        budget -= k * size
    return chosen


def min_device_bytes(groups: Sequence[GroupSpec], depth: int, fixed: int = 0) -> int:
    """The smallest device tier a plan at this depth fits in beside `fixed` reserved bytes (KV, workspace).

    Everything homed on the device, or `depth + 1` ring slots of one group size with every larger
    group homed: the same test `make_plan` applies.
    """
    stream = [g.nbytes for g in groups if not g.rows_only]
    total = sum(g.nbytes for g in groups)
    ring = [(depth + 1) * slot + sum(n for n in stream if n > slot) for slot in set(stream)]
    return fixed + min([total, *ring])


def _stage_bytes(slot: int, cpu_cap: int, cpu: int, host_reserve: int) -> int:
    """The staging slot size: a piece of at most STAGE_PIECE, shrunk (in pages) until two fit the host tier."""
    stage = min(round_up(slot, PAGE), STAGE_PIECE, cpu_cap // STAGE_SLOTS // PAGE * PAGE)
    if stage < min(MIN_STAGE, round_up(slot, PAGE)):
        need = STAGE_SLOTS * min(MIN_STAGE, round_up(slot, PAGE)) + host_reserve
        raise CapacityError(
            f"groups homed on disk reach the GPU through {STAGE_SLOTS} pinned staging buffers in the cpu tier, "
            f"but tiers.cpu.capacity is {_gib(cpu)}{' after the cold KV blocks' if host_reserve else ''}; raise "
            f"tiers.cpu.capacity to at least {_gib(need)} "
            f"({_gib(STAGE_SLOTS * min(STAGE_PIECE, round_up(slot, PAGE)) + host_reserve)} for full-speed pieces)"
        )
    return stage


def make_plan(groups: Sequence[GroupSpec], caps: Capacities, depth: int, kv_bytes: int = 0,
              workspace_bytes: int = 0, copy_to_device: bool = True, host_reserve: int = 0,
              disk_reserve: int = 0) -> Plan:
    """`host_reserve` / `disk_reserve`: bytes the host and disk tiers keep for other uses (cold KV blocks)."""
    order = tuple(g.name for g in groups)
    sizes = {g.name: g.nbytes for g in groups}
    rows = frozenset(g.name for g in groups if g.rows_only)
    stream = [g.name for g in groups if not g.rows_only]
    total = sum(sizes.values())
    ring_slots = depth + 1
    fixed = kv_bytes + workspace_bytes
    gpu_cap = caps.gpu

    def plan(homes: dict[str, str], slot: int, stage: int, lent: int = 0) -> Plan:
        reserved = {"kv": kv_bytes, "workspace": workspace_bytes}
        p = Plan(order, sizes, homes, depth, 0, 0, 0, 0, copy_to_device, caps, reserved, rows)
        n_ring = ring_slots if p.streamed else 0
        n_stage = STAGE_SLOTS if copy_to_device and any(p.route(g)[0] == "disk" for g in p.streamed) else 0
        reserved["ring"] = n_ring * slot
        return Plan(order, sizes, homes, depth, n_ring, slot if n_ring else 0, n_stage, stage if n_stage else 0,
                    copy_to_device, caps, reserved, rows, lent, host_reserve, disk_reserve)

    # everything on the device?
    if gpu_cap is None or total + fixed <= gpu_cap:
        return plan(dict.fromkeys(order, "gpu"), 0, 0)

    # otherwise choose the ring slot size that leaves the most bytes homed on the device
    best: tuple[int, int, list[str]] | None = None  # (homed bytes, slot size, homed groups)
    for slot in sorted({sizes[g] for g in stream}, reverse=True):
        must = [g for g in stream if sizes[g] > slot]
        budget = gpu_cap - fixed - ring_slots * slot - sum(sizes[g] for g in must)
        if budget < 0:
            continue
        homed = must + _fill([g for g in stream if sizes[g] <= slot], sizes, budget)
        score = sum(sizes[g] for g in homed)
        if best is None or score > best[0]:
            best = (score, slot, homed)
    largest = max((sizes[g] for g in stream), default=0)
    if best is None:
        lower = [d for d in range(depth) if min_device_bytes(groups, d, fixed) <= gpu_cap]
        raise CapacityError(
            f"the gpu tier ({_gib(gpu_cap)}) cannot hold the KV blocks and workspace ({_gib(fixed)}) plus "
            f"{ring_slots} ring slots; raise tiers.gpu.capacity to at least "
            f"{_gib(min_device_bytes(groups, depth, fixed))}"
            + (f" or lower prefetch.depth to {max(lower)}" if lower else "")
        )
    _, slot, on_gpu = best
    homes = dict.fromkeys(on_gpu, "gpu")
    # On a CPU compute device the two memory tiers are the same RAM: what the device tier leaves unused is
    # lent to the host tier, so the budget is not lost to packing whole groups into two separate bins.
    gpu_left = gpu_cap - fixed - ring_slots * slot - sum(sizes[g] for g in on_gpu)
    lent = 0 if copy_to_device else gpu_left

    # the host: rows-only groups first when there is no disk to take them, then the streamable rest;
    # two pinned staging slots come off the top when disk-homed groups must be copied to a CUDA device
    rest = ([] if caps.has_disk else sorted(rows)) + [g for g in stream if g not in homes]
    cpu_cap = None if caps.cpu is None else caps.cpu + lent - host_reserve
    if cpu_cap is not None and cpu_cap < 0:
        raise CapacityError(f"the cpu tier ({_gib(caps.cpu)}) cannot hold the cold KV blocks ({_gib(host_reserve)}); "
                            "raise tiers.cpu.capacity or lower kv_cache.cpu_blocks")
    stage = 0
    if cpu_cap is not None and sum(sizes[g] for g in rest) > cpu_cap:
        if copy_to_device and caps.has_disk:
            stage = _stage_bytes(slot, cpu_cap, caps.cpu, host_reserve)
        budget = cpu_cap - STAGE_SLOTS * stage
        must = [g for g in rest if g in rows]
        on_cpu = must + _fill([g for g in rest if g not in rows], sizes, budget - sum(sizes[g] for g in must))
        left = [g for g in rest if g not in on_cpu]
        if not caps.has_disk:
            raise CapacityError(
                f"the model ({_gib(total)}) does not fit in gpu {_gib(gpu_cap)} + cpu {_gib(caps.cpu)} and there "
                f"is no disk tier; add tiers.disk (a directory for the store) or raise tiers.cpu.capacity to at "
                f"least {_gib(sum(sizes[g] for g in rest) - lent)} (with tiers.gpu.capacity at least "
                f"{_gib(fixed + ring_slots * largest)})"
            )
        rest = on_cpu
        homes.update(dict.fromkeys(left, "disk"))
    homes.update(dict.fromkeys(rest, "cpu"))
    for g in rows:  # rows-only groups go to the slowest tier there is
        homes.setdefault(g, "disk")
    result = plan(homes, slot, stage, lent)
    if caps.has_disk and caps.disk is not None and total + disk_reserve > caps.disk:
        raise CapacityError(
            f"the store{' and the KV slot file' if disk_reserve else ''} need{'' if disk_reserve else 's'} "
            f"{_gib(total + disk_reserve)} but "
            f"tiers.disk.capacity is {_gib(caps.disk)}; raise it to at least {_gib(total + disk_reserve)}"
        )
    return result
