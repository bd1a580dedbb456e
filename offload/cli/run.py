"""`offload run`: generate text with a model described by a YAML config, and print what happened.

Streams tokens (one prompt) or prints results (a batch), then the plan, the bytes each tier
served and the decode timeline's summary when weights stream, and a one-line speed summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from offload.cli.trace import decode_summary, trace_meta, write_trace
from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.model.chat import ChatTemplate
from offload.runtime.runner import GenerationResult, Runner
from offload.runtime.sampling import Sampling, SamplingError
from offload.serve.files import FileDefaults, run_file
from schedulers.timeline import Timeline
from schedulers.trace import format_summary
from storage.units import fmt_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="generate text with a model described by a YAML config")
    run.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    run.add_argument("--model", default=None, metavar="DIR_OR_HUB_ID", help="override the YAML's model:")
    run.add_argument("--trace", default=None, metavar="FILE.json",
                     help="write a Chrome/Perfetto trace of the run (open it in ui.perfetto.dev)")
    run.add_argument("--no-spans", action="store_true",
                     help="record no spans (no summary, no trace; the timeline costs nothing)")
    run.add_argument("--chat", action="store_true",
                     help="each prompt is one user message, rendered with the checkpoint's chat template")
    run.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first")
    add_generation_args(run)
    files = run.add_argument_group("throughput mode (a file of requests)")
    files.add_argument("--input", default=None, metavar="FILE.jsonl",
                       help="one request per line: {\"id\", \"prompt\" or \"messages\", max_tokens, ...}")
    files.add_argument("--output", default=None, metavar="FILE.jsonl",
                       help="results, appended as they finish; a rerun skips the ids already there")
    files.add_argument("--batch", type=int, default=256, metavar="N",
                       help="outputs decoded together by each pass over the weights (default 256)")
    run.set_defaults(func=cmd_run)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                   help="a file whose whole text is one prompt (repeat for a batch)")
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one machine-readable JSON result instead of text")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags; each left out takes the checkpoint's generation_config.json default (else greedy)."""
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="default: generation_config.json's max_new_tokens, else 64 (run) / 512 (chat)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="0 = greedy; default: generation_config.json (do_sample, temperature), else greedy")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="default: generation_config.json, else 1")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="0 = off; default: generation_config.json")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a reply when its text contains TEXT (repeat for several; the reply excludes it)")


def check_sampling_args(args: argparse.Namespace) -> None:
    """Refuse a sampling flag out of range before any weight is read: one sentence naming the flag."""
    given = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k, "seed": args.seed}
    try:
        Sampling(**{k: v for k, v in given.items() if v is not None}, stop_strings=tuple(args.stop))
    except SamplingError as e:
        raise ConfigError(f"--{e.field.replace('_', '-')}: {e}") from None


def cli_sampling(runner: Runner, args: argparse.Namespace, fallback_max_new_tokens: int = 64) -> Sampling:
    """The flags given, else generation_config.json's defaults (`Runner.sampling`, as Python and the server)."""
    return runner.sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                           stop=tuple(args.stop), fallback_max_new_tokens=fallback_max_new_tokens)


def read_prompts(args: argparse.Namespace, default: str | None = None) -> list[str]:
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


