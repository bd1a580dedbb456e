"""The span recorder: every transfer and every layer's compute becomes a span on a track.

    compute     a group's math on the compute stream (host clock on CPU, CUDA events on GPU)
    stall       compute waiting for a group's bytes (the gap the prefetcher did not hide)
    disk-read   disk -> host (or straight into a device slot on a CPU run)
    h2d / d2h   host <-> device copies on the copy stream (CUDA events)
    disk-write  host -> disk

Times are seconds since the timeline's origin (`time.perf_counter`). CUDA spans are kept as
event pairs and resolved against an anchor event on `resolve()`, so recording never
synchronises the GPU. A disabled timeline records nothing and costs one branch.
Recording knows tracks, names and bytes; it knows nothing about models.

A long-lived process keeps a bounded window: with `keep_steps=N` only the spans (and counter
samples) of the last N to 1.25 N steps are kept, so memory stays flat however many steps
run; `keep_steps=None` keeps everything (what writing a trace of the whole run needs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

_NOTHING = nullcontext()  # `Timeline.range` when no profiler records


@dataclass(slots=True)
class Span:
    track: str
    name: str  # the group (e.g. "layer.3", "head") or a label
    step: int  # forward pass index
    start: float  # seconds since the timeline origin
    end: float
    nbytes: int = 0
    slot: int | None = None  # the ring / staging slot the bytes went to or were read from
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class _Run:
    """Spans of a run of names on one track in one step, made when read (`Timeline.add_many`)."""
    track: str
    names: list[str]
    step: int
    spans: list[tuple[float, float]] | Callable[[], list[tuple[float, float]]]

    def made(self) -> list[Span]:
        times = self.spans() if callable(self.spans) else self.spans
        return [Span(self.track, name, self.step, start, end) for name, (start, end) in zip(self.names, times)]


class Timeline:
    def __init__(self, enabled: bool = True, nvtx: bool = False, keep_steps: int | None = None) -> None:
        self.enabled = enabled
        self.nvtx = nvtx  # also mark ranges for Nsight (CUDA runs)
        if keep_steps is not None and keep_steps < 1:
            raise ValueError(f"keep_steps must be None or at least 1, got {keep_steps}")
        self.keep_steps = keep_steps  # None: keep every span; N: the last N steps (bounded memory)
        self.origin = time.perf_counter()
        self._spans: list[Span | _Run] = []  # a run's host spans are made when first read (`spans`)
        self._lazy = False  # `_spans` holds a `_Run`
        self.counters: list[tuple[str, float, dict[str, float]]] = []  # (name, time, values)
        self.step = 0
        self._pending: list[tuple[Span, Any, Any, int]] = []  # (span, start event, end event, device index)
        self._anchors: dict[int, tuple[Any, float]] = {}  # device index -> (anchor event, its host time)
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def next_step(self) -> None:
        self.step += 1
        if self._pending:
            self.resolve(block=False)  # keep the pending list (and its CUDA events) short
        if self.keep_steps is not None and self.step % max(1, self.keep_steps // 4) == 0:
            self._forget_before(self.step - self.keep_steps)

    def _forget_before(self, step: int) -> None:
        """Drop the spans of steps before `step`, and the counter samples older than every span kept. Runs of spans
        (`add_many`) go by their step, unmade: making the spans of every run since the last time cost a SmolLM2-135M
        decode ~0.13 ms a step (keep_steps 512: ~4000 spans each 128 steps); only the oldest run kept is made, for
        its start."""
        with self._lock:
            self._spans = [s for s in self._spans if s.step >= step]
            first = next((i for i, s in enumerate(self._spans) if isinstance(s, _Run)), None)
            if first is not None:  # (recorded in time order: the oldest run is the first)
                self._spans[first:first + 1] = self._spans[first].made()  # type: ignore[union-attr]
            oldest = min((s.start for s in self._spans if isinstance(s, Span)), default=self.now())
            self.counters = [c for c in self.counters if c[1] >= oldest]

    def add(self, track: str, name: str, start: float, end: float, nbytes: int = 0, slot: int | None = None,
            step: int | None = None, **args: Any) -> None:
        if self.enabled:
            span = Span(track, name, self.step if step is None else step, start, end, nbytes, slot, args)
            with self._lock:
                self._spans.append(span)

    def add_many(self, track: str, names: list[str],
                 spans: list[tuple[float, float]] | Callable[[], list[tuple[float, float]]]) -> None:
        """`add` of one span per name on a track, this step's (a pass's layers in one call); spans: their (start,
        end)s, or a function that gives them, called when the spans are first read. A step's Python runs with the
        caches cold (the weights went through them): 30 spans made per step cost ~0.1 ms of a ~12 ms step."""
        if self.enabled:
            run = _Run(track, list(names), self.step, spans)
            with self._lock:
                self._spans.append(run)
                self._lazy = True

    @property
    def spans(self) -> list[Span]:
        """Every span recorded (and kept), in the order recorded."""
        with self._lock:
            return self._folded()

    def _folded(self) -> list[Span]:
        """`_spans` with its runs made into spans (the lock held)."""
        if self._lazy:
            self._spans = [s for item in self._spans for s in (item.made() if isinstance(item, _Run) else (item,))]
            self._lazy = False
        return self._spans  # type: ignore[return-value]

    @contextmanager
    def span(self, track: str, name: str, nbytes: int = 0, slot: int | None = None, step: int | None = None,
             **args: Any) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        step, start = self.step if step is None else step, self.now()
        try:
            with self.range(f"offload/{track}/{name}"):
                yield
        finally:
            self.add(track, name, start, self.now(), nbytes, slot, step=step, **args)

    def range(self, name: str) -> AbstractContextManager[None]:
        """The same work as a torch.profiler range (and an NVTX range on CUDA), for PyTorch and Nsight users; nothing
        (one shared null context) unless a profiler records: ~20 us a range, two a layer (~1.5 ms a step of a
        30-layer model on a CPU)."""
        if not self.enabled or not (self.nvtx or torch.autograd._profiler_enabled()):
            return _NOTHING
        return self._range(name)

    @contextmanager
    def _range(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(name):
            if self.nvtx:
                torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                if self.nvtx:
                    torch.cuda.nvtx.range_pop()

    def count(self, name: str, **values: float) -> None:
        """A sample of a counter track (e.g. bytes resident per tier)."""
        if self.enabled:
            with self._lock:
                self.counters.append((name, self.now(), values))

    # -- CUDA ---------------------------------------------------------------------------------
    def add_cuda(self, track: str, name: str, start_event: Any, end_event: Any, nbytes: int = 0,
                 slot: int | None = None, step: int | None = None, device: Any = None, **args: Any) -> None:
        """Record a span timed by two CUDA events (created with enable_timing=True) recorded on `device`
        (a torch.device; None: the current one). Events are only comparable with an anchor on the same
        device, so each device gets its own anchor."""
        if not self.enabled:
            return
        key = self._anchor_for(device)
        span = Span(track, name, self.step if step is None else step, 0.0, 0.0, nbytes, slot, args)
        with self._lock:
            self._pending.append((span, start_event, end_event, key))

    def _anchor_for(self, device: Any) -> int:
        """The index of `device`'s anchor event, recording one (on that device's current stream) the first time."""
        import torch

        index = torch.cuda.current_device() if device is None or device.index is None else device.index
        if index not in self._anchors:
            with torch.cuda.device(index):
                anchor = torch.cuda.Event(enable_timing=True)
                anchor.record(torch.cuda.current_stream(index))
                anchor.synchronize()
            with self._lock:
                self._anchors.setdefault(index, (anchor, self.now()))
        return index

    def resolve(self, block: bool = True) -> None:
        """Turn pending CUDA event pairs into times; `block=False` takes only those already complete."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        later = []
        for span, start, end, key in pending:
            if not block and not end.query():
                later.append((span, start, end, key))
                continue
            end.synchronize()
            anchor, t0 = self._anchors[key]
            span.start = t0 + anchor.elapsed_time(start) / 1000
            span.end = t0 + anchor.elapsed_time(end) / 1000
            with self._lock:
                self._spans.append(span)
        if later:
            with self._lock:
                self._pending = later + self._pending

    # -- queries ------------------------------------------------------------------------------
    def spans_resolved(self) -> list[Span]:
        self.resolve()
        with self._lock:
            return list(self._folded())


    def on(self, track: str, step: int | None = None) -> list[Span]:
        self.resolve()
        return [s for s in self.spans if s.track == track and (step is None or s.step == step)]

    def bytes_on(self, track: str, steps: range | None = None) -> int:
        """Bytes of the spans recorded on a track: a view of the trace. The counter of bytes moved is
        `schedulers.traffic.Traffic`, counted at the same points as these spans (tests check they agree)."""
        return sum(s.nbytes for s in self.on(track) if steps is None or s.step in steps)

    def clear(self) -> None:
        self.resolve()
        with self._lock:
            self._spans.clear()
            self._lazy = False
            self.counters.clear()


# ----------------------------------------------------------------------------- interval arithmetic
def merge_intervals(spans: list[Span]) -> list[tuple[float, float]]:
    """The union of the spans' [start, end) intervals, sorted and non-overlapping."""
    out: list[tuple[float, float]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], s.end))
        else:
            out.append((s.start, s.end))
    return out


def busy_time(spans: list[Span]) -> float:
    """Seconds during which at least one of the spans is active."""
    return sum(b - a for a, b in merge_intervals(spans))


def overlap_time(a: list[Span], b: list[Span]) -> float:
    """Seconds during which some span of `a` and some span of `b` are both active."""
    ia, ib = merge_intervals(a), merge_intervals(b)
    i = j = 0
    total = 0.0
    while i < len(ia) and j < len(ib):
        lo, hi = max(ia[i][0], ib[j][0]), min(ia[i][1], ib[j][1])
        total += max(0.0, hi - lo)
        if ia[i][1] < ib[j][1]:
            i += 1
        else:
            j += 1
    return total
