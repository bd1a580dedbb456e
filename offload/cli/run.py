"""`offload run`: generate text with a model described by a YAML config, and print what happened.

Generated text goes to stdout, alone: one prompt streams (the prompt, then its continuation; with
`--chat` the reply only), a batch prints each result. What happened goes to stderr: the plan, the
bytes each tier served and the decode timeline's summary when weights stream, then a one-line speed
summary; `--json` puts one machine-readable result (with all of that) on stdout instead. Whatever
can be checked before the weights load is (`cli.prepare`): the prompts and --max-new-tokens against
the context, the chat template, and a missing store is converted with a progress bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from offload.cli.prepare import (
    before_run,
    check_new_tokens,
    load_config,
    model_config,
    parse_ids,
    require_chat,
)
from offload.cli.signals import settle_heap
from offload.cli.trace import decode_summary, trace_meta, write_trace
from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.model.chat import GenerationDefaults
from offload.model.tokenizer import TextTokenizer
from offload.runtime.requests import Context
from offload.runtime.runner import GenerationResult, Runner
from offload.runtime.sampling import Sampling, SamplingError, resolve_sampling
from offload.serve.files import FileDefaults, finished_ids, read_requests, run_file
from schedulers.timeline import Timeline
from schedulers.trace import format_summary
from storage.units import fmt_bytes

Prompt = str | list[int]


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
    p.add_argument("--prompt-ids", action="append", default=[], metavar="ID,ID,...",
                   help="a prompt given as token ids, e.g. 1,450,4996 (repeat for a batch)")
    add_sampling_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one machine-readable JSON result (text, plan, timings) on stdout instead of text")


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


def cli_sampling(g: GenerationDefaults, args: argparse.Namespace, fallback_max_new_tokens: int = 64) -> Sampling:
    """The flags given, else generation_config.json's defaults (`g`, as `Runner.sampling` and the server apply them)."""
    return resolve_sampling(g, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                            fallback_max_new_tokens=fallback_max_new_tokens)


def read_prompts(args: argparse.Namespace, default: str | None = None) -> list[Prompt]:
    """--prompt texts, then --prompt-file texts, then --prompt-ids token lists."""
    prompts: list[Prompt] = list(args.prompt)
    for f in args.prompt_file:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"--prompt-file {f!r} does not exist; give the path of a text file")
        prompts.append(path.read_text())
    prompts += [parse_ids(ids) for ids in getattr(args, "prompt_ids", [])]
    if not prompts:
        if default is None:
            raise ConfigError("no prompt given; pass --prompt TEXT, --prompt-file FILE or --prompt-ids 1,450,4996")
        prompts = [default]
    return prompts


@dataclass(frozen=True)
class Inputs:
    """The prompts as given, as the model takes them (token ids) and as a person reads them."""

    prompts: list[Prompt]
    ids: list[list[int]]
    shown: list[str]
    sampling: Sampling  # the flags, else generation_config.json's defaults
    chat: bool = False  # each prompt is one user message: the output is the reply alone


