"""What recording spans costs: one runner, spans on and off alternating, in one process (no variance between runs).

    python scripts/span_overhead.py MODEL_DIR [--pairs 12]

Prints the median decode ms/step with spans on and off and the relative overhead.
"""

from __future__ import annotations

import argparse
import statistics

from offload.config import OffloadConfig
from offload.runtime.runner import Runner
from schedulers.timeline import Timeline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    cfg = OffloadConfig.load({"model": args.model, "device": "cpu", "dtype": args.dtype,
                              "activations": {"prefill_chunk": 64}})
    timeline = Timeline()
    prompt = [list(range(1, 65))]
    on: list[float] = []
    off: list[float] = []
    with Runner(cfg, timeline=timeline) as r:
        r.generate(prompt, max_new_tokens=4, stop_on_eos=False)  # warm up
        for i in range(args.pairs):
            order = ((True, on), (False, off)) if i % 2 == 0 else ((False, off), (True, on))
            for enabled, sink in order:
                timeline.enabled = enabled
                sink.append(r.generate(prompt, max_new_tokens=16, stop_on_eos=False)[0].stats.decode_ms_per_step)
    a, b = statistics.median(on), statistics.median(off)
    print(f"spans on {a:.2f} ms/step, off {b:.2f} ms/step: overhead {100 * (a / b - 1):.1f}% "
          f"({len(timeline.spans)} spans recorded)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
