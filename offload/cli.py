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
    _add_generation_args(run)

    conv = sub.add_parser("convert", help="convert a checkpoint into a zarr store for the disk tier")
    conv.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR")
    conv.add_argument("store", type=Path, metavar="STORE_DIR")
    conv.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "auto"), default="auto",
                      help="dtype of the stored weights (default: the checkpoint's own; must match the run's dtype)")
    conv.add_argument("--force", action="store_true", help="replace a complete store")

    plan = sub.add_parser("plan", help="print where each layer lives and what moves per step (reads no weights)")
    plan.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

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
    if args.json:
        json.dump({"results": [{"prompt": p, "prompt_tokens": len(r.prompt_ids), "token_ids": r.token_ids,
                                "text": r.text, "finish_reason": r.finish_reason}
                               for p, r in zip(prompts, results)],
                   "stats": stats.to_dict(), "plan": runner.plan.to_dict(), "served_bytes": served}, out, indent=2)
        out.write("\n")
        return results
    if not stream:
        for i, (p, r) in enumerate(zip(prompts, results)):
            out.write(f"--- [{i}] {p}{r.text}\n")
    else:
        out.write("\n")
    out.write(
        f"[{stats.prompt_tokens} prompt tokens in {stats.prefill_s:.2f}s ({stats.prefill_tokens_per_s:.1f} tok/s) | "
        f"{stats.generated_tokens} new tokens, {stats.decode_ms_per_step:.1f} ms/step, "
        f"{stats.decode_tokens_per_s:.2f} tok/s]\n"
    )
    if runner.plan.streamed or len(set(runner.plan.homes.values())) > 1:
        passes = max(stats.prefill_passes + stats.decode_steps, 1)
        out.write(runner.plan.describe() + "\n")
        out.write("  served per forward pass: " + ", ".join(
            f"{tier} {n / passes / 2**20:.1f} MiB" for tier, n in sorted(served.items())) + "\n")
    return results


def cmd_run(args: argparse.Namespace) -> int:
    from offload.runner import Runner

    prompts = _prompts(args)
    with Runner.from_config(args.config) as runner:
        generate_and_print(runner, prompts, args)
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


def cmd_plan(args: argparse.Namespace) -> int:
    from offload.checkpoint import Checkpoint
    from offload.config import OffloadConfig
    from offload.runner import resolve_device, resolve_dtype
    from offload.tiered import plan_run

    config = OffloadConfig.load(args.config)
    ckpt = Checkpoint(config.model)
    device = resolve_device(config.device)
    rp = plan_run(config, ckpt.config, resolve_dtype(config.dtype, ckpt.config.torch_dtype), device)
    if args.json:
        print(json.dumps({"device": str(device), "kv_blocks": rp.kv_blocks, **rp.plan.to_dict()}, indent=2))
        return 0
    print(f"device {device}, model {config.model.name} ({ckpt.config.family}, {ckpt.config.num_layers} layers)")
    print(rp.plan.describe())
    kv = "sized per request" if rp.kv_blocks == 0 else (
        f"{rp.kv_blocks} blocks x {config.kv_cache.block_size} tokens "
        f"({rp.kv_blocks * rp.kv_block_bytes / 2**20:.1f} MiB)")
    print(f"  KV cache on the device: {kv}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from offload.demo import run_demo

    return run_demo(args)


COMMANDS = {"run": cmd_run, "convert": cmd_convert, "plan": cmd_plan, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except OffloadError as e:
        print(f"offload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("offload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
