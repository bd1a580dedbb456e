"""The transfer layer: one engine per run for every host->device copy, and the one marker type that orders them.

    engine.copy(dst, src, after=[markers]) -> Marker   copy into a slot once every marker has passed
    engine.upload(parts, after=[markers]) -> Upload    copy tensors to new device memory (cold KV blocks)
    engine.receive(upload) -> parts                    compute may use them: it waits on the marker, the host not
    engine.mark_compute() -> Marker                    "compute has reached this point"
    engine.compute_wait(marker)                        compute goes on only after marker
    marker.wait()                                      the host waits
    engine.synchronize()                               the host waits for every copy queued so far

On CUDA (`CudaEngine`) every copy, a weight group's and a layer's cold KV blocks alike, runs on
the engine's one copy stream from pinned buffers (the cpu tier's arena), and markers are CUDA
events: neither the host nor the compute stream blocks on a copy it does not need, and the
link's bytes are serialised in one queue, as the cost model (`offload.plan.costmodel`) assumes.
On a CPU (`ThreadEngine`) copies run on the calling worker thread and markers are already-passed
points; the scheduler above is the same code either way. Disk reads are not here: they are
always worker threads (`storage.reader`, driven by `schedulers.prefetch`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class Upload:
    """Tensors queued to the compute device, and the marker that ends their copies (`engine.receive` them)."""

    tensors: dict[str, torch.Tensor]
    marker: Marker = DONE


class TransferEngine(ABC):
    device: torch.device
    #: Do copies to the device really move bytes (CUDA), or is host memory the device's (a CPU run)?
    copies_to_device: bool = False

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()) -> Marker: ...

    @abstractmethod
    def mark_compute(self) -> Marker: ...

    @abstractmethod
    def compute_wait(self, marker: Marker) -> None: ...

    def timed_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()):
        """Like copy, plus (start, end) markers for the timeline (None on the CPU engine)."""
        return self.copy(dst, src, after), None

    @abstractmethod
    def upload(self, parts: dict[str, torch.Tensor], after: Sequence[Marker] = ()) -> Upload:
        """Copy host tensors to new memory on the device once every marker has passed; the sources may be
        reused once the upload's marker has passed."""

    def receive(self, upload: Upload) -> dict[str, torch.Tensor]:
        """The uploaded tensors, usable by compute from here on (compute waits for the copy; the host does not)."""
        self.compute_wait(upload.marker)
        upload.marker = DONE
        return upload.tensors

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

    def upload(self, parts: dict[str, torch.Tensor], after: Sequence[Marker] = ()) -> Upload:
        for m in after:
            m.wait()
        return Upload({k: v.to(self.device) for k, v in parts.items()})  # a CPU device: the very tensors

    def mark_compute(self) -> Marker:
        return DONE

    def compute_wait(self, marker: Marker) -> None:
        marker.wait()


class CudaEngine(TransferEngine):
    """CUDA: a dedicated copy stream; markers are events; the compute stream waits on events, not the host."""

    copies_to_device = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.copy_stream = torch.cuda.Stream(device=self.device)

    def _event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()) -> Marker:
        return self.timed_copy(dst, src, after)[0]

    def _after(self, after: Sequence[Marker]) -> None:
        """The copy stream waits for every marker (events on the device; a host-side marker on the host)."""
        for m in after:
            if isinstance(m, CudaMarker):
                self.copy_stream.wait_event(m.event)
            else:
                m.wait()

    def timed_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Marker] = ()):
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            self._after(after)
            start = self._event()
            start.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)
            end = self._event()
            end.record(self.copy_stream)
        return CudaMarker(end), (start, end)

    def upload(self, parts: dict[str, torch.Tensor], after: Sequence[Marker] = ()) -> Upload:
        """Allocated on the copy stream; `receive` marks them used by the compute stream, so the caching
        allocator does not hand their memory out again before the compute that reads them is done."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            self._after(after)
            moved = {k: v.to(self.device, non_blocking=True) for k, v in parts.items()}
            end = self._event()
            end.record(self.copy_stream)
        return Upload(moved, CudaMarker(end))

    def receive(self, upload: Upload) -> dict[str, torch.Tensor]:
        if isinstance(upload.marker, CudaMarker):
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(upload.marker.event)
            for t in upload.tensors.values():
                t.record_stream(stream)
        else:
            upload.marker.wait()
        upload.marker = DONE
        return upload.tensors

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
