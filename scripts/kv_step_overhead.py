"""Benchmark: the Python work of a decode step's KV bookkeeping at long context (CPU, small model shape).

    python -m scripts.kv_step_overhead [--contexts 2048 32768] [--batch 8] [--steps 5] [--out scripts/results]

Builds the paged KV cache of `batch` sequences of `context` tokens each (no model math: the
cache is filled by `prepare` alone), then times `prepare` for decode steps of one token per
sequence: the host-side work that builds the step's block tables and index tensors (what the
issue calls "ms of Python per step"). Writes OUT/kv-step-overhead.{md,json} (`scripts.machine.Result`:
the command, the machine, the load); to compare two checkouts, run it under each (PYTHONPATH) with its
own --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from offload.kv.blocks import KVSettings
from offload.kv.cache import PagedKVCache
from offload.model.config import ModelConfig
from scripts.machine import Result
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
    ap.add_argument("--contexts", type=int, nargs="*", default=[2048, 32768])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--cold", type=float, default=0.5, help="fraction of the blocks in the cpu tier")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    header = Result()
    rows = [measure(c, args.batch, args.steps, args.block, args.cold) for c in args.contexts]
    lines = [f"`prepare` for a decode step of {args.batch} sequences (small model shape, block {args.block}, "
             f"{args.cold:.0%} of the blocks in the cpu tier), median and min of {args.steps} steps.", "",
             "| context | batch | blocks | cold blocks | prepare ms/step (median) | min | fill s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['batch']} | {r['blocks']} | {r['cold_blocks']} | {r['prepare_ms_median']:.1f} "
              f"| {r['prepare_ms_min']:.1f} | {r['fill_s']:.1f} |" for r in rows]
    print(header.write(args.out, "kv-step-overhead", "\n".join(lines), rows).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
