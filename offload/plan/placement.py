"""The placement algorithm: from group sizes and tier capacities to a `Plan` (homes, ring, staging).

`make_plan` returns a `schedulers.plan.Plan` (a value you can print and test); the prefetcher
executes it. Rules, in order:

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

6. Mixtures of experts (an expert cache, unless `cache_slots` is 0): routed experts never take a ring
   slot or a device home (bar the all-fits case); the ring is sized for the other groups, those are
   homed first, and what the device tier leaves after the ring, the KV blocks and those homes becomes
   the expert cache (at least `MIN_CACHE_SLOTS` slots of the largest expert; `cache_slots` when given),
   into which experts homed off the device load on demand. On a CPU device a cache is kept only when
   some experts end up on disk (host RAM is device memory: the rest are read in place).

A plan that cannot fit raises CapacityError naming the minimum capacities that would. This
module knows group names, sizes and tiers; it knows nothing about models (the planner,
`offload.plan.planner`, turns a model and a config into its inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from schedulers.plan import Capacities, Plan
from storage.arena import PAGE, round_up
from storage.errors import CapacityError
from storage.units import fmt_bytes

STAGE_SLOTS = 2
#: The largest staging slot: a disk-homed group is read and copied to the device in pieces of this size.
STAGE_PIECE = 64 * 2**20
#: The smallest staging slot worth having (smaller pieces spend more time per copy than moving bytes).
MIN_STAGE = 2**20
#: The fewest expert cache slots a plan with on-demand experts keeps (one being computed, one loading).
MIN_CACHE_SLOTS = 2


@dataclass(frozen=True, slots=True)
class GroupSpec:
    name: str
    nbytes: int
    rows_only: bool = False  # read a few rows at a time (embeddings); never streamed whole
    expert: bool = False  # a routed expert: loaded on demand into the expert cache when it is not on the device


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


def min_device_bytes(groups: Sequence[GroupSpec], depth: int, fixed: int = 0, cache_slots: int | None = None,
                     in_place: bool = False, host: int | None = None, has_disk: bool = True) -> int:
    """The smallest device tier a plan at this depth fits in beside `fixed` reserved bytes (KV, workspace).

    Everything homed on the device, or `depth + 1` ring slots of one group size with every larger
    group homed (and the least expert cache): the same test `make_plan` applies. `in_place` (a CPU
    device): the host tier holds up to `host` bytes of groups (None: unlimited) where compute reads them
    in place: those need no device bytes and, when every group fits in RAM, no ring either; only what
    streams from disk passes through the ring (`make_plan`'s fallback on a CPU device).
    """
    cache = _least_cache(groups, cache_slots)
    stream = [g.nbytes for g in groups if not g.rows_only and not (cache and g.expert)]
    total = sum(g.nbytes for g in groups)
    if in_place:
        room = math.inf if host is None else host
        resident = sum(g.nbytes for g in groups if not g.rows_only) if has_disk else total  # rows-only: to disk
        options = [max(resident - room, 0)] + ([(depth + 1) * slot + max(sum(n for n in stream if n > slot) - room, 0)
                                                for slot in set(stream)] if has_disk else [])
        return fixed + int(min(options))
    ring = [(depth + 1) * slot + sum(n for n in stream if n > slot) + cache for slot in set(stream)]
    return fixed + min([total, *ring])


def _least_cache(groups: Sequence[GroupSpec], cache_slots: int | None) -> int:
    """Device bytes the smallest expert cache takes (0: no experts, or `cache_slots` 0)."""
    experts = [g.nbytes for g in groups if g.expert]
    if not experts or cache_slots == 0:
        return 0
    return (cache_slots or MIN_CACHE_SLOTS) * max(experts)


def _stage_bytes(slot: int, cpu_cap: int, cpu: int, host_reserve: int) -> int:
    """The staging slot size: a piece of at most STAGE_PIECE, shrunk (in pages) until two fit the host tier."""
    stage = min(round_up(slot, PAGE), STAGE_PIECE, cpu_cap // STAGE_SLOTS // PAGE * PAGE)
    if stage < min(MIN_STAGE, round_up(slot, PAGE)):
        need = STAGE_SLOTS * min(MIN_STAGE, round_up(slot, PAGE)) + host_reserve
        raise CapacityError(
            f"groups homed on disk reach the GPU through {STAGE_SLOTS} pinned staging buffers in the cpu tier, "
            f"but tiers.cpu.capacity is {fmt_bytes(cpu)}{' after the cold KV blocks' if host_reserve else ''}; raise "
            f"tiers.cpu.capacity to at least {fmt_bytes(need)} "
            f"({fmt_bytes(STAGE_SLOTS * min(STAGE_PIECE, round_up(slot, PAGE)) + host_reserve)} for full-speed pieces)"
        )
    return stage


def make_plan(groups: Sequence[GroupSpec], caps: Capacities, depth: int, kv_bytes: int = 0,
              workspace_bytes: int = 0, copy_to_device: bool = True, host_reserve: int = 0,
              disk_reserve: int = 0, cache_slots: int | None = None) -> Plan:
    """`host_reserve` / `disk_reserve`: bytes the host and disk tiers keep for other uses (cold KV blocks).
    `cache_slots`: expert cache slots (None: what the device tier leaves; 0: no cache, experts stream).

    On a CPU device a plan that cannot fit the usual way keeps groups in either RAM tier in place
    (`_in_place_plan`): only what streams from disk passes through the ring."""
    try:
        return _usual_plan(groups, caps, depth, kv_bytes, workspace_bytes, copy_to_device, host_reserve,
                           disk_reserve, cache_slots)
    except CapacityError:  # (routed experts keep the usual plan: their cache is planned there)
        if copy_to_device or caps.gpu is None or any(g.expert for g in groups) or caps.cpu == 0:
            raise
        return _in_place_plan(groups, caps, depth, kv_bytes, workspace_bytes, host_reserve, disk_reserve)


def _usual_plan(groups: Sequence[GroupSpec], caps: Capacities, depth: int, kv_bytes: int, workspace_bytes: int,
                copy_to_device: bool, host_reserve: int, disk_reserve: int, cache_slots: int | None) -> Plan:
    """Rules 1 to 6."""
    order = tuple(g.name for g in groups)
    sizes = {g.name: g.nbytes for g in groups}
    rows = frozenset(g.name for g in groups if g.rows_only)
    least_cache = _least_cache(groups, cache_slots)
    experts = [g.name for g in groups if g.expert] if least_cache else []
    eslot = max((sizes[g] for g in experts), default=0)
    stream = [g.name for g in groups if not g.rows_only]
    dense = [g for g in stream if g not in experts]  # what the ring and device homes are chosen among
    total = sum(sizes.values())
    ring_slots = depth + 1
    fixed = kv_bytes + workspace_bytes
    gpu_cap = caps.gpu

    def plan(homes: dict[str, str], slot: int, stage: int, lent: int = 0, cache: int = 0) -> Plan:
        reserved = {"kv": kv_bytes, "workspace": workspace_bytes}
        p = Plan(order, sizes, homes, depth, 0, 0, 0, 0, copy_to_device, caps, reserved, rows)
        on_demand = frozenset(g for g in experts if not p.is_resident(g)) if cache else frozenset()
        p = Plan(order, sizes, homes, depth, 0, 0, 0, 0, copy_to_device, caps, reserved, rows, on_demand=on_demand)
        n_ring = ring_slots if p.streamed else 0
        n_stage = STAGE_SLOTS if copy_to_device and any(p.route(g)[0] == "disk" for g in p.streamed) else 0
        slot = min(slot, max((sizes[g] for g in p.streamed), default=0))  # sized by what streams, nothing larger
        reserved["ring"] = n_ring * slot
        if on_demand:
            reserved["expert cache"] = cache * eslot
        return Plan(order, sizes, homes, depth, n_ring, slot if n_ring else 0, n_stage, stage if n_stage else 0,
                    copy_to_device, caps, reserved, rows, lent, host_reserve, disk_reserve,
                    on_demand=on_demand, cache_slots=cache if on_demand else 0,
                    cache_slot_bytes=eslot if on_demand else 0)

    # everything on the device?
    if gpu_cap is None or total + fixed <= gpu_cap:
        return plan(dict.fromkeys(order, "gpu"), 0, 0)

    # otherwise choose the ring slot size that leaves the most bytes homed on the device
    best: tuple[int, int, list[str]] | None = None  # (homed bytes, slot size, homed groups)
    for slot in sorted({sizes[g] for g in dense}, reverse=True):
        must = [g for g in dense if sizes[g] > slot]
        budget = gpu_cap - fixed - ring_slots * slot - sum(sizes[g] for g in must) - least_cache
        if budget < 0:
            continue
        homed = must + _fill([g for g in dense if sizes[g] <= slot], sizes, budget)
        score = sum(sizes[g] for g in homed)
        if best is None or score > best[0]:
            best = (score, slot, homed)
    largest = max((sizes[g] for g in dense), default=0)
    if best is None:
        lower = [d for d in range(depth) if min_device_bytes(groups, d, fixed, cache_slots) <= gpu_cap]
        raise CapacityError(
            f"the gpu tier ({fmt_bytes(gpu_cap)}) cannot hold the KV blocks and workspace ({fmt_bytes(fixed)}) plus "
            f"{ring_slots} ring slots{' and the expert cache' if least_cache else ''}; raise tiers.gpu.capacity to "
            f"at least {fmt_bytes(min_device_bytes(groups, depth, fixed, cache_slots))}"
            + (f" or lower prefetch.depth to {max(lower)}" if lower else "")
        )
    _, slot, on_gpu = best
    homes = dict.fromkeys(on_gpu, "gpu")
    # On a CPU compute device the two memory tiers are the same RAM: what the device tier leaves unused is
    # lent to the host tier, so the budget is not lost to packing whole groups into two separate bins.
    gpu_left = gpu_cap - fixed - ring_slots * slot - sum(sizes[g] for g in on_gpu)
    cache = 0
    if experts:
        cache = min(cache_slots or max(gpu_left // eslot, MIN_CACHE_SLOTS), len(experts))
        if cache_slots is None and cache == len(experts):  # every expert fits: home them (no cache)
            homes.update(dict.fromkeys(experts, "gpu"))
            gpu_left -= sum(sizes[g] for g in experts)
            cache = 0
        elif not copy_to_device and cache_slots is None and caps.cpu is not None and sum(
                sizes[g] for g in stream if g not in homes) <= caps.cpu + gpu_left - host_reserve:
            cache = 0  # a CPU device whose RAM holds every expert reads them in place: lend the room instead
        elif not copy_to_device and caps.cpu is None:
            cache = 0
        gpu_left -= cache * eslot
    lent = 0 if copy_to_device else gpu_left

    # the host: rows-only groups first when there is no disk to take them, then the streamable rest;
    # two pinned staging slots come off the top when disk-homed groups must be copied to a CUDA device
    rest = ([] if caps.has_disk else sorted(rows)) + [g for g in stream if g not in homes]
    cpu_cap = None if caps.cpu is None else caps.cpu + lent - host_reserve
    if cpu_cap is not None and cpu_cap < 0:
        raise CapacityError(f"the cpu tier ({fmt_bytes(caps.cpu)}) cannot hold the cold KV blocks "
                            f"({fmt_bytes(host_reserve)}); raise tiers.cpu.capacity or lower kv_cache.cpu_blocks")
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
                f"the model ({fmt_bytes(total)}) does not fit in gpu {fmt_bytes(gpu_cap)} + cpu {fmt_bytes(caps.cpu)} "
                f"and there is no disk tier; add tiers.disk (a directory for the store) or raise tiers.cpu.capacity "
                f"to at least {fmt_bytes(sum(sizes[g] for g in rest) - lent)} (with tiers.gpu.capacity at least "
                f"{fmt_bytes(fixed + ring_slots * largest)})"
            )
        rest = on_cpu
        homes.update(dict.fromkeys(left, "disk"))
    homes.update(dict.fromkeys(rest, "cpu"))
    for g in rows:  # rows-only groups go to the slowest tier there is
        homes.setdefault(g, "disk")
    result = plan(homes, slot, stage, lent, cache)
    check_disk(caps, total, disk_reserve)
    return result


def _in_place_plan(groups: Sequence[GroupSpec], caps: Capacities, depth: int, kv_bytes: int, workspace_bytes: int,
                   host_reserve: int, disk_reserve: int) -> Plan:
    """A CPU compute device: the gpu and cpu tiers are the same RAM and compute reads both in place, so only
    disk-homed groups stream, and the ring is sized by them alone (no ring when RAM holds every group). Among
    the ring sizes (none first), the one that keeps the most bytes in RAM; the device tier takes the largest
    of those, the host tier the rest (the device's unused bytes are lent to it)."""
    order = tuple(g.name for g in groups)
    fixed = kv_bytes + workspace_bytes
    sizes = {g.name: g.nbytes for g in groups}
    rows = [g.name for g in groups if g.rows_only]
    stream = [g.name for g in groups if not g.rows_only]
    gpu_cap = caps.gpu
    assert gpu_cap is not None
    host = math.inf if caps.cpu is None else caps.cpu - host_reserve
    if host < 0:
        raise CapacityError(f"the cpu tier ({fmt_bytes(caps.cpu)}) cannot hold the cold KV blocks "
                            f"({fmt_bytes(host_reserve)}); raise tiers.cpu.capacity or lower kv_cache.cpu_blocks")
    in_ram = stream if caps.has_disk else stream + rows  # without a disk every group lives in RAM
    best: tuple[int, int, list[str]] | None = None  # (bytes in RAM, slot size, groups in RAM)
    for slot in [0] + (sorted({sizes[g] for g in stream}, reverse=True) if caps.has_disk else []):
        device = gpu_cap - fixed - (depth + 1) * slot
        room = device + host
        must = [g for g in in_ram if sizes[g] > slot]  # what cannot pass through the ring stays in RAM
        if device < 0 or sum(sizes[g] for g in must) > room:
            continue
        homed = must + _fill([g for g in in_ram if sizes[g] <= slot], sizes, int(min(room, 2**62)) - sum(
            sizes[g] for g in must))
        score = sum(sizes[g] for g in homed)
        if slot == 0 and len(homed) < len(in_ram):
            continue  # without a ring every group must be in RAM
        if best is None or score > best[0]:
            best = (score, slot, homed)
    if best is None:
        need = min_device_bytes(groups, depth, fixed, 0, True, None if caps.cpu is None else int(host), caps.has_disk)
        if not caps.has_disk:
            raise CapacityError(
                f"the model ({fmt_bytes(sum(sizes.values()))}) does not fit in gpu {fmt_bytes(gpu_cap)} + cpu "
                f"{fmt_bytes(caps.cpu)} of RAM (the same memory on a CPU device) and there is no disk tier; add "
                f"tiers.disk (a directory for the store) or raise tiers.gpu.capacity to at least {fmt_bytes(need)}")
        raise CapacityError(
            f"the gpu tier ({fmt_bytes(gpu_cap)}) cannot hold the KV blocks and workspace ({fmt_bytes(fixed)}) plus "
            f"{depth + 1} ring slots; raise tiers.gpu.capacity to at least {fmt_bytes(need)}")
    _, slot, homed = best
    device = gpu_cap - fixed - (depth + 1) * slot
    on_gpu = _fill(homed, sizes, device)
    homes = dict.fromkeys(on_gpu, "gpu")
    homes.update({g: "cpu" for g in homed if g not in homes})
    for g in order:  # what RAM does not hold streams from disk; rows-only groups take the slowest tier
        homes.setdefault(g, "disk")
    lent = device - sum(sizes[g] for g in on_gpu)
    p = Plan(order, sizes, homes, depth, 0, 0, 0, 0, False, caps, {}, frozenset(rows))
    slot = max((sizes[g] for g in p.streamed), default=0)
    n_ring = depth + 1 if p.streamed else 0
    reserved = {"kv": kv_bytes, "workspace": workspace_bytes, "ring": n_ring * slot}
    result = Plan(order, sizes, homes, depth, n_ring, slot, 0, 0, False, caps, reserved, frozenset(rows),
                  lent, host_reserve, disk_reserve)
    total = sum(sizes.values())
    check_disk(caps, total, disk_reserve)
    return result


def check_disk(caps: Capacities, total: int, disk_reserve: int) -> None:
    """CapacityError unless the store (and the KV slot file) fit `tiers.disk.capacity`."""
    if caps.has_disk and caps.disk is not None and total + disk_reserve > caps.disk:
        need = fmt_bytes(total + disk_reserve)
        raise CapacityError(
            f"the store{' and the KV slot file' if disk_reserve else ''} need{'' if disk_reserve else 's'} {need} "
            f"but tiers.disk.capacity is {fmt_bytes(caps.disk)}; raise it to at least {need}")
