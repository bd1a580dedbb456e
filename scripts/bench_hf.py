"""Benchmark: a model Offload has no math for (Gemma 2), streamed from disk by the transformers path, vs
Accelerate's own disk offload of it, vs the native path on a Llama of the same size.

    python scripts/bench_hf.py --quick                     # a small model, small budgets: a smoke run
    python scripts/bench_hf.py                             # TinyLlama-1.1B shape, gpu 512MiB + cpu 512MiB + disk,
                                                           # each engine run in its own 2G memory cgroup
    python scripts/bench_hf.py --memory-max none           # without the full profile's 2G memory cgroup per run
    python scripts/bench_hf.py --batch 4                   # four sequences decoding together

Runs, each in a fresh subprocess (`scripts/bench.py`'s workers, so peak RSS is each run's own), the page cache
of the checkpoint and the stores evicted before each:
  generic         Offload, model_impl auto (transformers: Gemma 2 is not native), the Gemma 2 checkpoint on the
                  tiers (gpu + cpu budget, the rest streamed from the zarr store)
  accelerate      transformers + Accelerate `device_map="auto"`, `max_memory` = each budget in `--acc-budgets`
                  (the best is reported), the rest offloaded to disk
  native          Offload's own math on a Llama of the same widths and depth, the same tiers
  generic-llama   the same Llama through model_impl: transformers: with `native` it names the gap's cause
                  (transformers' math and one-sequence passes vs Offload's kernels), since the weights, the
                  store and the prefetcher are the same
Both models are random-initialised with transformers' config classes (bf16, save_pretrained); tokens are
compared between generic and accelerate (the same checkpoint and dtype). Results go to RESULTS/NAME.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python scripts/bench_hf.py` as well as `python -m scripts.bench_hf`

from scripts import memcg  # noqa: E402
from scripts.bench import call_worker  # noqa: E402
from scripts.machine import Result  # noqa: E402

PROFILES = {
    # widths shared by both models; budgets; the run
    "full": dict(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000, gpu="512MiB",
                 cpu="512MiB", acc_budgets=["1GiB", "1536MiB"], batch=1, prompt=64, new=16, depth=2, chunk=64,
                 memory_max="2G"),
    "quick": dict(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, vocab=4096, gpu="6MiB",
                  cpu="2MiB", acc_budgets=["8MiB"], batch=1, prompt=16, new=6, depth=1, chunk=16, memory_max=None),
}


def ensure_models(out: Path, p: dict) -> dict[str, Path]:
    """A Gemma 2 and a Llama of the same widths (bf16, random), saved by transformers."""
    import torch
    import transformers

    sizes = dict(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                 num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
                 head_dim=p["hidden"] // p["heads"], max_position_embeddings=4096)
    paths = {}
    for name, (config_cls, model_cls, extra) in {
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 4096}),
        "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),  # Gemma's are tied too
    }.items():
        path = out / "models" / f"{name}-{p['hidden']}x{p['layers']}-bf16"
        if not (path / "config.json").is_file():
            torch.manual_seed(0)
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**sizes, **extra))
            finally:
                torch.set_default_dtype(torch.float32)
            model.save_pretrained(path)
        paths[name] = path
    return paths


def same(a: dict, b: dict) -> bool | None:
    """Equal tokens (None when either run failed)."""
    return a["tokens"] == b["tokens"] if "tokens" in a and "tokens" in b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, small budgets (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out", help="models and stores go here")
    ap.add_argument("--memory-max", default=None,
                    help="each engine run's memory cgroup (default: the profile's: 2G in full; none: no cgroup)")
    ap.add_argument("--results", type=Path, default=None, help="where NAME.md and NAME.json go (default: OUT)")
    ap.add_argument("--name", default="bench-hf", help="the results' file name (without .md / .json)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences decoding together (default: the profile's, 1); the transformers path runs them "
                         "in lockstep (offload.hf.lockstep), Accelerate as one batch")
    args = ap.parse_args(argv)
    header = Result()
    p = PROFILES["quick" if args.quick else "full"] | ({"batch": args.batch} if args.batch else {})
    out = args.out.resolve()
    models = ensure_models(out, p)
    spec = {"batch": p["batch"], "prompt": p["prompt"], "new": p["new"]}
    kv = {"block_size": 16, "gpu_blocks": p["batch"] * -(-(p["prompt"] + p["new"]) // 16)}

    limit = memcg.limit_arg(args.memory_max, p["memory_max"])

    def offload(model: str, impl: str, gpu: str = p["gpu"], cpu: str = p["cpu"]) -> dict:
        store = out / "stores" / f"{models[model].name}-{impl}"
        cfg = {"model": str(models[model]), "model_impl": impl, "device": "cpu", "dtype": "bfloat16",
               "kv_cache": kv, "activations": {"prefill_chunk": p["chunk"]}, "prefetch": {"depth": p["depth"]},
               "tiers": {"gpu": {"capacity": gpu}, "cpu": {"capacity": cpu}, "disk": {"path": str(store)}}}
        r = call_worker("offload", spec | {"config": cfg}, limit)
        if "error" not in r:  # the first run converts the store: measure again on the warm store
            r = call_worker("offload", spec | {"config": cfg}, limit)
        return r

    runs = {"generic": offload("gemma2", "auto"), "native": offload("llama", "native"),
            "generic-llama": offload("llama", "transformers")}
    if limit:  # what a user gets with every tier auto inside the same cgroup
        runs["generic (auto tiers)"] = offload("gemma2", "auto", "auto", "auto")
    acc = {b: call_worker("accelerate", spec | {"model": str(models["gemma2"]), "max_memory": b,
                                               "offload_folder": str(out / "accelerate-offload" / b)}, limit)
           for b in p["acc_budgets"]}
    ok = {b: r for b, r in acc.items() if "error" not in r}
    best = min(ok, key=lambda b: ok[b]["ms_per_step"]) if ok else None
    runs["accelerate"] = ok[best] if best else next(iter(acc.values()))
    rows = []
    for name, r in runs.items():
        row = {"run": name, "ms_per_step": r.get("ms_per_step"), "peak_rss": r.get("peak_rss"),
               "prefill_s": r.get("prefill_s"), "error": r.get("error"),
               "disk_bytes_per_step": r.get("disk_bytes_per_step"), "stall_ms_per_step": r.get("stall_ms_per_step"),
               "cgroup_peak": (r.get("memcg") or {}).get("peak")}
        if name == "accelerate":
            row |= {"budget": best, "by_budget_ms_per_step": {b: x.get("ms_per_step") for b, x in acc.items()},
                    "devices": r.get("devices")}
        rows.append(row)
    g, a, n = (runs[k].get("ms_per_step") for k in ("generic", "accelerate", "native"))
    gl = runs["generic-llama"].get("ms_per_step")
    summary = {
        "generic_vs_accelerate": a / g if a and g else None,
        "generic_vs_native": g / n if g and n else None,
        "generic_llama_vs_native": gl / n if gl and n else None,
        "tokens_generic_equal_accelerate": same(runs["generic"], runs["accelerate"]),
        "tokens_generic_llama_equal_native": same(runs["generic-llama"], runs["native"]),
    }
    ga = runs.get("generic (auto tiers)", {}).get("ms_per_step")
    if ga:
        summary["generic_auto_tiers_vs_accelerate"] = a / ga if a else None
    result = {"profile": "quick" if args.quick else "full", "settings": p, "memory_max": limit,
              "models": {k: str(v) for k, v in models.items()}, "rows": rows, "summary": summary}
    print(header.write(args.results or out, args.name, markdown(result), result).read_text())
    return 0


def markdown(result: dict) -> str:
    p, s = result["settings"], result["summary"]
    mib = lambda n: f"{n / 2**20:.0f}" if n else "-"  # noqa: E731
    ms = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
    lines = [f"Profile `{result['profile']}`: hidden {p['hidden']}, {p['layers']} layers, vocab {p['vocab']}, bf16; "
             f"Offload budgets gpu {p['gpu']} + cpu {p['cpu']} + disk (prefetch depth {p['depth']}), Accelerate "
             f"max_memory {', '.join(p['acc_budgets'])} (best shown); batch {p['batch']}, prompt {p['prompt']}, "
             f"{p['new']} new tokens. Each run in a fresh process"
             + (f" inside its own memory cgroup of {result['memory_max'] / 2**20:.0f} MiB (scripts/memcg.py: page "
                "cache counted; caches dropped before each run)." if result["memory_max"]
                else " (no memory cgroup: peak RSS shown)."), "",
             "| run | ms/step | peak RSS MiB | cgroup peak MiB | disk MiB/step | stall ms/step | note |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        note = r["error"] or (f"max_memory {r['budget']}" if r["run"] == "accelerate" else "")
        lines.append(f"| {r['run']} | {ms(r['ms_per_step'])} | {mib(r['peak_rss'])} | "
                     f"{mib(r['cgroup_peak'])} | "
                     f"{mib(r['disk_bytes_per_step'])} | {ms(r['stall_ms_per_step'])} | {note} |")
    f = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
    lines += ["", f"generic vs Accelerate disk offload: {f(s['generic_vs_accelerate'])} faster; generic / native "
              f"(Gemma 2 vs a Llama of the same size): {f(s['generic_vs_native'])} the step time; the same Llama "
              f"through transformers / native: {f(s['generic_llama_vs_native'])}. Tokens generic = Accelerate: "
              f"{s['tokens_generic_equal_accelerate']}; Llama generic = native: "
              f"{s['tokens_generic_llama_equal_native']}."]
    if s.get("generic_auto_tiers_vs_accelerate"):
        lines[-1] += (" With every tier auto in the same cgroup: "
                      f"{f(s['generic_auto_tiers_vs_accelerate'])} faster than Accelerate.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
