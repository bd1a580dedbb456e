"""Does a five-line script that never calls `close()` exit cleanly? Runs it N times and counts.

    python scripts/exit_check.py --runs 20 [--out scripts/results/exit-check.json]

The script is the one from the bug report (bf16, three tiers, prefetch depth 2, no `close()`),
on a tiny generated checkpoint; each run is a fresh interpreter. A run is clean when it exits
with status 0 and prints nothing about threads or ignored exceptions on stderr (a loader thread
still inside a torch call at interpreter exit used to end with `terminate called without an
active exception`, status 134). `tests/test_reliability.py` runs the same check 3 times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from offload.testing.make_model import make_model

FIVE_LINES = """\
from offload import Runner
runner = Runner.from_config(r"{config}")
out = runner.generate(["Once upon a time"], max_new_tokens=16)
print(out[0].token_ids)
"""


def five_line_config(model: Path, store: Path) -> dict:
    """bf16, prefetch depth 2: the ring (3 slots) on the "gpu" tier, one layer in RAM, the other three layers,
    the embeddings and the head streamed from the store (the loader is busy every pass)."""
    return {"model": str(model), "device": "cpu", "dtype": "bfloat16",
            "tiers": {"gpu": {"capacity": "1450KiB"}, "cpu": {"capacity": "384KiB"}, "disk": {"path": str(store)}},
            "prefetch": {"depth": 2}, "kv_cache": {"gpu_blocks": 8}, "activations": {"prefill_chunk": 8}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", default=None, metavar="FILE.json", help="also write the counts here")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_model(root / "tiny", dtype="bfloat16")
        config = root / "five.yaml"
        config.write_text(yaml.safe_dump(five_line_config(model, root / "store")))
        script = root / "five.py"
        script.write_text(FIVE_LINES.format(config=config))
        statuses, bad, outputs, start = [], [], set(), time.monotonic()
        for i in range(args.runs):
            proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
            statuses.append(proc.returncode)
            outputs.add(proc.stdout.strip())
            if proc.returncode != 0 or "terminate called" in proc.stderr or "Exception ignored" in proc.stderr:
                bad.append({"run": i, "status": proc.returncode, "stderr": proc.stderr[-500:]})
    result = {"runs": args.runs, "clean": args.runs - len(bad), "statuses": statuses, "failures": bad,
              "distinct_outputs": len(outputs), "seconds": round(time.monotonic() - start, 1),
              "load_average": os.getloadavg()}
    print(f"{result['clean']} of {args.runs} runs exited cleanly (status 0, nothing on stderr about threads); "
          f"{len(outputs)} distinct token lists; {result['seconds']} s; load {os.getloadavg()[0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not bad and len(outputs) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
