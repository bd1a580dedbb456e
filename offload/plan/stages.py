"""Which layers each rank of a distributed run holds: contiguous slices balancing the predicted stage times.

    speeds = [RankSpeed.of(caps, cal, "cpu") for each rank]       # gathered from every rank
    split_layers(config, cfg, dtype, world, speeds) -> [range(0, 12), range(12, 22)]

A stage's time for a decode pass is predicted from its weight bytes: what its device tier holds is read at
the rank's calibrated compute rate, what does not fit crosses from host RAM or the store at the rank's
calibrated links, overlapped with the compute (the prefetcher's ring): max(compute, transfers). This is the
cost model's decode step in miniature (KV, the workspace and the ring's own room are left out: each rank
keeps a tenth of its device tier for them). It knows bytes, rates and layer counts; not processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.model.config import ModelConfig
from offload.plan.calibrate import Calibration, load_calibration
from offload.plan.planner import Planner, RunPlan
from offload.plan.predict import Workload, predict_decode
from offload.weights.groups import WeightFormat, expert_groups, model_layouts
from schedulers.plan import Capacities

#: of each rank's device tier, what weights may take (the rest: KV, workspace, ring)
WEIGHT_SHARE = 0.9
UNLIMITED = float(2**62)


@dataclass(frozen=True)
class RankSpeed:
    """What one rank brings: bytes its device tier and host tier hold, and how fast it reads each kind."""

    device_bytes: float  # UNLIMITED without tiers
    host_bytes: float
    compute: float  # weight bytes per second its layer kernels read (batch 1)
    host_link: float  # host -> device bytes per second (0: the host tier is the device's own memory)
    disk: float  # store read bytes per second

    @classmethod
    def of(cls, caps: Capacities, cal: Calibration, device_type: str) -> RankSpeed:
        cuda = device_type == "cuda"
        return cls(UNLIMITED if caps.gpu is None else WEIGHT_SHARE * caps.gpu,
                   UNLIMITED if caps.cpu is None else float(caps.cpu), cal.weight_bytes_per_s(device_type, 1),
                   cal.links["host->device"] if cuda else 0.0, cal.links["disk read"])

    def to_list(self) -> list[float]:
        return [self.device_bytes, self.host_bytes, self.compute, self.host_link, self.disk]

    def seconds(self, nbytes: float) -> float:
        """A stage of `nbytes` weights on this rank: compute and the streamed bytes' transfers overlapped."""
        host = min(max(nbytes - self.device_bytes, 0.0), self.host_bytes)
        disk = max(nbytes - self.device_bytes - host, 0.0)
        moved = (host / self.host_link if self.host_link else 0.0) + disk / self.disk
        return max(nbytes / self.compute, moved)


def layer_costs(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype) -> list[int]:
    """Bytes each layer's math reads (its experts included), the head's added to the last layer's."""
    fmt = WeightFormat.from_config(config.weights, cfg)
    sizes = {g: lay.nbytes for g, lay in model_layouts(cfg, dtype, fmt).items()}
    costs = [sizes[f"layer.{i}"] + sum(sizes[g] for g in expert_groups(cfg, i)) for i in range(cfg.num_layers)]
    costs[-1] += sizes["head"]
    return costs


