"""The `offload` command line: one module per command, wired together here.

    run        generate text; a JSONL file (cli.run)     serve      an OpenAI-compatible server (cli.serve)
    chat       a multi-turn conversation (cli.chat)      demo       the embedded default (cli.demo)
    convert    checkpoint -> store (cli.convert)         plan       plan + prediction (cli.plan)
    calibrate  measure this machine (cli.plan)           trace      summarise / draw a trace (cli.trace)

Library code logs through `logging`; the command modules alone print to the terminal. Every
`OffloadError` becomes one line on stderr and exit status 2; Ctrl-C and SIGTERM, exit status 130 / 143
and `offload: interrupted` / `offload: terminated` (`cli.signals`); a reader that goes away
(`offload run ... | head`) ends the command quietly with status 141, as SIGPIPE would. This
package may import every other part of `offload`; nothing imports it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

from offload.cli import chat, convert, demo, plan, run, serve, signals, trace
from offload.cli.prepare import convert_first, load_config
from offload.errors import ConfigError, OffloadError
from offload.runtime import pipeline, ranks

#: commands every rank of a torchrun launch runs: rank 0 the command itself, the others a pipeline stage
DISTRIBUTED = ("run", "chat", "serve")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="offload", description="Run LLMs larger than GPU memory.")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = ap.add_subparsers(dest="command", required=True)
    for module in (run, chat, serve, convert, trace, plan, demo):
        module.add_parser(sub)
    return ap


def run_stage(args: argparse.Namespace) -> int:
    """A worker rank under torchrun (RANK > 0): the same YAML, its slice of the layers, until rank 0 stops."""
    if getattr(args, "config", None) is None:
        raise ConfigError("under torchrun every rank needs the same --config FILE (chat --auto is one-process)")
    config = load_config(args.config, getattr(args, "model", None))
    convert_first(config)
    pipeline.run_stage(config.fetched())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (tests and embedders call this; the program is `program`)."""
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    previous = signals.install()  # SIGTERM stops like Ctrl-C: cleanly
    try:
        worker = args.command in DISTRIBUTED and ranks.launched() and ranks.env_rank() > 0
        status = run_stage(args) if worker else args.func(args)
        sys.stdout.flush()  # a reader gone by now is met here, inside these handlers, not at the interpreter's exit
        return status
    except OffloadError as e:
        print(f"offload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
        status, word = signals.status_of(e)
        print(f"offload: {word}", file=sys.stderr)
        return status
    except BrokenPipeError:  # stdout's reader closed it (`| head`): nobody reads the rest; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's last flush of stdout cannot fail again
        os.close(devnull)
        return 128 + signal.SIGPIPE
    finally:
        signals.restore(previous)


def program() -> NoReturn:
    """The `offload` command (console script, `python -m offload`): `main`, then out of the process at once."""
    signals.install()
    signals.own_process()
    try:
        status = main()
    except KeyboardInterrupt as e:  # a second signal while the first one's clean-up ran
        status = signals.status_of(e)[0]
    signals.leave(status)


if __name__ == "__main__":
    program()
