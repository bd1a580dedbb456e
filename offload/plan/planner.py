"""The planner: from the config's capacities and the model's shape to a `RunPlan`, every `auto` resolved.

A `RunPlan` is what a run needs decided before it allocates anything: the placement plan
(`schedulers.plan.Plan`, made by `offload.plan.placement`: each group's home tier, the ring, the staging
slots), the KV cache's settings and device blocks, and how an automatic prefetch depth was chosen. It is
made from the config and `config.json` alone: no weights are read, no GPU memory is touched,
so `offload plan` can plan for machines we do not have. The runtime executes the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.kv.blocks import KVSettings
from offload.kv.cache import PagedKVCache
from offload.kv.fetch import host_bytes, stage_blocks
from offload.kv.formats import ColdFormat
from offload.model import cpu_attention
from offload.model.config import ModelConfig
from offload.plan import memory
from offload.plan.calibrate import Calibration, compute_dtype, load_calibration
from offload.plan.experts import plan_experts
from offload.plan.memory import resolve_capacities as resolve_capacities
from offload.plan.memory import resolve_kv
from offload.plan.memory import run_capacities as run_capacities
from offload.plan.passes import ATTENTION_KEYS_PER_CHUNK, batch_rows, pass_blocks, workspace_bytes
from offload.plan.placement import GroupSpec, make_plan, min_device_bytes
from offload.plan.predict import Workload, compute_sizes, predict_decode
from offload.weights.groups import WeightFormat, model_layouts
from schedulers.plan import Capacities, Plan
from storage.errors import CapacityError
from storage.units import blocks_for, config_size, fmt_bytes

log = logging.getLogger(__name__)

#: KV tokens the device keeps room for when kv_cache.gpu_blocks is auto and tiers are set (if they fit).
AUTO_KV_TOKENS = 2048
#: prefill chunks an automatic activations.prefill_chunk tries, largest first; the last is the stated minimum.
AUTO_CHUNKS = (512, 256, 128, 64, 32, 16)
#: bounds of automatic cold KV tiers (kv_cache.cpu_blocks / disk_blocks: auto), in tokens.
AUTO_HOST_KV_TOKENS = 16384
AUTO_DISK_KV_TOKENS = 65536


@dataclass(frozen=True)
class Fit:
    """One depth's plan and what the device keeps beside the weights."""

    plan: Plan
    prefill_chunk: int  # prompt tokens per pass (the workspace is sized for it)
    kv_blocks: int  # device KV blocks reserved before weights are homed (0: sized per request)


@dataclass(frozen=True)
class RunPlan:
    """The placement plan plus the KV pool and the prefill chunk it leaves room for."""

    plan: Plan
    caps: Capacities
    kv_blocks: int  # blocks in the device pool; 0 = sized per request (no tiers, gpu_blocks auto)
    kv_block_bytes: int
    kv: KVSettings  # the KV cache's settings, every `auto` resolved (cpu_blocks / disk_blocks included)
    prefill_chunk: int  # activations.prefill_chunk resolved
    depth_note: str = ""  # how an automatic depth was chosen
    compute_dtype: torch.dtype = torch.float32  # compute_dtype resolved: the math and the KV cache
    concurrency: int = 1  # sequences the command wants decoded together (the workload the plan was made for)

    @property
    def batch(self) -> int | None:
        """Sequences the device pool keeps decoding together (None: the pool is sized per request)."""
        return batch_rows(self.kv_blocks, self.prefill_chunk, self.kv.block_size) if self.kv_blocks else None


