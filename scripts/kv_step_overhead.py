"""Benchmark: the Python work of a decode step's KV bookkeeping at long context (CPU, small model shape).

    python scripts/kv_step_overhead.py [--context 32768] [--batch 8] [--steps 5] [--out scripts/results]

Builds the paged KV cache of `batch` sequences of `context` tokens each (no model math: the
cache is filled by `prepare` alone), then times `prepare` for decode steps of one token per
sequence: the host-side work that builds the step's block tables and index tensors (what the
issue calls "ms of Python per step"). Run it under two checkouts (PYTHONPATH) to compare
before/after in one session; it appends a row to OUT/kv-step-overhead.md with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from offload.kv.blocks import KVSettings
from offload.kv.cache import PagedKVCache
from offload.model.config import ModelConfig
from storage.units import blocks_for

SMALL = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12,
         "num_key_value_heads": 4, "num_hidden_layers": 8, "vocab_size": 4096}


def measure(context: int, batch: int, steps: int, block: int, cold_fraction: float) -> dict:
    cfg = ModelConfig.from_dict(SMALL)
    blocks = batch * (blocks_for(context + steps, block) + 1)
    cold = int(blocks * cold_fraction)
    settings = KVSettings(block_size=block, gpu_blocks=blocks - cold, cpu_blocks=cold, eviction="lru")
    kv = PagedKVCache(cfg, block, blocks - cold, torch.bfloat16, "cpu", settings=settings)
    sids = [kv.add_sequence() for _ in range(batch)]
    t0 = time.perf_counter()
    for s in sids:  # one sequence at a time: the demotions of a long prefill
        kv.prepare([s], [context])
    fill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        kv.prepare(sids, [1] * batch)
        times.append(time.perf_counter() - t0)
    kv.close()
    return {"context": context, "batch": batch, "blocks": blocks, "cold_blocks": kv.count("cpu"),
            "prepare_ms_median": 1000 * sorted(times)[len(times) // 2], "prepare_ms_min": 1000 * min(times),
            "fill_s": fill}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--cold", type=float, default=0.5, help="fraction of the blocks in the cpu tier")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    row = measure(args.context, args.batch, args.steps, args.block, args.cold)
    row |= {"label": args.label or "run", "load": os.getloadavg()[0], "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine()}
    print(json.dumps(row))
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "kv-step-overhead.md"
    if not md.exists():
        md.write_text("| code | context | batch | blocks | cold blocks | prepare ms/step (median) | min | "
                      "load (1 min) |\n|---|---|---|---|---|---|---|---|\n")
    with md.open("a") as f:
        f.write(f"| {row['label']} | {row['context']} | {row['batch']} | {row['blocks']} | {row['cold_blocks']} | "
                f"{row['prepare_ms_median']:.1f} | {row['prepare_ms_min']:.1f} | {row['load']:.1f} |\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
