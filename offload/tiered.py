"""Weights over the tiers: plan the homes, fill them once, stream the rest through the prefetcher.

This is the runner's weight source. It turns the model into groups (`offload.weights`), asks
`schedulers.placement` for a plan from the YAML capacities, opens (or converts) the zarr
store when a disk tier is configured, fills every memory home once, and hands streaming to
`schedulers.prefetch`. With no `tiers:` section the plan is "everything on the device",
so the all-in-memory run is the same mechanism with nothing to stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from offload.checkpoint import Checkpoint, ModelConfig
from offload.config import OffloadConfig, TiersConfig
from offload.convert import open_store
from offload.kv_cache import KVSettings, PagedKVCache, kv_settings
from offload.kv_tiers import ColdFormat
from offload.weights import embedding_source, fill_group, model_layouts
from schedulers.placement import Capacities, GroupSpec, Plan, make_plan
from schedulers.prefetch import Prefetcher
from schedulers.timeline import Timeline
from schedulers.transfer import make_engine
from storage.store import Store
from storage.tiers import DeviceTier, DiskTier, HostTier, MemoryTier, Tier

log = logging.getLogger(__name__)

#: KV tokens the device keeps room for when kv_cache.gpu_blocks is auto and tiers are set.
AUTO_KV_TOKENS = 2048


def resolve_capacities(tiers: TiersConfig | None, device: torch.device) -> Capacities:
    """Bytes per tier; `auto` becomes what this machine has free (unlimited device memory on a CPU run)."""
    if tiers is None:
        return Capacities(gpu=None, cpu=None, disk=None, has_disk=False)
    gpu = tiers.gpu.capacity
    if gpu is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        gpu = int(free * 0.9)
    cpu = tiers.cpu.capacity
    if cpu is None:
        cpu = int(psutil.virtual_memory().available * 0.8)
    disk = tiers.disk
    return Capacities(gpu=gpu, cpu=cpu, disk=None if disk is None else disk.capacity, has_disk=disk is not None)


def workspace_bytes(cfg: ModelConfig, chunk: int, dtype: torch.dtype) -> int:
    """Activation memory of one prefill pass of `chunk` tokens (an estimate, reserved on the device).

    Flat activations (residual, norm output, fused qkv, gate/up, attention output) at the
    compute dtype, float32 attention scores and probabilities over a context of one chunk,
    and float32 logits for a batch of up to 64 last tokens.
    """
    per_token = 3 * cfg.hidden_size + (cfg.q_size + 2 * cfg.kv_size) + 3 * cfg.intermediate_size + cfg.q_size
    scores = 3 * chunk * cfg.num_heads * chunk * 4
    logits = min(chunk, 64) * cfg.vocab_size * 4
    return chunk * per_token * dtype.itemsize + scores + logits


@dataclass(frozen=True)
class RunPlan:
    """The placement plan plus the KV pool it leaves room for."""

    plan: Plan
    caps: Capacities
    kv_blocks: int  # blocks in the device pool; 0 = sized per request (no tiers, gpu_blocks auto)
    kv_block_bytes: int
    kv: KVSettings  # the KV cache's settings, every `auto` resolved
    depth_note: str = ""  # how an automatic depth was chosen


class Planner:
    """Plans for one config and model: homes for given capacities and depth, and the automatic depth."""

    def __init__(self, config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 caps: Capacities | None = None) -> None:
        self.config, self.cfg, self.dtype, self.device = config, cfg, dtype, device
        kv_cfg = config.kv_cache
        self.kv = kv_settings(config, cfg, device)
        self.block_bytes = PagedKVCache.block_nbytes(cfg, kv_cfg.block_size, dtype, self.kv.restore)
        self.kv_blocks = kv_cfg.gpu_blocks or (-(-AUTO_KV_TOKENS // kv_cfg.block_size) if config.tiers else 0)
        cold = ColdFormat.for_config(cfg, kv_cfg.block_size, dtype, self.kv.quantization, self.kv.restore)
        self.kv_cpu_bytes = kv_cfg.cpu_blocks * cold.block_nbytes(cfg.num_layers)
        self.kv_disk_bytes = kv_cfg.disk_blocks * cold.block_nbytes(cfg.num_layers)
        self.caps = caps or resolve_capacities(config.tiers, device)
        self.groups = [GroupSpec(name, layout.nbytes, rows_only=(name == "embed"))
                       for name, layout in model_layouts(cfg, dtype).items()]
        self.workspace = workspace_bytes(cfg, config.activations.prefill_chunk, dtype)

    def plan(self, caps: Capacities, depth: int) -> Plan:
        return make_plan(self.groups, caps, depth, kv_bytes=self.kv_blocks * self.block_bytes,
                         workspace_bytes=self.workspace, copy_to_device=self.device.type == "cuda",
                         host_reserve=self.kv_cpu_bytes, disk_reserve=self.kv_disk_bytes)

    def choose_depth(self, cal, work) -> tuple[int, str]:
        """The depth (0..6) with the fastest predicted decode step; ties go to the smaller ring."""
        from offload.predict import predict_decode
        from storage.errors import CapacityError

        best: tuple[float, int] | None = None
        tried = []
        for depth in range(7):
            try:
                plan = self.plan(self.caps, depth)
            except CapacityError:
                break
            step = predict_decode(plan, self.cfg, cal, self.device.type, work, self.dtype.itemsize).step_s
            tried.append(f"{depth}: {1000 * step:.0f} ms")
            if best is None or step < best[0] * 0.99:
                best = (step, depth)
            if not plan.streamed:
                break
        if best is None:
            self.plan(self.caps, 0)  # raises the CapacityError that explains what would fit
        return best[1], f"depth auto -> {best[1]} (predicted decode step by depth: {', '.join(tried)})"

    def run_plan(self) -> RunPlan:
        depth, note = self.config.prefetch.depth, ""
        if depth is None:
            from offload.calibrate import Calibration
            from offload.predict import Workload

            cal = Calibration.load(self.config.calibration)
            depth, note = self.choose_depth(cal, Workload(prefill_chunk=self.config.activations.prefill_chunk))
        plan = self.plan(self.caps, depth)
        kv_blocks = self.kv_blocks
        if self.config.kv_cache.gpu_blocks is None and self.config.tiers is not None and self.caps.gpu is not None:
            kv_blocks += max(plan.capacity("gpu") - plan.used("gpu"), 0) // self.block_bytes  # what is left free
        return RunPlan(plan, self.caps, kv_blocks, self.block_bytes, self.kv, note)


def plan_run(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> RunPlan:
    """Plan homes and the KV pool from the config alone (reads no weights, touches no GPU memory)."""
    return Planner(config, cfg, dtype, device).run_plan()


class TieredWeights:
    """The runner's weight source over GPU, pinned RAM and the zarr store."""

    def __init__(self, config: OffloadConfig, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 timeline: Timeline, run_plan: RunPlan) -> None:
        self.cfg, self.device, self.dtype = ckpt.config, device, dtype
        self.timeline = timeline
        self.layouts = model_layouts(ckpt.config, dtype)
        self.caps = run_plan.caps
        self.plan = run_plan.plan
        embed_group, self._embed_tensor = embedding_source(ckpt.config)
        log.info("%s", self.plan.describe())
        self.store: Store | None = None
        tiers_cfg = config.tiers
        self.tiers: dict[str, Tier] = {
            "gpu": DeviceTier(self.plan.capacity("gpu"), device),
            "cpu": HostTier(self.plan.capacity("cpu"), pinned=tiers_cfg.cpu.pinned if tiers_cfg else True),
        }
        self.prefetcher: Prefetcher | None = None
        try:
            if tiers_cfg is not None and tiers_cfg.disk is not None:
                d = tiers_cfg.disk
                self.store = open_store(ckpt, d.path, dtype, capacity=d.capacity, page_cache=d.page_cache)
                self.tiers["disk"] = self.store.tier
            self._fill_homes(ckpt)
            for name in self.plan.rows_only:  # read by rows later: check the whole group once, now
                if self.plan.homes[name] == "disk":
                    with timeline.span("disk-read", name, nbytes=self.layouts[name].nbytes, verify=True):
                        self.store.tier.verify_region(name)
            ring = self._slots("gpu", "ring", self.plan.ring_slots, self.plan.ring_slot_bytes)
            stage = self._slots("cpu", "stage", self.plan.stage_slots, self.plan.stage_slot_bytes)
            self.prefetcher = Prefetcher(self.plan, self.tiers, make_engine(device), timeline, ring, stage)
        except BaseException:
            self.close()
            raise
        self._embed_group = embed_group
        self._embed_spec = self.layouts[embed_group].spec(self._embed_tensor)

    # -- set-up -------------------------------------------------------------------------------
    def _fill_homes(self, ckpt: Checkpoint) -> None:
        """Every group homed in memory gets its bytes once: from the store when there is one, else the checkpoint."""
        staging: torch.Tensor | None = None
        for name, layout in self.layouts.items():
            home = self.plan.homes[name]
            if home == "disk":
                continue
            tier = self.tiers[home]
            assert isinstance(tier, MemoryTier)
            tier.allocate(name, layout.nbytes)
            dest = tier.view(name)
            if dest.device.type != "cpu":
                if staging is None or staging.numel() < layout.nbytes:
                    staging = torch.empty(layout.nbytes, dtype=torch.uint8)
                host = staging[: layout.nbytes]
            else:
                host = dest
            if self.store is not None:
                with self.timeline.span("disk-read", name, nbytes=layout.nbytes, home=home):
                    self.store.tier.read_into(name, host)
            else:
                fill_group(ckpt, layout, host)
            if host is not dest:
                dest.copy_(host)

    def _slots(self, tier: str, prefix: str, count: int, nbytes: int) -> list[torch.Tensor]:
        t = self.tiers[tier]
        assert isinstance(t, MemoryTier)
        for i in range(count):
            t.allocate(f"{prefix}.{i}", nbytes)
        return [t.view(f"{prefix}.{i}") for i in range(count)]

    def allocate_kv(self, nbytes: int) -> torch.Tensor:
        """The KV block pool's memory, as a region of the device tier."""
        gpu = self.tiers["gpu"]
        assert isinstance(gpu, MemoryTier)
        gpu.allocate("kv", nbytes)
        return gpu.view("kv")

    # -- the weight source interface ------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, H], read by rows from wherever the embedding table lives."""
        spec = self._embed_spec
        home = self.plan.homes[self._embed_group]
        tier = self.tiers[home]
        if isinstance(tier, MemoryTier):
            table = self.layouts[self._embed_group].views(tier.view(self._embed_group))[self._embed_tensor]
            return table[ids.to(table.device)].to(self.device)
        assert isinstance(tier, DiskTier)
        unique, inverse = torch.unique(ids.cpu(), return_inverse=True)
        row_bytes = spec.shape[1] * self.dtype.itemsize
        rows = torch.empty(len(unique), spec.shape[1], dtype=self.dtype)
        with self.timeline.span("disk-read", f"{self._embed_group} rows", nbytes=len(unique) * row_bytes):
            for i, token in enumerate(unique.tolist()):
                tier.read_into(self._embed_group, rows[i], offset=spec.offset + token * row_bytes)
        return rows[inverse].to(self.device)

    def acquire(self, group: str) -> dict[str, torch.Tensor]:
        return self.layouts[group].views(self.prefetcher.acquire(group))

    def release(self, group: str) -> None:
        self.prefetcher.release(group)

    def abort_pass(self) -> None:
        self.prefetcher.reset()

    def submit_side(self, jobs) -> None:
        self.prefetcher.submit_side(jobs)

    def side_result(self, group: str):
        return self.prefetcher.side_result(group)

    def served(self) -> dict[str, int]:
        """Bytes of weights each home tier handed to compute so far (in place, copied or read)."""
        return dict(self.prefetcher.served) if self.prefetcher else {}

    def moved(self) -> dict[str, int]:
        """Bytes each link moved so far (disk->cpu, disk->gpu, cpu->gpu), prefetched ahead included."""
        return dict(self.prefetcher.bytes_moved) if self.prefetcher else {}

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        for name in ("gpu", "cpu"):
            if name in self.tiers:
                self.tiers[name].close()
        if self.store is not None:
            self.store.close()
            self.store = None
