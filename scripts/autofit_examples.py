"""The budgets issue 9 saw refused, at their real shapes: each now runs with `auto` and gives the resident tokens.

    python scripts/autofit_examples.py [--work /tmp/offload-autofit] [--only NAME ...]

  medium    TinyLlama-1.1B shape (bf16), gpu 512 MiB + cpu 512 MiB + disk, prefetch depth 2
  small8    the 8-layer `small` model (float32), a gpu tier of 5 layers, prefetch depth 0..3
  gpu3      a 150-token prompt with kv_cache.gpu_blocks: 3: prefilled 32 tokens a pass, earlier blocks demoted
  smollm    SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied; float32,
            ~540 MB), gpu 200 MiB + cpu 100 MiB + disk, three short prompts

Every other key is left `auto`. Each example prints the resolved prefill chunk, the device,
host and disk KV blocks and the plan, and compares its greedy tokens with the all-resident
run of the same checkpoint (no tiers) in the same process. Results: scripts/results/autofit-examples.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from offload.model.checkpoint import Checkpoint
from offload.runtime.runner import Runner
from offload.testing.make_model import make_model
from offload.weights.groups import model_layouts

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 17, 99, 23, 5, 61, 7, 300, 41, 42, 43], [1, 8, 2], [1, 400, 33, 12, 19, 250]]
LONG = [1] + [(7 * i) % 400 + 3 for i in range(149)]
NEW = 8
SMOLLM = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}


def model(work: Path, name: str, **kw) -> Path:
    path = work / name
    if not (path / "config.json").is_file():
        make_model(path, **kw)
    return path


def examples(work: Path) -> list[tuple[str, Callable[[], Path], dict, list[list[int]]]]:
    """(name, checkpoint maker, config overrides, prompts) for every example; checkpoints are written on first use."""
    medium = functools.partial(model, work, "medium", size="medium", dtype="bfloat16")
    small = functools.partial(model, work, "small", size="small")
    smollm = functools.partial(model, work, "smollm", size="tiny", tie=True, overrides=SMOLLM)
    out = [("medium depth 2", medium, {"dtype": "bfloat16", "prefetch": {"depth": 2},
                                        "tiers": {"gpu": {"capacity": "512MiB"}, "cpu": {"capacity": "512MiB"},
                                                  "disk": {"path": str(work / "store-medium")}}}, PROMPTS)]
    for depth in range(4):
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


def in_layers(ckpt: Path, overrides: dict) -> dict:
    """Capacities written as "N layers" become N times the checkpoint's layer size (float32)."""
    layer = model_layouts(Checkpoint(ckpt).config, torch.float32)["layer.0"].nbytes
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
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "autofit-examples.md"))
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    lines = ["# Issue 9's refused budgets, every knob `auto`", "", f"load average at start: {os.getloadavg()}", ""]
    resident: dict[str, list[list[int]]] = {}
    ok = True
    for name, make, overrides, prompts in examples(work):
        if args.only and not any(name.startswith(p) for p in args.only):
            continue
        ckpt = make()
        overrides = in_layers(ckpt, overrides)
        key = json.dumps([str(ckpt), overrides.get("dtype"), prompts])
        if key not in resident:
            resident[key] = run(ckpt, {"dtype": overrides.get("dtype", "float32")}, prompts)["tokens"]
        got = run(ckpt, overrides, prompts)
        equal = got["tokens"] == resident[key]
        ok &= equal
        lines += [f"## {name}: {'tokens equal to the all-resident run' if equal else 'TOKENS DIFFER'}", "",
                  f"prefill chunk {got['prefill_chunk']} ({got['passes']} prefill passes), KV blocks {got['kv_blocks']}"
                  f", KV moved {got['kv_moved']}, {got['s']:.1f} s", "", "```", got["plan"], "```", ""]
        print("\n".join(lines[-7:]), flush=True)
    Path(args.out).write_text("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
