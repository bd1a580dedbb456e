"""Llama-3-70B with speculative decoding, on paper: the cost model's plan next to SpecExec's figures.

    python -m scripts.spec_plan_70b            # writes scripts/results/spec-plan-70b.{md,json}

The machine of scripts/examples/llama3-70b-24gb.yaml (RTX 4090 24 GB, 56 GiB RAM for Offload,
7 GB/s NVMe; links and kernels from scripts/calibrations/rtx4090-pcie4-nvme.json). The draft is
the target's own int4 copy (issue 10's scheme: 4 bits and a bf16 scale and zero per 64 inputs,
4.5 bits a weight; embedding and head kept in bf16), placed first: on the GPU as far as it goes
(the target keeps its ring, KV and workspace there), the rest in RAM, read over PCIe each draft pass.
The target (bf16) gets what is left: little RAM, so most of it streams from the NVMe drive.
Acceptance is not known on paper; the table gives the prediction for a range of it, with
`tokens` chosen as `tokens: auto` would choose it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from offload.config import OffloadConfig
from offload.model.config import ModelConfig
from offload.plan.calibrate import load_calibration
from offload.plan.placement import GroupSpec
from offload.plan.planner import Planner
from offload.plan.predict import Workload, predict_decode
from offload.plan.speculative import choose_tokens, verify_cost
from scripts.machine import Result

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "scripts" / "examples" / "llama3-70b-24gb.yaml"
CALIBRATION = ROOT / "scripts" / "calibrations" / "rtx4090-pcie4-nvme.json"
INT4_BITS = 4 + 32 / 64  # 4-bit codes, a bf16 scale and zero per group of 64


def scenario(config: OffloadConfig, cfg: ModelConfig, draft_cfg: ModelConfig, cal, depth: int) -> dict:
    """Place an int4 draft first (GPU as far as the target's minimum allows, then RAM), the target after it."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    target = Planner(config, cfg, dtype, dev)
    plain = target.placement(target.caps, depth)
    draft = Planner(config, draft_cfg, dtype, dev)
    draft.groups = [GroupSpec(g.name, g.nbytes if g.name in ("embed", "head") else int(g.nbytes * INT4_BITS / 16),
                              g.rows_only) for g in draft.groups]
    draft.kv_blocks = 0  # its KV: a few MB per thousand tokens, inside the margin
    target_min_gpu = plain.used("gpu") - sum(plain.sizes[g] for g in plain.order if plain.homes[g] == "gpu")
    draft_caps = dataclasses.replace(target.caps, gpu=target.caps.gpu - target_min_gpu, has_disk=False, disk=None)
    dplan = draft.placement(draft_caps, depth)
    draft_gpu = dplan.used("gpu") - dplan.reserved_gpu.get("kv", 0)
    draft_cpu = dplan.used("cpu")
    left = dataclasses.replace(target.caps, gpu=target.caps.gpu - draft_gpu, cpu=max(target.caps.cpu - draft_cpu, 0))
    tplan = target.placement(left, depth)
    return {"t_draft": predict_decode(dplan, draft_cfg, cal, "cuda", Workload(), 2).step_s,
            "t_target": predict_decode(tplan, cfg, cal, "cuda", Workload(), 2).step_s,
            "cost": verify_cost(tplan, cfg, cal, "cuda", 2), "draft_gpu": draft_gpu, "draft_cpu": draft_cpu}


def main() -> int:
    header = Result()
    config = OffloadConfig.load(EXAMPLE).replace(calibration=CALIBRATION)
    raw = json.loads((config.model / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw, "llama3-70b")
    small = ModelConfig.from_dict(raw | {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                                         "num_hidden_layers": 32}, "llama3-8b")  # Llama-3-8B's shape
    cal = load_calibration(CALIBRATION)
    depth = 2
    target = Planner(config, cfg, torch.bfloat16, torch.device("cuda"))
    t_plain = predict_decode(target.placement(target.caps, depth), cfg, cal, "cuda", Workload(), 2).step_s
    gib = 2**30
    lines = [
        "# Llama-3-70B with speculative decoding, on paper", "",
        "RTX 4090 24 GB (22 GiB for Offload), 56 GiB RAM, 7 GB/s NVMe (calibration "
        f"`{CALIBRATION.name}`), prefetch depth {depth}, batch 1. Plain bf16 target with the whole budget: "
        f"{1000 * t_plain:.0f} ms/token ({1 / t_plain:.3f} tokens/s).", "",
    ]
    data = {"plain_ms_per_token": 1000 * t_plain, "drafts": {}}
    for name, dcfg in (("the target's own int4 copy (self-int4)", cfg), ("a Llama-3-8B-shaped int4 draft", small)):
        sc = scenario(config, cfg, dcfg, cal, depth)
        data["drafts"][name] = {"draft_ms": 1000 * sc["t_draft"], "target_ms": 1000 * sc["t_target"],
                                "draft_gpu_bytes": sc["draft_gpu"], "draft_cpu_bytes": sc["draft_cpu"], "rows": []}
        t_draft, t_target, cost = sc["t_draft"], sc["t_target"], sc["cost"]
        lines += [
            f"## Draft: {name}", "",
            f"Placed first: {sc['draft_gpu'] / gib:.1f} GiB on the GPU, {sc['draft_cpu'] / gib:.1f} GiB in RAM; "
            f"{1000 * t_draft:.0f} ms per draft pass. The bf16 target in what is left: {1000 * t_target:.0f} ms "
            f"per pass (x{cost(8):.2f} for 9 tokens).", "",
            "| acceptance | tokens (auto) | tokens per pass | ms per step | tokens/s | x plain |",
            "|---|---|---|---|---|---|",
        ]
        for alpha in (0.5, 0.6, 0.7, 0.8, 0.9):
            p = choose_tokens(alpha, t_draft, lambda k, t=t_target, c=cost: t * c(k), t_target)
            tps = p.tokens_per_pass / p.step_s
            lines.append(f"| {alpha:.1f} | {p.tokens} | {p.tokens_per_pass:.2f} | {1000 * p.step_s:.0f} | "
                         f"{tps:.3f} | {tps * t_plain:.1f} |")
            data["drafts"][name]["rows"].append({"acceptance": alpha, "tokens": p.tokens, "tokens_per_pass":
                                                 p.tokens_per_pass, "ms_per_step": 1000 * p.step_s,
                                                 "tokens_per_s": tps})
        lines.append("")
    lines += ["SpecExec (Svirschevski et al., NeurIPS 2024), 50B+ models offloaded to RAM on consumer GPUs: "
              "4-6 tokens/s with a 4-bit target, 2-3 tokens/s with a 16-bit target (a 7B-class draft and "
              "trees of thousands of tokens, the target in RAM). Above: a chain, and a bf16 target that does not "
              "fit in RAM (141 GB), so most of it streams from the NVMe drive every pass; the self-int4 draft "
              "(~40 GB) takes the RAM the target would have used."]
    print(header.write(ROOT / "scripts" / "results", "spec-plan-70b", "\n".join(lines), data).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
