"""The KV cache's bookkeeping types: blocks, sequences, the per-step index tensors, the settings.

    Block        where one logical block lives (tier, slot) and what eviction looks at
    Sequence     a block table in token order, plus blocks reserved for its future tokens
    Recency      when each sequence was last attended over, handed to its blocks when eviction looks
    TierBlocks   the blocks of one tier that a step attends over, flattened over the batch
    StepKV       index tensors built once per step and shared by every layer
    KVSettings   the cache's settings with every `auto` resolved (by the planner)
    tier_blocks  one tier's TierBlocks of a step, from the block tables by tensor operations
    step_tables  a step's [B, cols] tables (positions, valid, block ids), built in numpy
    new_slots    the device slot and offset each new token of a step is written to, built in numpy
    one_tier     the TierBlocks of a step whose blocks all lie in one tier (the token order), without tensor ops

Bookkeeping only: nothing here moves a block or touches its bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from storage.tiers import TIERS, on


@dataclass
class Block:
    tier: str
    slot: int
    last_touch: float = 0.0
    mass: float = 0.0  # accumulated attention probability it received (summed over heads and queries)


@dataclass
class Sequence:
    blocks: list[int] = field(default_factory=list)  # logical ids, in token order
    length: int = 0  # tokens whose K/V are (or are being) written
    reserved: list[int] = field(default_factory=list)  # logical ids held for its future blocks


@dataclass
class Recency:
    """The last step that attended over each sequence, kept per sequence while steps run (a step does not walk
    every block) and handed to the blocks' `last_touch` when eviction reads it (`sync`)."""

    touched: dict[int, float] = field(default_factory=dict)  # sequence -> clock of its last step
    dirty: set[int] = field(default_factory=set)  # sequences touched since their blocks last got their time

    def touch(self, sids: list[int], now: float) -> None:
        self.touched.update(dict.fromkeys(sids, now))
        self.dirty.update(sids)

    def sync(self, seqs: dict[int, Sequence], blocks: dict[int, Block], sids: list[int] | None = None) -> None:
        for sid in list(self.dirty) if sids is None else sids:
            self.dirty.discard(sid)
            t = self.touched.get(sid)
            for blk in [] if t is None else filter(None, map(blocks.get, seqs[sid].blocks)):
                blk.last_touch = max(blk.last_touch, t)

    def forget(self, sid: int, seqs: dict[int, Sequence], blocks: dict[int, Block]) -> None:
        """A sequence is freed: blocks it shared outlive it and keep its last touch."""
        self.sync(seqs, blocks, [sid])
        self.touched.pop(sid, None)


@dataclass(frozen=True)
class TierBlocks:
    """The blocks of one tier that a step attends over, flattened over the batch."""

    tier: str
    slots: list[int]  # tier slots, one per block
    ids: list[int]  # logical ids
    seq: torch.Tensor  # [n] batch row of each block
    block: torch.Tensor  # [n] index of each block in its sequence (its column in the token-order layout)
    col: torch.Tensor  # [n] column of each block in its row of this group alone
    cols: int  # padded blocks per row
    positions: torch.Tensor  # [B, cols * block_size] absolute position of each key slot
    valid: torch.Tensor  # [B, cols * block_size]
    slot_index: torch.Tensor | None = None  # [n] `slots` on the compute device, built once per step (device tier)


