"""Check: `offload plan`'s predicted decode step against the measured one, on this machine, for a small model.

    python -m scripts.plan_check [--model DIR] [--formats none int8 int4] [--new 32]

Calibrates this machine's compute first (as `offload calibrate --device cpu` does, into a temporary file, so
that the prediction and the run see the same load), then for each weight format plans the model all resident
on the CPU and runs it: greedy decode of `--new` tokens after a short prompt, the mean decode step against the
plan's step at batch 1 and the run's mean context. Each row also shows the prediction without the calibrated
fixed cost per layer (what the planner predicted before it: weight bytes over a rate measured on one large
layer). The default model is SmolLM2-135M-Instruct (`scripts/trained_model.py`) in bf16.

Writes scripts/results/plan-check.{md,json} with the command, the machine and the load (a shared machine:
rerun when it is quiet).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import offload  # noqa: F401 - first: its OpenMP wait policy holds only where it is set before torch loads

# isort: split
import torch  # noqa: E402

from offload.config import OffloadConfig  # noqa: E402
from offload.model.checkpoint import Checkpoint  # noqa: E402
from offload.model.config import ModelConfig  # noqa: E402
from offload.plan.calibrate import REFERENCE, Calibration, calibrate  # noqa: E402
from offload.plan.planner import Planner  # noqa: E402
from offload.plan.predict import Workload, predict_decode  # noqa: E402
from offload.runtime.device import resolve_device, resolve_dtype  # noqa: E402
from offload.runtime.overhead import engine_overhead_s  # noqa: E402
from offload.runtime.runner import Runner  # noqa: E402
from offload.weights.groups import group_layout  # noqa: E402
from scripts.machine import Result, load  # noqa: E402
from scripts.trained_model import ensure_trained_model  # noqa: E402

PROMPT = "The history of the Roman Empire begins with"


def predicted(config: OffloadConfig, cal: Calibration, context: int) -> float:
    cfg = Checkpoint(config.model).config
    dtype, device = resolve_dtype(config.dtype, cfg.torch_dtype), resolve_device(config.device)
    planner = Planner(config, cfg, dtype, device)
    plan = planner.run_plan().plan
    return predict_decode(plan, cfg, cal, device.type, Workload(context=context), dtype.itemsize,
                          planner.compute_sizes).step_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the trained SmolLM2-135M)")
    ap.add_argument("--formats", nargs="*", default=["none", "int8", "int4"])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", default="scripts/results")
    args = ap.parse_args()
    result = Result()
    model = Path(args.model) if args.model else ensure_trained_model(dtype="float32")
    t0 = time.perf_counter()
    cal = calibrate(torch.device("cpu"), torch.bfloat16, None, engine=engine_overhead_s)
    cal_s = time.perf_counter() - t0
    # the same numbers without the fixed cost: bytes over the rate of the large layer alone (before the change)
    big = group_layout(ModelConfig.from_dict(REFERENCE), "layer.0", torch.bfloat16).nbytes
    old = copy.deepcopy(cal)
    for table in old.compute.values():  # (one line, no fixed costs: the narrow line and the cold ones' dropped)
        for key in [k for k in table if "narrow" in k or k == "cold_layer_overhead_s"]:
            del table[key]
        fixed = table.pop("layer_overhead_s")
        table["weight_bytes_per_s"] = [r / (1 + f * r / big) for r, f in
                                       zip(table["weight_bytes_per_s"], fixed)]
    path = Path(tempfile.mkdtemp()) / "calibration.json"
    cal.save(path)
    rows = []
    for fmt in args.formats:
        config = OffloadConfig.load({"model": str(model), "device": "cpu", "dtype": "bfloat16",
                                     "weights": {"quantization": fmt}, "calibration": str(path)})
        with Runner(config) as r:
            prompt = r.encode(PROMPT)
            r.generate([prompt], max_new_tokens=4, temperature=0.0)  # compiled kernels, warm caches
            before = load()
            res = r.generate([prompt], max_new_tokens=args.new, temperature=0.0, stop_on_eos=False)
            st = res[0].stats
        measured = st.decode_s / max(st.decode_steps, 1)
        context = len(prompt) + args.new // 2
        pred = predicted(config, cal, context)
        pred_old = predicted(config, old, context)
        row = {"format": fmt, "measured_ms": 1000 * measured, "predicted_ms": 1000 * pred,
               "predicted_without_layer_cost_ms": 1000 * pred_old, "ratio": pred / measured,
               "ratio_without_layer_cost": pred_old / measured, "load_before": before, "load_after": load()}
        rows.append(row)
        print(row, flush=True)
    table = cal.compute["cpu"]
    md = [f"Model {model.name}, bf16, all resident on the CPU, batch 1, {args.new} new tokens. Compute calibrated "
          f"by the script first ({cal_s:.0f} s): fixed cost per layer "
          + ", ".join(f"{1000 * f:.2f} ms" for f in table["layer_overhead_s"])
          + " and " + ", ".join(f"{r / 1e9:.2f}" for r in table["weight_bytes_per_s"])
          + f" GB/s of weights at {table['tokens']} tokens.\n",
          "| format | measured step ms | predicted ms | predicted / measured | without the per-layer cost: ms | "
          "ratio | load before / after |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['format']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['ratio']:.2f} | "
                  f"{r['predicted_without_layer_cost_ms']:.1f} | {r['ratio_without_layer_cost']:.2f} | "
                  f"{r['load_before']} / {r['load_after']} |")
    print(result.write(args.out, "plan-check", "\n".join(md), {"calibration": cal.compute, "rows": rows}))


if __name__ == "__main__":
    main()