def balance(costs: Sequence[float], parts: int,
            time: Callable[[int, float], float] = lambda part, nbytes: nbytes) -> tuple[int, ...]:
    """Layers per part, contiguous, minimising the slowest part's `time(part, bytes)` (each part at least one
    layer; by default the bytes themselves)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][j]: first j layers over k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], time(k - 1, prefix[j] - prefix[i]))
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    counts, j = [], n
    for k in range(parts, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return tuple(reversed(counts))


def split_layers(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, world: int,
                 speeds: Sequence[RankSpeed] | None = None) -> list[range]:
    """Each rank's contiguous slice: `distributed.layers`, or (auto) the balance of the predicted stage times
    (with `speeds`, each rank's own; without, the stages' bytes)."""
    counts = config.distributed.layers
    if counts is None:
        if cfg.num_layers < world:
            raise ConfigError(f"{world} ranks need at least {world} layers; the model has {cfg.num_layers}: "
                              "launch fewer ranks")
        costs = layer_costs(config, cfg, dtype)
        counts = balance(costs, world) if speeds is None else balance(
            costs, world, lambda part, nbytes: speeds[part].seconds(nbytes))
    if len(counts) != world or sum(counts) != cfg.num_layers:
        raise ConfigError(f"distributed.layers {list(counts)} must give each of the {world} ranks its layers, "
                          f"summing to the model's {cfg.num_layers}")
    starts = [sum(counts[:r]) for r in range(world)]
    return [range(s, s + n) for s, n in zip(starts, counts)]


@dataclass(frozen=True)
class StagePlan:
    """One rank's plan: its slice, the placement of its groups, its KV pool and its predicted stage time."""

    rank: int
    world: int
    layers: range
    num_layers: int
    run: RunPlan
    step_s: float | None  # a batch-1 decode pass over this stage (None: no prediction)

    @property
    def kv(self) -> list[int]:
        """What every rank agrees on (each takes the minimum): device, cpu and disk KV blocks, prefill chunk,
        and whether this rank streams no weights (1) or some (0)."""
        rp = self.run
        return [rp.kv_blocks, rp.kv.cpu_blocks, rp.kv.disk_blocks, rp.prefill_chunk, int(not rp.plan.streamed)]

    @property
    def homes(self) -> dict[str, int]:
        """Groups homed in each tier."""
        homes = list(self.run.plan.homes.values())
        return {t: homes.count(t) for t in ("gpu", "cpu", "disk")}

    def describe(self, kv_blocks: int | None = None) -> str:
        """The line each rank logs at start (`kv_blocks`: the pool every rank agreed on)."""
        plan = self.run.plan
        homes = ", ".join(f"{t}: {n}" for t, n in self.homes.items())
        return (f"rank {self.rank} of {self.world}: layers {self.layers.start}-{self.layers.stop - 1}"
                + (" + embeddings" if self.layers.start == 0 else "")
                + (" + head" if self.layers.stop == self.num_layers else "")
                + f"; groups homed {homes}" + (f" ({len(plan.streamed)} streamed)" if plan.streamed else "")
                + f"; KV {self.run.kv_blocks if kv_blocks is None else kv_blocks} device blocks"
                + (f", predicted stage time {1000 * self.step_s:.1f} ms at batch 1" if self.step_s is not None
                   else ""))

    def to_dict(self) -> dict:
        plan = self.run.plan
        return {"rank": self.rank, "layers": [self.layers.start, self.layers.stop],
                "homes": self.homes,
                "streamed": len(plan.streamed), "kv_blocks": self.run.kv_blocks,
                "predicted_stage_ms": None if self.step_s is None else 1000 * self.step_s}


def plan_stage_of(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  caps: Capacities, cal: Calibration, layers: range, rank: int, world: int) -> StagePlan:
    """The plan one rank makes for its slice (what `offload plan --ranks` shows for each, and each rank runs)."""
    planner = Planner(config, cfg, dtype, device, caps, layers)
    rp = planner.run_plan()
    try:
        step: float | None = predict_decode(rp.plan, cfg, cal, device.type, Workload(), dtype.itemsize,
                                            planner.compute_sizes).step_s
    except Exception:  # a prediction is a note, never a reason to stop
        step = None
    return StagePlan(rank, world, layers, cfg.num_layers, rp, step)


def plan_stages(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                caps: Capacities, world: int) -> list[StagePlan]:
    """Every rank's plan for a launch of `world` ranks that each have these tiers (the same YAML on alike
    machines): the slices as `layers: auto` balances them, each planned as its rank will."""
    cal = load_calibration(config.calibration)
    slices = split_layers(config, cfg, dtype, world, [RankSpeed.of(caps, cal, device.type)] * world)
    return [plan_stage_of(config, cfg, dtype, device, caps, cal, layers, r, world) for r, layers in enumerate(slices)]
