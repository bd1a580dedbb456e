"""Cold KV on its way to compute: one layer of a step's cold blocks, read into pinned staging, uploaded.

    fetcher = ColdFetcher(fmt, planes, cpu_blocks, disk_blocks, engine, piece, memory=...)  # the cpu tier's arena
    parts, nbytes = fetcher.fetch(stores, groups, layer)   # side thread: {tier: [Upload, ...] | parts}
    parts = receive(engine, parts[tier])                    # compute: waits on the markers, the host not

On a CUDA device each cold group of a layer is gathered (host blocks) or read (disk blocks,
through the one checksummed disk read path, `O_DIRECT` where a slot is whole pages) straight
into one of `STAGE_BUFFERS` pinned staging buffers carved from the cpu tier's pinned arena,
then uploaded in its cold format (int8 stays int8, dequantized on the device) on the transfer
engine's one copy stream (`schedulers.transfer`: the weights' stream and marker type). A
buffer holds `piece` blocks (the planner's choice: at most `STAGE_PIECE` bytes of them, or one
layer of every cold block if that is less, shrunk to what the cpu tier can hold); a longer
group crosses in pieces, alternating buffers, and the pieces are joined on the device. A
buffer is refilled once the copies out of it have passed their markers: the side thread
waits for that, never the compute thread. On a CPU device, or with
`cpu_attention`, the parts pass through where they are: a CPU run's host blocks in the compute
format are not copied at all (`InPlace`: attention reads them in the host tier's plane, through
the step's table), disk blocks are read into fresh memory. Each fetch is one "kv-fetch" span and
the same bytes in the run's `Traffic` (kind "kv", tier -> compute), counted in one place.
`host_bytes` is the host memory the cold tiers take (blocks + staging): the planner's and the
cache's one formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload.kv.blocks import TierBlocks
from offload.kv.formats import ColdFormat, TierStore
from schedulers.timeline import Timeline
from schedulers.traffic import COMPUTE, Traffic
from schedulers.transfer import Marker, TransferEngine, Upload
from storage.arena import PAGE, HostArena, round_up
from storage.slots import MemorySlots

#: Pinned staging buffers: the side thread fills one while the copies out of the other run.
STAGE_BUFFERS = 2
#: The most block bytes one staging buffer holds (64 MiB pieces already run PCIe at full speed).
STAGE_PIECE = 64 * 2**20

@dataclass(frozen=True)
class InPlace:
    """A host tier's blocks of one layer where they lie: the tier's store, the layer's plane in it and the blocks'
    slots (a CPU run reads them in place: `offload.kv.view.LayerKV`)."""

    store: TierStore
    layer: int
    slots: list[int]

    def plane(self, name: str) -> torch.Tensor:
        """Array `name`'s plane [slots, *slot_shape], where it lies (the slots checked written)."""
        return self.store.arrays[name].plane(self.layer, self.slots)

    def gather(self) -> dict[str, torch.Tensor]:
        """The blocks copied out, [len(slots), *slot_shape] per array (for a reader that cannot read them in place)."""
        return self.store.read_plane(self.layer, self.slots)


#: a tier's parts where they are, the uploads of its pieces, or its blocks read in place
Fetched = dict[str, torch.Tensor] | list[Upload] | InPlace


