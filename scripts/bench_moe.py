"""Benchmark: a mixture of experts streamed from disk, its expert cache, next-layer prediction and peers.

    python -m scripts.bench_moe --accelerate --llama-cpp   # qwen3_moe "medium" (64 experts, top 8; 4.2 GiB bf16)
    python -m scripts.bench_moe --quick        # qwen3_moe "small" (32 experts, top 4; ~0.35 GiB): a smoke run

For each batch size, in fresh subprocesses (page cache evicted first, peak RSS each run's own):
  resident      every weight in RAM: the compute-only step and the reference tokens
  lfu+prefetch  layers resident, experts homed on disk, the expert cache (policy lfu) with next-layer prediction
  lru           the same cache with policy lru and no prediction
  ring          experts.cache 0: every expert of every layer streams through the ring each pass (issue 19.2's path)
  auto          every tier `auto` (the planner fits what the cgroup leaves), experts as the planner chooses
  accelerate    transformers + Accelerate device_map auto with Offload's RAM budget, the rest on disk (--accelerate)
  llama.cpp     the checkpoint converted to GGUF, llama-bench (--llama-cpp; builds llama.cpp, ~20 min)
Per Offload run: decode ms/step, disk bytes per decode step against the routed-expert bound (the bytes of the
experts the step routed, plus the streamed layers), the cache's hit rate (cached and with prefetch), the
prediction's recall and precision, tokens equal to the resident run; and the run's routing trace replayed
through LRU and LFU caches of the same size (the policy comparison on a trace recorded from this model: its
routers are random, so the trace is close to uniform; see tests/test_moe_cache.py for skewed ones).
Every engine run but `resident` runs in its own memory cgroup smaller than the model (scripts/memcg.py; the full
profile's 2G for a 4.2 GiB model, `--memory-max` to change it), the page cache dropped first: Accelerate gets its
best `max_memory` of the profile's list, llama.cpp its mmap in the cgroup's spare room.
Results: scripts/results/NAME.{md,json} (`scripts.machine.Result`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import memcg  # noqa: E402
from scripts.bench import call_worker, evict, prompts, vm_hwm  # noqa: E402
from scripts.machine import Result  # noqa: E402

PROFILES = {
    "full": dict(size="medium", prompt=32, new=16, batches=[1, 8], gpu="1GiB", chunk=32, memory_max="2G",
                 acc_budgets=["1GiB", "1536MiB"]),
    "quick": dict(size="small", prompt=12, new=6, batches=[1, 8], gpu="200MiB", chunk=16, memory_max=None,
                  acc_budgets=["200MiB"]),
}
PEERS = ("accelerate", "llama.cpp")
VARIANTS = {"lfu+prefetch": {"policy": "lfu", "prefetch": True}, "lru": {"policy": "lru", "prefetch": False},
            "ring": {"cache": 0}, "auto": {}}  # auto: every tier `auto` (what the cgroup leaves), experts as planned


def worker(spec: dict) -> dict:
    from offload.config import OffloadConfig
    from offload.runtime.runner import Runner
    from schedulers.expert_policy import hit_rate, make_policy

    base = vm_hwm()
    cfg = spec["config"]
    if cfg.get("tiers", {}).get("disk"):
        evict([Path(cfg["tiers"]["disk"]["path"])])
    with Runner(OffloadConfig.load(cfg)) as r:
        cache = r.target.weights.cache
        if cache is not None:
            cache.trace = []
        batch = prompts(spec["batch"], spec["prompt"], r.cfg.vocab_size)
        t0 = time.perf_counter()
        res = r.generate(batch, max_new_tokens=spec["new"], stop_on_eos=False)
        wall = time.perf_counter() - t0
        stats = res[0].stats
        steps = set(stats.decode_only_steps)
        n = max(len(steps), 1)
        plan = r.plan
        routed = [s for s in r.timeline.on("experts") if s.step in steps]
        expert = max((plan.sizes[g] for g in plan.order if ".expert." in g), default=0)
        routed_bytes = expert * sum(s.args["hits"] + s.args["prefetched"] + s.args["misses"] for s in routed) / n
        out = {"ms_per_step": stats.decode_only_ms_per_step, "wall_s": wall, "prefill_s": stats.prefill_s,
               "disk_bytes_per_step": r.timeline.bytes_on("disk-read", steps) / n,
               "streamed_layer_bytes_per_step": sum(plan.sizes[g] for g in plan.streamed if ".expert." not in g),
               "routed_expert_bytes_per_step": routed_bytes, "experts": stats.experts,
               "tokens": [x.token_ids for x in res], "plan": plan.to_dict(), "cache_slots": plan.cache_slots}
        if cache is not None and cache.trace:
            slots = plan.cache_slots
            out["policy_on_recorded_trace"] = {
                p: round(hit_rate(cache.trace, slots, make_policy(p, slots), warmup=len(cache.trace) // 4), 4)
                for p in ("lru", "lfu")} | {"uses": len(cache.trace), "slots": slots}
    out["peak_rss"], out["base_rss"] = vm_hwm(), base
    return out


def run_worker(spec: dict, memory_max: str | None, timeout: int = 7200) -> dict:
    """This script's worker in a fresh process, inside a memory cgroup of `memory_max` when given."""
    cmd = [sys.executable, str(Path(__file__)), "--worker", "--spec", json.dumps(spec)]
    return memcg.run_json(cmd, memory_max, timeout=timeout, drop=memory_max is not None, check=True)


