"""`offload chat`: a multi-turn conversation in the terminal, the KV cache kept between turns.

    offload chat --config model.yaml [--system TEXT] [--stop TEXT ...] [--max-new-tokens N]
    offload chat --auto MODEL_OR_PATH [--disk DIR]     # set up for this machine first (cli.auto), once

Each line read from stdin is a user message; the reply streams to stdout, followed by a
newline, and a one-line account of the turn goes to stderr (prompt tokens reused from the
cache and computed, new tokens, why it ended). `/reset` starts over, `/exit` (or end of
input) quits; Ctrl-C stops a reply (at the prompt, the chat), SIGTERM ends the chat, and an
error (a conversation longer than the KV cache) ends only the turn. Sampling defaults come
from the checkpoint's generation_config.json; flags override them. Every EOS id it names ends a
reply, and so does any `--stop` text. With `kv_cache.eviction: idle`, stdin is read on a thread of
its own and, while the user is away, the conversation's KV blocks untouched for `idle_seconds`
leave the device (`PagedKVCache.expire_idle`).
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from offload.cli import auto
from offload.cli.prepare import before_run, check_new_tokens, convert_first, load_config, model_config, require_chat
from offload.cli.run import add_sampling_args, check_sampling_args, cli_sampling
from offload.cli.signals import Terminated, settle_heap
from offload.errors import ConfigError, OffloadError
from offload.model import hub
from offload.runtime.conversation import Conversation
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling
from storage import interrupts


def add_parser(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="talk to a chat model (multi-turn; the conversation's KV is kept)")
    chat.add_argument("--config", default=None, metavar="FILE", help="YAML configuration")
    chat.add_argument("--model", default=None, metavar="DIR_OR_HUB_ID", help="override the YAML's model:")
    auto.add_arguments(chat)
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system message to start with")
    chat.add_argument("--context", type=int, default=None, metavar="TOKENS",
                      help="longest conversation, for sizing the KV cache when no tiers are configured")
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)


def session_sampling(runner: Runner, args: argparse.Namespace) -> Sampling:
    return cli_sampling(runner.generation, args, fallback_max_new_tokens=512)


def line_reader(inp: TextIO, timeout: float | None, wait: Callable[[], object]) -> Callable[[], str]:
    """`inp.readline`; with a timeout, lines come from a reader thread and `wait` runs every timeout/2 seconds
    while none comes (so the KV of a conversation waiting for its user can leave the device)."""
    if timeout is None:
        return inp.readline
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in iter(inp.readline, ""):
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, name="offload-chat-input", daemon=True).start()

    def readline() -> str:
        while True:
            try:
                return lines.get(timeout=min(max(timeout / 2, 0.05), 5.0))
            except queue.Empty:
                wait()
    return readline


def repl(conv: Conversation, inp: TextIO, out: TextIO, err: TextIO) -> int:
    """Read user lines until end of input or /exit; stream each reply. Returns the number of turns."""
    turns = 0
    interactive = inp.isatty()
    readline = line_reader(inp, conv.engine.kv.policy.timeout, conv.engine.kv.expire_idle)
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            conv.reset()
            err.write("(conversation cleared)\n")
            continue

        def show(delta: str) -> None:
            out.write(delta)
            out.flush()
        try:
            reply = conv.say(text, on_text=show)
        except OffloadError as e:  # e.g. the conversation outgrew the KV cache: say so, keep the session
            out.write("\n")
            err.write(f"offload: error: {e} (/reset starts a new conversation)\n")
            continue
        except Terminated:  # SIGTERM ends the chat (cli.main: exit status 143)
            out.write("\n")
            raise
        except KeyboardInterrupt:  # Ctrl-C stops this reply (it is not kept); end of input quits
            interrupts.delivered()
            out.write("\n")
            err.write("(reply interrupted)\n")
            continue
        out.write("\n")
        out.flush()
        turns += 1
        err.write(f"[turn {turns}: {reply.cached} prompt tokens from the cache, {reply.prefilled} computed | "
                  f"{len(reply.token_ids)} new tokens ({reply.finish_reason}) in {reply.seconds:.2f}s]\n")
    return turns


def chat_with(runner: Runner, args: argparse.Namespace) -> int:
    conv = Conversation(runner, session_sampling(runner, args), system=args.system, context=args.context)
    try:
        repl(conv, sys.stdin, sys.stdout, sys.stderr)
    finally:
        conv.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Every check that reads small files comes first (sampling flags, a chat template, --max-new-tokens
    against the context), then the setup (--auto) or a first-run conversion, then the weights load."""
    check_sampling_args(args)
    if (args.config is None) == (args.auto is None):
        raise ConfigError("give --config FILE or --auto MODEL_OR_PATH (one of the two)")
    if args.auto is None and (args.disk or args.weights):
        raise ConfigError("--disk and --weights go with --auto; with --config set tiers.disk.path in the YAML")
    if args.auto is not None:
        if hub.is_hub_id(args.auto):  # config and tokenizer files only: no weights before the template is known
            require_chat(hub.fetch(args.auto, weights=False))
        elif Path(args.auto).expanduser().is_dir():
            require_chat(Path(args.auto).expanduser().resolve())
        with contextlib.redirect_stdout(sys.stderr):  # the setup's account (machine, store, plan) is not the chat
            config = auto.prepare(args.auto, args.disk, args.weights)
    else:
        config = load_config(args.config, args.model)
    require_chat(config.model)
    check_new_tokens(model_config(config), args.max_new_tokens)
    if args.auto is None:
        before_run(config)
    else:  # (its setup compiled the kernels before it calibrated)
        convert_first(config)
    if args.auto is not None:
        print("loading the weights into their homes ...", file=sys.stderr)
    t0 = time.perf_counter()
    with Runner(config) as runner:
        settle_heap()
        print(f"ready in {time.perf_counter() - t0:.1f}s; type a message (/reset starts over, /exit quits)",
              file=sys.stderr)
        return chat_with(runner, args)
