"""What a plan assumes about a mixture of experts: the share of experts a pass routes, the expert cache's hit rate,
and where experts homed in host RAM are computed (moved to the device, or on the host with their input moved).

The planner calls `plan_experts` on every placement it makes. The hit rate is `coverage` of the cache under
independent routing with expert popularity falling as rank**-`ASSUMED_SKEW`: 0, uniform routing, so the
assumed hit rate is simply cache slots / experts loaded on demand (a real model's skew only raises it;
the run reports the measured rate beside it). The host-or-device choice compares, per routed expert of a
decode pass of `tokens` rows, the link's time for its bytes (times the cache's miss rate) plus the device's
compute, against the host's compute plus moving the rows there and back; `offload plan` prints both times.
It knows model shapes, plans and calibrated rates; nothing about tensors or files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from offload.model.config import ModelConfig
from offload.plan.calibrate import Calibration
from offload.plan.costmodel import H2D
from schedulers.expert_policy import coverage
from schedulers.plan import Plan

#: expert popularity skew the planner assumes (0: uniform routing; the honest guess without a trace)
ASSUMED_SKEW = 0.0
#: fixed cost of one expert computed on the host from a CUDA device (two small copies and a synchronisation)
HOST_ROUND_TRIP_S = 50e-6


def routed_share(cfg: ModelConfig, tokens: int) -> float:
    """The expected share of a MoE layer's experts that a pass of `tokens` rows routes (uniform routing)."""
    if not cfg.is_moe:
        return 0.0
    return 1.0 - (1.0 - cfg.experts_per_token / cfg.num_experts) ** max(tokens, 1)


@dataclass(frozen=True)
class ExpertChoice:
    """Per routed expert homed in host RAM, one decode pass of `tokens` rows: seconds by each path."""

    tokens: int
    device_s: float  # its bytes over the link (the cache's misses only) + the device's compute
    host_s: float  # the host's compute + its rows to the host and back

    @property
    def host(self) -> bool:
        return self.host_s < self.device_s


def expert_choice(plan: Plan, cfg: ModelConfig, cal: Calibration, compute_sizes: dict[str, int],
                  tokens: int = 1, hit_rate: float | None = None) -> ExpertChoice | None:
    """The two paths' times for one host-homed expert (None when no expert is homed in host RAM)."""
    host = [g for g in plan.order if ".expert." in g and plan.homes[g] == "cpu"]
    if not host:
        return None
    g = host[0]
    size, csize = plan.sizes[g], compute_sizes.get(g, plan.sizes[g])
    hit = _hit(plan, plan.on_demand | plan.host_compute) if hit_rate is None else hit_rate
    device = (1 - hit) * size / cal.links[H2D] + csize / cal.weight_bytes_per_s("cuda", tokens)
    rows = 2 * tokens * cfg.hidden_size * 4  # float32 rows there and back, at most
    host_s = csize / cal.weight_bytes_per_s("cpu", tokens) + rows / cal.links[H2D] + HOST_ROUND_TRIP_S
    return ExpertChoice(tokens, device, host_s)


def plan_experts(plan: Plan, cfg: ModelConfig, cal: Calibration, compute: str,
                 compute_sizes: dict[str, int]) -> Plan:
    """The plan with its expert assumptions filled in: routed share (batch 1), assumed hit rate, and on a CUDA
    device the experts homed in host RAM computed there when `compute` is host, or auto and the host is faster."""
    if not cfg.is_moe:
        return plan
    share = routed_share(cfg, 1)
    if plan.copy_to_device and compute != "device":
        choice = expert_choice(plan, cfg, cal, compute_sizes, hit_rate=_hit(plan, plan.on_demand))
        if choice is not None and (compute == "host" or choice.host):
            host = frozenset(g for g in plan.on_demand if plan.homes[g] == "cpu")
            on_demand = plan.on_demand - host
            slots = min(plan.cache_slots, len(on_demand))  # the cache keeps the disk-homed ones only
            reserved = dict(plan.reserved_gpu)
            reserved.pop("expert cache", None)
            if slots:
                reserved["expert cache"] = slots * plan.cache_slot_bytes
            plan = dataclasses.replace(plan, on_demand=on_demand, host_compute=host, reserved_gpu=reserved,
                                       cache_slots=slots, cache_slot_bytes=plan.cache_slot_bytes if slots else 0)
    return dataclasses.replace(plan, routed_share=share, hit_rate=_hit(plan, plan.on_demand))


def _hit(plan: Plan, on_demand: frozenset[str]) -> float:
    """The assumed hit rate of the plan's cache over these on-demand experts."""
    if not on_demand or not plan.cache_slots:
        return 0.0
    layers = len({g.rsplit(".expert.", 1)[0] for g in on_demand})
    return min(1.0, coverage(plan.cache_slots, layers, max(len(on_demand) // max(layers, 1), 1), ASSUMED_SKEW))
