"""Benchmark: speculative decoding over weights streamed from disk vs plain streaming, in one run.

    python -m scripts.bench_spec                 # SmolLM2-135M (trained) and the medium random model
    python -m scripts.bench_spec --quick         # the trained model only, fewer tokens

The target (bf16) streams every layer, the embedding and the head from the zarr store on each pass
(tiers: a ring on the device, no host RAM for weights, page cache off); the draft is resident. For each
target, in fresh subprocesses, first the plain streamed run, then speculative runs with `tokens` 4, 8
and auto: decode tokens/s (draft passes included), acceptance, tokens per verify pass, mean draft and
verify pass times, and whether the greedy tokens equal the plain run's (they must). Beside each
measured speed-up, two predictions of `offload.plan.speculative` at the measured acceptance:
from the measured pass times, and from the cost model alone (calibration, plans of both models).

The drafts are the target itself packed (`speculative.draft: self-int4` and `self-int8`, issue 10's
group-wise weights, resident in memory beside the streamed ring). The worst case is the medium model
with random weights (flat distributions: drafts rarely agree). Results:
scripts/results/bench-spec.{json,md}, with the command, the machine and the load (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from scripts.machine import Result, load
from storage.units import blocks_for

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "The history of the Roman Empire begins with",
    "Here is a Python function that computes the factorial of a number:\n\ndef factorial(n):",
    "Photosynthesis is the process by which plants",
]


# ----------------------------------------------------------------------------- worker (one per subprocess)
def worker(spec: dict) -> dict:
    from offload.config import OffloadConfig
    from offload.runtime.runner import Runner
    from scripts.bench import evict

    cfg = spec["config"]
    evict([Path(cfg["tiers"]["disk"]["path"])])
    with Runner(OffloadConfig.load(cfg)) as r:
        prompts = [r.encode(p) for p in PROMPTS[: spec["batch"]]] if r.tokenizer else spec["ids"]
        t0 = time.perf_counter()
        res = r.generate(prompts, max_new_tokens=spec["new"], temperature=spec.get("temperature", 0.0),
                         seed=0, stop_on_eos=False)
        wall = time.perf_counter() - t0
        st = res[0].stats
        verify = [s.duration for s in r.timeline.on("speculative") if s.name == "verify"]
        disk = r.timeline.bytes_on("disk-read")
        spec_ = r.speculator
        return {
            "tokens": [x.token_ids for x in res], "wall_s": wall, "decode_tokens_per_s": st.decode_tokens_per_s,
            "decode_passes": st.decode_steps, "decode_tokens": st.decode_tokens,
            "tokens_per_pass": st.tokens_per_decode_pass, "acceptance": st.acceptance,
            "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
            "ms_per_pass": 1000 * st.decode_s / max(st.decode_steps, 1),
            "verify_ms": 1000 * sum(verify) / len(verify) if verify else None,
            "draft_ms": 1000 * spec_.draft_s / spec_.draft_passes if spec_ and spec_.draft_passes else None,
            "auto_choice": spec_.choice.tokens if spec_ and spec_.choice else None,
            "alpha": spec_.alpha if spec_ else None,  # per-token acceptance given the ones before were kept
            "tree_wins": spec_.tree_wins if spec_ else None,  # steps that kept a branch other than the first
            "disk_bytes_per_pass": disk / max(st.decode_steps + st.prefill_passes, 1),
            "streamed_groups": len(r.plan.streamed), "load": load(),
        }


def run_worker(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_spec", "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=3000, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- predictions
def plan_of(config: dict):
    from offload.config import OffloadConfig
    from offload.model.checkpoint import Checkpoint
    from offload.plan.planner import Planner
    from offload.runtime.device import resolve_device, resolve_dtype

    cfg = OffloadConfig.load(config)
    ckpt = Checkpoint(cfg.model)
    dtype = resolve_dtype(cfg.dtype, ckpt.config.torch_dtype)
    return Planner(cfg, ckpt.config, dtype, resolve_device(cfg.device)).run_plan(), ckpt.config, dtype


def predictions(row: dict, plain: dict, target_cfg: dict, draft_cfg: dict, k: int) -> dict:
    from offload.plan.calibrate import load_calibration
    from offload.plan.predict import Workload, predict_decode
    from offload.plan.speculative import predict, verify_cost

    alpha = row["alpha"]
    t_plain = plain["ms_per_pass"] / 1000
    measured = predict(alpha, k, row["draft_ms"] / 1000, lambda _: row["verify_ms"] / 1000, t_plain)
    cal = load_calibration(None)
    (trp, tcfg, tdt), (drp, dcfg, ddt) = plan_of(target_cfg), plan_of(draft_cfg)
    t_tgt = predict_decode(trp.plan, tcfg, cal, "cpu", Workload(batch=row["batch"]), tdt.itemsize).step_s
    t_drf = predict_decode(drp.plan, dcfg, cal, "cpu", Workload(batch=row["batch"]), ddt.itemsize).step_s
    cost = verify_cost(trp.plan, tcfg, cal, "cpu", tdt.itemsize)
    model = predict(alpha, k, t_drf, lambda j: t_tgt * cost(j), t_tgt)
    return {"predicted_speedup_from_measured_times": measured.speedup,
            "predicted_speedup_from_cost_model": model.speedup,
            "cost_model_plain_ms": 1000 * t_tgt, "cost_model_draft_ms": 1000 * t_drf,
            "predicted_tokens_per_pass": measured.tokens_per_pass}


# ----------------------------------------------------------------------------- orchestration
def bench_target(name: str, target: Path, drafts: dict[str, Path], out: Path, new: int, ks: list, batch: int,
                 temperature: float = 0.0, tree_ks: tuple = ()) -> list[dict]:
    import torch

    from offload.kv.cache import PagedKVCache
    from offload.model.checkpoint import Checkpoint
    from offload.weights.groups import model_layouts
    from scripts.bench import ensure_store

    store = out / "stores" / target.name
    ensure_store(target, store)
    cfg = Checkpoint(target).config
    layer = model_layouts(cfg, torch.bfloat16)["layer.0"].nbytes
    ids = [[1] + torch.randint(3, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(i)).tolist()
           for i in range(batch)]
    blocks = batch * blocks_for(64 + new + 16, 16)
    head = model_layouts(cfg, torch.bfloat16)["head"].nbytes
    ring = 3 * layer + head + (24 << 20)  # a ring of 3 layers; the head (larger than a slot) homed; KV, workspace
    base = {"model": str(target), "device": "cpu", "dtype": "bfloat16", "prefetch": {"depth": 2},
            "kv_cache": {"block_size": 16, "gpu_blocks": blocks}, "activations": {"prefill_chunk": 64},
            "tiers": {"gpu": {"capacity": ring}, "cpu": {"capacity": 0}, "disk": {"path": str(store)}}}
    job = {"batch": batch, "new": new, "ids": ids, "temperature": temperature}
    print(f"[{name}] plain streamed run (load {load()})", file=sys.stderr)
    plain = run_worker(job | {"config": base})
    rows = [{"target": name, "run": "plain", "batch": batch, **plain}]
    for dname, draft in drafts.items():
        draft_alone = {"model": str(draft), "device": "cpu", "dtype": "bfloat16",
                       "kv_cache": {"block_size": 16, "gpu_blocks": blocks}, "activations": {"prefill_chunk": 64}}
        if str(draft).startswith("self-"):  # the target itself, packed, resident
            draft_alone |= {"model": str(target), "weights": {"quantization": str(draft).removeprefix("self-")}}
        draft_rp, _, _ = plan_of(draft_alone)
        draft_bytes = draft_rp.plan.used("gpu") + blocks * draft_rp.kv_block_bytes
        spec_tiers = base["tiers"] | {"gpu": {"capacity": ring + draft_bytes}}  # the draft resident beside the ring
        for k in [*ks, *(f"{t} tree" for t in tree_ks)]:
            tree = isinstance(k, str) and k.endswith("tree")
            cfg_k = base | {"tiers": spec_tiers, "speculative": {"draft": str(draft), "tokens": k, "tree": tree}}
            if tree:  # device blocks for the forks of the extra branches (3 per output, each a chain and a copy)
                k = int(k.split()[0])
                extra = batch * 3 * (2 + blocks_for(k + 1, 16))
                block = PagedKVCache.block_nbytes(Checkpoint(target).config, 16, torch.bfloat16)
                cfg_k = cfg_k | {"speculative": {"draft": str(draft), "tokens": k, "tree": True},
                                 "kv_cache": {"block_size": 16, "gpu_blocks": blocks + extra},
                                 "tiers": spec_tiers | {"gpu": {"capacity": spec_tiers["gpu"]["capacity"]
                                                                + extra * (block + draft_rp.kv_block_bytes)}}}
            label = f"{dname} k={k}" + (" tree" if tree else "")
            print(f"[{name}] draft {dname}, {label} (load {load()})", file=sys.stderr)
            row = {"target": name, "run": label, "batch": batch, **run_worker(job | {"config": cfg_k})}
            row["speedup"] = row["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
            row["same_tokens_as_plain"] = row["tokens"] == plain["tokens"]
            if row["draft_ms"] and row["verify_ms"]:
                used = k if k != "auto" else max(row["auto_choice"] or 1, 1)
                row |= predictions(row, plain, base, draft_alone, used)
            rows.append(row)
            print(f"[{name}] {row['run']}: {row['decode_tokens_per_s']:.2f} tok/s vs plain "
                  f"{plain['decode_tokens_per_s']:.2f} (x{row['speedup']:.2f}), acceptance {row['acceptance']:.2f}, "
                  f"{row['tokens_per_pass']:.2f} tokens/pass, same tokens: {row['same_tokens_as_plain']}",
                  file=sys.stderr)
    return rows


def markdown(result: dict) -> str:
    lines = ["# Speculative decoding over streamed weights", "",
             "| target | run | tok/s | x plain | drafts kept | alpha | tokens/pass | draft ms | verify ms "
             "| plain ms/pass "
             "| predicted x (measured times) | predicted x (cost model) | same tokens | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, d=2):
        return "" if v is None else f"{v:.{d}f}" if isinstance(v, float) else str(v)

    plain = {}
    for r in result["rows"]:
        if r["run"] == "plain":
            plain[r["target"]] = r["ms_per_pass"]
        lines.append(f"| {r['target']} | {r['run']} | {f(r['decode_tokens_per_s'])} | {f(r.get('speedup'))} | "
                     f"{f(r['acceptance'])} | {f(r.get('alpha'))} | {f(r['tokens_per_pass'])} | "
                     f"{f(r['draft_ms'], 0)} | "
                     f"{f(r['verify_ms'], 0)} | {f(plain.get(r['target']), 0)} | "
                     f"{f(r.get('predicted_speedup_from_measured_times'))} | "
                     f"{f(r.get('predicted_speedup_from_cost_model'))} | {r.get('same_tokens_as_plain', '')} | "
                     f"{r['load']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the trained model only, 16 new tokens")
    ap.add_argument("--out", type=Path, default=Path("/tmp/spec-bench"), help="models and stores go here")
    ap.add_argument("--results", type=Path, default=ROOT / "scripts" / "results")
    ap.add_argument("--medium", type=Path, default=None, help="the medium random model (made if absent)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from scripts.bench import ensure_model
    from scripts.trained_model import ensure_trained_model

    header = Result()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = {"rows": []}
    trained = ensure_trained_model(dtype="bfloat16")
    new = 16 if args.quick else args.new
    drafts = {"self-int4": "self-int4", "self-int8": "self-int8"}
    result["rows"] += bench_target("SmolLM2-135M (trained)", trained, drafts, out, new,
                                   [4, "auto"] if args.quick else [4, 8, "auto"], batch=1,
                                   tree_ks=(4,) if args.quick else (4, 8))
    if not args.quick:
        medium = args.medium or ensure_model(out, "medium")
        result["rows"] += bench_target("medium (random)", medium, {"self-int4": "self-int4"}, out, 8, [4, "auto"],
                                       batch=1)
    for r in result["rows"]:
        r.pop("tokens", None)
    print(header.write(args.results, "bench-spec", markdown(result), result).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