class Planner:
    """Plans for one config and model: homes for given capacities and depth, and the automatic depth.

    `auto` means fit: an automatic prefill chunk and device KV pool shrink (down to one chunk of
    `AUTO_CHUNKS[-1]` tokens and its blocks plus one) until the ring fits beside them; explicit
    values are kept as given. A plan that cannot fit even at the minimum is refused with every
    knob that would make it fit and the value it would need (`refusal`).

    `concurrency`: the sequences the command decodes together (1: `run` with prompts, the Python API; `serve
    --max-batch`, `run --input --batch`). Above one, an automatic device pool first keeps that many running (each
    pins its newest block, the rest of its KV in the host/disk tiers; halved down to two), shrinking the chunk for
    them. What the device has left joins the pool, up to what the workload can use: `concurrency` contexts of
    `context` tokens where the command knows it (`offload run`: prompt and new tokens), else the model's."""

    def __init__(self, config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 caps: Capacities | None = None, layers: range | None = None, concurrency: int = 1,
                 context: int | None = None) -> None:
        self.config, self.cfg, self.dtype, self.device = config, cfg, dtype, device
        self.context = context  # None: the model's context
        self.layers = range(cfg.num_layers) if layers is None else layers  # a pipeline stage plans its slice
        self.planes = len(self.layers)  # layers a KV block holds on this stage
        self.concurrency = max(1, concurrency)
        kv_cfg = config.kv_cache
        self.bs = kv_cfg.block_size
        self.cal = load_calibration(config.calibration)
        self.kv = resolve_kv(config, cfg, device, self.cal.links)
        self.fmt = WeightFormat.from_config(config.weights, cfg)
        # the compute dtype is a property of the machine, not of the placement: every placement computes alike
        # (the same tokens as the all-in-memory run); only a float32 plan that cannot fit falls back (run_plan)
        self.upcast = compute_dtype(config.compute_dtype, dtype, device, self.fmt.quantization != "none")
        self._set_compute(self.upcast)
        self.caps = caps or run_capacities(config, device)
        self.fmt.check(cfg)
        # a first stage without the head reads a tied head (the embeddings) by rows only
        rows = {"embed"} | ({"head"} if self.layers.stop < cfg.num_layers else set())
        self.groups = [GroupSpec(name, layout.nbytes, rows_only=name in rows, expert=".expert." in name)
                       for name, layout in model_layouts(cfg, dtype, self.fmt, self.layers).items()]
        #: bytes the math reads per group at the compute rate (packed ones scaled by their calibrated speed)
        self.compute_sizes = compute_sizes(cfg, dtype, self.fmt, self.cal, device.type, self.groups)
        self.chunks = self._chunk_choices()

    def _set_compute(self, dtype: torch.dtype) -> None:
        """The compute dtype, and the KV block sizes that follow from it."""
        kv_cfg, self.compute = self.config.kv_cache, dtype
        self.block_bytes = PagedKVCache.block_nbytes(self.cfg, kv_cfg.block_size, dtype, self.kv.restore,
                                                    self.planes)
        self.cold_fmt = ColdFormat.for_config(self.cfg, kv_cfg.block_size, dtype, self.kv.quantization,
                                              self.kv.restore)
        self.cold_block_bytes = self.cold_fmt.block_nbytes(self.planes)
        self.kv_cpu_bytes = (kv_cfg.cpu_blocks or 0) * self.cold_block_bytes  # explicit ones; auto: what is left
        self.kv_disk_bytes = (kv_cfg.disk_blocks or 0) * self.cold_block_bytes

    def _chunk_choices(self) -> tuple[int, ...]:
        """The prefill chunks to try, largest first: the explicit one, or the automatic ones the KV pool allows."""
        chunk, blocks = self.config.activations.prefill_chunk, self.config.kv_cache.gpu_blocks
        limit = None if blocks is None else (blocks - 1) * self.bs + 1  # a pass writes at most this many tokens
        if chunk is not None:
            if limit is not None and chunk > limit:
                need = blocks_for(chunk - 1, self.bs) + 1  # the chunk's blocks when it starts inside a partial block
                raise ConfigError(
                    f"activations.prefill_chunk: {chunk} can need {need} device KV blocks in a pass but "
                    f"kv_cache.gpu_blocks is {blocks}; lower prefill_chunk to at most {limit} (or auto), or raise "
                    f"gpu_blocks to at least {need} (or auto)")
            return (chunk,)
        top = self.config.activations.prefill_chunk_max
        auto = (top, *(c for c in AUTO_CHUNKS if c < top))
        if self.context is not None:  # no larger than the one pass the workload's longest prompt needs
            auto = tuple(c for c in auto if c <= min((c for c in auto if c >= self.context), default=top))
        if limit is None:
            return auto
        return tuple(sorted({min(c, max(limit - 1, 1)) for c in auto}, reverse=True))

    def _kv_choices(self, chunk: int) -> list[int]:
        """Device KV blocks to try: the explicit count, 0 (per request), or 2048 tokens (or `context`) then least."""
        blocks = self.config.kv_cache.gpu_blocks
        if blocks is not None:
            return [blocks]
        if self.config.tiers is None:
            return [0]
        least = pass_blocks(chunk, self.bs)  # a chunk's blocks plus the newest block of the sequence
        tokens = AUTO_KV_TOKENS if self.context is None else min(AUTO_KV_TOKENS, self.context + self.bs)
        return sorted({max(blocks_for(tokens, self.bs), least), least}, reverse=True)

    def _choices(self) -> Iterator[tuple[int, int]]:
        """(prefill chunk, device KV blocks) to try, best first: with a concurrent workload and an automatic
        pool, `concurrency` running sequences (halved down to two) beside the largest chunk that fits them;
        then the largest chunk with the blocks `_kv_choices` gives."""
        if self.concurrency > 1 and self.config.kv_cache.gpu_blocks is None and self.config.tiers is not None:
            rows = self.concurrency
            while rows > 1:
                for chunk in self.chunks:
                    yield chunk, max(pass_blocks(chunk, self.bs) + rows, self._kv_choices(chunk)[-1])
                rows //= 2
        for chunk in self.chunks:
            for kv_blocks in self._kv_choices(chunk):
                yield chunk, kv_blocks

    def kv_bound(self, chunk: int, context: int | None = None) -> int:
        """The most device KV blocks the workload can use: a pass's and `concurrency` sequences' of `context` tokens."""
        return pass_blocks(chunk, self.bs) + self.concurrency * blocks_for(context or self.cfg.max_position_embeddings,
                                                                           self.bs)

    def _make(self, caps: Capacities, depth: int, chunk: int, kv_blocks: int) -> Plan:
        ws = self.workspace(chunk)
        plan = make_plan(self.groups, caps, depth, kv_bytes=kv_blocks * self.block_bytes, workspace_bytes=ws,
                         copy_to_device=self.device.type == "cuda", host_reserve=self.kv_cpu_bytes,
                         disk_reserve=self.kv_disk_bytes, cache_slots=self.config.experts.cache)
        return plan_experts(plan, self.cfg, self.cal, self.config.experts.compute, self.compute_sizes)

    def workspace(self, chunk: int, dtype: torch.dtype | None = None) -> int:
        """A pass's activations at the compute dtype (or `dtype`, weights and math alike; no scores where a CPU
        kernel attends), and with weights upcast after the transfer, the largest group's upcast copy."""
        compute = dtype or self.compute
        scores = not (self.kv.eviction != "attention" and cpu_attention.attends(self.device.type, compute))
        ws = workspace_bytes(self.cfg, chunk, compute, ATTENTION_KEYS_PER_CHUNK * chunk, scores)
        if dtype is None and self.compute != self.dtype:
            ws += max(self.compute_sizes.values()) * self.compute.itemsize // self.dtype.itemsize
        return ws

    def _min_device(self, groups: list[GroupSpec], caps: Capacities, depth: int, fixed: int) -> int:
        """The smallest device tier for these groups (on a CPU device the host tier's groups are read in place)."""
        cache = self.config.experts.cache
        if self.device.type == "cuda":
            return min_device_bytes(groups, depth, fixed, cache)
        host = None if caps.cpu is None else max(caps.cpu - self.kv_cpu_bytes, 0)
        if host == 0 or any(g.expert for g in groups):  # no RAM beside the device tier; experts: their cache
            return min_device_bytes(groups, depth, fixed, cache)
        return min(min_device_bytes(groups, depth, fixed, cache),  # the usual plan, else RAM in place
                   min_device_bytes(groups, depth, fixed, cache, True, host, caps.has_disk))

    def fit(self, caps: Capacities, depth: int) -> Fit:
        """The largest prefill chunk and device KV pool (among the allowed ones) a plan at this depth fits beside."""
        for chunk, kv_blocks in self._choices():
            fixed = kv_blocks * self.block_bytes + self.workspace(chunk)
            if caps.gpu is None or self._min_device(self.groups, caps, depth, fixed) <= caps.gpu:
                return Fit(self._make(caps, depth, chunk, kv_blocks), chunk, kv_blocks)  # host errors raise here
        raise self.refusal(caps, depth)

    def smallest(self, caps: Capacities, depth: int, chunk: int | None = None, kv: int | None = None,
                 dtype: torch.dtype | None = None) -> int:
        """Device bytes of the smallest plan at this depth: the smallest chunk and KV pool unless given, weights
        moving as `dtype`."""
        chunk = self.chunks[-1] if chunk is None else chunk
        dtype = dtype or self.dtype
        kv = self._kv_choices(chunk)[-1] if kv is None else kv
        groups = [dataclasses.replace(g, nbytes=g.nbytes * dtype.itemsize // self.dtype.itemsize) for g in self.groups]
        fixed = kv * self.block_bytes * dtype.itemsize // self.dtype.itemsize + self.workspace(
            chunk, None if dtype == self.dtype else dtype)
        return self._min_device(groups, caps, depth, fixed)

    def refusal(self, caps: Capacities, depth: int) -> CapacityError:
        """Why the device tier cannot hold even the smallest plan at this depth, naming every knob that would help."""
        assert caps.gpu is not None
        chunk, gpu, bs = self.chunks[-1], caps.gpu, self.bs
        explicit_kv = self.config.kv_cache.gpu_blocks

        def need(depth: int = depth, chunk: int = chunk, kv: int | None = None, dtype: torch.dtype = self.dtype) -> int:
            return self.smallest(caps, depth, chunk, kv, dtype)

        helps = [f"tiers.gpu.capacity: {config_size(need())}"]
        tiers = self.config.tiers
        if self.device.type == "cpu" and tiers is not None and tiers.gpu.capacity is None:  # auto: the RAM is short
            ram = math.ceil((need() + (tiers.cpu.capacity or 0)) / 0.8)
            helps[0] = (f"{config_size(ram)} of free RAM (this process has {fmt_bytes(memory.ram_available())}, and "
                        "an auto gpu tier is 0.8 of it): close programs or raise the memory limit")
        if self.device.type == "cpu" and not caps.has_disk:  # RAM must hold every group: a store lifts that
            helps.insert(0, "tiers.disk: {path: DIR} (there is no disk tier; add tiers.disk and what RAM cannot "
                            "hold streams from a store there)")
        if any(need(depth=d) <= gpu for d in range(depth)):
            helps.append(f"prefetch.depth: {max(d for d in range(depth) if need(depth=d) <= gpu)}")
        least = blocks_for(chunk, bs) + 1
        if explicit_kv is not None and need(kv=least) <= gpu:
            most = (gpu - need(kv=0)) // self.block_bytes
            helps.append(f"kv_cache.gpu_blocks: {most} (or auto)")
        if self.config.activations.prefill_chunk is not None:
            smaller = [c for c in AUTO_CHUNKS if c < chunk and need(chunk=c, kv=explicit_kv) <= gpu]
            if smaller:
                helps.append(f"activations.prefill_chunk: {smaller[0]} (or auto)")
        if self.dtype.itemsize == 4 and need(dtype=torch.bfloat16) <= gpu:
            helps.append("dtype: bfloat16")
        kv = self._kv_choices(chunk)[-1]
        return CapacityError(
            f"the gpu tier ({fmt_bytes(gpu)}{' of RAM' if self.device.type == 'cpu' else ''}) cannot hold the "
            f"smallest plan at prefetch depth {depth} ({depth + 1} ring slots, a prefill chunk of {chunk} tokens and "
            f"{kv} device KV blocks need {fmt_bytes(need())}); any one of these fits: " + "; ".join(helps))

    def placement(self, caps: Capacities, depth: int) -> Plan:
        """Homes, ring and staging for these capacities and depth (CapacityError if they cannot fit)."""
        return self.fit(caps, depth).plan

    def choose_depth(self, cal: Calibration, work: Workload) -> tuple[int, str]:
        """The depth (0..6) with the fastest predicted decode step; ties go to the smaller ring."""
        best: tuple[float, int] | None = None
        tried = []
        for depth in range(7):
            try:
                plan = self.placement(self.caps, depth)
            except CapacityError:
                break
            step = predict_decode(plan, self.cfg, cal, self.device.type, work, self.dtype.itemsize,
                                  self.compute_sizes).step_s
            tried.append(f"{depth}: {1000 * step:.0f} ms")
            if best is None or step < best[0] * 0.99:
                best = (step, depth)
            if not plan.streamed:
                break
        if best is None:
            self.placement(self.caps, 0)  # raises the CapacityError that explains what would fit
        return best[1], f"depth auto -> {best[1]} (predicted decode step by depth: {', '.join(tried)})"

    def run_plan(self) -> RunPlan:
        """The plan for the config's own capacities and depth (an automatic depth chosen by the cost model). Where
        the RAM `run_capacities` kept for a first run's compiling leaves no room for the smallest plan, the plan
        takes it back (before computing in a narrower dtype: that would change the tokens)."""
        if not self.caps.held:
            return self._run_plan(fallback=True)
        try:
            return self._run_plan(fallback=False)
        except CapacityError:
            log.warning("the RAM kept for compiling the CPU kernels leaves no room for the plan: this first run takes "
                        "what its smallest plan needs of it, and may be stopped for memory while it compiles (later "
                        "runs fit)")
        caps, tiers = self.caps, self.config.tiers
        short = max(self.smallest(caps, self.config.prefetch.depth or 0) - caps.gpu, 0)
        least = memory.release_held(caps, tiers, short if tiers.gpu.capacity is None else None)
        for self.caps in dict.fromkeys((least, memory.release_held(caps, tiers))):  # then all (a deeper ring, say)
            with contextlib.suppress(CapacityError):
                return self._run_plan(fallback=False)
        return self._run_plan(fallback=True)  # in float32's place: the model's dtype, or the refusal

    def _run_plan(self, fallback: bool) -> RunPlan:
        """`run_plan` with the capacities as they are; `fallback`: a float32 plan that cannot fit computes in dtype."""
        depth, note = self.config.prefetch.depth, ""
        if depth is None:
            cal = load_calibration(self.config.calibration)
            depth, note = self.choose_depth(cal, Workload(prefill_chunk=self.chunks[0]))
        try:
            fit = self.fit(self.caps, depth)
        except CapacityError:
            if not fallback or self.compute == self.dtype or self.config.compute_dtype != "auto":
                raise
            self._set_compute(self.dtype)  # auto: fit what there is, in dtype
            fit = self.fit(self.caps, depth)
            log.warning("compute_dtype auto: a float32 plan does not fit these tiers, so this run computes in %s "
                        "(its tokens can differ from an all-in-memory run's, which computes in float32 on this "
                        "CPU); set compute_dtype to choose", str(self.dtype).removeprefix("torch."))
        plan, kv_blocks = fit.plan, fit.kv_blocks
        if self.config.kv_cache.gpu_blocks is None and self.config.tiers is not None and self.caps.gpu is not None:
            free = max(plan.capacity("gpu") - plan.used("gpu"), 0)  # what is left free, up to what the workload uses
            if self.device.type == "cpu":  # the device tier is this machine's RAM: never more than it has
                free = min(free, max(memory.ram_available() - self.caps.held - plan.used("gpu") - plan.used("cpu"), 0))
            most = self.kv_bound(fit.prefill_chunk, self.context)
            if self.caps.kv_blocks is not None:  # a speculative draft keeps one block for every block of the target
                most = min(most, self.caps.kv_blocks)
            kv_blocks = max(kv_blocks, min(kv_blocks + free // self.block_bytes, most))
            plan = dataclasses.replace(plan, reserved_gpu={**plan.reserved_gpu, "kv": kv_blocks * self.block_bytes})
        useful = self.kv_bound(fit.prefill_chunk) if self.caps.kv_blocks is None else min(
            self.kv_bound(fit.prefill_chunk), self.caps.kv_blocks)  # beside a draft: what its pool mirrors
        cpu_blocks, disk_blocks, piece = self._cold_blocks(plan, max(useful - kv_blocks, 0))
        host, stage = host_bytes(self.cold_fmt, self.planes, cpu_blocks, piece)
        plan = dataclasses.replace(plan, host_reserve=host, kv_stage_bytes=stage,
                                   disk_reserve=disk_blocks * self.cold_block_bytes)
        kv = dataclasses.replace(self.kv, cpu_blocks=cpu_blocks, disk_blocks=disk_blocks, stage_blocks=piece)
        if self.device.type == "cpu":
            memory.check_ram(plan)
        return RunPlan(plan, self.caps, kv_blocks, self.block_bytes, kv, fit.prefill_chunk, note, self.compute,
                       self.concurrency)

    def _cold_blocks(self, plan: Plan, useful: int) -> tuple[int, int, int]:
        """(kv_cache.cpu_blocks, disk_blocks, blocks per KV staging buffer), `auto` resolved: what the tier leaves
        free, within a bound and within the `useful` blocks the workload could still fill beside the device pool
        (the host tier first). On CUDA (without cpu_attention) cold blocks cross to the device through two pinned
        staging buffers in the cpu tier (`offload.kv.fetch`), taken before auto host blocks: each of up to
        `STAGE_PIECE` bytes of blocks, shrunk to what the tier can hold, down to one block; where not even
        that fits, automatic cold tiers are none, explicit ones refused."""
        kv_cfg, tiers = self.config.kv_cache, self.config.tiers
        cpu_cap = plan.capacity("cpu")
        room = None if cpu_cap is None else cpu_cap - (plan.used("cpu") - plan.host_reserve)  # for cold KV bytes

        def fits(cpu: int, piece: int) -> bool:
            return room is None or host_bytes(self.cold_fmt, self.planes, cpu, piece)[0] <= room

        def most(bound: int, ok) -> int:
            """The largest n in [0, bound] with ok(n) (ok holds for every smaller n too)."""
            lo, hi = 0, bound
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
            return lo

        cpu_bound = kv_cfg.cpu_blocks if kv_cfg.cpu_blocks is not None else (
            0 if tiers is None else min(blocks_for(AUTO_HOST_KV_TOKENS, self.bs), useful))
        disk = kv_cfg.disk_blocks
        if disk is None:  # trimmed below to what the host tier leaves of the useful blocks
            cap = plan.capacity("disk")
            bound = min(blocks_for(AUTO_DISK_KV_TOKENS, self.bs), useful)
            disk = 0 if tiers is None or tiers.disk is None else (
                bound if cap is None else min(bound, max(cap - plan.used("disk"), 0) // self.cold_block_bytes))
        piece = 0
        if self.device.type == "cuda" and not self.kv.cpu_attention and cpu_bound + disk:
            piece = most(stage_blocks(self.cold_fmt, cpu_bound + disk), lambda p: fits(kv_cfg.cpu_blocks or 0, p))
            if piece == 0 and not (kv_cfg.cpu_blocks or kv_cfg.disk_blocks):
                return 0, 0, 0  # automatic cold tiers with no room to bring a block to the device: none
        cpu = kv_cfg.cpu_blocks
        if cpu is None:
            cpu = most(cpu_bound, lambda n: fits(n, piece))
        if kv_cfg.disk_blocks is None:
            disk = min(disk, max(useful - cpu, 0))
        piece = piece if cpu + disk else 0
        if (cpu + disk and self.device.type == "cuda" and not self.kv.cpu_attention and piece == 0) or not fits(
                cpu, piece):
            host, stage = host_bytes(self.cold_fmt, self.planes, cpu, max(piece, 1))
            raise CapacityError(
                f"the cpu tier ({fmt_bytes(cpu_cap)}) cannot hold the cold KV blocks and the pinned staging they "
                f"cross to the device in ({fmt_bytes(host)}, of which staging {fmt_bytes(stage)}) beside the weights; "
                "raise tiers.cpu.capacity or lower kv_cache.cpu_blocks / disk_blocks")
        return cpu, disk, piece
