"""Benchmark: Llama-3-70B's exact layer shapes, a few layers, streamed from disk through small tiers.

    python -m scripts.bench_70b_layers                    # 2 layers (~7.6 GB bf16) under /tmp/offload-70b
    python -m scripts.bench_70b_layers --layers 3 --work /big/disk      # (from the repository root)

A generated checkpoint (`offload.testing.make_model` with overrides: hidden 8192, 64 heads, 8 KV
heads, intermediate 28672, vocab 128256, llama3 rope; random weights, bf16) is converted once to a
store and calibrated once on this machine. Then, each in its own process:

  offload       the tiered run: every layer and the head streamed from disk (cpu tier 0, a gpu tier of
                two ring slots), greedy tokens, per-layer bytes and times from the timeline
  transformers  LlamaForCausalLM on the same checkpoint (bf16, CPU), greedy tokens

and it prints per layer: bytes read vs the plan's size, disk-read and compute times vs what the
cost model predicts for one layer with this machine's calibration; then the 80-layer
extrapolation of the measured step next to the planner's own 80-layer prediction for this
machine, and the on-paper plan of scripts/examples/llama3-70b-24gb.yaml (RTX 4090 calibration).
Results: scripts/results/bench-70b-layers.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench import evict, vm_hwm
from scripts.machine import Result

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=28672,
             vocab_size=128256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
PROMPT = [1, 450, 7, 88, 301, 12, 64, 9]
NEW = 4


# ----------------------------------------------------------------------------- workers (own processes)
def worker_offload(spec: dict) -> dict:
    from offload.config import OffloadConfig
    from offload.plan.calibrate import load_calibration
    from offload.plan.predict import Workload, compute_seconds, predict_decode
    from offload.runtime.runner import Runner

    evict([Path(spec["config"]["tiers"]["disk"]["path"])])
    cfg = OffloadConfig.load(spec["config"])
    with Runner(cfg) as r:
        t0 = time.perf_counter()
        [res] = r.generate([PROMPT], max_new_tokens=NEW, stop_on_eos=False)
        wall = time.perf_counter() - t0
        decode = sorted(set(res.stats.decode_only_steps))
        spans = r.timeline.spans_resolved()
        per = {}
        for g in r.plan.order:
            if g == "embed":
                continue
            reads = [s for s in spans if s.track == "disk-read" and s.name == g and s.step in decode]
            comp = [s for s in spans if s.track == "compute" and s.name == g and s.step in decode]
            per[g] = {"bytes_read_per_step": sum(s.nbytes for s in reads) / len(decode),
                      "planned_bytes": r.plan.sizes[g], "home": r.plan.homes[g],
                      "read_s": sum(s.duration for s in reads) / len(decode),
                      "compute_s": sum(s.duration for s in comp) / len(decode)}
        cal = load_calibration(cfg.calibration)
        work = Workload(batch=1, context=len(PROMPT) + NEW // 2)
        comp = compute_seconds(r.plan, r.cfg, cal, "cpu", 1, work.context, 1, r.dtype.itemsize)
        pred = predict_decode(r.plan, r.cfg, cal, "cpu", work, r.dtype.itemsize)
        for g in per:
            per[g]["predicted_read_s"] = r.plan.sizes[g] / cal.links["disk read"]
            per[g]["predicted_compute_s"] = comp.get(g, 0.0)
        return {"tokens": res.token_ids, "ms_per_step": res.stats.decode_only_ms_per_step, "wall_s": wall,
                "decode_steps": len(decode), "per_group": per, "predicted_step_s": pred.step_s,
                "plan": r.plan.describe(), "prefill_chunk": r.prefill_chunk, "kv_blocks": r.kv.pool.num_blocks,
                "cpu_kv_blocks": r.kv_settings.cpu_blocks, "disk_kv_blocks": r.kv_settings.disk_blocks,
                "peak_rss": vm_hwm(), "calibration": cal.source, "links": cal.links,
                "kernel": cal.compute.get("cpu")}


def worker_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    return {"tokens": out[0, len(PROMPT):].tolist(), "peak_rss": vm_hwm()}


WORKERS = {"offload": worker_offload, "transformers": worker_transformers}


def run_worker(kind: str, spec: dict) -> dict:
    cmd = [sys.executable, "-m", "scripts.bench_70b_layers", "--worker", kind, "--spec", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the run
def ensure(work: Path, layers: int) -> tuple[Path, Path, Path]:
    from offload.testing.make_model import make_model

    ckpt, store, cal = work / "ckpt", work / "store", work / "calibration.json"
    marker = ckpt / "config.json"
    if not marker.is_file() or json.loads(marker.read_text())["num_hidden_layers"] != layers:
        print(f"writing the checkpoint ({layers} layers) to {ckpt} ...", flush=True)
        make_model(ckpt, family="llama", size="tiny", dtype="bfloat16", rope_scaling="llama3", tie=False,
                   shard_bytes=1 << 30, overrides=SHAPE | {"num_hidden_layers": layers}, progress=True)
    if not (store / "manifest.json").is_file():
        print(f"converting to {store} ...", flush=True)
        subprocess.run([sys.executable, "-m", "offload", "convert", str(ckpt), str(store), "--dtype", "bfloat16",
                        "--force"], check=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    if not cal.is_file():
        print("calibrating this machine ...", flush=True)
        subprocess.run([sys.executable, "-m", "offload", "calibrate", "--device", "cpu", "--dtype", "bfloat16",
                        "--disk-path", str(work), "-o", str(cal)], check=True, cwd=ROOT,
                       env=os.environ | {"PYTHONPATH": str(ROOT)})
    return ckpt, store, cal


def on_paper(config: dict, ckpt: Path) -> tuple[str, str]:
    """The planner's 80-layer prediction for this machine (the run's own config), and the RTX 4090 example's plan."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    cfg80 = json.loads((ckpt / "config.json").read_text()) | {"num_hidden_layers": 80}
    path = ckpt.parent / "config-80.json"
    path.write_text(json.dumps(cfg80))
    run_yaml = ckpt.parent / "run.yaml"
    run_yaml.write_text(json.dumps(config))  # JSON is YAML
    here = subprocess.run([sys.executable, "-m", "offload", "plan", "--config", str(run_yaml), "--model-config",
                           str(path), "--context", str(len(PROMPT) + NEW // 2)],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    paper = subprocess.run([sys.executable, "-m", "offload", "plan", "--config",
                            "scripts/examples/llama3-70b-24gb.yaml", "--calibration",
                            "scripts/calibrations/rtx4090-pcie4-nvme.json"], capture_output=True, text=True, cwd=ROOT,
                           env=env)
    return here.stdout + here.stderr, paper.stdout + paper.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/offload-70b", help="where the checkpoint, store and calibration go")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--gpu", default="4600MiB", help="the gpu tier: two ring slots of the 2.1 GB head, no layer homed")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results"))
    ap.add_argument("--replan", action="store_true", help="reuse the measured runs of the last report; replan only")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](json.loads(args.spec))))
        return 0
    work = Path(args.work)
    ckpt, store, cal = ensure(work, args.layers)
    config = {"model": str(ckpt), "device": "cpu", "dtype": "bfloat16", "calibration": str(cal),
              "tiers": {"gpu": {"capacity": args.gpu}, "cpu": {"capacity": 0}, "disk": {"path": str(store)}},
              "prefetch": {"depth": 1}}  # kv_cache and activations: auto
    header = Result()
    out = Path(args.out)
    if args.replan:  # keep the measured runs, redo the plans and the report
        old = json.loads((out / "bench-70b-layers.json").read_text())
        ours, ref = old["data"]["offload"], old["data"]["transformers"]
    else:
        ours = run_worker("offload", {"config": config})
        ref = run_worker("transformers", {"model": str(ckpt)})
    here, paper = on_paper(config, ckpt)
    layers = [g for g in ours["per_group"] if g.startswith("layer.")]
    per_layer_ms = sum(max(ours["per_group"][g]["read_s"], ours["per_group"][g]["compute_s"]) for g in layers) \
        / len(layers) * 1000
    head = ours["per_group"]["head"]
    extrapolated = 80 * per_layer_ms + 1000 * max(head["read_s"], head["compute_s"])
    result = {"layers": args.layers, "shape": SHAPE, "prompt": PROMPT, "new": NEW, "offload": ours, "transformers": ref,
              "tokens_equal": ours["tokens"] == ref["tokens"], "per_layer_ms_measured": per_layer_ms,
              "extrapolated_80_layers_ms_per_token": extrapolated, "plan_80_layers_here": here,
              "plan_on_paper_rtx4090": paper}
    print(header.write(out, "bench-70b-layers", markdown(result), result).read_text())
    return 0 if result["tokens_equal"] else 1