@dataclass(frozen=True)
class StepKV:
    """Per-step index tensors, built once and shared by every layer."""

    slot_blocks: torch.Tensor  # [N] device slot of each new token
    slot_offsets: torch.Tensor  # [N] offset in that block
    groups: tuple[TierBlocks, ...]  # one per tier holding blocks of the batch
    cols: int  # blocks of the longest sequence: the token-order layout is [B, cols * block_size]
    positions: torch.Tensor  # [B, cols * block_size] absolute position of each key slot
    valid: torch.Tensor  # [B, cols * block_size]
    block_ids: torch.Tensor  # [B, cols] logical id of each block (-1: padding), CPU
    table: torch.Tensor | None = None  # [B, cols] device slot of each block (0: padding) when the device holds all
    masks: dict = field(default_factory=dict, compare=False)  # window -> the attention mask every layer shares

    @functools.cached_property
    def split_table(self) -> torch.Tensor:
        """[B, cols] (CPU) each block's device slot, or -1 - i for the i-th of the step's cold blocks counted group
        by group in `groups` order (0: padding): the table every layer reads the device pool and its cold blocks
        through (`offload.kv.view.LayerKV`)."""
        table = torch.zeros(self.block_ids.shape, dtype=torch.long)
        start = 0
        for g in self.groups:
            if g.tier == "gpu":
                rows = torch.tensor(g.slots, dtype=torch.long)
            else:
                rows = -1 - torch.arange(start, start + len(g.slots))
                start += len(g.slots)
            table[g.seq.cpu(), g.block.cpu()] = rows
        return table


@dataclass(frozen=True)
class KVSettings:
    block_size: int = 16
    gpu_blocks: int = 64
    cpu_blocks: int = 0
    disk_blocks: int = 0
    eviction: str = "lru"
    idle_seconds: float = 30.0
    quantization: str = "none"  # none | int8 (cold blocks)
    restore: str = "transfer"  # transfer | recompute
    cpu_attention: bool = False  # attend cold blocks on the CPU instead of moving them to the device
    direct_io: bool = False  # read the KV slot file with O_DIRECT where a slot is whole pages
    stage_blocks: int = 0  # blocks per pinned staging buffer cold KV crosses to a CUDA device in (0: as many as fit)
    prefix_cache: str = "on"  # on | off | persist (offload.kv.prefix)
    persist_blocks: int = 4096  # with persist: blocks kept on disk for later processes (least recently used go)


def tier_blocks(where_all: torch.Tensor, tier: str, block_ids: torch.Tensor, kv_lens: list[int],
                whole: tuple[torch.Tensor, torch.Tensor], bs: int, dev: torch.device) -> TierBlocks | None:
    """The blocks of `tier` among the step's block tables (block_ids [B, cols], -1 padding), by tensor ops.

    `where_all` [blocks, 2]: (tier index, slot) of every logical block; `whole`: the token-order
    (positions, valid) of every block, this group's own when it holds them all."""
    where = where_all[block_ids.clamp(min=0)]  # [B, cols, 2]
    mine = (where[..., 0] == TIERS.index(tier)) & (block_ids >= 0)  # [B, cols]
    seq_idx, block_idx = mine.nonzero(as_tuple=True)  # row-major: sequence, then token order
    if not len(seq_idx):
        return None
    B = block_ids.shape[0]
    slots = where[seq_idx, block_idx, 1]  # [n]
    index = slots.to(dev) if tier == "gpu" else None
    if torch.equal(mine, block_ids >= 0):  # the tier holds every block: its layout is the token order
        return TierBlocks(tier, slots.tolist(), block_ids[seq_idx, block_idx].tolist(), seq_idx.to(dev),
                          block_idx.to(dev), block_idx.to(dev), block_ids.shape[1], whole[0].contiguous().to(dev),
                          whole[1].to(dev), index)
    col = (mine.cumsum(1) - 1)[seq_idx, block_idx]  # [n] column in this group's own rows
    cols = int(mine.sum(1).max())
    offs = torch.arange(bs)
    pos = block_idx[:, None] * bs + offs  # [n, bs] absolute position of each key slot
    flat = (seq_idx[:, None] * cols + col[:, None]) * bs + offs  # [n, bs] index into [B, cols * bs]
    positions = torch.zeros(B * cols * bs, dtype=torch.long)
    valid = torch.zeros(B * cols * bs, dtype=torch.bool)
    positions[flat] = pos
    valid[flat] = pos < torch.tensor(kv_lens)[seq_idx][:, None]
    return TierBlocks(tier, slots.tolist(), block_ids[seq_idx, block_idx].tolist(),
                      seq_idx.to(dev), block_idx.to(dev), col.to(dev), cols,
                      positions.view(B, cols * bs).to(dev), valid.view(B, cols * bs).to(dev), index)


