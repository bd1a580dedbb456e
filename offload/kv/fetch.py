"""Cold KV on its way to compute: one layer of a step's cold blocks, read into pinned staging, uploaded.

    fetcher = ColdFetcher(fmt, planes, cpu_blocks, disk_blocks, engine, memory=...)  # memory: the cpu tier's arena
    parts, nbytes = fetcher.fetch(stores, groups, layer)   # side thread: {tier: Upload | parts}; a span, traffic
    parts = engine.receive(parts[tier])                     # compute: waits on the marker, the host not

On a CUDA device each cold group of a layer is gathered (host blocks) or read (disk blocks,
through the one checksummed disk read path, `O_DIRECT` where a slot is whole pages) straight
into one of `STAGE_BUFFERS` pinned staging buffers carved from the cpu tier's pinned arena,
then uploaded in its cold format (int8 stays int8, dequantized on the device) on the transfer
engine's one copy stream (`schedulers.transfer`: the weights' stream and marker type); a buffer
is reused once the copies out of it have passed their marker (the side thread waits for that,
never the compute thread). A step whose groups name one block twice (samples sharing a prompt)
exceeds a buffer and uploads from ordinary memory instead: slower, the same bytes. On a CPU
device, or with `cpu_attention`, the parts pass through where they are. Each fetch is one
"kv-fetch" span and the same bytes in the run's `Traffic` (kind "kv", tier -> compute), counted
in one place. `host_bytes` is the host memory the cold tiers take (blocks + staging), the
planner's and the cache's one formula.
"""

from __future__ import annotations

import math

import torch

from offload.kv.blocks import TierBlocks
from offload.kv.formats import ColdFormat, TierStore
from schedulers.timeline import Timeline
from schedulers.traffic import COMPUTE, Traffic
from schedulers.transfer import Marker, TransferEngine, Upload
from storage.arena import PAGE, HostArena, round_up

#: Pinned staging buffers, each one layer of every cold block: the side thread fills one while the other's
#: copies run.
STAGE_BUFFERS = 2


def _part_bytes(fmt: ColdFormat, blocks: int) -> dict[str, int]:
    """Bytes of one layer of `blocks` blocks, per part of the format, each rounded up to whole pages."""
    return {name: round_up(blocks * math.prod(shape) * dt.itemsize, PAGE) for name, (shape, dt) in fmt.arrays.items()}


def host_bytes(fmt: ColdFormat, planes: int, cpu_blocks: int, disk_blocks: int, staged: bool) -> tuple[int, int]:
    """(host bytes of the cold KV tiers, of which staging): the cpu blocks, then (`staged`: a CUDA device without
    cpu_attention) `STAGE_BUFFERS` buffers of one layer of every cold block, page-aligned."""
    blocks = fmt.block_nbytes(planes) * cpu_blocks
    if not staged or cpu_blocks + disk_blocks == 0:
        return blocks, 0
    stage = STAGE_BUFFERS * sum(_part_bytes(fmt, cpu_blocks + disk_blocks).values())
    return round_up(blocks, PAGE) + stage, stage


class ColdFetcher:
    def __init__(self, fmt: ColdFormat, planes: int, cpu_blocks: int, disk_blocks: int, engine: TransferEngine,
                 cpu_attention: bool = False, memory: torch.Tensor | None = None, timeline: Timeline | None = None,
                 traffic: Traffic | None = None) -> None:
        """`memory`: the host region of the cold tiers (`host_bytes`), staging after the cpu blocks; without it
        the staging buffers come from an arena of their own."""
        self.engine = engine
        self.timeline = timeline or Timeline(enabled=False)
        self.traffic = traffic or Traffic()
        self.staged = engine.copies_to_device and not cpu_attention and cpu_blocks + disk_blocks > 0
        self._arena: HostArena | None = None
        self._buffers: list[dict[str, torch.Tensor]] = []  # per buffer: part name -> uint8 region
        self._markers: list[list[Marker]] = [[] for _ in range(STAGE_BUFFERS)]
        self._next = 0
        self._blocks = cpu_blocks + disk_blocks  # one staging buffer holds one layer of this many blocks
        if not self.staged:
            return
        total, stage = host_bytes(fmt, planes, cpu_blocks, disk_blocks, True)
        if memory is None or memory.numel() < total:
            assert memory is None, "the cold KV host region is smaller than host_bytes() says"
            self._arena = HostArena(stage, pin=engine.device.type == "cuda")
            region = self._arena.data[:stage]
        else:
            region = memory[total - stage : total]
        offset = 0
        for _ in range(STAGE_BUFFERS):
            parts = {}
            for name, n in _part_bytes(fmt, cpu_blocks + disk_blocks).items():
                parts[name] = region[offset : offset + n]
                offset += n
            self._buffers.append(parts)

    def fetch(self, stores: dict[str, TierStore], groups: list[TierBlocks], layer: int
              ) -> tuple[dict[str, dict[str, torch.Tensor] | Upload], int]:
        """One layer of each cold group, read where it lives and (CUDA) queued to the device: ({tier: parts or
        Upload}, bytes read); a "kv-fetch" span and the same bytes in `traffic`."""
        start = self.timeline.now()
        out = self._fetch(stores, groups, layer)
        nbytes = {g.tier: len(g.slots) * stores[g.tier].slot_nbytes for g in groups}
        for tier, n in nbytes.items():
            self.traffic.add("kv", tier, COMPUTE, n)
        self.timeline.add("kv-fetch", f"layer.{layer}", start, self.timeline.now(), nbytes=sum(nbytes.values()))
        return out, sum(nbytes.values())

    def _fetch(self, stores: dict[str, TierStore], groups: list[TierBlocks], layer: int
               ) -> dict[str, dict[str, torch.Tensor] | Upload]:
        out: dict[str, dict[str, torch.Tensor] | Upload] = {}
        if not self.staged:
            for g in groups:
                out[g.tier] = stores[g.tier].read_plane(layer, g.slots)
            return out
        if sum(len(g.slots) for g in groups) > self._blocks or any(len(set(g.slots)) < len(g.slots)
                                                                      for g in groups):
            for g in groups:  # a block named twice: more entries than a buffer holds (see the module docstring)
                out[g.tier] = self.engine.upload(stores[g.tier].read_plane(layer, g.slots))
            return out
        b, self._next = self._next, (self._next + 1) % STAGE_BUFFERS
        for m in self._markers[b]:
            m.wait()  # the copies out of this buffer have finished (this is the side thread waiting)
        self._markers[b] = []
        used = dict.fromkeys(self._buffers[b], 0)
        for g in groups:
            dests = {}
            for name, arr in stores[g.tier].arrays.items():
                n = len(g.slots) * arr.slot_nbytes
                region = self._buffers[b][name][used[name] : used[name] + n]
                dests[name] = region.view(arr.dtype).view(len(g.slots), *arr.slot_shape)  # [n, *slot_shape]
                used[name] += n
            parts = stores[g.tier].read_plane(layer, g.slots, out=dests)
            upload = self.engine.upload(parts)
            self._markers[b].append(upload.marker)
            out[g.tier] = upload
        return out

    def close(self) -> None:
        """Wait for the copies out of the staging buffers, then let the memory go."""
        for markers in self._markers:
            for m in markers:
                m.wait()
        self._markers = [[] for _ in range(STAGE_BUFFERS)]
        if self._arena is not None:
            self._arena.close()
            self._arena = None
