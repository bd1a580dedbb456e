"""The automatic prefix cache: full KV blocks found by their content, shared copy-on-write across requests.

    key(block i) = blake2b(key(block i-1) + tokens of block i),   key(block -1) = blake2b(identity)

A full block's key names its tokens and every token before it, under the model / dtype / KV-format
identity, so two sequences with the same first `k * block_size` tokens have the same first `k` keys and
their K/V are the same bits (the forward pass is row-invariant). The index holds one logical reference
to each block it names; a request's sequence attaches the longest chain of cached blocks (incref, the
sequence's own reserved ids for them given back) and prefills only the rest, at least one token. A
cached block is full, so nobody writes into it again: a sequence that diverges inside it or past it
writes its own blocks (`PagedKVCache.truncate` and copy-on-write treat it as shared).

An unreferenced cached block (the index's reference only) is an ordinary block to the tiers: eviction
moves it device -> host -> disk in its cold format (int8 blocks stay int8 when reused), and a hit attends
over it where it lives (or promotes it, as the cache promotes any block a running sequence holds). It
leaves the index, least recently used first (deepest first on ties), only when a reservation needs its
logical id. With `persist`, `offload.kv.persist` keeps the blocks on disk across processes.

This module knows tokens, keys and logical ids; where a block's bytes live is `offload.kv.cache`'s.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offload.kv.blocks import Block
from offload.kv.persist import PersistedBlocks
from storage.block_pool import Admission

MODES = ("on", "off", "persist")


def chain_keys(root: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of the full blocks of `tokens`, each chained on the one before it (16 bytes each)."""
    keys, prev = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens[start : start + block_size]))
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclass
class PrefixStats:
    hits: int = 0  # requests that attached at least one cached block
    misses: int = 0  # requests that attached none
    cached_tokens: int = 0  # prompt tokens attached instead of prefilled
    evicted: int = 0  # blocks that left the index to make room
    loaded: int = 0  # blocks read back from the persisted store


class PrefixCache:
    """The index of one KV pool's content-addressed blocks (`identity`: model, dtype, KV format, block size)."""

    def __init__(self, kv: Any, identity: str, persisted: PersistedBlocks | None = None) -> None:
        # (the pool owns this index: a weak way back, so that a pool let go is freed at once, not when the cyclic
        # collector comes round: a calibration's probe pools held 842 MiB after it, SmolLM2's first start on 24 GiB)
        self.kv, self.identity = weakref.proxy(kv), identity
        self.root = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self.index: dict[bytes, int] = {}  # key -> logical id
        self.keys: dict[int, bytes] = {}  # logical id -> key
        self.depth: dict[int, int] = {}  # logical id -> its index in the chain
        self.persisted = persisted
        self.stats = PrefixStats()

    @classmethod
    def build(cls, kv: Any, identity: str, persist_dir: Path | None) -> PrefixCache | None:
        """The pool's prefix cache as `kv.settings.prefix_cache` asks (None: off; persist: under `persist_dir`)."""
        s = kv.settings
        if s.prefix_cache == "off" or not kv.holds_kv:  # a pool whose K/V live elsewhere has no blocks to share
            return None
        persisted = (PersistedBlocks(persist_dir, identity, s.persist_blocks)
                     if s.prefix_cache == "persist" and persist_dir is not None else None)
        return cls(kv, identity, persisted)

    def holds(self, bid: int) -> bool:
        return bid in self.keys

    @property
    def blocks(self) -> int:
        return len(self.keys)

    def pin(self, sid: int, tokens: Sequence[int]) -> int:
        """Give the empty sequence `sid` the indexed blocks of the longest prefix of `tokens` that leaves one token
        to compute, before its reservation is made (admission then reserves that many blocks fewer); returns the
        blocks given. `attach` later extends the chain with what was indexed or persisted meanwhile."""
        kv = self.kv
        seq = kv.seqs[sid]
        assert seq.length == 0 and not seq.blocks, "a prefix is pinned to an empty sequence"
        for key in chain_keys(self.root, tokens[: max(len(tokens) - 1, 0)], kv.block_size):
            bid = self.index.get(key)
            if bid is None:
                break
            kv.logical.incref([bid])  # the sequence's reference
            seq.blocks.append(bid)
        seq.length = len(seq.blocks) * kv.block_size
        return len(seq.blocks)

    def attach(self, sid: int, tokens: Sequence[int]) -> int:
        """Extend the cached blocks of `sid` (none, or those `pin` gave) with the longest chain of cached blocks of
        `tokens` that leaves at least one token to compute; returns the tokens cached (a multiple of the block size).

        Each block attached here replaces one of the ids the sequence reserved (given back for an indexed block; a
        block read back from the persisted store takes the reserved id itself), so its worst case still holds."""
        kv = self.kv
        seq = kv.seqs[sid]
        assert seq.length == len(seq.blocks) * kv.block_size, "a prefix attaches to whole cached blocks"
        keys = chain_keys(self.root, tokens[: max(len(tokens) - 1, 0)], kv.block_size)
        for depth, key in enumerate(keys[len(seq.blocks) :], start=len(seq.blocks)):
            bid = self.index.get(key)
            if bid is not None:
                kv.logical.incref([bid])  # the sequence's reference
                if seq.reserved:
                    kv.unref([seq.reserved.pop()])
            elif self.persisted is not None and seq.reserved and self._load(key, depth, seq.reserved[-1]):
                bid = seq.reserved.pop()  # its reference is now the sequence's; `_load` added the index's
            else:
                break
            seq.blocks.append(bid)
        seq.length = cached = len(seq.blocks) * kv.block_size
        self.stats.hits += bool(cached)
        self.stats.misses += not cached
        self.stats.cached_tokens += cached
        kv.timeline.count("prefix-cache", hits=self.stats.hits, misses=self.stats.misses, blocks=self.blocks)
        return cached

    def register(self, sid: int, tokens: Sequence[int]) -> int:
        """Index the full blocks of `sid`, whose K/V hold `tokens` (every one of them written); returns how
        many blocks were new. A key already naming another block keeps it (the same bits, computed twice)."""
        kv = self.kv
        blocks = kv.seqs[sid].blocks
        new = 0
        for depth, key in enumerate(chain_keys(self.root, tokens[: kv.length(sid)], kv.block_size)):
            bid = blocks[depth]
            if key in self.index or bid in self.keys:
                continue
            kv.logical.incref([bid])
            self.index[key], self.keys[bid], self.depth[bid] = bid, key, depth
            new += 1
            if self.persisted is not None:
                self.persisted.save(key, kv.device_block(bid))
        return new

    @torch.inference_mode()
    def make_room(self, n: int, tier: str | None = None) -> None:
        """Drop unreferenced cached blocks, least recently used first, until `n` logical ids are free (with
        `tier`: until `n` slots of that tier are, dropping only blocks living there)."""
        kv = self.kv
        pool = kv.logical if tier is None else kv.pools[tier]
        if pool.num_free >= n:
            return
        kv.recency.sync(kv.seqs, kv.blocks)
        idle = [bid for bid in self.keys if kv.logical.refcount(bid) == 1
                and (tier is None or kv.blocks[bid].tier == tier)]
        idle.sort(key=lambda bid: (kv.blocks[bid].last_touch, -self.depth[bid]))
        for bid in idle:
            if pool.num_free >= n:
                break
            self.forget(bid)
            self.stats.evicted += 1

    def forget(self, bid: int) -> None:
        """The index's reference to `bid` goes (the block goes with it unless a sequence holds it)."""
        key = self.keys.pop(bid)
        del self.index[key], self.depth[bid]
        self.kv.unref([bid])

    @torch.inference_mode()
    def clear(self) -> None:
        for bid in list(self.keys):
            self.forget(bid)

    def _load(self, key: bytes, depth: int, bid: int) -> bool:
        """Read a persisted block into the reserved id `bid` (a device block) and index it; False when it is
        absent or damaged."""
        assert self.persisted is not None
        parts = self.persisted.load(key, self.kv.device_fmt, self.kv.cfg.num_layers)
        if parts is None:
            return False
        self.kv.materialise(bid, parts)
        self.kv.logical.incref([bid])  # the index's reference
        self.index[key], self.keys[bid], self.depth[bid] = bid, key, depth
        self.stats.loaded += 1
        return True