def ensure_model(out: Path, size: str) -> Path:
    from offload.testing.make_model import make_model

    path = out / "models" / f"{size}-qwen3_moe-bf16"
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        make_model(tmp, family="qwen3_moe", size=size, dtype="bfloat16", seed=0)
        tmp.rename(path)
    return path


#: llama.cpp's converter names a BPE tokenizer's pre-tokenizer by hashing what it makes of a test text, and
#: refuses one it has never seen, as make_model's is; its ids are all a benchmark uses, so it gets the default
CONVERT = """
import runpy, sys
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
src, sys.argv = sys.argv[1], ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def llama_cpp(model: Path, out: Path, spec: dict, memory_max: str | None) -> dict:
    """llama.cpp on the checkpoint's BF16 GGUF (the same bytes as our bf16 store), `llama-batched-bench` with this
    batch's prompt and new tokens, inside the same memory cgroup (its mmap uses the cgroup's spare room as page
    cache; caches dropped first). The GGUF comes from ../shared/peers/llama_cpp.sh, which builds llama.cpp once."""
    script = ROOT.parent / "shared" / "peers" / "llama_cpp.sh"
    bin_dir = Path(subprocess.run(["bash", str(script), "build"], capture_output=True, text=True,
                                  check=True).stdout.split()[-1])
    gguf = out / "gguf" / model.name
    gguf.parent.mkdir(parents=True, exist_ok=True)
    if not Path(f"{gguf}-bf16.gguf").is_file():  # the converter, told our tokenizer's pre-tokenizer (see CONVERT)
        src = bin_dir.parent.parent
        subprocess.run([sys.executable, "-c", CONVERT, str(src), str(model), "--outtype", "bf16", "--outfile",
                        f"{gguf}-bf16.gguf"], check=True, env=os.environ | {"PYTHONPATH": f"{src}/gguf-py:{src}"})
    tool = bin_dir / "llama-batched-bench"
    if not tool.is_file():  # the peers script builds llama-bench; the batched tool is one more target of its tree
        subprocess.run(["cmake", "--build", str(bin_dir.parent), "--target", "llama-batched-bench"], check=True,
                       capture_output=True)
    b, n = spec["batch"], spec["new"]
    cmd = [str(tool), "-m", f"{gguf}-bf16.gguf", "-t", str(os.cpu_count()), "-c", str(b * (spec["prompt"] + n + 8)),
           "-npp", str(spec["prompt"]), "-ntg", str(n), "-npl", str(b), "--output-format", "jsonl"]
    for _ in range(2):  # (it has exited 0 having printed nothing, once in a bench's first call: asked once more)
        proc, stats = memcg.run(cmd, memory_max, drop=True, capture_output=True, text=True, timeout=7200,
                                env=os.environ | {"LD_LIBRARY_PATH": str(bin_dir)})
        if proc.returncode != 0:
            return {"error": memcg.why_failed(proc, stats), "memcg": stats}
        rows = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if rows:
            break
    else:  # a row saying so, not a crash that loses the other engines' rows
        return {"error": "llama-batched-bench exited 0 and printed no result, twice", "memcg": stats}
    row = json.loads(rows[-1])
    return {"ms_per_step": 1000 * row["t_tg"] / n, "prefill_s": row["t_pp"], "format": "BF16 GGUF",
            "llama_batched_bench": row, "memcg": stats}


def summary(rows: list[dict]) -> str:
    """Offload's best tiered run against each peer, per batch size."""
    out = []
    for b in sorted({r["batch"] for r in rows}):
        ours = [r for r in rows if r["batch"] == b and r["run"] in VARIANTS and r.get("ms_per_step")]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["ms_per_step"])
        peers = [f"{r['run']}'s step {r['ms_per_step'] / best['ms_per_step']:.2f}x ours" if r.get("ms_per_step") else
                 f"{r['run']} failed ({r.get('error')})" for r in rows if r["batch"] == b and r["run"] in PEERS]
        out.append(f"Batch {b}: Offload's best tiered run ({best['run']}) {best['ms_per_step']:.0f} ms/step"
                   + ("; " + ", ".join(peers) if peers else "") + ".")
    return " ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small model, few tokens (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out", help="models and stores go here")
    ap.add_argument("--accelerate", action="store_true", help="also run the Accelerate peer")
    ap.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp on the GGUF conversion")
    ap.add_argument("--memory-max", default=None,
                    help="each engine run's memory cgroup (default: the profile's: 2G in full; none: no cgroup)")
    ap.add_argument("--name", default=None, help="the results' name (default moe-bench or moe-bench-quick)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.spec))))
        return 0
    result = Result()
    prof = PROFILES["quick" if args.quick else "full"]
    model = ensure_model(args.out, prof["size"])
    store = args.out / "stores" / model.name
    common = {"model": str(model), "device": "cpu", "dtype": "bfloat16", "compute_dtype": "bfloat16",
              "kv_cache": {"gpu_blocks": 64}, "activations": {"prefill_chunk": prof["chunk"]},
              "prefetch": {"depth": 2}}
    tiers = {"gpu": {"capacity": prof["gpu"]}, "cpu": {"capacity": 0}, "disk": {"path": str(store)}}
    limit = memcg.limit_arg(args.memory_max, prof["memory_max"])
    rows = []
    for batch in prof["batches"]:
        spec = {"batch": batch, "prompt": prof["prompt"], "new": prof["new"]}
        resident = run_worker(spec | {"config": common}, None)
        rows.append({"batch": batch, "run": "resident", **resident})
        for name, experts in VARIANTS.items():
            t = tiers if experts else tiers | {"gpu": {"capacity": "auto"}, "cpu": {"capacity": "auto"}}
            r = run_worker(spec | {"config": common | {"tiers": t, "experts": experts}}, limit)
            r["same_tokens"] = r["tokens"] == resident["tokens"]
            rows.append({"batch": batch, "run": name, **r})
        if args.accelerate:  # its best budget inside the same cgroup
            acc = {b: call_worker("accelerate", spec | {"model": str(model), "max_memory": b,
                                                        "offload_folder": str(args.out / "acc" / b)}, limit)
                   for b in prof["acc_budgets"]}
            ok = {b: r for b, r in acc.items() if "error" not in r}
            best = min(ok, key=lambda b: ok[b]["ms_per_step"]) if ok else prof["acc_budgets"][0]
            rows.append({"batch": batch, "run": "accelerate", "budget": best, **acc[best],
                         "same_tokens": acc[best].get("tokens") == resident["tokens"] if best in ok else None,
                         "by_budget_ms_per_step": {b: r.get("ms_per_step", r.get("error")) for b, r in acc.items()}})
        if args.llama_cpp:
            rows.append({"batch": batch, "run": "llama.cpp", **llama_cpp(model, args.out, spec, limit)})
    md = [f"Model: qwen3_moe `{prof['size']}` (make_model, random weights, bf16), device tier {prof['gpu']}, no host "
          f"tier, experts on disk; {prof['prompt']}-token prompts, {prof['new']} new tokens. Memory cgroup: "
          + (f"{limit / 2**20:.0f} MiB per engine run (scripts/memcg.py: page cache counted, caches dropped "
             "before each run; the resident row runs without it)" if limit
             else "none (budgets are Offload's tiers only)")
          + (". A --quick run: the smoke test, not the benchmark." if args.quick else "."), "",
          "| batch | run | ms/step | disk read / step | routed bound / step | hit rate (cached / with prefetch) "
          "| prediction recall / precision | LRU / LFU on the recorded trace | same tokens | cgroup peak | note |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r.get("experts") or {}
        mib = 2**20
        bound = (f"{(r['routed_expert_bytes_per_step'] + r['streamed_layer_bytes_per_step']) / mib:.1f} MiB" if e
                 else "-")  # the routed experts are counted by the cache
        pol = r.get("policy_on_recorded_trace")
        md.append(f"| {r['batch']} | {r['run']} | {r.get('ms_per_step', 0):.1f} | "
                  f"{r.get('disk_bytes_per_step', 0) / mib:.1f} MiB | {bound} | "
                  + (f"{100 * e['hit_rate']:.0f}% / {100 * e['hit_rate_with_prefetch']:.0f}%" if e else "-") + " | "
                  + (f"{100 * e['prediction_recall']:.0f}% / {100 * e['prediction_precision']:.0f}%"
                     if e.get("prediction_recall") is not None else "-") + " | "
                  + (f"{100 * pol['lru']:.0f}% / {100 * pol['lfu']:.0f}% ({pol['slots']} slots)" if pol else "-")
                  + f" | {r.get('same_tokens', '-')} | "
                  + (f"{r['memcg']['peak'] / mib:.0f} MiB" if (r.get("memcg") or {}).get("peak") else "-") + " | "
                  + (r.get("error") or (f"max_memory {r['budget']} (of {', '.join(prof['acc_budgets'])})"
                                        if r["run"] == "accelerate" else r.get("format", ""))) + " |")
    md += ["", summary(rows)]
    for r in rows:
        r.pop("step_ms", None)
    name = args.name or ("moe-bench-quick" if args.quick else "moe-bench")
    path = result.write(ROOT / "scripts" / "results", name, "\n".join(md), rows)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
