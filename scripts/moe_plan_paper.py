"""Mixtures of experts on paper: Mixtral-8x22B and Qwen3-235B-A22B, int4, on a 24 GB GPU + 64 or 128 GB RAM + NVMe.

    python -m scripts.moe_plan_paper          # writes scripts/results/moe-plan-paper.{md,json}

From each model's config.json alone (the published values, written below) the planner places the groups
(attention, norms, routers and shared weights per layer; every routed expert its own group), sizes the
expert cache from what the 24 GB leave after the ring and KV, decides where experts homed in RAM are
computed, and the cost model predicts a batch-1 decode step. Links and GPU kernels are
scripts/calibrations/rtx4090-pcie4-nvme.json (an example RTX 4090 / PCIe 4.0 / NVMe machine, not measured
here); the host's expert kernels are ASSUMED_HOST (a desktop with dual-channel DDR5, not measured). "auto"
lets the cost model choose where experts homed in RAM are computed; "device" always moves them. The
expert cache's hit rate is the planner's assumption (uniform routing: slots / experts), not a measurement.
DeepSeek-V3 is not planned: its family (MLA attention) is not built in Offload.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from offload.config import OffloadConfig
from offload.model.config import ModelConfig
from offload.plan.calibrate import load_calibration
from offload.plan.costmodel import plan_bytes
from offload.plan.experts import expert_choice
from offload.plan.planner import Planner
from offload.plan.predict import Workload, predict_decode
from scripts.machine import Result
from storage.units import fmt_bytes

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION = ROOT / "scripts" / "calibrations" / "rtx4090-pcie4-nvme.json"
#: host expert kernels, assumed: int4 weights read at ~45 GB/s at one row (about half of dual-channel DDR5-6000's
#: 96 GB/s), which the cost model counts in dense bf16 bytes (x 16 / 4.5), falling with rows as the FLOPs bind
ASSUMED_HOST = {"tokens": [1, 8, 64, 512], "weight_bytes_per_s": [160e9, 120e9, 40e9, 5e9]}
GiB = 2**30

MODELS = {
    "Mixtral-8x22B": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 6144,
        "intermediate_size": 16384, "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8,
        "vocab_size": 32768, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 65536,
        "rope_theta": 1e6, "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"},
    "Qwen3-235B-A22B": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}


def scenario(name: str, raw: dict, ram: int, compute: str, cal, tmp: Path) -> dict:
    model = tmp / name
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(raw))
    config = OffloadConfig.load({
        "model": str(model), "device": "cuda", "dtype": "bfloat16", "calibration": str(CALIBRATION),
        "tiers": {"gpu": {"capacity": "24GiB"}, "cpu": {"capacity": ram}, "disk": {"path": str(tmp / "store")}},
        "weights": {"quantization": "int4", "group_size": 64}, "prefetch": {"depth": 2},
        "kv_cache": {"gpu_blocks": 128, "cpu_blocks": 0, "disk_blocks": 0}, "experts": {"compute": compute}})
    cfg = ModelConfig.from_dict(raw, name)
    planner = Planner(config, cfg, torch.bfloat16, torch.device("cuda"))
    planner.cal = cal
    plan = planner.run_plan().plan
    pred = predict_decode(plan, cfg, cal, "cuda", Workload(batch=1, context=512), 2, planner.compute_sizes)
    experts = [g for g in plan.order if ".expert." in g]
    dense = [g for g in plan.order if g.startswith("layer.") and ".expert." not in g]
    expert_bytes = plan.sizes[experts[0]]
    # the bytes a token touches: every layer's own group, its k routed experts and the head (nothing cached)
    bound = sum(plan.sizes[g] for g in dense) + plan.sizes["head"] + (
        len(dense) * cfg.experts_per_token * expert_bytes)
    choice = expert_choice(plan, cfg, cal, planner.compute_sizes)
    return {
        "model": name, "ram": ram, "expert_compute": compute,
        "model_bytes": sum(plan.sizes.values()), "expert_bytes": expert_bytes, "experts": len(experts),
        "homes": {t: sum(1 for g in experts if plan.homes[g] == t) for t in ("gpu", "cpu", "disk")},
        "layers_on_gpu": sum(1 for g in dense if plan.homes[g] == "gpu"), "layers": len(dense),
        "cache_slots": plan.cache_slots, "assumed_hit_rate": plan.hit_rate, "host_compute": len(plan.host_compute),
        "touched_bytes_per_token": bound,
        "bytes_per_token": {link: plan_bytes(plan, link) for link in ("disk read", "host->device")},
        "s_per_token": pred.step_s, "bottleneck": pred.bottleneck, "link_s": pred.link_s, "compute_s": pred.compute_s,
        "per_routed_expert": None if choice is None else {"device_s": choice.device_s, "host_s": choice.host_s},
    }


def main() -> None:
    result = Result()
    cal = load_calibration(CALIBRATION)
    cal = dataclasses.replace(cal, compute=cal.compute | {"cpu": ASSUMED_HOST})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, raw in MODELS.items():
            for ram in (64 * GiB, 128 * GiB):
                for compute in ("auto", "device"):
                    rows.append(scenario(name, raw, ram, compute, cal, Path(tmp)))
    md = [__doc__.split("\n\n", 2)[2].strip(), "",
          "| model | RAM | experts computed | experts gpu/cpu/disk | cache slots (assumed hit) | disk read / token "
          "| PCIe / token | touched / token (layers + k experts + head) | s/token | bound by |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h, moved = r["homes"], r["bytes_per_token"]
        where = f"host ({r['host_compute']} in RAM)" if r["host_compute"] else "on the GPU"
        md.append(f"| {r['model']} | {r['ram'] // GiB} GiB | {where} | {h['gpu']}/{h['cpu']}/{h['disk']} | "
                  f"{r['cache_slots']} ({100 * r['assumed_hit_rate']:.0f}%) | "
                  f"{fmt_bytes(moved['disk read'])} | {fmt_bytes(moved['host->device'])} | "
                  f"{fmt_bytes(r['touched_bytes_per_token'])} | {r['s_per_token']:.3f} | {r['bottleneck']} |")
    md += ["", "Per routed expert homed in RAM (batch 1): moved to the GPU vs computed on the host:"]
    for r in rows:
        if r["expert_compute"] == "auto" and r["per_routed_expert"]:
            p = r["per_routed_expert"]
            md.append(f"- {r['model']}, {r['ram'] // GiB} GiB: expert {fmt_bytes(r['expert_bytes'])}, "
                      f"{1000 * p['device_s']:.2f} ms moved vs {1000 * p['host_s']:.2f} ms on the host")
    path = result.write(ROOT / "scripts" / "results", "moe-plan-paper", "\n".join(md), rows)
    print(path.read_text())


if __name__ == "__main__":
    main()
