"""The budgets issue 9 saw refused, at their real shapes: each now runs with `auto` and gives the resident tokens.

    python -m scripts.autofit_examples [--work /tmp/offload-autofit] [--only NAME ...]

  medium    TinyLlama-1.1B shape (bf16), gpu 512 MiB + cpu 512 MiB + disk, prefetch depth 2
  small8    the 8-layer `small` model (float32), a gpu tier of 5 layers, prefetch depth 0..3
  gpu3      a 150-token prompt with kv_cache.gpu_blocks: 3: prefilled 32 tokens a pass, earlier blocks demoted
  smollm    SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied; float32,
            ~540 MB), gpu 200 MiB + cpu 100 MiB + disk, three short prompts

Every other key is left `auto`. `--plans` only plans each example at its real shape (no weights).
Each example prints the resolved prefill chunk, the device,
host and disk KV blocks and the plan, and compares its greedy tokens with the all-resident
run of the same checkpoint (no tiers) in the same process. Results: scripts/results/autofit-examples.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from offload.config import OffloadConfig
from offload.errors import CapacityError
from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig
from offload.plan.planner import Planner
from offload.runtime.runner import DTYPES, Runner
from offload.testing.make_model import SIZES, make_model, model_config
from offload.weights.groups import model_layouts
from scripts.machine import Result

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 17, 99, 23, 5, 61, 7, 300, 41, 42, 43], [1, 8, 2], [1, 400, 33, 12, 19, 250]]
LONG = [1] + [(7 * i) % 400 + 3 for i in range(149)]
NEW = 8
SMOLLM = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}


def model(work: Path, name: str, **kw) -> Path:
    """The example's checkpoint, written on first use."""
    path = work / name
    if not (path / "config.json").is_file():
        make_model(path, **kw)
    return path


def shape(spec: dict) -> ModelConfig:
    """The example's model shape without writing weights (the size's nominal vocabulary)."""
    size = SIZES[spec["size"]]
    raw = model_config("llama", size, size.vocab, spec.get("dtype", "float32"), None, spec.get("tie"))
    return ModelConfig.from_dict(raw | spec.get("overrides", {}))


def plan_only(work: Path, spec: dict, overrides: dict) -> str:
    """The resolved plan for the example's shape and budget, or the refusal; reads no weights."""
    cfg = shape(spec)
    layer = model_layouts(cfg, torch.float32)["layer.0"].nbytes
    overrides = in_layers(layer, overrides)
    config = OffloadConfig.load({"model": str(work), "device": "cpu", "dtype": "float32"} | overrides)
    try:
        rp = Planner(config, cfg, DTYPES[config.dtype], torch.device("cpu")).run_plan()
    except CapacityError as e:
        return f"refused: {e}"
    return (f"depth {rp.plan.depth}, prefill chunk {rp.prefill_chunk}, KV blocks gpu {rp.kv_blocks} / cpu "
            f"{rp.kv.cpu_blocks} / disk {rp.kv.disk_blocks}, workspace {rp.plan.reserved_gpu['workspace'] / 2**20:.1f}"
            f" MiB, ring {rp.plan.ring_slots} x {rp.plan.ring_slot_bytes / 2**20:.1f} MiB")


def examples(work: Path) -> list[tuple[str, dict, dict, list[list[int]]]]:
    """(name, make_model arguments, config overrides, prompts) for every example."""
    medium = {"name": "medium", "size": "medium", "dtype": "bfloat16"}
    small = {"name": "small", "size": "small"}
    smollm = {"name": "smollm", "size": "tiny", "tie": True, "overrides": SMOLLM}
    out = [("medium depth 2", medium, {"dtype": "bfloat16", "prefetch": {"depth": 2},
                                        "tiers": {"gpu": {"capacity": "512MiB"}, "cpu": {"capacity": "512MiB"},
                                                  "disk": {"path": str(work / "store-medium")}}}, PROMPTS)]
    for depth in range(5):  # depth 4: five ring slots fill the tier, refused naming depth 3
        out.append((f"small8 gpu=5 layers depth {depth}", small,
                    {"prefetch": {"depth": depth}, "tiers": {"gpu": {"capacity": "5 layers"},
                                                             "cpu": {"capacity": "2 layers"},
                                                             "disk": {"path": str(work / "store-small")}}},
                    PROMPTS))
    out.append(("gpu_blocks 3, 150-token prompt", small,
                {"kv_cache": {"gpu_blocks": 3}, "tiers": {"gpu": {"capacity": "512MiB"}, "cpu": {"capacity": "512MiB"},
                                                          "disk": {"path": str(work / "store-small")}}}, [LONG]))
    out.append(("smollm2-135m shape, gpu 200 MiB + cpu 100 MiB", smollm,
                {"tiers": {"gpu": {"capacity": "200MiB"}, "cpu": {"capacity": "100MiB"},
                           "disk": {"path": str(work / "store-smollm")}}}, PROMPTS))
    return out


