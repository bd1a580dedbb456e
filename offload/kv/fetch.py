"""Cold KV on its way to the device: the loader's side thread stages a layer's cold blocks, compute waits.

    stager = ColdStager(device)          # per KV cache: a copy stream of its own on CUDA
    staged = stager(parts)               # side thread: pinned, copied without blocking, an event recorded
    parts = ready(staged)                # compute thread: the compute stream waits on the event (no host sync)

On CUDA the blocks cross PCIe in their cold format (int8 stays int8, dequantized on the device
by `formats.cold_kv`), from pinned memory, on a stream of their own, while the compute stream runs
the layers before: nothing in a decode step waits on the host. On a CPU the parts pass through.
The pinned sources may be dropped at once: PyTorch's caching host allocator keeps a pinned block
from reuse until the copies recorded on it completed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Staged:
    """A layer's cold parts already queued to the device on the copy stream, and the event that ends them."""

    parts: dict[str, torch.Tensor]
    event: torch.cuda.Event | None


class ColdStager:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | Staged:
        if self.stream is None:
            return parts
        pinned = {k: v if v.is_pinned() else v.pin_memory() for k, v in parts.items()}
        with torch.cuda.stream(self.stream):
            moved = {k: v.to(self.device, non_blocking=True) for k, v in pinned.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return Staged(moved, event)


def ready(parts: dict[str, torch.Tensor] | Staged) -> dict[str, torch.Tensor]:
    """The parts, usable on the current stream: it waits for the copy (the host does not), and the copy
    stream's memory is marked as used by it so the allocator does not hand it out early."""
    if not isinstance(parts, Staged):
        return parts
    if parts.event is not None:
        stream = torch.cuda.current_stream(next(iter(parts.parts.values())).device)
        stream.wait_event(parts.event)
        for t in parts.parts.values():
            t.record_stream(stream)
        parts.event = None
    return parts.parts
