"""The planner: from the config's capacities and the model's shape to a `RunPlan`, every `auto` resolved.

A `RunPlan` is what a run needs decided before it allocates anything: the placement plan
(`schedulers.placement.Plan`: each group's home tier, the ring, the staging slots), the KV
cache's settings and device blocks, and how an automatic prefetch depth was chosen. It is
made from the config and `config.json` alone: no weights are read, no GPU memory is touched,
so `offload plan` can plan for machines we do not have. The runtime executes the plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from offload.config import OffloadConfig, TiersConfig
from offload.errors import ConfigError
from offload.kv.blocks import KVSettings
from offload.kv.cache import PagedKVCache
from offload.kv.formats import ColdFormat
from offload.model.config import ModelConfig
from offload.plan.calibrate import load_calibration
from offload.plan.predict import Workload, predict_decode
from offload.weights.groups import WeightFormat, model_layouts
from schedulers.calibration import Calibration
from schedulers.placement import Capacities, GroupSpec, Plan, make_plan
from storage.errors import CapacityError

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
        self.kv = resolve_kv(config, cfg, device)
        self.block_bytes = PagedKVCache.block_nbytes(cfg, kv_cfg.block_size, dtype, self.kv.restore)
        self.kv_blocks = kv_cfg.gpu_blocks or (-(-AUTO_KV_TOKENS // kv_cfg.block_size) if config.tiers else 0)
        cold = ColdFormat.for_config(cfg, kv_cfg.block_size, dtype, self.kv.quantization, self.kv.restore)
        self.kv_cpu_bytes = kv_cfg.cpu_blocks * cold.block_nbytes(cfg.num_layers)
        self.kv_disk_bytes = kv_cfg.disk_blocks * cold.block_nbytes(cfg.num_layers)
        self.caps = caps or resolve_capacities(config.tiers, device)
        self.fmt = WeightFormat.from_config(config.weights, cfg)
        self.fmt.check(cfg)
        self.groups = [GroupSpec(name, layout.nbytes, rows_only=(name == "embed"))
                       for name, layout in model_layouts(cfg, dtype, self.fmt).items()]
        #: bytes the math reads per group at the compute dtype (packed matrices multiply at dense speed)
        self.compute_sizes = {name: layout.nbytes for name, layout in model_layouts(cfg, dtype).items()}
        self.workspace = workspace_bytes(cfg, config.activations.prefill_chunk, dtype)

    def placement(self, caps: Capacities, depth: int) -> Plan:
        """Homes, ring and staging for these capacities and depth (CapacityError if they cannot fit)."""
        return make_plan(self.groups, caps, depth, kv_bytes=self.kv_blocks * self.block_bytes,
                         workspace_bytes=self.workspace, copy_to_device=self.device.type == "cuda",
                         host_reserve=self.kv_cpu_bytes, disk_reserve=self.kv_disk_bytes)

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
        """The plan for the config's own capacities and depth (an automatic depth chosen by the cost model)."""
        depth, note = self.config.prefetch.depth, ""
        if depth is None:
            cal = load_calibration(self.config.calibration)
            depth, note = self.choose_depth(cal, Workload(prefill_chunk=self.config.activations.prefill_chunk))
        plan = self.placement(self.caps, depth)
        kv_blocks = self.kv_blocks
        if self.config.kv_cache.gpu_blocks is None and self.config.tiers is not None and self.caps.gpu is not None:
            kv_blocks += max(plan.capacity("gpu") - plan.used("gpu"), 0) // self.block_bytes  # what is left free
        return RunPlan(plan, self.caps, kv_blocks, self.block_bytes, self.kv, note)


def resolve_kv(config: OffloadConfig, cfg: ModelConfig, device: torch.device) -> KVSettings:
    """The KV cache's settings with every `auto` resolved and impossible combinations refused."""
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
    if kv.disk_blocks and config.tiers.disk is None:
        raise ConfigError("kv_cache.disk_blocks needs tiers.disk (a directory for the KV slot file)")
    cpu_attention = kv.cpu_attention
    if cpu_attention is None:  # FlexGen's choice: read host blocks where they are when RAM beats the link
        if device.type == "cuda":
            links = load_calibration(config.calibration).links
            cpu_attention = links["memcpy"] > links["host->device"]
        else:
            cpu_attention = False  # on a CPU device host blocks are attended in place anyway
    return KVSettings(block_size=kv.block_size, gpu_blocks=kv.gpu_blocks or 0, cpu_blocks=kv.cpu_blocks,
                      disk_blocks=kv.disk_blocks, eviction=kv.eviction, idle_seconds=kv.idle_seconds,
                      quantization=kv.quantization, restore=restore, cpu_attention=cpu_attention)
