"""GPU benchmark: a model several times the gpu capacity streamed from pinned RAM, against the PCIe bound.

    python scripts/gpu_bench.py --out DIR        # needs CUDA; medium bf16 (2.2 GB) through a 512 MiB gpu tier

Measured in one run: pinned and pageable host->device bandwidth (CUDA events), the compute-only
step (all weights on the GPU), and the streamed step at batch 1 and 8 with its bytes per step
(from the spans). Reports `step / max(compute, bytes / pinned bandwidth)` and the overlap of
copies with compute from the timeline. Writes DIR/gpu_bench.json and DIR/gpu_spans.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from offload.runtime.runner import Runner
from schedulers.timeline import busy_time, overlap_time
from scripts.bench import ensure_model, prompts


def h2d_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        dev.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dev.copy_(host, non_blocking=pinned)
        end.record()
        end.synchronize()
        out[name] = nbytes * repeats / (start.elapsed_time(end) / 1000)
    return out


def run(config: dict, batch: int, prompt: int, new: int) -> dict:
    with Runner.from_config(config) as r:
        ids = prompts(batch, prompt, r.cfg.vocab_size)
        r.generate(ids[:1], max_new_tokens=2, stop_on_eos=False)  # warm up kernels
        r.timeline.clear()
        t0 = time.perf_counter()
        res = r.generate(ids, max_new_tokens=new, stop_on_eos=False)
        wall = time.perf_counter() - t0
        stats = res[0].stats
        decode = set(stats.decode_only_steps)  # the passes that only decoded
        h2d = [s for s in r.timeline.on("h2d") if s.step in decode]
        compute = [s for s in r.timeline.on("compute") if s.step in decode]
        spans = [{"track": s.track, "name": s.name, "step": s.step, "start": s.start, "end": s.end,
                  "bytes": s.nbytes} for s in r.timeline.spans]
        return {
            "ms_per_step": stats.decode_only_ms_per_step, "wall_s": wall,
            "h2d_bytes_per_step": sum(s.nbytes for s in h2d) / max(len(decode), 1),
            "h2d_busy_s": busy_time(h2d), "compute_busy_s": busy_time(compute),
            "overlap_of_h2d_with_compute": overlap_time(h2d, compute) / max(busy_time(h2d), 1e-9),
            "plan": r.plan.to_dict(), "tokens": [x.token_ids for x in res], "spans": spans,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="medium")
    ap.add_argument("--gpu", default="512MiB", help="gpu tier capacity")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: CUDA is not available here; run it on a machine with a GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = ensure_model(args.out, args.size)
    bw = h2d_bandwidth()
    print(f"h2d pinned {bw['pinned'] / 1e9:.1f} GB/s, pageable {bw['pageable'] / 1e9:.1f} GB/s", file=sys.stderr)
    base = {"model": str(model), "device": "cuda", "dtype": "bfloat16", "activations": {"prefill_chunk": 64}}
    streamed_cfg = base | {"tiers": {"gpu": {"capacity": args.gpu}, "cpu": {"capacity": "auto", "pinned": True}},
                           "prefetch": {"depth": args.depth}}
    rows, all_spans = [], {}
    for batch in args.batches:
        resident = run(base, batch, args.prompt, args.new)
        streamed = run(streamed_cfg, batch, args.prompt, args.new)
        all_spans[f"batch{batch}"] = streamed.pop("spans")
        resident.pop("spans")
        pcie_ms = 1000 * streamed["h2d_bytes_per_step"] / bw["pinned"]
        bound = max(resident["ms_per_step"], pcie_ms)
        row = {"batch": batch, "streamed_ms_per_step": streamed["ms_per_step"],
               "compute_only_ms_per_step": resident["ms_per_step"],
               "h2d_bytes_per_step": streamed["h2d_bytes_per_step"],
               "pcie_ms_per_step": pcie_ms, "ratio_to_bound": streamed["ms_per_step"] / bound,
               "overlap_of_h2d_with_compute": streamed["overlap_of_h2d_with_compute"],
               "tokens_equal_resident": streamed["tokens"] == resident["tokens"], "plan": streamed["plan"]}
        rows.append(row)
        print(f"batch {batch}: streamed {row['streamed_ms_per_step']:.1f} ms/step, compute "
              f"{resident['ms_per_step']:.1f}, pcie {pcie_ms:.1f} -> ratio {row['ratio_to_bound']:.2f}, overlap "
              f"{row['overlap_of_h2d_with_compute']:.2f}, tokens equal {row['tokens_equal_resident']}", file=sys.stderr)
    result = {"device": torch.cuda.get_device_name(), "h2d_bytes_per_s": bw, "gpu_capacity": args.gpu,
              "model": str(model), "rows": rows}
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=2))
    (args.out / "gpu_spans.json").write_text(json.dumps(all_spans))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
