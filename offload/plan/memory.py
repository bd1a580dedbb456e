"""What memory a run may use on this machine: tier capacities with `auto` resolved, the RAM a CPU device shares
between its gpu and cpu tiers, and the KV cache's settings with `auto` resolved. Reads the machine (psutil,
torch.cuda), never a model's weights.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import psutil
import torch

from offload.config import OffloadConfig, TiersConfig
from offload.errors import ConfigError
from offload.kv.blocks import KVSettings
from offload.model import fused
from offload.model.config import ModelConfig
from schedulers.plan import Capacities, Plan
from storage.errors import CapacityError
from storage.units import fmt_bytes

log = logging.getLogger(__name__)

#: the packed weight formats the CPU kernels compute with (a calibration times each, unless told fewer)
PACKED = ("int8", "int4")


def packed_kernels(config: OffloadConfig) -> tuple[str, ...]:
    """The packed formats whose CPU kernels the run computes with: the weights', a self-int draft's."""
    used = {config.weights.quantization, config.speculative.draft.removeprefix("self-")}
    return tuple(s for s in PACKED if s in used)


_told: set[int] = set()  # the compile reserve `run_capacities` has told of (the first a process holds)
#: does this process compile the CPU kernels in child processes before its runner plans (the command line's runs:
#: `cli.prepare.before_run`; `offload plan`, which predicts them)? Its plans then keep no room for compiling
_apart: list[bool] = [False]


def compile_apart(on: bool) -> None:
    """Plan this process's runs as compiling the CPU kernels in child processes first (`on`), or in the process,
    keeping room for it (`run_capacities`; a Runner made in Python, or a run whose compiling child failed)."""
    _apart[0] = on


def run_capacities(config: OffloadConfig, device: torch.device, tell: bool = True) -> Capacities:
    """The run's tier capacities (`resolve_capacities`): on a CPU device, `auto` tiers leave free what this install's
    first run still compiles in its own process (`fused.compile_reserve`; none where it compiles them in children
    first: `compile_apart`). numba keeps that for the process's life: a cold first run of a 1.7B int4 with a
    1563-token prompt in a 1.5 GiB cgroup filled it without the reserve, 1.07 tok/s; with it, peak 1.44 GB, 1.34
    tok/s. Says so (`tell`) once a process, for the run's own plan, not for another weight format's
    (`offload plan`'s table, whose reserve is not this run's)."""
    tiers, held = config.tiers, 0
    if device.type == "cpu" and tiers is not None and (tiers.gpu.capacity is None or tiers.cpu.capacity is None) \
            and not _apart[0]:
        held = fused.compile_reserve(bool(packed_kernels(config)))
        if held and tell and not _told:  # (a command may plan more than once: the first is the run's own)
            _told.add(held)
            log.warning("this install's CPU kernels are not compiled yet: this run compiles them (about a minute) "
                        "and keeps %s of RAM for it, which the auto tiers leave free (later runs home weights there)",
                        fmt_bytes(held))
    return resolve_capacities(tiers, device, held)


def resolve_capacities(tiers: TiersConfig | None, device: torch.device, held: int = 0) -> Capacities:
    """Bytes per tier; `auto` becomes what this machine has free: 0.9 of the GPU's free memory, 0.8 of the RAM
    this process may fill (its memory cgroup's room if that is less) beyond `held` bytes. On a CPU device the gpu
    and cpu tiers are one RAM: an `auto` tier gets what the other leaves of it, and with both `auto` the device
    tier takes it all (layers homed there are computed in place)."""
    if tiers is None:
        return Capacities(gpu=None, cpu=None, disk=None, has_disk=False)
    gpu, cpu = tiers.gpu.capacity, tiers.cpu.capacity
    if gpu is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        gpu = int(free * 0.9)
    given_up = 0
    if device.type == "cpu" and (gpu is None or cpu is None):
        free = ram_available()
        room = int(max(free - held, 0) * 0.8)
        given_up = int(free * 0.8) - room
        if gpu is None:
            gpu = max(room - (cpu or 0), 0)
        if cpu is None:
            cpu = max(room - gpu, 0)
    if cpu is None:
        cpu = int(ram_available() * 0.8)
    disk = tiers.disk
    return Capacities(gpu=gpu, cpu=cpu, disk=None if disk is None else disk.capacity, has_disk=disk is not None,
                      held=given_up)


def release_held(caps: Capacities, tiers: TiersConfig, nbytes: int | None = None) -> Capacities:
    """caps with what `resolve_capacities` held back (or `nbytes` of it) given to the auto tier it came from (the
    gpu tier where both are auto), for a plan that cannot fit without it."""
    give = caps.held if nbytes is None else min(nbytes, caps.held)
    if tiers.gpu.capacity is None:
        return dataclasses.replace(caps, gpu=caps.gpu + give, held=caps.held - give)
    return dataclasses.replace(caps, cpu=caps.cpu + give, held=caps.held - give)


def ram_available() -> int:
    """Bytes of RAM this process may still fill (what a CPU device's gpu and cpu tiers share): the machine's
    available memory, or less inside a memory cgroup (a container, a systemd scope, a job's limit)."""
    free = int(psutil.virtual_memory().available)
    room = cgroup_room()
    return free if room is None else min(free, room)


CGROUP = Path("/sys/fs/cgroup")


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP) -> int | None:
    """What this process's memory cgroup has left before its limit (the tightest of it and its ancestors),
    reclaimable page cache counted as room; None without a limit (or on a machine without cgroups)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1: the memory hierarchy's own mount
            return _room(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    for line in lines:
        if line.startswith("0::"):  # cgroup v2: one hierarchy
            return _room(root, line[3:], "memory.max", "memory.current", "inactive_file")
    return None


def _room(mount: Path, path: str, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    best = None
    cg = mount / path.strip("/")
    while True:
        try:
            limit = (cg / limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as ~2^63
                stat = dict(x.split() for x in (cg / "memory.stat").read_text().splitlines() if x.strip())
                used = int((cg / usage_file).read_text()) - int(stat.get(cache_key, stat.get("inactive_file", 0)))
                room = max(int(limit) - used, 0)
                best = room if best is None else min(best, room)
        except (OSError, ValueError):
            pass
        if cg == mount or mount not in cg.parents:
            return best
        cg = cg.parent


def check_ram(plan: Plan) -> None:
    """On a CPU device the gpu and cpu tiers are one RAM: a plan that uses more of it than the machine has free
    is refused before anything is allocated (the placement itself only knows the configured capacities)."""
    need, free = plan.used("gpu") + plan.used("cpu"), ram_available()
    if need > free:
        raise CapacityError(
            f"this plan needs {fmt_bytes(need)} of RAM (on a CPU device the gpu and cpu tiers are both this machine's "
            f"RAM: {fmt_bytes(plan.used('gpu'))} + {fmt_bytes(plan.used('cpu'))}) but {fmt_bytes(free)} is free"
            + (" to this process (its memory cgroup's limit)" if cgroup_room() is not None else "")
            + "; lower tiers.gpu.capacity / tiers.cpu.capacity (or set them to auto) or kv_cache.gpu_blocks / "
            "cpu_blocks" + ("" if plan.capacities.has_disk else ", or add tiers.disk"))


def resolve_kv(config: OffloadConfig, cfg: ModelConfig, device: torch.device, links: dict[str, float]) -> KVSettings:
    """The KV cache's settings with every `auto` resolved and impossible combinations refused; `links` are the
    calibrated bytes per second of this machine's links (`Calibration.links`)."""
    kv = config.kv_cache
    restore = config.activations.kv_restore
    if restore == "auto":  # keep whichever is fewer bytes: the layer inputs, or K and V
        restore = "recompute" if cfg.hidden_size < 2 * cfg.kv_size else "transfer"
    if restore == "recompute" and kv.quantization == "int8":
        raise ConfigError("kv_cache.quantization: int8 applies to K/V; with activations.kv_restore: recompute the "
                          "cold blocks hold layer inputs instead. Choose one of the two")
    if (kv.cpu_blocks or kv.disk_blocks) and config.tiers is None:
        raise ConfigError("kv_cache.cpu_blocks / disk_blocks need a `tiers:` section (their memory is counted "
                          "in tiers.cpu.capacity, their file lives under tiers.disk.path)")
    if kv.prefix_cache == "persist" and (config.tiers is None or config.tiers.disk is None):
        raise ConfigError("kv_cache.prefix_cache: persist keeps blocks under tiers.disk.path; add a disk tier or "
                          "use prefix_cache: on")
    if kv.disk_blocks and config.tiers.disk is None:
        raise ConfigError("kv_cache.disk_blocks needs tiers.disk (a directory for the KV slot file)")
    cpu_attention = kv.cpu_attention
    if cpu_attention is None:  # FlexGen's choice: read host blocks where they are when RAM beats the link
        if device.type == "cuda":
            cpu_attention = links["memcpy"] > links["host->device"]
        else:
            cpu_attention = False  # on a CPU device host blocks are attended in place anyway
    disk = config.tiers.disk if config.tiers else None
    return KVSettings(block_size=kv.block_size, gpu_blocks=kv.gpu_blocks or 0, cpu_blocks=kv.cpu_blocks or 0,
                      disk_blocks=kv.disk_blocks or 0, eviction=kv.eviction, idle_seconds=kv.idle_seconds,
                      quantization=kv.quantization, restore=restore, cpu_attention=cpu_attention,
                      direct_io=bool(disk and disk.direct_io and not disk.page_cache),
                      prefix_cache=kv.prefix_cache, persist_blocks=kv.prefix_disk_blocks)