class PrefixBlocks:
    """What `PagedKVCache` offers its prefix cache: room made from idle cached blocks, references dropped, a block
    materialised from bytes, a device block's bytes (a mixin: these run on the cache's own state)."""

    prefix: PrefixCache | None  # the rest (logical, pools, stores, blocks, ...) is PagedKVCache's

    def can_allocate(self, n: int) -> Admission:
        """Could `n` logical blocks be allocated now (cached blocks nobody uses make room), later, never?"""
        if self.prefix is not None and n <= self.logical.num_blocks:
            self.prefix.make_room(n)
        return self.logical.can_allocate(n)

    def take_logical(self, n: int) -> list[int]:
        """`n` logical ids, idle cached blocks giving theirs up first if the pool is short (CapacityError if
        even that is not enough: admission reserves what a request needs)."""
        self.can_allocate(n)
        return self.logical.allocate(n)

    def drop_idle(self, n: int, tier: str) -> bool:
        """The last tier is full: idle cached blocks living there leave the cache until it has `n` free slots
        (True when it has)."""
        if self.prefix is not None:
            self.prefix.make_room(n, tier)
        return self.pools[tier].num_free >= n

    def close_prefix(self) -> None:
        """Wait for the persisted blocks still being written (the pool is closing)."""
        if self.prefix is not None and self.prefix.persisted is not None:
            self.prefix.persisted.close()

    def unref(self, ids: list[int]) -> None:
        """Drop one reference to each logical block; those nobody references give their slots back."""
        self._release(self.logical.free(ids))

    def idle_cached(self, bid: int) -> bool:
        """Only the prefix cache holds `bid` (no sequence attends over it)."""
        return self.prefix is not None and self.prefix.holds(bid) and self.logical.refcount(bid) == 1

    def idle_count(self, tier: str | None = None) -> int:
        """Blocks only the prefix cache holds (in `tier`): free for the taking when a reservation needs them.
        Safe to read from another thread while steps run (a count that may be one step old)."""
        if self.prefix is None:
            return 0
        ids = list(self.prefix.keys)  # one atomic copy: the engine's thread may change the index meanwhile
        return sum(1 for bid in ids if self.logical.refcount(bid) == 1
                   and (tier is None or getattr(self.blocks.get(bid), "tier", None) == tier))

    def materialise(self, bid: int, parts: dict[str, torch.Tensor]) -> None:
        """Put the bytes of the allocated, empty logical block `bid` ({array: [layers, *shape]}, device format)
        in a device slot (demoting another block if the device is full)."""
        slot = self._take_slot("gpu", self._writing())
        self.stores["gpu"].write_block(slot, parts)
        self.blocks[bid] = Block("gpu", slot, self.clock())
        self._where[bid] = torch.tensor([0, slot])

    def device_block(self, bid: int) -> dict[str, torch.Tensor] | None:
        """A device block's bytes ({array: [layers, *shape]}); None for a cold one (its format may be lossy)."""
        b = self.blocks.get(bid)
        return None if b is None or b.tier != "gpu" else self.stores["gpu"].read_block(b.slot)
