"""The user-facing side of the timeline: trace files, summaries, pictures, plans with predictions.

    offload run --trace FILE.json           write a Chrome/Perfetto trace of the run (and print its summary)
    offload trace summary FILE.json         the summary of a saved trace (--json for machines)
    offload trace plot FILE.json -o X.png   a Gantt chart of a window of steps (needs matplotlib)
    offload calibrate                       measure this machine's links and kernels
    offload plan --config FILE              the plan, its predicted step time and what would help most
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from offload.checkpoint import ModelConfig
from offload.config import OffloadConfig, format_size, parse_size
from offload.errors import ConfigError
from schedulers.timeline import Timeline
from schedulers.trace import Counter, format_summary, load_chrome, summarize, to_chrome

log = logging.getLogger(__name__)

#: trace-summary link names <- calibration link names
CALIBRATED = {"disk read": "disk read", "host->device": "host->device", "device->host": "device->host"}


# ----------------------------------------------------------------------------- traces
def trace_meta(runner, stats) -> dict[str, Any]:
    first_decode = runner.timeline.step - stats.decode_steps
    return {"model": str(runner.config.model), "device": str(runner.device), "dtype": str(runner.dtype),
            "plan": runner.plan.to_dict(), "prefill_passes": stats.prefill_passes,
            "decode_steps": [first_decode, runner.timeline.step], "calibration": calibration_links(runner.config)}


def calibration_links(config: OffloadConfig) -> dict[str, float]:
    from offload.calibrate import Calibration

    try:
        cal = Calibration.load(config.calibration)
    except ConfigError:
        return {}
    return {} if cal.source == "defaults" else {k: cal.links[v] for k, v in CALIBRATED.items() if v in cal.links}


def write_trace(path: str | Path, timeline: Timeline, meta: dict[str, Any]) -> None:
    counters = [Counter(name, t, values) for name, t, values in timeline.counters]
    Path(path).write_text(json.dumps(to_chrome(timeline.spans_resolved(), counters, meta)))


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


# ----------------------------------------------------------------------------- calibrate
def cmd_calibrate(args: argparse.Namespace) -> int:
    from offload.calibrate import calibrate, default_path

    device = torch.device(args.device) if args.device != "auto" else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but CUDA is not available here")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    disk = Path(args.disk_path) if args.disk_path else (default_path().parent)
    cal = calibrate(device, dtype, disk)
    out = Path(args.output) if args.output else default_path()
    cal.save(out)
    for link, bps in sorted(cal.links.items()):
        print(f"  {link:<22} {bps / 1e9:8.2f} GB/s")
    table = cal.compute[device.type]
    for n, bps in zip(table["tokens"], table["weight_bytes_per_s"]):
        print(f"  layer kernels, {n:>4} tokens: {bps / 1e9:8.2f} GB/s of weights")
    print(f"wrote {out}")
    return 0


# ----------------------------------------------------------------------------- plan
def _plan_inputs(args: argparse.Namespace) -> tuple[OffloadConfig, ModelConfig]:
    """The config (YAML, or flags) and the model shape (config.json alone is enough: no weights are read)."""
    if args.config:
        config = OffloadConfig.load(args.config)
        model_json = Path(args.model_config) if args.model_config else config.model / "config.json"
    elif args.model_config:
        model_json = Path(args.model_config)
        if not model_json.is_file():
            raise ConfigError(f"--model-config {str(model_json)!r} does not exist; give a model's config.json")
        config = OffloadConfig.load({"model": str(model_json.resolve().parent), "device": args.device or "cuda"})
    else:
        raise ConfigError("give --config FILE or --model-config config.json")
    if not model_json.is_file():
        raise ConfigError(f"{model_json} does not exist; the plan needs the model's config.json")
    try:
        cfg = ModelConfig.from_dict(json.loads(model_json.read_text()), str(model_json))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{model_json}: not valid JSON ({e})") from None
    overrides: dict[str, Any] = {}
    if args.device:
        overrides["device"] = args.device
    if args.calibration:
        overrides["calibration"] = Path(args.calibration).resolve()
    if args.gpu or args.cpu or args.disk_path:
        from offload.config import CpuTierConfig, DiskTierConfig, GpuTierConfig, TiersConfig

        tiers = config.tiers or TiersConfig()
        gpu = GpuTierConfig(parse_size(args.gpu, "--gpu")) if args.gpu else tiers.gpu
        cpu = CpuTierConfig(parse_size(args.cpu, "--cpu"), tiers.cpu.pinned) if args.cpu else tiers.cpu
        disk = DiskTierConfig(Path(args.disk_path).resolve()) if args.disk_path else tiers.disk
        overrides["tiers"] = TiersConfig(gpu, cpu, disk)
    return (config.replace(**overrides) if overrides else config), cfg


def cmd_plan(args: argparse.Namespace) -> int:
    from offload.calibrate import Calibration
    from offload.predict import Workload, explain, predict_decode, predict_prefill_per_token, suggestions
    from offload.runner import resolve_dtype
    from offload.tiered import Planner

    config, cfg = _plan_inputs(args)
    device = torch.device(config.device if config.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and config.tiers is not None and config.tiers.gpu.capacity is None \
            and not torch.cuda.is_available():
        raise ConfigError("tiers.gpu.capacity: auto needs the GPU itself; give a size (e.g. --gpu 24GiB) to plan "
                          "on paper")
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype)
    planner = Planner(config, cfg, dtype, device)
    rp = planner.run_plan()
    cal = Calibration.load(config.calibration)
    work = Workload(batch=args.batch, context=args.context, prefill_chunk=config.activations.prefill_chunk)
    pred = predict_decode(rp.plan, cfg, cal, device.type, work, dtype.itemsize)
    per_token = predict_prefill_per_token(rp.plan, cfg, cal, device.type, work, dtype.itemsize)
    helps = suggestions(planner.plan, planner.caps, rp.plan.depth, cfg, cal, device.type, work, dtype.itemsize, pred)
    if args.json:
        print(json.dumps({"device": str(device), "kv_blocks": rp.kv_blocks, "calibration": cal.source,
                          "prediction": pred.to_dict() | {"prefill_s_per_token": per_token},
                          "suggestions": [s.__dict__ for s in helps], **rp.plan.to_dict()}, indent=2))
        return 0
    params = sum(g.nbytes for g in planner.groups) / dtype.itemsize
    count = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    print(f"device {device}, {cfg.family} model, {cfg.num_layers} layers, {count} parameters "
          f"({format_size(sum(g.nbytes for g in planner.groups))} in {str(dtype).removeprefix('torch.')})")
    print(rp.plan.describe())
    kv = "sized per request" if rp.kv_blocks == 0 else (
        f"{rp.kv_blocks} blocks x {config.kv_cache.block_size} tokens "
        f"({rp.kv_blocks * rp.kv_block_bytes / 2**20:.1f} MiB)")
    print(f"  KV cache on the device: {kv}")
    if rp.depth_note:
        print(f"  {rp.depth_note}")
    src = ("conservative defaults (no calibration file: run `offload calibrate`)" if cal.source == "defaults"
           else cal.source)
    print(f"prediction (calibration: {src}):")
    print(f"  decode step, batch {work.batch}, context {work.context}: {1000 * pred.step_s:.0f} ms "
          f"({work.batch / pred.step_s:.2f} tokens/s)")
    for line in explain(rp.plan, pred, cal):
        print(f"  {line}")
    print(f"  prefill: {1000 * per_token:.2f} ms per prompt token (passes of {work.prefill_chunk} tokens)")
    if helps:
        print("what would help most:")
        for s in helps[:4]:
            print(f"  {s.change}: {1000 * s.step_s:.0f} ms/step, {s.tokens_per_s:.2f} tokens/s "
                  f"({s.tokens_per_s / (work.batch / pred.step_s):.1f}x)")
    return 0


def add_commands(sub) -> None:
    trace = sub.add_parser("trace", help="summarise or draw a trace written by `offload run --trace`")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    summ = tsub.add_parser("summary", help="bytes, bandwidth, stalls and overlap per link")
    summ.add_argument("file", metavar="FILE.json")
    summ.add_argument("--json", action="store_true")
    pl = tsub.add_parser("plot", help="a Gantt-style PNG of a window of steps (needs matplotlib)")
    pl.add_argument("file", metavar="FILE.json")
    pl.add_argument("-o", "--output", required=True, metavar="PNG")
    pl.add_argument("--steps", default=None, metavar="A:B", help="steps A..B-1 (default: the last 3 decode steps)")

    cal = sub.add_parser("calibrate", help="measure this machine's disk, copies and layer kernels")
    cal.add_argument("--disk-path", default=None, metavar="DIR", help="where to test disk reads (the store's disk)")
    cal.add_argument("-o", "--output", default=None, metavar="FILE",
                     help="where to save (default: $OFFLOAD_CACHE/calibration.json, which the planner reads)")
    cal.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    cal.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))

    plan = sub.add_parser("plan", help="where each layer lives, the predicted step time, what would help "
                                       "(reads no weights)")
    plan.add_argument("--config", default=None, metavar="FILE", help="YAML configuration")
    plan.add_argument("--model-config", default=None, metavar="config.json",
                      help="plan from a model's config.json alone (with --config or the flags below)")
    plan.add_argument("--calibration", default=None, metavar="FILE", help="a file from `offload calibrate`")
    plan.add_argument("--device", default=None, help="override the device (e.g. cuda, to plan on paper)")
    plan.add_argument("--gpu", default=None, metavar="SIZE", help="tiers.gpu.capacity")
    plan.add_argument("--cpu", default=None, metavar="SIZE", help="tiers.cpu.capacity")
    plan.add_argument("--disk-path", default=None, metavar="DIR", help="tiers.disk.path")
    plan.add_argument("--batch", type=int, default=1, help="sequences decoded together, for the prediction")
    plan.add_argument("--context", type=int, default=128, help="tokens of context, for the prediction")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


COMMANDS = {"trace": cmd_trace, "calibrate": cmd_calibrate, "plan": cmd_plan}