def in_layers(layer: int, overrides: dict) -> dict:
    """Capacities written as "N layers" become N times the layer size."""
    tiers = {t: ({"capacity": int(v["capacity"].split()[0]) * layer}
                 if isinstance(v.get("capacity"), str) and v["capacity"].endswith("layers") else v)
             for t, v in overrides.get("tiers", {}).items()}
    return overrides | ({"tiers": tiers} if tiers else {})


def run(ckpt: Path, overrides: dict, prompts: list[list[int]]) -> dict:
    cfg = {"model": str(ckpt), "device": "cpu", "dtype": "float32"} | overrides
    t0 = time.perf_counter()
    with Runner.from_config(cfg) as r:
        res = r.generate(prompts, max_new_tokens=NEW, stop_on_eos=False)
        info = {"prefill_chunk": r.prefill_chunk, "kv_blocks": {"gpu": r.kv.pool.num_blocks,
                                                                "cpu": r.kv_settings.cpu_blocks,
                                                                "disk": r.kv_settings.disk_blocks},
                "plan": r.plan.describe() if "tiers" in overrides else "", "depth": r.plan.depth,
                "kv_moved": r.traffic.routes("kv"), "passes": res[0].stats.prefill_passes}
    return info | {"tokens": [x.token_ids for x in res], "s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/offload-autofit")
    ap.add_argument("--only", nargs="*", default=None, help="run the examples whose name starts with these")
    ap.add_argument("--plans", action="store_true", help="only plan each example (no weights, seconds)")
    ap.add_argument("--results", type=Path, default=ROOT / "scripts" / "results",
                    help="where autofit-{examples,plans}.{md,json} go")
    args = ap.parse_args(argv)
    header = Result()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.plans:
        plans = {name: plan_only(work, spec, overrides) for name, spec, overrides, _ in examples(work)}
        lines = ["# Issue 9's refused budgets, every knob `auto`: the plans (no weights read)", ""]
        lines += [f"- {name}: {plan}" for name, plan in plans.items()]
        print(header.write(args.results, "autofit-plans", "\n".join(lines), plans).read_text())
        return 0
    lines = ["# Issue 9's refused budgets, every knob `auto`", ""]
    data = {}
    resident: dict[str, list[list[int]]] = {}
    ok = True
    for name, spec, overrides, prompts in examples(work):
        if args.only and not any(name.startswith(p) for p in args.only):
            continue
        spec = dict(spec)
        ckpt = model(work, spec.pop("name"), **spec)
        overrides = in_layers(model_layouts(Checkpoint(ckpt).config, torch.float32)["layer.0"].nbytes, overrides)
        key = json.dumps([str(ckpt), overrides.get("dtype"), prompts])
        if key not in resident:
            resident[key] = run(ckpt, {"dtype": overrides.get("dtype", "float32")}, prompts)["tokens"]
        got = run(ckpt, overrides, prompts)
        equal = got["tokens"] == resident[key]
        ok &= equal
        data[name] = {k: v for k, v in got.items() if k != "plan"} | {"tokens_equal_resident": equal}
        lines += [f"## {name}: {'tokens equal to the all-resident run' if equal else 'TOKENS DIFFER'}", "",
                  f"prefill chunk {got['prefill_chunk']} ({got['passes']} prefill passes), KV blocks {got['kv_blocks']}"
                  f", KV moved {got['kv_moved']}, {got['s']:.1f} s", "", "```", got["plan"], "```", ""]
        print("\n".join(lines[-7:]), flush=True)
    header.write(args.results, "autofit-examples", "\n".join(lines), data)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
