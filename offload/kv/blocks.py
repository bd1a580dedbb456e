"""The KV cache's bookkeeping types: blocks, sequences, the per-step index tensors, the settings.

    Block        where one logical block lives (tier, slot) and what eviction looks at
    Sequence     a block table in token order, plus blocks reserved for its future tokens
    TierBlocks   the blocks of one tier that a step attends over, flattened over the batch
    StepKV       index tensors built once per step and shared by every layer
    KVSettings   the cache's settings with every `auto` resolved (by the planner)

Plain data: no tensors are allocated here and nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
