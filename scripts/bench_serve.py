"""Benchmark: one weight pass serves every request. Tokens/s by batch, and the server against the same batch offline.

    python scripts/bench_serve.py                # medium (TinyLlama-1.1B shape) bf16, gpu 512MiB + cpu 512MiB + disk
    python scripts/bench_serve.py --quick        # small model: a smoke run

One Runner (homes filled once, one fixed KV pool sized for the largest batch) measures, in one run:
  sweep    for batch 1, 8, 32, 64, 128: decode tokens/s (the tokens the decode steps sampled, counted,
           over the time of those steps), next to
           batch x (1 / step at batch 1) (the ideal when the bytes moved per step bound it) and the
           compute bound (batch / the layers' compute time per step, from the same run's spans)
  server   `--server-batch` concurrent OpenAI clients (streaming, one thread each) against the
           same prompts run offline through `Runner.generate`: generated tokens / wall time, each
           from the first request to the last token
Results go to scripts/results/bench-serve{,-quick}.{json,md} (or --results), with the command line, the
machine and the load (`scripts.machine.Result`).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from offload.config import OffloadConfig  # noqa: E402
from offload.runtime.runner import Runner  # noqa: E402
from offload.serve.background import BackgroundServer  # noqa: E402
from offload.serve.loop import Limits  # noqa: E402
from schedulers.timeline import busy_time  # noqa: E402
from scripts.bench import ensure_model, ensure_store, evict, prompts  # noqa: E402
from scripts.machine import Result  # noqa: E402
from storage.units import blocks_for  # noqa: E402

PROFILES = {
    "full": dict(size="medium", gpu="512MiB", cpu="512MiB", prompt=8, new=8, batches=[1, 8, 32, 64, 128],
                 server_batch=32, chunk=256, depth=1),
    "quick": dict(size="small", gpu="64MiB", cpu="32MiB", prompt=8, new=6, batches=[1, 4, 8], server_batch=4,
                  chunk=64, depth=1),
}


def in_thread(fn, *args):
    """Run fn on a fresh thread, as the server's engine loop runs: offline and served runs compute alike
    (on a loaded machine the main thread's OpenMP team runs small matmuls several times slower)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def offline(runner: Runner, ps: list[list[int]], new: int) -> tuple[list, float]:
    t0 = time.perf_counter()
    results = in_thread(lambda: runner.generate(ps, max_new_tokens=new, stop_on_eos=False))
    return results, time.perf_counter() - t0


def sweep_row(runner: Runner, batch: int, prof: dict) -> dict:
    ps = prompts(batch, prof["prompt"], runner.cfg.vocab_size, seed=batch)
    results, wall = offline(runner, ps, prof["new"])
    stats = results[0].stats
    steps = set(stats.decode_only_steps)
    tl = runner.timeline
    compute = sum(s.duration for s in tl.on("compute") if s.step in steps) / max(len(steps), 1)
    disk = busy_time([s for s in tl.on("disk-read") if s.step in steps]) / max(len(steps), 1)
    ms = stats.decode_only_ms_per_step
    return {"batch": batch, "decode_ms_per_step": ms, "decode_tokens": stats.decode_tokens,
            "decode_s": stats.decode_s, "tokens_per_s": stats.decode_tokens_per_s,
            "compute_ms_per_step": 1000 * compute, "disk_busy_ms_per_step": 1000 * disk,
            "compute_bound_tokens_per_s": batch / compute if compute else 0.0, "decode_steps": len(steps),
            "prefill_s": stats.prefill_s, "wall_s": wall,
            "generated": sum(len(r.token_ids) for r in results)}


def server_vs_offline(runner: Runner, batch: int, prof: dict) -> dict:
    ps = prompts(batch, prof["prompt"], runner.cfg.vocab_size, seed=1000 + batch)
    done_offline, offline_s = offline(runner, ps, prof["new"])
    offline_tokens = sum(len(r.token_ids) for r in done_offline)
    with BackgroundServer(runner, Limits(max_batch=batch, max_queue=batch), name="bench") as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=3600)
        gate = threading.Barrier(batch + 1)

        def ask(p: list[int]) -> tuple[int, float]:
            gate.wait()
            n = 0
            for ch in client.completions.create(model="bench", prompt=p, max_tokens=prof["new"], temperature=0,
                                                stream=True, logprobs=0):
                n += len(ch.choices[0].logprobs.tokens) if ch.choices and ch.choices[0].logprobs else 0
            return n, time.perf_counter()

        with ThreadPoolExecutor(batch) as pool:
            futures = [pool.submit(ask, p) for p in ps]
            gate.wait()
            t1 = time.perf_counter()
            done = [f.result() for f in futures]
        server_s = max(t for _, t in done) - t1
        server_tokens = sum(n for n, _ in done)
        steps = srv.loop.steps
    return {"batch": batch, "offline_tokens": offline_tokens, "offline_s": offline_s,
            "offline_tokens_per_s": offline_tokens / offline_s, "server_tokens": server_tokens,
            "server_s": server_s, "server_tokens_per_s": server_tokens / server_s, "server_steps": steps,
            "ratio": (server_tokens / server_s) / (offline_tokens / offline_s)}


