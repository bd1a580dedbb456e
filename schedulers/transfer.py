"""Transfer engines: one interface for asynchronous copies and the markers that order them.

    engine.copy(dst, src, after=[markers]) -> Marker   copy once every marker has passed
    engine.mark_compute() -> Marker                    "compute has reached this point"
    engine.compute_wait(marker)                        compute goes on only after marker
    marker.wait()                                      the host waits
    engine.synchronize()                               the host waits for every copy queued so far

On CUDA (`CudaEngine`) copies run on a dedicated copy stream from pinned buffers and markers
are CUDA events, so neither the host nor the compute stream blocks on a copy it does not
need. On a CPU (`ThreadEngine`) copies run on the calling worker thread and markers are
already-passed points; the scheduler above is the same code either way. Disk reads are not
here: they are always worker threads (see `schedulers.prefetch`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class Marker(ABC):
    @abstractmethod
    def wait(self) -> None:
        """Block the host until the marked work is done."""

    @abstractmethod
    def done(self) -> bool: ...


class DoneMarker(Marker):
    """A point already passed (CPU copies complete before `copy` returns)."""

    def wait(self) -> None:
        pass

    def done(self) -> bool:
        return True


DONE = DoneMarker()


class CudaMarker(Marker):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


class TransferEngine(ABC):
    device: torch.device

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()) -> Marker: ...

    @abstractmethod
    def mark_compute(self) -> Marker: ...

    @abstractmethod
    def compute_wait(self, marker: Marker) -> None: ...

    def timed_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()):
        """Like copy, plus (start, end) markers for the timeline (None on the CPU engine)."""
        return self.copy(dst, src, after), None

    def synchronize(self) -> None:  # noqa: B027 - CPU copies are done when `copy` returns
        """Block the host until every copy queued so far has finished (before their buffers are freed)."""


class ThreadEngine(TransferEngine):
    """CPU: the caller is a worker thread, so a copy simply runs now; markers are trivially passed."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()) -> Marker:
        for m in after:
            m.wait()
        dst.copy_(src)
        return DONE

    def mark_compute(self) -> Marker:
        return DONE

    def compute_wait(self, marker: Marker) -> None:
        marker.wait()


class CudaEngine(TransferEngine):
    """CUDA: a dedicated copy stream; markers are events; the compute stream waits on events, not the host."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.copy_stream = torch.cuda.Stream(device=self.device)

    def _event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()) -> Marker:
        return self.timed_copy(dst, src, after)[0]

    def timed_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()):
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            for m in after:
                if isinstance(m, CudaMarker):
                    self.copy_stream.wait_event(m.event)
                else:
                    m.wait()
            start = self._event()
            start.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)
            end = self._event()
            end.record(self.copy_stream)
        return CudaMarker(end), (start, end)

    def synchronize(self) -> None:
        self.copy_stream.synchronize()

    def mark_compute(self) -> Marker:
        event = self._event()
        event.record(torch.cuda.current_stream(self.device))
        return CudaMarker(event)

    def compute_wait(self, marker: Marker) -> None:
        if isinstance(marker, CudaMarker):
            torch.cuda.current_stream(self.device).wait_event(marker.event)
        else:
            marker.wait()


def make_engine(device: torch.device) -> TransferEngine:
    return CudaEngine(device) if device.type == "cuda" else ThreadEngine(device)
