"""The engine loop as a service: one thread owns the runner; other threads put jobs in and read events out.

    loop = EngineLoop(runner, Limits(max_batch=64, max_queue=256, timeout_s=600))
    loop.start()                                    # the thread: step while anything runs, sleep otherwise
    job = loop.submit(Job(prompt_ids, Sampling(max_new_tokens=32), sink=on_event))
    loop.cancel(job)                                # a client went away: its KV blocks free at the next step
    loop.stop()                                     # refuse new jobs, finish the running ones, join the thread

    job (a queue, bounded: QueueFull when full)  ->  engine (waiting / running)  ->  sink(Event) per token
                                                      one pass over the weights per step, every running output

Jobs join the engine at a step boundary while fewer than `max_batch` outputs run; the engine
admits them as the KV cache allows (OK), keeps them waiting (LATER) or they were refused at
`submit` (NEVER: CapacityError, before anything is queued). A job past its deadline is
aborted with finish reason "timeout". Sinks are called on the loop's thread and must not
block (the server hands events to its event loop). Without `start()` the caller drives the
loop itself with `step()` (the throughput mode for files). This module knows jobs, events
and text; tensors stay inside the engine and the runner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload.errors import OffloadError
from offload.runtime.engine import Engine
from offload.runtime.ranks import RankError
from offload.runtime.requests import Output, Request, TokenLogprob
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling
from offload.runtime.stops import StopMatcher

log = logging.getLogger(__name__)

#: every this many steps the loop drops older spans and per-pass stats, so memory stays flat
HISTORY_STEPS = 1024
#: engine finish reasons as an OpenAI client reads them
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "timeout": "timeout"}


class QueueFull(OffloadError):
    """The bounded queue is full: the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Draining(OffloadError):
    """The loop is shutting down and takes no new jobs."""


@dataclass(frozen=True)
class Limits:
    max_batch: int = 256  # outputs running at once (each pass computes all of them); the KV cache may admit fewer
    max_queue: int | None = 256  # jobs waiting to join (None: unbounded, for files); beyond it submit raises
    timeout_s: float | None = None  # a job not finished this many seconds after submission is aborted


@dataclass(frozen=True)
class Event:
    """What a sink receives: a token of output `output` (its text delta), or the end of that output."""

    output: int  # 0..n-1 within the job
    text: str = ""
    token_id: int | None = None
    logprob: TokenLogprob | None = None
    finish: str = ""  # "" while running; "stop" | "length" | "abort" | "timeout" (FINISH's values)
    error: str = ""  # the loop failed this job (the message says why)
    unavailable: bool = False  # ... and the server cannot go on (a rank of a distributed run failed): 503


@dataclass(eq=False)
class Job:
    prompt: list[int]
    sampling: Sampling
    sink: Callable[[Event], None]
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one it writes
    name: str = "request"
    # owned by the loop
    request: Request | None = None
    deadline: float = float("inf")
    finished: list[bool] = field(default_factory=list)
    texts: list[StopMatcher] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return bool(self.finished) and all(self.finished)


