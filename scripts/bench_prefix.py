"""Benchmark: a shared prompt prefix computed once (the prefix cache), with the weights streamed.

    python -m scripts.bench_prefix            # medium (TinyLlama-1.1B shape) bf16, a 2048-token shared prompt
    python -m scripts.bench_prefix --quick    # small model, a 256-token shared prompt: a smoke run

Three measurements, each with the weights streamed through gpu + cpu budgets from the disk store:
  ttft      time to first token (generate, max_new_tokens=1) of a first request (the shared system prompt and
            a short question) and of a second one (the same prompt, another question), prefix_cache on; the
            same second request with prefix_cache off, as the cold reference. Aim: second / first <= 0.1.
Every runner (and process) first answers a short unrelated warm-up request, so one-time costs are not counted.
  server    `clients` concurrent OpenAI clients (streaming), each the shared prompt and its own question,
            generated tokens / wall time from the first request to the last token, prefix_cache on vs off.
  restart   prefix_cache: persist: one process runs the first request and exits; a new process (a real
            restart: a subprocess) runs the second and reports its TTFT and the prompt tokens it read back.
Results go to scripts/results/bench-prefix{,-quick}.{json,md} (or --results), with the command, the machine and
the load (`scripts.machine.Result`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
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
from scripts.bench import ensure_model, ensure_store, evict, prompts  # noqa: E402
from scripts.machine import Result  # noqa: E402
from storage.units import blocks_for  # noqa: E402

PROFILES = {
    "full": dict(size="medium", gpu="1GiB", cpu="512MiB", shared=2048, question=16, new=8, clients=32,
                 chunk=512, depth=1),
    "quick": dict(size="small", gpu="64MiB", cpu="32MiB", shared=256, question=8, new=4, clients=4, chunk=128,
                  depth=1),
}


def config(model: Path, store: Path, prof: dict, mode: str) -> dict:
    per = blocks_for(prof["shared"] + prof["question"] + prof["new"], 16)
    return {"model": str(model), "device": "cpu", "dtype": "bfloat16", "prefetch": {"depth": prof["depth"]},
            "tiers": {"gpu": {"capacity": prof["gpu"]}, "cpu": {"capacity": prof["cpu"]},
                      "disk": {"path": str(store)}},
            # admission reserves each request's worst case (shared blocks counted per request): the disk pool
            # gives the logical ids; blocks actually written fit the device pool
            "kv_cache": {"block_size": 16, "gpu_blocks": 4 * per, "disk_blocks": (prof["clients"] + 2) * per,
                         "prefix_cache": mode},
            "activations": {"prefill_chunk": prof["chunk"]}}


def requests(prof: dict, vocab: int, n: int) -> list[list[int]]:
    [shared] = prompts(1, prof["shared"], vocab, seed=0)
    return [shared + q[1:] for q in prompts(n, prof["question"] + 1, vocab, seed=1)]


def in_thread(fn, *args):
    """As the server's engine loop runs (a fresh thread): offline and served runs compute alike."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def ttft(runner: Runner, prompt: list[int]) -> dict:
    t0 = time.perf_counter()
    [res] = in_thread(lambda: runner.generate([prompt], max_new_tokens=1, stop_on_eos=False))
    return {"ttft_s": time.perf_counter() - t0, "cached_tokens": res.stats.cached_tokens,
            "prompt_tokens": len(prompt), "token": res.token_ids[0]}


def warm_up(runner: Runner) -> None:
    """A short unrelated prompt first: the first pass of a process pays one-time costs (kernels compiled or
    loaded, pools made) that are not the prefill being measured."""
    in_thread(lambda: runner.generate([[1, 5, 9, 13]], max_new_tokens=1, stop_on_eos=False))


def measure_ttft(model: Path, store: Path, prof: dict) -> dict:
    out = {}
    with Runner(OffloadConfig.load(config(model, store, prof, "on"))) as r:
        warm_up(r)
        first, second = requests(prof, r.cfg.vocab_size, 2)
        out["first"] = ttft(r, first)
        out["second"] = ttft(r, second)
    with Runner(OffloadConfig.load(config(model, store, prof, "off"))) as r:
        warm_up(r)
        out["second_cold"] = ttft(r, second)
    out["ratio"] = out["second"]["ttft_s"] / out["first"]["ttft_s"]
    out["same_token"] = out["second"]["token"] == out["second_cold"]["token"]
    return out