def markdown(r: dict) -> str:
    o = r["offload"]
    lines = [f"# Llama-3-70B layer shapes, {r['layers']} layers, streamed from disk", "",
             "",
             f"tokens: offload {o['tokens']}, transformers {r['transformers']['tokens']} -> "
             f"{'equal' if r['tokens_equal'] else 'DIFFERENT'}",
             f"auto-fit: prefill chunk {o['prefill_chunk']}, device KV blocks {o['kv_blocks']}, cold KV blocks "
             f"cpu {o['cpu_kv_blocks']} / disk {o['disk_kv_blocks']}; peak RSS offload "
             f"{o['peak_rss'] / 2**30:.1f} GiB, transformers {r['transformers']['peak_rss'] / 2**30:.1f} GiB", "",
             "| group | home | bytes read / step | planned bytes | disk read s (measured / predicted) | "
             "compute s (measured / predicted) |", "|---|---|---|---|---|---|"]
    for g, p in o["per_group"].items():
        lines.append(f"| {g} | {p['home']} | {p['bytes_read_per_step']:.0f} | {p['planned_bytes']} | "
                     f"{p['read_s']:.3f} / {p['predicted_read_s']:.3f} | {p['compute_s']:.3f} / "
                     f"{p['predicted_compute_s']:.3f} |")
    lines += ["", f"decode step: measured {o['ms_per_step']:.0f} ms, predicted {1000 * o['predicted_step_s']:.0f} ms "
              f"(calibration {o['calibration']})",
              f"one layer (max of read and compute, measured): {r['per_layer_ms_measured']:.0f} ms; "
              f"80 layers + head, extrapolated: {r['extrapolated_80_layers_ms_per_token'] / 1000:.1f} s/token", "",
              "## The planner's 80-layer plan for this machine (same tiers)", "", "```",
              r["plan_80_layers_here"].strip(), "```", "",
              "## On paper: scripts/examples/llama3-70b-24gb.yaml, RTX 4090 calibration", "", "```",
              r["plan_on_paper_rtx4090"].strip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