class EngineLoop:
    def __init__(self, runner: Runner, limits: Limits = Limits()) -> None:
        self.runner, self.limits = runner, limits
        self.engine = Engine(runner)
        self._lock = threading.Condition()
        self._pending: deque[Job] = deque()  # submitted, not yet handed to the engine
        self._cancels: list[tuple[Job, str]] = []
        self._active: list[Job] = []  # handed to the engine, not done
        self._draining = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # forward passes run
        self.failed: BaseException | None = None  # the last error a step raised (jobs running then were failed)
        self.fatal: RankError | None = None  # a rank of a distributed run failed: every job ends, the server exits
        self.on_fatal: Callable[[], None] | None = None  # told when that happens (the server stops listening)

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue a job: CapacityError if it could never fit, QueueFull if the queue is full, Draining if stopping."""
        req = Request(job.prompt, job.sampling, name=job.name, on_token=lambda i, t, s: self._on_token(job, i, t, s))
        self.engine.check_fits(req)  # reads only the pool's fixed size: safe from any thread
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down and takes no new requests; retry on another one")
            queued = len(self._pending) + len(self.engine.waiting)
            if self.limits.max_queue is not None and queued >= self.limits.max_queue:
                raise QueueFull(f"{queued} requests are already waiting (the queue holds {self.limits.max_queue}); "
                                "retry later or raise --max-queue", retry_after_s=self._retry_after())
            job.request = req
            job.finished = [False] * job.sampling.n
            job.texts = [StopMatcher(job.stop) for _ in range(job.sampling.n)]
            if self.limits.timeout_s is not None:
                job.deadline = time.monotonic() + self.limits.timeout_s
            self._pending.append(job)
            self._lock.notify_all()
        return job

    def cancel(self, job: Job, reason: str = "abort") -> None:
        """End a job now (its client went away): blocks come back at the next step boundary."""
        with self._lock:
            self._cancels.append((job, reason))
            self._lock.notify_all()

    def stats(self) -> dict[str, int]:
        """Counters for /stats and the soak test (plain ints, read without stopping the loop)."""
        kv = self.engine.kv
        return {"steps": self.steps, "queued": len(self._pending) + len(self.engine.waiting),
                "running": sum(len(r.outputs) for r in self.engine.prefilling + self.engine.decoding),
                # free: unused, or held only by the prefix cache (taken back when a request needs them)
                "kv_blocks": kv.pool.num_blocks, "kv_blocks_free": kv.pool.num_free + kv.idle_count("gpu"),
                "kv_logical_free": kv.logical.num_free + kv.idle_count(), "kv_sequences": len(kv.seqs),
                "kv_prefix_blocks": kv.prefix.blocks if kv.prefix is not None else 0}

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._active or self._cancels)

    def _retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the mean step time times a few steps, at least 1."""
        ms = self.engine.stats.step_ms[-8:]
        return max(1, round(4 * sum(ms) / len(ms) / 1000)) if ms else 1

    # -- the loop's thread --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="offload-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Take no new jobs; with `drain`, let the running ones finish (waiting at most timeout_s), then join."""
        with self._lock:
            self._draining = True
            if not drain:
                self._cancels += [(j, "abort") for j in [*self._pending, *self._active]]
            self._lock.notify_all()
        if self._thread is None:
            return
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self.busy and self._thread.is_alive() and (end is None or time.monotonic() < end):
                self._lock.wait(0.1)
            self._stopped = True
            self._cancels += [(j, "abort") for j in [*self._pending, *self._active]]
            self._lock.notify_all()
        self._thread.join()

    def _run(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)
        while True:
            with self._lock:
                if not self.busy and not self._stopped:
                    self._lock.wait(0.5)
                busy, stopped = self.busy, self._stopped
            if busy:
                self.step()
            elif stopped:
                return  # stopped, and nothing left to finish
            else:  # waiting for work: KV untouched for kv_cache.idle_seconds (eviction: idle) leaves the device
                self.engine.kv.expire_idle()

    @torch.inference_mode()
    def step(self) -> None:
        """Cancels and timeouts, newcomers join (within max_batch), one forward pass, finished jobs leave."""
        with self._lock:
            cancels, self._cancels = self._cancels, []
            now = time.monotonic()
            cancels += [(j, "timeout") for j in [*self._pending, *self._active] if j.deadline < now]
            for job, reason in cancels:
                if job in self._pending:
                    self._pending.remove(job)
                    self._end(job, reason)
            self._feed()
        for job, reason in cancels:
            if job in self._active:
                self.engine.abort(job.request)
                self._end(job, reason)
        try:
            if self.engine.busy:
                self.engine.step()
                self.steps += 1
                if self.steps % HISTORY_STEPS == 0:
                    self._forget_history()
        except RankError as e:  # the pipeline is broken: every job ends now (503), no new one is taken
            log.error("%s", e)
            self.fatal = self.failed = e
            with self._lock:
                self._draining = True
                jobs, self._pending = [*self._pending, *self._active], deque()
            for job in self._active:
                self.engine.abort(job.request)
            for job in jobs:
                self._end(job, "abort", error=str(e), unavailable=True)
            if self.on_fatal is not None:
                self.on_fatal()
        except Exception as e:  # a real error (a corrupt chunk, out of memory): fail who was running, keep serving
            log.exception("a forward pass failed; the requests it carried end with an error")
            self.failed = e
            for job in list(self._active):
                self.engine.abort(job.request)
                self._end(job, "abort", error=f"the forward pass failed: {e}")
        with self._lock:
            self._active = [j for j in self._active if not j.done]
            self._lock.notify_all()

    def _forget_history(self) -> None:
        """A server runs for days: keep the timeline's spans and the per-pass stats of recent steps only."""
        self.runner.timeline.clear()
        st = self.engine.stats
        del st.step_ms[:-HISTORY_STEPS], st.passes[:-HISTORY_STEPS]

    def _feed(self) -> None:
        running = sum(len(r.outputs) for r in [*self.engine.waiting, *self.engine.prefilling, *self.engine.decoding])
        while self._pending and (running == 0 or running + self._pending[0].sampling.n <= self.limits.max_batch):
            job = self._pending.popleft()
            self.engine.submit(job.request)
            self._active.append(job)
            running += job.sampling.n

    def _end(self, job: Job, reason: str, error: str = "", unavailable: bool = False) -> None:
        for k, done in enumerate(job.finished):
            if not done:
                job.finished[k] = True
                job.sink(Event(k, finish=FINISH[reason], error=error, unavailable=unavailable))

    def _on_token(self, job: Job, index: int, token: int, delta: str) -> None:
        """The engine's token callback (on this thread): stop strings, then one event to the job's sink."""
        req = job.request
        k = index - req.outputs[0].index
        out: Output = req.outputs[k]
        text, matched = job.texts[k].push(delta)
        if matched:
            out.finish_reason = "stop"  # the engine frees its sequence at the end of this step
        if out.finish_reason:
            text += job.texts[k].flush()
        lp = out.logprobs[-1] if out.logprobs else None
        job.finished[k] = bool(out.finish_reason)
        job.sink(Event(k, text, token, lp, FINISH.get(out.finish_reason, "")))