def stage_blocks(fmt: ColdFormat, blocks: int) -> int:
    """Blocks (one layer each) a staging buffer holds: `STAGE_PIECE` bytes' worth, at most `blocks`, at least 1."""
    per_block = sum(math.prod(shape) * dt.itemsize for shape, dt in fmt.arrays.values())
    return max(1, min(blocks, STAGE_PIECE // per_block))


def _part_bytes(fmt: ColdFormat, blocks: int) -> dict[str, int]:
    """Bytes of one layer of `blocks` blocks, per part of the format, each rounded up to whole pages."""
    return {name: round_up(blocks * math.prod(shape) * dt.itemsize, PAGE) for name, (shape, dt) in fmt.arrays.items()}


def host_bytes(fmt: ColdFormat, planes: int, cpu_blocks: int, piece: int) -> tuple[int, int]:
    """(host bytes of the cold KV tiers, of which staging): the cpu blocks, then (`piece` > 0: a CUDA device
    without cpu_attention) `STAGE_BUFFERS` page-aligned staging buffers of `piece` blocks (one layer each)."""
    blocks = fmt.block_nbytes(planes) * cpu_blocks
    if piece <= 0:
        return blocks, 0
    stage = STAGE_BUFFERS * sum(_part_bytes(fmt, piece).values())
    return round_up(blocks, PAGE) + stage, stage


def host_in_place(device_type: str, fmt: str) -> bool:
    """Does a run on this device read its host tier's blocks of this cold format where they lie (`InPlace`): a CPU
    computing on the compute-dtype K/V ("kv")?"""
    return device_type == "cpu" and fmt == "kv"


def receive(engine: TransferEngine, fetched: Fetched) -> dict[str, torch.Tensor]:
    """A tier's fetched parts, usable by compute: uploads are received (the compute stream waits on their markers)
    and a group's pieces joined on the device."""
    if isinstance(fetched, dict):
        return fetched
    if isinstance(fetched, InPlace):
        return fetched.gather()
    pieces = [engine.receive(u) for u in fetched]
    return pieces[0] if len(pieces) == 1 else {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}


class ColdFetcher:
    def __init__(self, fmt: ColdFormat, planes: int, cpu_blocks: int, disk_blocks: int, engine: TransferEngine,
                 piece: int = 0, cpu_attention: bool = False, memory: torch.Tensor | None = None,
                 timeline: Timeline | None = None, traffic: Traffic | None = None) -> None:
        """`piece`: blocks per staging buffer (0: `stage_blocks`' choice). `memory`: the host region of the cold
        tiers (`host_bytes`), staging after the cpu blocks; without it the staging comes from an arena of its own."""
        self.engine = engine
        self.timeline = timeline or Timeline(enabled=False)
        self.traffic = traffic or Traffic()
        self.staged = engine.copies_to_device and not cpu_attention and cpu_blocks + disk_blocks > 0
        # a CPU run's host blocks in the compute format are read where they lie
        self.in_place = host_in_place(engine.device.type, fmt.name)
        self._arena: HostArena | None = None
        self._buffers: list[dict[str, torch.Tensor]] = []  # per buffer: part name -> uint8 region
        self._markers: list[list[Marker]] = [[] for _ in range(STAGE_BUFFERS)]
        self._next = 0
        self.piece = piece or stage_blocks(fmt, cpu_blocks + disk_blocks)  # blocks per staging buffer
        if not self.staged:
            return
        total, stage = host_bytes(fmt, planes, cpu_blocks, self.piece)
        if memory is None:
            self._arena = HostArena(stage, pin=engine.device.type == "cuda")
            region = self._arena.data[:stage]
        else:
            assert memory.numel() >= total, "the cold KV host region is smaller than host_bytes() says"
            region = memory[total - stage : total]
        offset = 0
        for _ in range(STAGE_BUFFERS):
            parts = {}
            for name, n in _part_bytes(fmt, self.piece).items():
                parts[name] = region[offset : offset + n]
                offset += n
            self._buffers.append(parts)

    def fetch(self, stores: dict[str, TierStore], groups: list[TierBlocks], layer: int
              ) -> tuple[dict[str, Fetched], int]:
        """One layer of each cold group, read where it lives and (CUDA) queued to the device: ({tier: parts, or the
        uploads of its pieces}, bytes read); a "kv-fetch" span and the same bytes in `traffic`."""
        start = self.timeline.now()
        out: dict[str, Fetched] = {}
        for g in groups:
            store = stores[g.tier]
            if self.staged:
                out[g.tier] = self._staged(store, g.slots, layer)
            elif self.reads_in_place(store):
                out[g.tier] = InPlace(store, layer, g.slots)
            else:
                out[g.tier] = store.read_plane(layer, g.slots)
        nbytes = {g.tier: len(g.slots) * stores[g.tier].slot_nbytes for g in groups}
        for tier, n in nbytes.items():
            self.traffic.add("kv", tier, COMPUTE, n)
        self.timeline.add("kv-fetch", f"layer.{layer}", start, self.timeline.now(), nbytes=sum(nbytes.values()))
        return out, sum(nbytes.values())

    def reads_in_place(self, store: TierStore) -> bool:
        """Are this tier's blocks read where they lie (`InPlace`, no copy: a CPU run's host tier)?"""
        return self.in_place and all(isinstance(a, MemorySlots) for a in store.arrays.values())

    def _staged(self, store: TierStore, slots: list[int], layer: int) -> list[Upload]:
        """The slots' layer, piece by piece through the staging buffers, each piece uploaded as soon as it is read."""
        uploads = []
        for first in range(0, len(slots), self.piece):
            chunk = slots[first : first + self.piece]
            b, self._next = self._next, (self._next + 1) % STAGE_BUFFERS
            for m in self._markers[b]:
                m.wait()  # the copies out of this buffer have finished (the side thread waits, compute does not)
            dests = {name: self._buffers[b][name][: len(chunk) * arr.slot_nbytes].view(arr.dtype)
                     .view(len(chunk), *arr.slot_shape) for name, arr in store.arrays.items()}  # [n, *slot_shape]
            upload = self.engine.upload(store.read_plane(layer, chunk, out=dests))
            self._markers[b] = [upload.marker]
            uploads.append(upload)
        return uploads

    def close(self) -> None:
        """Wait for the copies out of the staging buffers, then let the memory go."""
        for markers in self._markers:
            for m in markers:
                m.wait()
        self._markers = [[] for _ in range(STAGE_BUFFERS)]
        if self._arena is not None:
            self._arena.close()
            self._arena = None
