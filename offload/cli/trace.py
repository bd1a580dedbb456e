"""The user-facing side of the timeline: trace files, summaries, pictures.

    offload run --trace FILE.json           write a Chrome/Perfetto trace of the run (and print its summary)
    offload trace summary FILE.json         the summary of a saved trace (--json for machines)
    offload trace plot FILE.json -o X.png   a Gantt chart of a window of steps (needs matplotlib)
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.plan.calibrate import load_calibration
from schedulers.timeline import Timeline
from schedulers.trace import Counter, format_summary, load_chrome, summarize, to_chrome
from storage.io import atomic_write_bytes

log = logging.getLogger(__name__)

#: trace-summary link names <- calibration link names
CALIBRATED = {"disk read": "disk read", "host->device": "host->device", "device->host": "device->host"}


# ----------------------------------------------------------------------------- traces
def trace_meta(runner, stats) -> dict[str, Any]:
    decode = stats.decode_only_steps
    first_decode, end = (decode[0], decode[-1] + 1) if decode else (runner.timeline.step, runner.timeline.step)
    return {"model": str(runner.config.model), "device": str(runner.device), "dtype": str(runner.dtype),
            "plan": runner.plan.to_dict(), "prefill_passes": stats.prefill_passes,
            "decode_steps": [first_decode, end], "calibration": calibration_links(runner.config)}


def calibration_links(config: OffloadConfig) -> dict[str, float]:
    try:
        cal = load_calibration(config.calibration)
    except ConfigError:
        return {}
    return {} if cal.source == "defaults" else {k: cal.links[v] for k, v in CALIBRATED.items() if v in cal.links}


def write_trace(path: str | Path, timeline: Timeline, meta: dict[str, Any]) -> None:
    """Written to a temporary file and renamed: a full disk or a kill leaves no half-written trace."""
    counters = [Counter(name, t, values) for name, t, values in timeline.counters]
    atomic_write_bytes(Path(path), json.dumps(to_chrome(timeline.spans_resolved(), counters, meta)).encode())


def decode_summary(timeline: Timeline, meta: dict[str, Any]):
    first, last = meta.get("decode_steps", [0, timeline.step])
    steps = range(first, last) if last > first else None
    return summarize(timeline.spans_resolved(), steps, meta.get("calibration"))


def cmd_trace(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise ConfigError(f"trace file {str(path)!r} does not exist; write one with `offload run --trace FILE`")
    try:
        spans, counters, meta = load_chrome(path)
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not a trace written by `offload run --trace`") from None
    first, last = meta.get("decode_steps", [0, 0])
    steps = range(first, last) if last > first else None
    if args.trace_command == "summary":
        summary = summarize(spans, steps, meta.get("calibration"))
        print(json.dumps(summary.to_dict(), indent=2) if args.json else format_summary(summary))
        return 0
    return plot(spans, Path(args.output), args.steps, steps)


def plot(spans, output: Path, window: str | None, decode: range | None) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("`offload trace plot` needs matplotlib; install it with "
                          "pip install 'offload[plot]' (or pip install matplotlib)") from None
    all_steps = sorted({s.step for s in spans})
    if window:
        lo, _, hi = window.partition(":")
        chosen = range(int(lo), int(hi) if hi else int(lo) + 1)
    elif decode is not None and len(decode) >= 1:
        chosen = range(max(decode.start, decode.stop - 3), decode.stop)  # the last three decode steps
    else:
        chosen = range(all_steps[0], all_steps[-1] + 1) if all_steps else range(0)
    shown = [s for s in spans if s.step in chosen]
    if not shown:
        raise ConfigError(f"no spans in steps {chosen.start}..{chosen.stop - 1}; the trace has steps "
                          f"{all_steps[0] if all_steps else '-'}..{all_steps[-1] if all_steps else '-'}")
    t0 = min(s.start for s in shown)
    tracks = [t for t in ("compute", "stall", "disk-read", "h2d", "d2h", "disk-write", "kv-spill", "kv-fetch")
              if any(s.track == t for s in shown)]
    colors = {"compute": "#4c72b0", "stall": "#c44e52", "disk-read": "#dd8452", "h2d": "#55a868",
              "d2h": "#8172b3", "disk-write": "#937860", "kv-spill": "#da8bc3", "kv-fetch": "#8c8c8c"}
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(tracks) + 1.6))
    for row, track in enumerate(tracks):
        bars = [((s.start - t0) * 1000, max((s.end - s.start) * 1000, 0.05)) for s in shown if s.track == track]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors.get(track, "#999999"), edgecolor="white",
                       linewidth=0.3)
    for step in chosen:  # step boundaries
        starts = [s.start for s in shown if s.step == step and s.track == "compute"]
        if starts:
            x = (min(starts) - t0) * 1000
            ax.axvline(x, color="black", linewidth=0.6, linestyle=":")
            ax.text(x, -0.5, f" step {step}", fontsize=8, va="top")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_ylim(-0.6, len(tracks) - 0.2)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_title(f"offload timeline, steps {chosen.start}..{chosen.stop - 1}")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    print(f"wrote {output}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="summarise or draw a trace written by `offload run --trace`")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    summ = tsub.add_parser("summary", help="bytes, bandwidth, stalls and overlap per link")
    summ.add_argument("file", metavar="FILE.json")
    summ.add_argument("--json", action="store_true")
    pl = tsub.add_parser("plot", help="a Gantt-style PNG of a window of steps (needs matplotlib)")
    pl.add_argument("file", metavar="FILE.json")
    pl.add_argument("-o", "--output", required=True, metavar="PNG")
    pl.add_argument("--steps", default=None, metavar="A:B", help="steps A..B-1 (default: the last 3 decode steps)")
    trace.set_defaults(func=cmd_trace)
