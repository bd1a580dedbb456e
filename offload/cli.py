"""The `offload` command line: run, demo (and, as the tiers land, convert, plan).

Library code logs through `logging`; this module alone prints to the terminal. Every
`OffloadError` becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from offload.errors import ConfigError, OffloadError


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                   help="a file whose whole text is one prompt (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--json", action="store_true", help="print one machine-readable JSON result instead of text")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="offload", description="Run LLMs larger than GPU memory.")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text with a model described by a YAML config")
    run.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    run.add_argument("--trace", default=None, metavar="FILE.json",
                     help="write a Chrome/Perfetto trace of the run (open it in ui.perfetto.dev)")
    run.add_argument("--no-spans", action="store_true",
                     help="record no spans (no summary, no trace; the timeline costs nothing)")
    _add_generation_args(run)

    conv = sub.add_parser("convert", help="convert a checkpoint into a zarr store for the disk tier")
    conv.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR")
    conv.add_argument("store", type=Path, metavar="STORE_DIR")
    conv.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "auto"), default="auto",
                      help="dtype of the stored weights (default: the checkpoint's own; must match the run's dtype)")
    conv.add_argument("--force", action="store_true", help="replace a complete store")

    from offload.profiling import add_commands

    add_commands(sub)

    demo = sub.add_parser("demo", help="generate a small model (first time only) and run it; no downloads")
    demo.add_argument("--cache-dir", type=Path, default=None,
                      help="where the demo model lives (default: $OFFLOAD_CACHE or ~/.cache/offload)")
    _add_generation_args(demo)
    return ap


def _prompts(args: argparse.Namespace, default: str | None = None) -> list[str]:
    prompts = list(args.prompt)
    for f in args.prompt_file:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"--prompt-file {f!r} does not exist; give the path of a text file")
        prompts.append(path.read_text())
    if not prompts:
        if default is None:
            raise ConfigError("no prompt given; pass --prompt TEXT or --prompt-file FILE")
        prompts = [default]
    return prompts


def generate_and_print(runner, prompts: list[str], args: argparse.Namespace, out=None) -> list:
    """Stream tokens (one prompt) or print results (a batch), then a one-line speed summary."""
    out = out or sys.stdout
    stream = not args.json and len(prompts) == 1

    def on_token(i: int, token: int, text: str) -> None:
        out.write(text)
        out.flush()

    if stream:
        out.write(prompts[0])
        out.flush()
    results = runner.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              on_token=on_token if stream else None)
    stats = results[0].stats
    served = runner.weights.served()
    summary = None
    if runner.timeline.enabled and stats.decode_steps:
        from offload.profiling import decode_summary, trace_meta

        summary = decode_summary(runner.timeline, trace_meta(runner, stats))
    if args.json:
        json.dump({"results": [{"prompt": p, "prompt_tokens": len(r.prompt_ids), "token_ids": r.token_ids,
                                "text": r.text, "finish_reason": r.finish_reason}
                               for p, r in zip(prompts, results)],
                   "stats": stats.to_dict(), "plan": runner.plan.to_dict(), "served_bytes": served,
                   "summary": summary.to_dict() if summary else None}, out, indent=2)
        out.write("\n")
        return results
    if not stream:
        for i, (p, r) in enumerate(zip(prompts, results)):
            out.write(f"--- [{i}] {p}{r.text}\n")
    else:
        out.write("\n")
    if runner.plan.streamed or len(set(runner.plan.homes.values())) > 1:
        passes = max(stats.prefill_passes + stats.decode_steps, 1)
        out.write(runner.plan.describe() + "\n")
        out.write("  served per forward pass: " + ", ".join(
            f"{tier} {n / passes / 2**20:.1f} MiB" for tier, n in sorted(served.items())) + "\n")
        if summary is not None:
            from schedulers.trace import format_summary

            out.write("decode timeline: " + format_summary(summary) + "\n")
    out.write(  # the last line: the speed summary
        f"[{stats.prompt_tokens} prompt tokens in {stats.prefill_s:.2f}s ({stats.prefill_tokens_per_s:.1f} tok/s) | "
        f"{stats.generated_tokens} new tokens, {stats.decode_ms_per_step:.1f} ms/step, "
        f"{stats.decode_tokens_per_s:.2f} tok/s]\n"
    )
    return results


def cmd_run(args: argparse.Namespace) -> int:
    from offload.config import OffloadConfig
    from offload.runner import Runner
    from schedulers.timeline import Timeline

    if args.trace and args.no_spans:
        raise ConfigError("--trace needs the spans; drop --no-spans")
    prompts = _prompts(args)
    with Runner(OffloadConfig.load(args.config), timeline=Timeline(enabled=not args.no_spans)) as runner:
        generate_and_print(runner, prompts, args)
        if args.trace:
            from offload.profiling import trace_meta, write_trace

            write_trace(args.trace, runner.timeline, trace_meta(runner, runner.last_stats))
            print(f"trace written to {args.trace} (open it in ui.perfetto.dev; `offload trace summary "
                  f"{args.trace}`)", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from offload.checkpoint import Checkpoint
    from offload.convert import convert
    from offload.runner import resolve_dtype

    ckpt = Checkpoint(args.checkpoint)
    dtype = resolve_dtype(args.dtype, ckpt.config.torch_dtype)
    store = convert(ckpt, args.store, dtype, force=args.force, progress=True)
    print(f"wrote {store.path}: {len(store.groups)} groups, {store.total_bytes / 2**30:.2f} GiB "
          f"({str(dtype).removeprefix('torch.')})")
    store.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from offload.demo import run_demo

    return run_demo(args)


def _commands() -> dict:
    from offload import profiling

    return {"run": cmd_run, "convert": cmd_convert, "demo": cmd_demo, **profiling.COMMANDS}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _commands()[args.command](args)
    except OffloadError as e:
        print(f"offload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("offload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
