"""A server in a thread of this process, on an ephemeral loopback port (tests, benchmarks, notebooks).

    with BackgroundServer(runner, Limits(max_batch=16)) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")
        srv.loop.stats()["kv_blocks_free"]

The runner must already have its fixed KV pool (`Runner.fix_kv_pool`); leaving the block
stops uvicorn, aborts what is still running and joins the engine loop (the runner stays open).
"""

from __future__ import annotations

import threading
import time

import uvicorn

from offload.runtime.runner import Runner
from offload.serve.api import create_app
from offload.serve.loop import EngineLoop, Limits
from offload.serve.schema import ServedModel


class BackgroundServer:
    def __init__(self, runner: Runner, limits: Limits | None = None, name: str | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.loop = EngineLoop(runner, limits or Limits())
        self.served = ServedModel.from_runner(runner, name)
        config = uvicorn.Config(create_app(self.served, self.loop), host=host, port=port, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="offload-http", daemon=True)
        self.host, self.port = host, port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> BackgroundServer:
        self.loop.start()
        self._thread.start()
        end = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.loop.stop(drain=False)
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self.loop.stop(drain=False, timeout_s=5)
