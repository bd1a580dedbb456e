"""A fixed pool of equally shaped blocks in one tier: the free list and reference counts.

Blocks are allocated once, as one tensor `[num_blocks, *block_shape]` (or kept elsewhere,
with an empty `block_shape`: then the pool is bookkeeping only), and handed out by index.
The pool is the only owner of the free list and the reference counts (several sequences
may share a block copy-on-write), so nothing else can free a block twice or leak one. It is
shaped as a FIFO free queue so a freed block is reused as late as possible.
It knows block shapes and bytes, never what a block means.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable

import torch

from storage.errors import CapacityError


class Admission(enum.Enum):
    """The answer to "can I have n blocks?": "not now" is a value, not an exception."""

    OK = "ok"  # available now
    LATER = "later"  # the pool is big enough but busy: wait for blocks to be freed
    NEVER = "never"  # more than the pool will ever hold


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_shape: tuple[int, ...] = (),
        dtype: torch.dtype = torch.uint8,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        memory: torch.Tensor | None = None,
    ) -> None:
        """`memory`: an already allocated uint8 region (a tier's) to lay the blocks over, instead of a new tensor."""
        if num_blocks <= 0:
            raise CapacityError(f"a block pool needs at least one block, got {num_blocks}; raise its capacity")
        self.num_blocks = num_blocks
        self.block_shape = tuple(block_shape)
        shape = (num_blocks, *self.block_shape)
        if not self.block_shape:  # bookkeeping only: the blocks' bytes live elsewhere
            self.data = None
        elif memory is None:
            self.data = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        else:
            n = math.prod(shape) * dtype.itemsize
            assert memory.dtype == torch.uint8 and memory.numel() >= n, "the region is smaller than the pool"
            self.data = memory[:n].view(dtype).view(shape)  # [num_blocks, *block_shape]
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def block_nbytes(self) -> int:
        return 0 if self.data is None else self.data[0].numel() * self.data.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> Admission:
        if n > self.num_blocks:
            return Admission.NEVER
        return Admission.OK if n <= len(self._free) else Admission.LATER

    def allocate(self, n: int) -> list[int]:
        status = self.can_allocate(n)
        if status is not Admission.OK:
            raise CapacityError(
                f"asked for {n} blocks but the pool has {len(self._free)} free of {self.num_blocks}; "
                "check can_allocate() first or raise the pool size"
            )
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        for i in ids:
            assert self._refs[i] > 0, f"block {i} is free"
            self._refs[i] += 1

    def free(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference to each block; those left with none return to the pool (and are returned)."""
        released = []
        for i in ids:
            assert self._refs[i] > 0, f"block {i} freed twice"
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)
                released.append(i)
        return released

    def refcount(self, block: int) -> int:
        return self._refs[block]