def markdown(result: dict) -> str:
    p = result["settings"]
    base = result["sweep"][0]
    profile = "the `--quick` profile (a small model, not the medium one)" if result["profile"] == "quick" else \
        "the full profile"
    lines = [f"Model {Path(result['model']).name}, {profile}: budgets gpu {p['gpu']} + cpu {p['cpu']} + disk, "
             f"prefetch depth {p['depth']}, prompt {p['prompt']}, {p['new']} new tokens, prefill chunk {p['chunk']}, "
             f"KV {result['kv_blocks']} device blocks (room for the largest batch); one Runner for every row. "
             "tokens/s: the tokens the decode steps sampled over their time.",
             "",
             "| batch | ms/step | tokens/s | batch x (1/step at batch 1) | x batch 1 | compute ms/step | compute bound "
             "tok/s | of compute bound | disk busy ms/step | binds first |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["sweep"]:
        ideal = r["batch"] * base["tokens_per_s"]
        binds = "compute" if r["compute_ms_per_step"] >= r["disk_busy_ms_per_step"] else "disk"
        lines.append(f"| {r['batch']} | {r['decode_ms_per_step']:.0f} | {r['tokens_per_s']:.2f} | {ideal:.2f} | "
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.1f}x | {r['compute_ms_per_step']:.0f} | "
                     f"{r['compute_bound_tokens_per_s']:.2f} | "
                     f"{r['tokens_per_s'] / r['compute_bound_tokens_per_s']:.2f} | {r['disk_busy_ms_per_step']:.0f} | "
                     f"{binds} |")
    s = result["server"]
    lines += ["", f"Server: {s['batch']} concurrent OpenAI clients (streaming) vs the same {s['batch']} prompts "
              "offline (`Runner.generate`), generated tokens / wall time including prefill:", "",
              "| batch | offline tok/s | server tok/s | server / offline |", "|---|---|---|---|",
              f"| {s['batch']} | {s['offline_tokens_per_s']:.2f} | {s['server_tokens_per_s']:.2f} | "
              f"{s['ratio']:.2f} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, small budgets (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out", help="models and stores go here")
    ap.add_argument("--results", type=Path, default=ROOT / "scripts" / "results", help="where the tables go")
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--server-batch", type=int, default=None)
    args = ap.parse_args(argv)
    prof = dict(PROFILES["quick" if args.quick else "full"])
    if args.batches:
        prof["batches"] = args.batches
    if args.server_batch:
        prof["server_batch"] = args.server_batch
    header = Result()
    out = args.out.resolve()
    model = ensure_model(out, prof["size"])
    store = out / "stores" / model.name
    ensure_store(model, store)
    evict([store])
    blocks = max(prof["batches"] + [prof["server_batch"]]) * blocks_for(prof["prompt"] + prof["new"], 16)
    config = {"model": str(model), "device": "cpu", "dtype": "bfloat16", "prefetch": {"depth": prof["depth"]},
              "tiers": {"gpu": {"capacity": prof["gpu"]}, "cpu": {"capacity": prof["cpu"]},
                        "disk": {"path": str(store)}},
              "kv_cache": {"block_size": 16, "gpu_blocks": blocks}, "activations": {"prefill_chunk": prof["chunk"]}}
    rows = []
    with Runner(OffloadConfig.load(config)) as runner:
        print(runner.plan.describe(), file=sys.stderr)
        for batch in prof["batches"]:
            rows.append(sweep_row(runner, batch, prof))
            r = rows[-1]
            print(f"batch {batch}: {r['decode_ms_per_step']:.0f} ms/step, {r['tokens_per_s']:.2f} tok/s, compute "
                  f"{r['compute_ms_per_step']:.0f} ms/step, disk busy {r['disk_busy_ms_per_step']:.0f}",
                  file=sys.stderr)
        server = server_vs_offline(runner, prof["server_batch"], prof)
        print(f"server batch {server['batch']}: {server['server_tokens_per_s']:.2f} tok/s vs offline "
              f"{server['offline_tokens_per_s']:.2f} (ratio {server['ratio']:.2f})", file=sys.stderr)
        plan = runner.plan.describe()
    result = {"profile": "quick" if args.quick else "full", "settings": prof, "model": str(model), "plan": plan,
              "kv_blocks": blocks, "sweep": rows, "server": server}
    name = "bench-serve-quick" if args.quick else "bench-serve"
    print(header.write(args.results, name, markdown(result), result).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
