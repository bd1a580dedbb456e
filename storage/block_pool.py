"""A fixed pool of block ids in one tier (or the logical id space): the free list and reference counts.

The bytes of the blocks live elsewhere (a tier's slot arrays); the pool hands out ids. It is
the only owner of the free list and the reference counts (several sequences may share a
block copy-on-write), so nothing else can free a block twice or leak one. It is shaped as a
FIFO free queue so a freed block is reused as late as possible. It knows ids, never what a
block holds.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable

from storage.errors import CapacityError


class Admission(enum.Enum):
    """The answer to "can I have n blocks?": "not now" is a value, not an exception."""

    OK = "ok"  # available now
    LATER = "later"  # the pool is big enough but busy: wait for blocks to be freed
    NEVER = "never"  # more than the pool will ever hold


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise CapacityError(f"a block pool needs at least one block, got {num_blocks}; raise its capacity")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

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
