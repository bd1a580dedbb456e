"""Paged KV cache: fixed-size blocks, one block table per sequence.

A block holds `block_size` tokens of K and V for *all* layers, so one block is one
contiguous byte range that can later move between tiers as a unit:

    pool.data  # [num_blocks, layers, 2 (k|v), block_size, kv_heads, head_dim]

A sequence's block table lists its blocks in token order; token t of the sequence lives in
block `table[t // block_size]` at offset `t % block_size`. The block pool (in `storage`)
alone owns the free list and reference counts. This module knows sequences and token
positions, not weights or model math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.checkpoint import ModelConfig
from offload.model import BatchLayout
from storage.block_pool import Admission, BlockPool
from storage.errors import CapacityError


@dataclass
class Sequence:
    blocks: list[int]
    length: int = 0  # tokens whose K/V are (or are being) written


@dataclass(frozen=True)
class StepKV:
    """Per-step index tensors, built once and shared by every layer."""

    slot_blocks: torch.Tensor  # [N] block of each new token
    slot_offsets: torch.Tensor  # [N] offset in that block
    tables: torch.Tensor  # [B, max_blocks] block ids (padding -> block 0, masked)
    key_positions: torch.Tensor  # [B, max_blocks * block_size] position of each gathered key
    key_valid: torch.Tensor  # [B, max_blocks * block_size] key slot holds a real token


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device | str, memory: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.device = torch.device(device)
        self.pool = BlockPool(num_blocks, (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim),
                              dtype, device, memory=memory)
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0

    @staticmethod
    def block_nbytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- sequences ----------------------------------------------------------------------------
    def admit(self, tokens: int) -> Admission:
        """Could a sequence of `tokens` total tokens get its blocks (now / once others finish / never)?"""
        return self.pool.can_allocate(self.blocks_for(tokens))

    def add_sequence(self, reserve_tokens: int = 0) -> int:
        """A new sequence, with blocks for `reserve_tokens` allocated up front (worst-case reservation)."""
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = Sequence(blocks=self._allocate(self.blocks_for(reserve_tokens)))
        return sid

    def _allocate(self, n: int) -> list[int]:
        """Blocks are zeroed when handed out: padded key slots are multiplied by zero attention weights,
        and 0 * NaN from stale or never-written memory would poison the whole row."""
        ids = self.pool.allocate(n)
        if ids:
            self.pool.data[torch.tensor(ids, device=self.pool.data.device)] = 0
        return ids

    def free_sequence(self, sid: int) -> None:
        seq = self.seqs.pop(sid)
        self.pool.free(seq.blocks)

    def length(self, sid: int) -> int:
        return self.seqs[sid].length

    # -- steps --------------------------------------------------------------------------------
    def prepare(self, sids: list[int], q_lens: list[int]) -> tuple[BatchLayout, StepKV]:
        """Reserve blocks for `q_lens[b]` new tokens of each sequence; return the step's index tensors."""
        bs = self.block_size
        need = sum(max(self.blocks_for(self.seqs[s].length + n) - len(self.seqs[s].blocks), 0)
                   for s, n in zip(sids, q_lens))
        if self.pool.can_allocate(need) is not Admission.OK:
            raise CapacityError(
                f"the KV cache needs {need} more blocks but has {self.pool.num_free} free of "
                f"{self.pool.num_blocks}; raise kv_cache.gpu_blocks or lower the batch size"
            )
        slot_blocks, slot_offsets, kv_lens = [], [], []
        for sid, n in zip(sids, q_lens):
            seq = self.seqs[sid]
            extra = self.blocks_for(seq.length + n) - len(seq.blocks)
            if extra > 0:
                seq.blocks += self._allocate(extra)
            pos = torch.arange(seq.length, seq.length + n)
            table = torch.tensor(seq.blocks, dtype=torch.long)
            slot_blocks.append(table[pos // bs])
            slot_offsets.append(pos % bs)
            seq.length += n
            kv_lens.append(seq.length)
        layout = BatchLayout.build(q_lens, kv_lens, self.device)
        max_blocks = max(len(self.seqs[s].blocks) for s in sids)
        tables = torch.zeros(len(sids), max_blocks, dtype=torch.long)
        for b, sid in enumerate(sids):
            blocks = self.seqs[sid].blocks
            tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        key_pos = torch.arange(max_blocks * bs).expand(len(sids), -1)
        key_valid = key_pos < torch.tensor(kv_lens)[:, None]
        step = StepKV(
            torch.cat(slot_blocks).to(self.device), torch.cat(slot_offsets).to(self.device),
            tables.to(self.device), key_pos.to(self.device), key_valid.to(self.device),
        )
        return layout, step

    def view(self, layer: int, layout: BatchLayout, step: StepKV) -> LayerKV:
        return LayerKV(self, layer, layout, step)


class LayerKV:
    """The KV cache as one layer of one step sees it (implements `offload.model.KVView`)."""

    def __init__(self, cache: PagedKVCache, layer: int, layout: BatchLayout, step: StepKV) -> None:
        self.cache, self.layer, self.layout, self.step = cache, layer, layout, step

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        data = self.cache.pool.data[:, self.layer]  # [blocks, 2, block_size, Hkv, D]
        data[self.step.slot_blocks, 0, self.step.slot_offsets] = k
        data[self.step.slot_blocks, 1, self.step.slot_offsets] = v

    def groups(self, window: int | None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        data = self.cache.pool.data[:, self.layer]  # [blocks, 2, block_size, Hkv, D]
        B, nb = self.step.tables.shape
        kv = data[self.step.tables]  # [B, nb, 2, block_size, Hkv, D]
        k = kv[:, :, 0].reshape(B, nb * self.cache.block_size, *kv.shape[-2:])
        v = kv[:, :, 1].reshape(B, nb * self.cache.block_size, *kv.shape[-2:])
        mask = self.layout.mask(self.step.key_positions, self.step.key_valid, window)
        return [(k, v, mask)]
