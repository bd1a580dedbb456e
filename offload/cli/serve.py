"""`offload serve`: an OpenAI-compatible HTTP server over one engine loop (uvicorn + FastAPI).

Plans and fills the memory homes once, fixes the KV pool, starts the engine loop's thread and
serves until SIGINT/SIGTERM; then uvicorn stops accepting connections and waits for the
running requests to finish (at most --drain-timeout seconds), the loop drains, and the runner
is closed.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys

import uvicorn

from offload.cli.prepare import before_run, load_config
from offload.cli.signals import settle_heap
from offload.errors import ConfigError
from offload.runtime.runner import Runner
from offload.serve.api import create_app
from offload.serve.loop import EngineLoop, Limits
from offload.serve.schema import ServedModel
from storage.units import blocks_for

log = logging.getLogger(__name__)

#: KV tokens a server keeps room for when the config leaves the pool per request (no tiers, gpu_blocks auto)
AUTO_SERVE_KV_TOKENS = 16384


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--config", required=True, metavar="FILE", help="YAML configuration")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the banner says which)")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: the checkpoint's "
                                                       "directory name)")
    add_loop_args(p)
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests waiting to join the batch; beyond it the server answers 429 with Retry-After")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="a request not finished this many seconds after it arrived is aborted (504)")
    p.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                   help="reply length for chat requests that do not say max_tokens")
    p.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="on SIGTERM, how long running requests may take to finish")
    p.set_defaults(func=cmd_serve)


def add_loop_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch", type=int, default=256, metavar="N",
                   help="outputs computed together by each pass over the weights (the KV cache may admit fewer)")
    p.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                   help="KV tokens to keep room for when the config sizes the pool per request (no tiers and "
                        f"kv_cache.gpu_blocks: auto; default {AUTO_SERVE_KV_TOKENS}); else kv_cache decides")


def fixed_pool(runner: Runner, kv_tokens: int | None) -> None:
    """A long-lived engine needs one KV pool: the planned one, or room for `kv_tokens` tokens now."""
    if kv_tokens is not None and kv_tokens < 1:
        raise ConfigError(f"--kv-tokens must be at least 1, got {kv_tokens}")
    planned = runner.kv
    block = runner.kv_settings.block_size
    kv = runner.fix_kv_pool(blocks_for(kv_tokens or AUTO_SERVE_KV_TOKENS, block))
    if planned is None:
        log.info("KV pool: %d blocks of %d tokens (--kv-tokens)", kv.pool.num_blocks, block)
    elif kv_tokens is not None:
        log.warning("--kv-tokens is ignored: the config fixes the KV pool (%d blocks; kv_cache.gpu_blocks)",
                    kv.pool.num_blocks)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (before the model loads): a bad or busy address is one sentence."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port; give one from 1 to 65535 (0: any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} is not an address of this machine ({e.strerror}); use 127.0.0.1, "
                          "0.0.0.0 or a name that resolves") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port
        sock.bind(address)
        sock.listen(2048)  # now, so a second server cannot bind the port while this one loads (as uvicorn's backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use (another server?); stop it or pass "
                              "another --port") from None
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --host or --port") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server that says, once it accepts connections, where (uvicorn itself is silent about sockets
    it was given, since 0.54): the line a user or a script waits for."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            print(f"offload: ready: http://{host}:{port}/v1 accepts requests (Ctrl-C stops the server)",
                  file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    for flag in ("max_batch", "max_queue", "default_max_tokens"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1")
    sock = listen(args.host, args.port)  # before the weights load: a busy port costs nothing
    try:
        config = load_config(args.config)
        before_run(config)
        runner = Runner(config, concurrency=args.max_batch)  # an automatic KV pool sized for a batch
    except BaseException:
        sock.close()
        raise
    try:
        fixed_pool(runner, args.kv_tokens)
        settle_heap()
        loop = EngineLoop(runner, Limits(args.max_batch, args.max_queue, args.request_timeout))
        served = ServedModel.from_runner(runner, args.model_name, args.default_max_tokens)
        loop.start()
        server = Server(uvicorn.Config(create_app(served, loop), host=args.host, port=args.port,
                                       log_level="info", timeout_graceful_shutdown=args.drain_timeout))
        loop.on_fatal = lambda: setattr(server, "should_exit", True)  # a rank failed: answer 503 and exit
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        batch = min(loop.engine.batch, args.max_batch)
        print(f"offload: serving {served.name} on http://{args.host}:{port}/v1 (KV {runner.kv.pool.num_blocks} "
              f"device blocks: up to {batch} sequences decode together"
              + (f", fewer than --max-batch {args.max_batch}" if batch < args.max_batch else "") + ")", file=sys.stderr)
        # uvicorn re-raises the signal it stopped for once it has drained; these handlers take it so the
        # engine loop and the runner still close in order and the exit status is 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: log.info("signal %d: stopping", signum))
        server.run(sockets=[sock])  # returns after SIGINT/SIGTERM, once the open requests finished (or drained)
        loop.stop(drain=False, timeout_s=args.drain_timeout)
        if loop.fatal is not None:
            raise loop.fatal  # exit status 2, the failed rank named
    finally:
        sock.close()
        runner.close()
    print("offload: server stopped", file=sys.stderr)
    return 0
