"""Benchmark row: pinned host bytes against the cpu tier's capacity, one arena vs one pinned allocation per region.

    python -m scripts.pinned_bytes [--config scripts/examples/llama3-70b-24gb.yaml] [--out scripts/results]

Plans the example (Llama-3-70B on a 24 GB GPU, on paper: no weights, no GPU) for several cpu
capacities and reports, per plan: the cpu tier's capacity, the bytes its regions use, the
bytes the arena pins (each region rounded to a page), and what pinning every region on its
own with `torch.empty(pin_memory=True)` would take (CUDA's caching host allocator rounds each
allocation up to a power of two) with the old full-layer staging slots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from offload.config import OffloadConfig, parse_size
from offload.model.config import ModelConfig
from offload.plan.placement import STAGE_SLOTS
from offload.plan.planner import Planner
from scripts.machine import Result

ROOT = Path(__file__).resolve().parent.parent


def pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "scripts/examples/llama3-70b-24gb.yaml")
    ap.add_argument("--cpu", nargs="*", default=["8GiB", "24GiB", "56GiB"])
    ap.add_argument("--out", type=Path, default=ROOT / "scripts/results")
    args = ap.parse_args()
    header = Result()
    base = OffloadConfig.load(args.config)
    model_dir = (args.config.parent / base.model) if not Path(base.model).is_absolute() else Path(base.model)
    cfg = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    rows = []
    for cpu in args.cpu:
        raw = OffloadConfig.load(args.config)
        capacity = parse_size(cpu, "--cpu")
        tiers = dataclasses.replace(raw.tiers, cpu=dataclasses.replace(raw.tiers.cpu, capacity=capacity))
        config = dataclasses.replace(raw, tiers=tiers, prefetch=dataclasses.replace(raw.prefetch, depth=1))
        plan = Planner(config, cfg, torch.bfloat16, torch.device("cuda")).run_plan().plan
        homes = [plan.sizes[g] for g in plan.order if plan.homes[g] == "cpu"]
        old_stage = plan.ring_slot_bytes if plan.stage_slots else 0
        per_region = sum(pow2(n) for n in homes) + STAGE_SLOTS * pow2(old_stage) * bool(plan.stage_slots)
        rows.append((cpu, plan.capacity("cpu"), plan.used("cpu"), plan.pinned_bytes(), per_region,
                     plan.stage_slot_bytes, old_stage, len(homes)))
    g = 2**30
    lines = [f"Pinned host bytes vs the cpu tier's capacity: {args.config.name} (Llama-3-70B bf16 layers of "
             f"{max(plan.sizes.values()) / g:.2f} GiB max), planned for CUDA on paper, prefetch depth 1.", "",
             "| tiers.cpu.capacity | groups homed on cpu | cpu tier used GiB | arena pins GiB | pinned / capacity | "
             "per-region pin_memory (old) GiB | staging slot MiB (old) |", "|---|---|---|---|---|---|---|"]
    for cpu, cap, used, pinned, old, stage, old_stage, n in rows:
        lines.append(f"| {cpu} | {n} | {used / g:.2f} | {pinned / g:.2f} | {pinned / cap:.4f} | {old / g:.2f} | "
                     f"{stage / 2**20:.0f} ({old_stage / 2**20:.0f}) |")
    keys = ("cpu", "capacity", "used", "pinned", "per_region_old", "stage_slot", "stage_slot_old", "homed_groups")
    print(header.write(args.out, "pinned-bytes", "\n".join(lines), [dict(zip(keys, r)) for r in rows]).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