def generate_and_print(runner: Runner, prompts: list[str], args: argparse.Namespace,
                       out: TextIO | None = None) -> list[GenerationResult]:
    """Stream tokens (one prompt) or print results (a batch), then a one-line speed summary.

    With `--chat` each prompt is one user message rendered with the checkpoint's chat template."""
    out = out or sys.stdout
    inputs: list = prompts
    if getattr(args, "chat", False):
        template = ChatTemplate.from_checkpoint(runner.config.model)
        if template is None or runner.tokenizer is None:
            raise ConfigError(f"--chat: {runner.config.model} has no chat template (tokenizer_config.json: "
                              "chat_template) or no tokenizer.json; drop --chat for plain completion")
        system = [{"role": "system", "content": args.system}] if getattr(args, "system", None) else []
        inputs = [runner.tokenizer.encode(template.render(system + [{"role": "user", "content": p}]),
                                          add_special_tokens=False) for p in prompts]
    stream = not args.json and len(prompts) == 1
    generated: dict[int, list[int]] = {}  # output index -> tokens so far (what an interrupt still prints)

    def on_token(i: int, token: int, text: str) -> None:
        generated.setdefault(i, []).append(token)
        if stream:
            out.write(text)
            out.flush()

    if stream:
        out.write(prompts[0])
        out.flush()
    try:
        results = runner.generate(inputs, sampling=cli_sampling(runner, args), on_token=on_token)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: show what was generated, then stop
        print_interrupted(runner, prompts, generated, stream, args.json, out)
        raise
    stats = results[0].stats
    served = runner.traffic.served()
    summary = None
    if runner.timeline.enabled and stats.decode_steps:
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
        passes = max(len(stats.passes), 1)
        out.write(runner.plan.describe() + "\n")
        out.write("  served per forward pass: " + ", ".join(
            f"{tier} {fmt_bytes(n / passes, 'MiB')}" for tier, n in sorted(served.items())) + "\n")
        if summary is not None:
            out.write("decode timeline: " + format_summary(summary) + "\n")
    out.write(  # the last line: the speed summary
        f"[{stats.prompt_tokens} prompt tokens in {stats.prefill_s:.2f}s ({stats.prefill_tokens_per_s:.1f} tok/s) | "
        f"{stats.generated_tokens} new tokens, {stats.decode_ms_per_step:.1f} ms/step, "
        f"{stats.decode_tokens_per_s:.2f} tok/s]\n"
    )
    return results


def print_interrupted(runner: Runner, prompts: list[str], generated: dict[int, list[int]], stream: bool,
                      as_json: bool, out: TextIO) -> None:
    n = sum(map(len, generated.values()))
    if as_json:
        json.dump({"interrupted": True, "results": [
            {"prompt": p, "token_ids": generated.get(i, []),
             "text": runner.tokenizer.decode(generated.get(i, [])) if runner.tokenizer else "",
             "finish_reason": "interrupted"} for i, p in enumerate(prompts)]}, out, indent=2)
    elif not stream:
        for i, p in enumerate(prompts):
            text = runner.tokenizer.decode(generated.get(i, [])) if runner.tokenizer else str(generated.get(i, []))
            out.write(f"--- [{i}] {p}{text}\n")
    (sys.stderr if as_json else out).write(f"\n[interrupted after {n} new tokens]\n")
    out.flush()


def cmd_run(args: argparse.Namespace) -> int:
    if args.trace and args.no_spans:
        raise ConfigError("--trace needs the spans; drop --no-spans")
    check_sampling_args(args)
    if args.input or args.output:
        return run_jsonl(args)
    prompts = read_prompts(args)
    config = OffloadConfig.load(args.config, model=args.model)
    # a trace covers the whole run: keep every span; otherwise the configured window (bounded memory)
    timeline = Timeline(enabled=not args.no_spans, keep_steps=None if args.trace else config.timeline.keep_steps)
    with Runner(config, timeline=timeline) as runner:
        generate_and_print(runner, prompts, args)
        if args.trace:
            write_trace(args.trace, runner.timeline, trace_meta(runner, runner.last_stats))
            print(f"trace written to {args.trace} (open it in ui.perfetto.dev; `offload trace summary "
                  f"{args.trace}`)", file=sys.stderr)
    return 0


def run_jsonl(args: argparse.Namespace) -> int:
    """`--input/--output`: every request of a JSONL file, a large batch per pass, results as they finish."""
    if not (args.input and args.output):
        raise ConfigError("the throughput mode needs both --input FILE.jsonl and --output FILE.jsonl")
    if args.prompt or args.prompt_file:
        raise ConfigError("--prompt / --prompt-file and --input are exclusive; put the prompts in the --input file")
    if args.batch < 1:
        raise ConfigError(f"--batch must be at least 1, got {args.batch}")
    defaults = FileDefaults(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    with Runner(OffloadConfig.load(args.config), timeline=Timeline(enabled=not args.no_spans)) as runner:
        report = run_file(runner, Path(args.input), Path(args.output), defaults, args.batch)
        if args.trace:
            write_trace(args.trace, runner.timeline, {})
    print(f"[{report.done} requests done, {report.skipped} already in {args.output} | {report.tokens} new tokens "
          f"in {report.seconds:.1f}s, {report.tokens_per_s:.2f} tok/s]")
    return 0
