"""Soak: a server under mixed load and faults for 2000+ engine steps; RSS and KV block counts must stay flat.

    python scripts/soak_serve.py [--steps 3000] [--clients 8]

Clients (one thread each, the official openai client) loop over: non-streamed completions,
streamed ones read to the end, streams dropped after a few tokens (cancellation), n=2 samples,
chat, requests that run past the timeout (504), and requests whose KV could never fit (400). Every 0.5 s
the script samples the process RSS and the loop's counters. Pass: after a warm-up (the first
fifth of the steps), the RSS of the last quarter exceeds that of the first quarter by less than
`--max-growth-mib`, and once the clients stop every KV block is free and no sequence is left.
Results go to scripts/results/soak-serve.{json,md}, with the command, the machine and the load.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
import psutil  # noqa: E402

from offload.config import OffloadConfig  # noqa: E402
from offload.runtime.runner import Runner  # noqa: E402
from offload.serve.background import BackgroundServer  # noqa: E402
from offload.serve.loop import Limits  # noqa: E402
from offload.testing.make_model import make_model  # noqa: E402
from schedulers.timeline import Timeline  # noqa: E402
from scripts.machine import Result  # noqa: E402

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls watch from an old oak tree".split()


def client_loop(c: openai.OpenAI, seed: int, stop: threading.Event, counts: dict[str, int], lock) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        kind = rng.choice(["plain", "stream", "drop", "samples", "chat", "refused", "slow"])
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
        n = rng.randint(1, 48)
        try:
            if kind == "plain":
                c.completions.create(model="soak", prompt=prompt, max_tokens=n)
            elif kind == "stream":
                for _ in c.completions.create(model="soak", prompt=prompt, max_tokens=n, stream=True):
                    pass
            elif kind == "drop":
                s = c.completions.create(model="soak", prompt=prompt, max_tokens=200, stream=True)
                for i, _ in enumerate(s):
                    if i >= 2:
                        break
                s.close()
            elif kind == "samples":
                c.completions.create(model="soak", prompt=prompt, max_tokens=n, n=2, temperature=1.0, seed=seed)
            elif kind == "chat":
                c.chat.completions.create(model="soak", messages=[{"role": "user", "content": prompt}], max_tokens=n)
            elif kind == "slow":  # more tokens than the timeout allows
                c.completions.create(model="soak", prompt=prompt, max_tokens=600)
            else:  # its KV could never fit the pool: refused with 400 before it is queued
                c.completions.create(model="soak", prompt=prompt, max_tokens=3000)
        except openai.APIStatusError as e:
            kind = f"{kind}:{e.status_code}"
        except openai.APIError as e:  # a stream that ended with an error event (a timeout)
            kind = f"{kind}:{type(e).__name__}"
        with lock:
            counts[kind] = counts.get(kind, 0) + 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-growth-mib", type=float, default=16.0)
    ap.add_argument("--results", type=Path, default=ROOT / "scripts" / "results")
    args = ap.parse_args(argv)
    header = Result()
    tmp = Path(tempfile.mkdtemp(prefix="offload-soak-"))
    try:
        model = make_model(tmp / "soak", family="llama", size="tiny")
        (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
        config = OffloadConfig.load({"model": str(model), "device": "cpu", "dtype": "float32",
                                     "kv_cache": {"gpu_blocks": 128}})
        samples: list[dict] = []
        counts: dict[str, int] = {}
        lock = threading.Lock()
        with Runner(config, timeline=Timeline(enabled=True)) as runner, \
                BackgroundServer(runner, Limits(max_batch=16, max_queue=16, timeout_s=3.0), name="soak") as srv:
            proc = psutil.Process()
            stop = threading.Event()
            c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
            threads = [threading.Thread(target=client_loop, args=(c, i, stop, counts, lock), daemon=True)
                       for i in range(args.clients)]
            for t in threads:
                t.start()
            t0 = time.monotonic()
            while srv.loop.steps < args.steps:
                samples.append(srv.loop.stats() | {"rss": proc.memory_info().rss, "t": time.monotonic() - t0})
                time.sleep(0.5)
            stop.set()
            for t in threads:
                t.join(timeout=120)
            end = time.monotonic() + 30
            while srv.loop.stats()["running"] and time.monotonic() < end:
                time.sleep(0.05)
            time.sleep(0.2)
            final = srv.loop.stats() | {"rss": proc.memory_info().rss, "spans": len(runner.timeline.spans)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    warm = [s for s in samples if s["steps"] >= args.steps // 5]
    q = max(len(warm) // 4, 1)
    first, last = statistics.median(s["rss"] for s in warm[:q]), statistics.median(s["rss"] for s in warm[-q:])
    growth = (last - first) / 2**20
    ok = growth < args.max_growth_mib and final["kv_blocks_free"] == final["kv_blocks"] \
        and final["kv_sequences"] == 0 and final["kv_logical_free"] == final["kv_blocks"]
    result = {"steps": final["steps"], "clients": args.clients, "requests": counts, "rss_first_mib": first / 2**20,
              "rss_last_mib": last / 2**20, "growth_mib": growth, "final": final, "ok": ok,
              "samples": samples}
    lines = [f"Soak: {final['steps']} engine steps, {args.clients} clients, {sum(counts.values())} requests "
             f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}).",
             f"RSS after warm-up: first quarter {first / 2**20:.1f} MiB, last quarter {last / 2**20:.1f} MiB "
             f"(growth {growth:+.1f} MiB; limit {args.max_growth_mib} MiB).",
             f"At the end: {final['kv_blocks_free']}/{final['kv_blocks']} device KV blocks free, "
             f"{final['kv_logical_free']} logical free, {final['kv_sequences']} sequences, "
             f"{final['spans']} spans held; {'PASS' if ok else 'FAIL'}."]
    print(header.write(args.results, "soak-serve", "\n".join(lines), result).read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
