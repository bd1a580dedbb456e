"""Check: what `speculative.tokens: auto`'s plan predicts against what the run measures, for a small model.

    python -m scripts.spec_check [--model DIR] [--drafts self-int8 self-int4] [--new 32]

Calibrates this machine's compute first (into a temporary file, as `offload calibrate --device cpu` would),
then runs the model (default SmolLM2-135M-Instruct, bf16, all resident on the CPU, greedy) plain, and for each
self draft: the plan's prediction (`SpecGain`: draft pass, target pass, verify cost; at the plan's assumed
acceptance and at the acceptance the run measured), a run at `tokens: 4` (its measured speed-up against the
plain run, acceptance, pass times), and a run at `tokens: auto` (whether it kept the draft, and its speed-up).
The tokens of every run must equal the plain run's.

Writes scripts/results/spec-check.{md,json} with the command, the machine and the load.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import offload  # noqa: F401 - first: its OpenMP wait policy holds only where it is set before torch loads

# isort: split
import torch  # noqa: E402

from offload.config import OffloadConfig  # noqa: E402
from offload.model.checkpoint import Checkpoint  # noqa: E402
from offload.plan.calibrate import calibrate  # noqa: E402
from offload.plan.planner import run_capacities  # noqa: E402
from offload.plan.speculative import MAX_AUTO_TOKENS, PLAN_ALPHA  # noqa: E402
from offload.runtime.runner import Runner  # noqa: E402
from offload.runtime.speculative import auto_gain  # noqa: E402
from scripts.machine import Result, load  # noqa: E402
from scripts.trained_model import ensure_trained_model  # noqa: E402

PROMPT = "Here is a Python function that computes the factorial of a number:\n\ndef factorial(n):"


def run(keys: dict, new: int) -> dict:
    with Runner(OffloadConfig.load(keys)) as r:
        prompt = r.encode(PROMPT)
        r.generate([prompt], max_new_tokens=4, temperature=0.0)  # compiled kernels, warm caches
        before = load()
        res = r.generate([prompt], max_new_tokens=new, temperature=0.0, stop_on_eos=False)
        st, spec = res[0].stats, r.speculator
        return {"tokens": res[0].token_ids, "tokens_per_s": st.decode_tokens_per_s, "drafted": r.draft is not None,
                "note": r.speculation_note, "alpha": spec.alpha if spec else None,
                "draft_ms": 1000 * spec.draft_s / spec.draft_passes if spec and spec.draft_passes else None,
                "load": f"{before} / {load()}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafts", nargs="*", default=["self-int8", "self-int4"])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", default="scripts/results")
    args = ap.parse_args()
    result = Result()
    model = Path(args.model) if args.model else ensure_trained_model(dtype="float32")
    path = Path(tempfile.mkdtemp()) / "calibration.json"
    calibrate(torch.device("cpu"), torch.bfloat16, None).save(path)
    base = {"model": str(model), "device": "cpu", "dtype": "bfloat16", "calibration": str(path)}
    plain = run(base, args.new)
    print("plain", plain, flush=True)
    cfg = Checkpoint(model).config
    rows = []
    for draft in args.drafts:
        fixed = run(base | {"speculative": {"draft": draft, "tokens": 4}}, args.new)
        auto = run(base | {"speculative": {"draft": draft, "tokens": "auto"}}, args.new)
        config = OffloadConfig.load(base | {"speculative": {"draft": draft, "tokens": "auto"}})
        gain = auto_gain(config, cfg, torch.bfloat16, torch.device("cpu"),
                         run_capacities(config, torch.device("cpu")))
        best = max(range(1, MAX_AUTO_TOKENS + 1), key=lambda k: gain.at(PLAN_ALPHA, k).speedup)  # (even < 1x)
        row = {"draft": draft, "plan_draft_ms": 1000 * gain.t_draft, "plan_step_ms": 1000 * gain.t_alone,
               "plan_x_at_plan_alpha": gain.at(PLAN_ALPHA, best).speedup, "plan_tokens_at_plan_alpha": best,
               "plan_x4_at_measured_alpha": gain.at(fixed["alpha"], 4).speedup,
               "measured_x4": fixed["tokens_per_s"] / plain["tokens_per_s"], "measured_alpha": fixed["alpha"],
               "measured_draft_ms": fixed["draft_ms"], "measured_plain_ms": 1000 / plain["tokens_per_s"],
               "auto_kept_draft": auto["drafted"], "auto_note": auto["note"],
               "auto_x": auto["tokens_per_s"] / plain["tokens_per_s"],
               "same_tokens": fixed["tokens"] == plain["tokens"] == auto["tokens"],
               "load": f"{fixed['load']}; {auto['load']}"}
        rows.append(row)
        print(row, flush=True)
    md = [f"Model {model.name}, bf16, all resident on the CPU, greedy, {args.new} new tokens; plain decoding "
          f"{plain['tokens_per_s']:.2f} tokens/s ({1000 / plain['tokens_per_s']:.0f} ms/token, load {plain['load']}). "
          f"Plan: the cost model with a calibration the script measured first; acceptance {PLAN_ALPHA} is what "
          "`tokens: auto` assumes before a run.\n",
          "| draft | plan: draft pass / plain step ms | plan: best x at 0.8 (tokens) | measured: draft pass ms | "
          "tokens 4: plan x at measured acceptance | tokens 4: measured x (acceptance) | auto: draft kept? | "
          "auto: measured x | same tokens | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['draft']} | {r['plan_draft_ms']:.0f} / {r['plan_step_ms']:.0f} | "
                  f"{r['plan_x_at_plan_alpha']:.2f} ({r['plan_tokens_at_plan_alpha']}) | "
                  f"{r['measured_draft_ms']:.0f} | "
                  f"{r['plan_x4_at_measured_alpha']:.2f} | {r['measured_x4']:.2f} ({r['measured_alpha']:.2f}) | "
                  f"{'yes' if r['auto_kept_draft'] else 'no'} | {r['auto_x']:.2f} | {r['same_tokens']} | {r['load']} |")
    print(result.write(args.out, "spec-check", "\n".join(md), {"plain": plain, "rows": rows}))


if __name__ == "__main__":
    main()