def prepare_inputs(config: OffloadConfig, prompts: list[Prompt], args: argparse.Namespace) -> Inputs:
    """Tokenize (with `--chat`, render the checkpoint's template first) and refuse what could never run,
    before any weight loads: no template, a token outside the vocabulary, a prompt and --max-new-tokens
    longer than the context."""
    cfg = model_config(config)
    chat = bool(getattr(args, "chat", False))
    template = require_chat(config.model) if chat else None
    tokenizer = TextTokenizer.from_checkpoint(config.model)
    system = [{"role": "system", "content": args.system}] if getattr(args, "system", None) else []
    ids, shown = [], []
    for p in prompts:
        if isinstance(p, list):
            if chat:
                raise ConfigError("--prompt-ids are the model's input as they are; with --chat give the message "
                                  "as --prompt TEXT")
            bad = [t for t in p if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ConfigError(f"--prompt-ids: token id {bad[0]} is outside the model's vocabulary "
                                  f"(0..{cfg.vocab_size - 1})")
            ids.append(p)
            shown.append(tokenizer.decode(p) if tokenizer else " ".join(map(str, p)))
        elif tokenizer is None:
            raise ConfigError(f"{config.model} has no tokenizer.json, so prompts must be token ids: "
                              "give --prompt-ids 1,450,4996")
        else:
            ids.append(tokenizer.encode(template.render(system + [{"role": "user", "content": p}]),
                                        add_special_tokens=False) if template else tokenizer.encode(p))
            shown.append(p)
    sampling = cli_sampling(GenerationDefaults.from_checkpoint(config.model, cfg.eos_token_ids), args)
    for i, x in enumerate(ids):
        Context(cfg.max_position_embeddings).check(len(x), sampling.max_new_tokens,
                                                   f"prompt {i}" if len(ids) > 1 else "the prompt",
                                                   knob="--max-new-tokens")
    return Inputs(prompts, ids, shown, sampling, chat)


def generate_and_print(runner: Runner, inputs: Inputs, args: argparse.Namespace, out: TextIO | None = None,
                       err: TextIO | None = None) -> list[GenerationResult]:
    """Stream tokens (one prompt) or print results (a batch) on `out`; what happened goes to `err`."""
    out, err = out or sys.stdout, err or sys.stderr
    stream = not args.json and len(inputs.ids) == 1
    generated: dict[int, list[int]] = {}  # output index -> tokens so far (what an interrupt still prints)

    def on_token(i: int, token: int, text: str) -> None:
        generated.setdefault(i, []).append(token)
        if stream:
            out.write(text)
            out.flush()

    if stream and not inputs.chat:  # a completion continues its prompt; a reply stands alone
        out.write(inputs.shown[0])
        out.flush()
    try:
        results = runner.generate(inputs.ids, sampling=inputs.sampling, on_token=on_token)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: show what was generated, then stop
        print_interrupted(runner, inputs, generated, stream, args.json, out, err)
        raise
    stats = results[0].stats
    served = runner.traffic.served()
    summary = None
    if runner.timeline.enabled and stats.decode_steps:
        summary = decode_summary(runner.timeline, trace_meta(runner, stats))
    if args.json:
        json.dump({"results": [{"prompt": p, "prompt_tokens": len(r.prompt_ids), "token_ids": r.token_ids,
                                "text": r.text, "finish_reason": r.finish_reason}
                               for p, r in zip(inputs.prompts, results)],
                   "stats": stats.to_dict(), "plan": runner.plan.to_dict(), "served_bytes": served,
                   "summary": summary.to_dict() if summary else None}, out, indent=2)
        out.write("\n")
        out.flush()
        return results
    if not stream:
        sep = "\n" if inputs.chat else ""  # a reply on its own line under the message
        for i, (shown, r) in enumerate(zip(inputs.shown, results)):
            out.write(f"--- [{i}] {shown}{sep}{r.text}\n")
    else:
        out.write("\n")
    out.flush()
    if runner.plan.streamed or len(set(runner.plan.homes.values())) > 1:
        passes = max(len(stats.passes), 1)
        err.write(runner.plan.describe() + "\n")
        err.write("  served per forward pass: " + ", ".join(
            f"{tier} {fmt_bytes(n / passes, 'MiB')}" for tier, n in sorted(served.items())) + "\n")
        if summary is not None:
            err.write("decode timeline: " + format_summary(summary) + "\n")
    if stats.experts:
        e = stats.experts
        recall = e["prediction_recall"]
        err.write(f"expert cache: {e['routed']} routed experts, {100 * e['hit_rate_with_prefetch']:.0f}% on the "
                  f"device when asked for (cached {100 * e['hit_rate']:.0f}%, prefetched {e['prefetched']}, loaded "
                  f"on demand {e['misses']}; the plan assumed {100 * runner.plan.hit_rate:.0f}%)"
                  + ("" if recall is None else f"; next-layer prediction recall {100 * recall:.0f}%") + "\n")
    err.write(  # the last line: the speed summary
        f"[{stats.prompt_tokens} prompt tokens in {stats.prefill_s:.2f}s ({stats.prefill_tokens_per_s:.1f} tok/s) | "
        f"{stats.generated_tokens} new tokens, {stats.decode_ms_per_step:.1f} ms/step, "
        f"{stats.decode_tokens_per_s:.2f} tok/s]\n"
    )
    return results


def print_interrupted(runner: Runner, inputs: Inputs, generated: dict[int, list[int]], stream: bool,
                      as_json: bool, out: TextIO, err: TextIO) -> None:
    """What was generated (stdout: the text, or JSON), then, on its own line on stderr, how far it got."""
    n = sum(map(len, generated.values()))
    asked = inputs.sampling.max_new_tokens * len(inputs.ids)
    if as_json:
        json.dump({"interrupted": True, "results": [
            {"prompt": p, "token_ids": generated.get(i, []),
             "text": runner.tokenizer.decode(generated.get(i, [])) if runner.tokenizer else "",
             "finish_reason": "interrupted"} for i, p in enumerate(inputs.prompts)]}, out, indent=2)
        out.write("\n")
    elif not stream:
        sep = "\n" if inputs.chat else ""
        for i, shown in enumerate(inputs.shown):
            text = runner.tokenizer.decode(generated.get(i, [])) if runner.tokenizer else str(generated.get(i, []))
            out.write(f"--- [{i}] {shown}{sep}{text}\n")
    else:
        out.write("\n")  # the streamed text ends its line, so the account below starts its own
    out.flush()
    err.write(f"[interrupted after {n} new tokens; {asked - n} more of the {asked} asked for were not generated]\n")
    err.flush()


def cmd_run(args: argparse.Namespace) -> int:
    if args.trace and args.no_spans:
        raise ConfigError("--trace needs the spans; drop --no-spans")
    check_sampling_args(args)
    if args.input or args.output:
        return run_jsonl(args)
    prompts = read_prompts(args)
    return run_prompts(load_config(args.config, args.model), prompts, args)


def run_prompts(config: OffloadConfig, prompts: list[Prompt], args: argparse.Namespace) -> int:
    """Check the prompts (before any weight loads), convert a missing store, generate and print."""
    inputs = prepare_inputs(config, prompts, args)
    before_run(config)
    trace = getattr(args, "trace", None)
    # a trace covers the whole run: keep every span; otherwise the configured window (bounded memory)
    timeline = Timeline(enabled=not getattr(args, "no_spans", False),
                        keep_steps=None if trace else config.timeline.keep_steps)
    context = max(len(x) for x in inputs.ids) + inputs.sampling.max_new_tokens  # the pool need hold no more
    with Runner(config, timeline=timeline, context=context) as runner:
        settle_heap()
        generate_and_print(runner, inputs, args)
        if trace:
            write_trace(trace, runner.timeline, trace_meta(runner, runner.last_stats))
            print(f"trace written to {trace} (open it in ui.perfetto.dev; `offload trace summary "
                  f"{trace}`)", file=sys.stderr)
    return 0


def run_jsonl(args: argparse.Namespace) -> int:
    """`--input/--output`: every request of a JSONL file, a large batch per pass, results as they finish."""
    if not (args.input and args.output):
        raise ConfigError("the throughput mode needs both --input FILE.jsonl and --output FILE.jsonl")
    if args.prompt or args.prompt_file or args.prompt_ids:
        raise ConfigError("--prompt / --prompt-file / --prompt-ids and --input are exclusive; put the prompts in "
                          "the --input file")
    if args.batch < 1:
        raise ConfigError(f"--batch must be at least 1, got {args.batch}")
    config = load_config(args.config, args.model)
    check_new_tokens(model_config(config), args.max_new_tokens)
    before_run(config)
    defaults = FileDefaults(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    inp, outp = Path(args.input), Path(args.output)
    with Runner(config, timeline=Timeline(enabled=not args.no_spans), concurrency=args.batch) as runner:
        settle_heap()
        try:
            report = run_file(runner, inp, outp, defaults, args.batch)
        except KeyboardInterrupt:  # the results written so far stay; a rerun resumes after them
            ids = [r["id"] for r in read_requests(inp)]
            done = len(set(ids) & finished_ids(outp))
            print(f"[interrupted: {done} of {len(ids)} requests done, {len(ids) - done} remaining; run the same "
                  "command again to resume]", file=sys.stderr)
            raise
        if args.trace:
            write_trace(args.trace, runner.timeline, {})
    held = f"{report.batch} sequence{'s' if report.batch != 1 else ''}"
    print(f"[{report.done} requests done, {report.skipped} already in {args.output} | {report.tokens} new tokens "
          f"in {report.seconds:.1f}s, {report.tokens_per_s:.2f} tok/s | the KV cache holds {held} decoding "
          f"together (--batch {args.batch}); at most {report.most_rows} ran in one pass]", file=sys.stderr)
    return 0