def slot_table(groups: tuple[TierBlocks, ...], block_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, cols] device slot of each block of the step's tables (0: padding) when the device holds every block
    (attention can then read them where they lie), else None."""
    if len(groups) != 1 or groups[0].tier != "gpu":
        return None
    ids = block_ids.numpy()
    table = np.zeros(ids.shape, np.int64)
    table[ids >= 0] = groups[0].slots  # row-major, as the group's blocks
    return torch.from_numpy(table)


# A decode step builds these once for a few tokens: numpy's ~1 us an operation, not torch's ~5-20 (SmolLM2-135M's
# int4 step on 2 cores, in situ: the KV step's index tensors 0.45 -> 0.23 ms of a ~6.5 ms step).
def step_tables(tables: list[list[int]], kv_lens: list[int], bs: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token-order layout of a step's block tables (each sequence's logical ids): (positions [B, cols * bs] of
    each key slot, valid [B, cols * bs], block_ids [B, cols], -1 padding), cols the longest table."""
    cols = max(map(len, tables))
    ids = np.full((len(tables), cols), -1, np.int64)
    for b, t in enumerate(tables):
        ids[b, :len(t)] = t
    valid = np.arange(cols * bs)[None, :] < np.asarray(kv_lens, np.int64)[:, None]
    return _key_positions(len(tables), cols * bs), torch.from_numpy(valid), torch.from_numpy(ids)


@functools.lru_cache(maxsize=8)  # (B * n longs each: the shapes in use now)
def _key_positions(B: int, n: int) -> torch.Tensor:
    """[B, n] long: 0 .. n - 1 in every row, contiguous, read only (shared by the steps of B sequences over n key slots:
    a decode step makes a new one only when a sequence takes a new block)."""
    return torch.arange(n).expand(B, -1).contiguous()


@functools.lru_cache(maxsize=16)
def _block_rows(lens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch row, index in its table) [n] of each block of tables of these lengths, read only (`one_tier`)."""
    return (torch.from_numpy(np.repeat(np.arange(len(lens)), lens)),
            torch.from_numpy(np.concatenate([np.arange(n) for n in lens])))


def new_slots(slots: list[list[int]], starts: list[int], q_lens: list[int], bs: int,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot block, offset) [N] of each new token: sequence b's tokens starts[b] .. starts[b] + q_lens[b] - 1, its
    blocks' device slots `slots[b]` in token order."""
    blocks, offsets = [], []
    for table, start, n in zip(slots, starts, q_lens):
        pos = np.arange(start, start + n)
        first = start // bs  # only the blocks the new tokens land in
        blocks.append(np.asarray(table[first:-(-(start + n) // bs)], np.int64)[pos // bs - first])
        offsets.append(pos % bs)
    return torch.from_numpy(np.concatenate(blocks)), torch.from_numpy(np.concatenate(offsets))


def one_tier(tier: str, tables: list[list[int]], slots: list[list[int]], positions: torch.Tensor,
             valid: torch.Tensor, dev: torch.device) -> TierBlocks:
    """`tier_blocks` where `tier` holds every block of the step's tables (slots: theirs in it, in table order)."""
    lens = tuple(map(len, tables))
    seq, block = (on(t, dev) for t in _block_rows(lens))
    flat = [s for row in slots for s in row]
    index = on(torch.from_numpy(np.array(flat, np.int64)), dev) if tier == "gpu" else None
    return TierBlocks(tier, flat, [i for row in tables for i in row], seq, block, block, max(lens),
                      on(positions.contiguous(), dev), on(valid, dev), index)