def measure_server(model: Path, store: Path, prof: dict, mode: str) -> dict:
    with Runner(OffloadConfig.load(config(model, store, prof, mode))) as runner:
        warm_up(runner)
        ps = requests(prof, runner.cfg.vocab_size, prof["clients"])
        n = prof["clients"]
        with BackgroundServer(runner, Limits(max_batch=n, max_queue=n), name="bench") as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=3600)
            gate = threading.Barrier(n + 1)

            def ask(p: list[int]) -> tuple[int, float, int]:
                gate.wait()
                tokens, cached = 0, 0
                for ch in client.completions.create(model="bench", prompt=p, max_tokens=prof["new"], temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
                    if ch.usage is not None:  # the last chunk
                        tokens = ch.usage.completion_tokens
                        cached = ch.usage.prompt_tokens_details.cached_tokens
                return tokens, time.perf_counter(), cached

            with ThreadPoolExecutor(n) as pool:
                futures = [pool.submit(ask, p) for p in ps]
                gate.wait()
                t1 = time.perf_counter()
                done = [f.result() for f in futures]
        wall = max(t for _, t, _ in done) - t1
        tokens = sum(k for k, _, _ in done)
        return {"mode": mode, "clients": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                "cached_tokens": sum(c for _, _, c in done), "steps": srv.loop.steps}


def worker(spec: dict) -> dict:
    """One process's part of the restart measurement: the first or the second request, prefix_cache: persist."""
    model, store, prof = Path(spec["model"]), Path(spec["store"]), spec["prof"]
    with Runner(OffloadConfig.load(config(model, store, prof, "persist"))) as r:
        warm_up(r)
        first, second = requests(prof, r.cfg.vocab_size, 2)
        row = ttft(r, first if spec["which"] == "first" else second)
        row["persisted_blocks"] = r.kv.prefix.persisted.count
        return row


def run_worker(spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "scripts.bench_prefix", "--worker", json.dumps(spec)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_restart(model: Path, store: Path, prof: dict) -> dict:
    for old in (store / "prefix-cache").glob("*/*.kvb"):
        old.unlink()
    spec = {"model": str(model), "store": str(store), "prof": prof}
    first = run_worker(spec | {"which": "first"})
    second = run_worker(spec | {"which": "second"})
    return {"first_process": first, "second_process": second, "ratio": second["ttft_s"] / first["ttft_s"]}


def markdown(result: dict) -> str:
    p, t = result["settings"], result["ttft"]
    profile = ("the `--quick` profile (a small model and a short shared prompt, not the 2k-token medium run; the "
               "machine was shared with other jobs)") if result["profile"] == "quick" else "the full profile"
    lines = [f"Model {Path(result['model']).name}, {profile}: bf16 weights streamed (gpu {p['gpu']} + cpu {p['cpu']} "
             f"+ disk store), prefetch depth {p['depth']}, a shared prompt of {p['shared']} tokens and questions of "
             f"{p['question']}, prefill chunk {p['chunk']}, block 16.", "",
             "| request | TTFT s | prompt tokens | from the cache |", "|---|---|---|---|"]
    for name, label in (("first", "first (cold cache)"), ("second", "second (prefix cached)"),
                        ("second_cold", "second, prefix_cache: off")):
        r = t[name]
        lines.append(f"| {label} | {r['ttft_s']:.3f} | {r['prompt_tokens']} | {r['cached_tokens']} |")
    lines += ["", f"Second / first TTFT: **{t['ratio']:.3f}** (aim <= 0.1); the second request's first token equals "
              f"the cold run's: {t['same_token']}.", "",
              f"Server, {p['clients']} concurrent streaming clients sharing the prompt, {p['new']} new tokens each:",
              "",
              "| prefix_cache | tokens | wall s | tokens/s | prompt tokens from the cache | passes |",
              "|---|---|---|---|---|---|"]
    for s in result["server"]:
        lines.append(f"| {s['mode']} | {s['tokens']} | {s['wall_s']:.2f} | {s['tokens_per_s']:.2f} | "
                     f"{s['cached_tokens']} | {s['steps']} |")
    on, off = result["server"]
    lines.append(f"\nOn / off tokens/s: **{on['tokens_per_s'] / off['tokens_per_s']:.2f}x**.")
    rs = result["restart"]
    lines += ["", "Restart with `prefix_cache: persist` (two processes on one store):", "",
              "| process | TTFT s | from the cache | blocks on disk after |", "|---|---|---|---|",
              f"| first | {rs['first_process']['ttft_s']:.3f} | {rs['first_process']['cached_tokens']} | "
              f"{rs['first_process']['persisted_blocks']} |",
              f"| second (new process) | {rs['second_process']['ttft_s']:.3f} | "
              f"{rs['second_process']['cached_tokens']} | {rs['second_process']['persisted_blocks']} |",
              "", f"Second process / first TTFT: **{rs['ratio']:.3f}**."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, a 256-token shared prompt (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out", help="models and stores go here")
    ap.add_argument("--results", type=Path, default=ROOT / "scripts" / "results", help="where the tables go")
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    prof = dict(PROFILES["quick" if args.quick else "full"])
    if args.clients:
        prof["clients"] = args.clients
    header = Result()
    out = args.out.resolve()
    model = ensure_model(out, prof["size"])
    store = out / "stores" / model.name
    ensure_store(model, store)
    evict([store])
    result = {"profile": "quick" if args.quick else "full", "settings": prof, "model": str(model)}
    result["ttft"] = measure_ttft(model, store, prof)
    print(f"ttft: {result['ttft']}", file=sys.stderr)
    result["server"] = [measure_server(model, store, prof, mode) for mode in ("on", "off")]
    print(f"server: {result['server']}", file=sys.stderr)
    result["restart"] = measure_restart(model, store, prof)
    print(f"restart: {result['restart']}", file=sys.stderr)
    name = "bench-prefix-quick" if args.quick else "bench-prefix"
    print(header.write(args.results, name, markdown(result), result).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
