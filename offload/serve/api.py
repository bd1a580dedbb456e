"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /stats.

    app = create_app(ServedModel.from_runner(runner), loop)      # loop: a started EngineLoop
    uvicorn.run(app, host="127.0.0.1", port=8000)

A handler parses the body (`schema`), puts one job per prompt on the engine loop and reads its
events from an asyncio queue the loop's thread feeds (`call_soon_threadsafe`): handlers never
touch tensors. Streaming answers are server-sent events, one chunk per token, ending with
`data: [DONE]`. A client that goes away (a closed stream, or a dropped connection while a
non-streamed answer is computed) has its jobs cancelled, which frees their KV blocks at the
next step. Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
400 for a bad request (a body that is not JSON, an unknown field, a bad value, or one whose KV
could never fit), 404 for an unknown model or URL, 405 for a wrong method, 429 with Retry-After
when the queue is full, 503 while shutting down, 504 when a request timed out. `created` is when
the request arrived, in every chunk of a stream as in a whole answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import psutil
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from offload.errors import CapacityError, ContextLengthError
from offload.runtime.sampling import Sampling
from offload.serve.loop import Draining, EngineLoop, Event, Job, QueueFull
from offload.serve.schema import BadRequest, ChatBody, Choice, CompletionBody, ServedModel, new_id, usage

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
               503: "server_unavailable", 504: "timeout_error", 500: "server_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class Call:
    """One HTTP request's jobs on the loop, and the asyncio queue their events arrive on."""

    def __init__(self, loop: EngineLoop, prompts: list[list[int]], sampling: Sampling, stops: tuple[str, ...],
                 name: str) -> None:
        self.loop, self.n = loop, sampling.n
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        self.jobs: list[Job] = []
        self.choices = [Choice(i) for i in range(len(prompts) * sampling.n)]
        self.prompt_tokens = sum(map(len, prompts))
        try:
            for j, prompt in enumerate(prompts):
                name_j = name if len(prompts) == 1 else f"{name} prompt {j}"
                self.jobs.append(loop.submit(Job(prompt, sampling, self._sink(aloop, j), stops, name_j)))
        except BaseException:
            self.cancel()
            raise

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache supplied to the call's jobs (known once each has started)."""
        return sum(job.request.cached or 0 for job in self.jobs if job.request is not None)

    def _sink(self, aloop: asyncio.AbstractEventLoop, j: int) -> Callable[[Event], None]:
        def put(ev: Event) -> None:  # on the loop's thread
            try:
                aloop.call_soon_threadsafe(self.queue.put_nowait, (j * self.n + ev.output, ev))
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass
        return put

    def cancel(self) -> None:
        for job in self.jobs:
            if not job.done:
                self.loop.cancel(job)

    async def events(self, request: Request) -> AsyncIterator[tuple[Choice, Event]]:
        """(choice, event) until every choice has finished; a client that disconnects cancels the jobs."""
        left = len(self.choices)
        try:
            while left:
                try:
                    i, ev = await asyncio.wait_for(self.queue.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        log.info("client went away; cancelling %d job(s)", len(self.jobs))
                        return
                    continue
                c = self.choices[i]
                c.text += ev.text
                if ev.token_id is not None:
                    c.token_ids.append(ev.token_id)
                if ev.logprob is not None:
                    c.logprobs.append(ev.logprob)
                if ev.finish:
                    c.finish = ev.finish
                    left -= 1
                yield c, ev
        finally:
            self.cancel()  # no-op for finished jobs; frees the blocks of the others


def _failure(call: Call) -> JSONResponse | None:
    """An error answer when the call did not complete: a failed pass, a timeout."""
    errors = [ev for ev in (c.finish for c in call.choices) if ev == "timeout"]
    if errors:
        t = call.loop.limits.timeout_s
        return error_response(504, f"the request did not finish within {t:g} s (--request-timeout); "
                                   "ask for fewer max_tokens or raise the timeout", code="timeout")
    return None


def create_app(served: ServedModel, loop: EngineLoop) -> FastAPI:
    app = FastAPI(title="Offload", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, *_validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where})", 405: f"Invalid method for URL ({where})"}.get(
            exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    def start(prompts: list[list[int]], sampling: Sampling, stops: tuple[str, ...], name: str) -> Call:
        return Call(loop, prompts, sampling, stops, name)

    async def handle(request: Request, build: Callable[[], tuple[list[list[int]], Sampling, tuple[str, ...]]],
                     stream: bool, chat: bool, logprobs: bool, include_usage: bool) -> Any:
        created = int(time.time())  # OpenAI's `created`: when the request came, in every chunk and answer
        try:
            prompts, sampling, stops = build()
            call = start(prompts, sampling, stops, "chat" if chat else "completion")
        except BadRequest as e:
            return error_response(e.status, str(e), e.param, e.code)
        except ContextLengthError as e:  # the schema refuses these first; the engine's check is the same one
            param = ("messages" if chat else "prompt") if e.prompt_too_long else "max_tokens"
            return error_response(400, str(e), param, "context_length_exceeded")
        except CapacityError as e:
            return error_response(400, str(e), "max_tokens", "kv_capacity_exceeded")
        except QueueFull as e:
            return error_response(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after_s)})
        except Draining as e:
            return error_response(503, str(e), code="shutting_down")
        rid = new_id("chatcmpl" if chat else "cmpl")
        if stream:
            return StreamingResponse(_sse(served, call, request, rid, created, chat, logprobs, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        errors = []
        async for _, ev in call.events(request):
            if ev.error:
                errors.append(ev)
        if errors:
            if errors[0].unavailable:  # a rank of a distributed run failed: this server stops
                return error_response(503, errors[0].error, code="unavailable")
            return error_response(500, errors[0].error, code="engine_error")
        failed = _failure(call)
        if failed is not None:
            return failed
        make = served.chat_response if chat else served.completion_response
        return make(rid, call.choices, call.prompt_tokens, logprobs, created, call.cached_tokens)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "offload"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Any:
        opts = body.stream_options
        return await handle(request, lambda: served.completion(body), body.stream, False, body.logprobs is not None,
                            bool(opts and opts.include_usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Any:
        def build() -> tuple[list[list[int]], Sampling, tuple[str, ...]]:
            ids, sampling, stops = served.chat(body)
            return [ids], sampling, stops
        opts = body.stream_options
        return await handle(request, build, body.stream, True, body.logprobs, bool(opts and opts.include_usage))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return loop.stats() | {"rss_bytes": psutil.Process().memory_info().rss}

    return app


def _validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None, str | None]:
    """(message, param, code) for a body FastAPI could not parse, as OpenAI words them."""
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":  # loc is ("body", character offset): not a field
        return ("We could not parse the JSON body of your request (" + first.get("ctx", {}).get("error", "invalid")
                + f" at character {first.get('loc', ('', '?'))[-1]}); send a JSON object", None, None)
    parts = [x for x in first.get("loc", ()) if x != "body"]
    param = ".".join(f"[{x}]" if isinstance(x, int) else str(x) for x in parts) or None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", None, None
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    return f"Invalid value for '{param or 'body'}': {first.get('msg', 'invalid request')}", param, "invalid_value"


async def _sse(served: ServedModel, call: Call, request: Request, rid: str, created: int, chat: bool,
               logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token (and one per finish), then usage if asked, then [DONE]."""
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": served.name}

    def chunk(choice: dict[str, Any], **extra: Any) -> str:
        return f"data: {json.dumps(head | {'choices': [choice]} | extra)}\n\n"

    if chat:
        for c in call.choices:  # the role comes first, as OpenAI sends it
            yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
    async for c, ev in call.events(request):
        if ev.error:
            yield f"data: {json.dumps({'error': {'message': ev.error, 'type': 'server_error'}})}\n\n"
            return
        if ev.finish == "timeout":
            yield f"data: {json.dumps({'error': {'message': 'the request timed out', 'type': 'timeout_error'}})}\n\n"
            return
        ids = [ev.token_id] if ev.token_id is not None else []
        lps = [ev.logprob] if ev.logprob is not None else []
        if chat:
            lp = served.chat_logprobs(lps, ids) if logprobs and lps else None
            delta = {"content": ev.text} if ev.text or not ev.finish else {}
            yield chunk({"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": ev.finish or None})
        else:
            lp = served.completion_logprobs(lps, ids) if logprobs and lps else None
            yield chunk({"index": c.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish or None})
    if all(c.finish for c in call.choices):
        if include_usage:
            used = usage(call.prompt_tokens, call.choices, call.cached_tokens)
            yield f"data: {json.dumps(head | {'choices': [], 'usage': used})}\n\n"
        yield "data: [DONE]\n\n"
