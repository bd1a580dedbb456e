"""Paged KV cache over three tiers: hot blocks on the device, cold ones in host RAM and on disk.

A block holds `block_size` tokens of K and V for *all* layers. A sequence's block table
lists *logical* block ids in token order; token t lives in block `table[t // block_size]`
at offset `t % block_size`. Each logical block lives in exactly one tier slot at a time:

    logical pool (storage.block_pool)  ids and reference counts (shared by samples, the prefix cache)
    tier pools (storage.block_pool)    free slots of the gpu / cpu / disk stores
    stores (offload.kv.formats)        the bytes, plane (layer) major

New tokens are always written on the device. When the device is short of slots, the
eviction policy picks victims (never the newest block of a running sequence, never a block
written this step) and they move device -> host -> disk, converted to the cold format
(full precision, int8 with per-block per-head scales, or the layer inputs for recompute).
When the device has room again, the hottest cold blocks come back (transfer format only).
A policy with a timeout (`idle`) also demotes the blocks untouched for `idle_seconds`, room
needed or not, at every step and whenever `expire_idle` is called between steps; they stay
cold until a step attends over them again.

Attention reads every block in token order (the arithmetic of a cache that never left the device: the
same tokens bit for bit): a CPU each key where it lies through one table (`StepKV.split_table`), else
cold blocks put back in order on the device (`offload.kv.fetch`, the run's one transfer engine). With
`cpu_attention`, cold groups are attended on the CPU and merged exactly by log-sum-exp; the per-block
share of attention feeds the `attention` eviction policy.

Prompts admitted with a worst-case reservation of logical blocks (OK / LATER / NEVER) never run out
half way; full blocks found by their tokens (`offload.kv.prefix`) hold an id until a reservation or the
last tier needs it. This module knows sequences, blocks and token positions; the math is in `offload.model`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from offload.kv import blocks as kvb
from offload.kv.blocks import Block, KVSettings, Recency, Sequence, StepKV, slot_table, tier_blocks
from offload.kv.fetch import ColdFetcher, Fetched
from offload.kv.formats import ColdFormat, TierStore, cold_kv, to_cold
from offload.kv.prefix import PrefixBlocks, PrefixCache
from offload.kv.view import LayerKV
from offload.model import functional as M
from offload.model.config import ModelConfig
from offload.model.layout import BatchLayout
from schedulers.eviction import Candidate, make_policy
from schedulers.timeline import Timeline
from schedulers.traffic import Traffic
from schedulers.transfer import TransferEngine, make_engine
from storage.block_pool import Admission, BlockPool
from storage.errors import CapacityError
from storage.lock import ScratchDir
from storage.tiers import TIERS, on
from storage.units import blocks_for


class PagedKVCache(PrefixBlocks):
    #: do the blocks hold the keys and values (so their device bytes come from the plan's KV region)? A
    #: subclass that keeps only the bookkeeping, its KV elsewhere, says no (offload.hf.executor.HFSequences)
    holds_kv = True

    def __init__(self, cfg: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device | str, memory: torch.Tensor | None = None,
                 settings: KVSettings | None = None, disk_dir: Path | None = None, pin_memory: bool = False,
                 timeline: Timeline | None = None, clock: Callable[[], float] = time.monotonic,
                 rope: M.Rope | None = None, page_cache: bool = False, traffic: Traffic | None = None,
                 host_memory: torch.Tensor | None = None, engine: TransferEngine | None = None,
                 identity: str = "", prefix_dir: Path | None = None, layers: range | None = None) -> None:
        """`memory` / `host_memory`: uint8 regions (of the device tier / the pinned cpu tier) for the device blocks
        and the cold host bytes (`fetch.host_bytes`). `engine`: the run's transfer engine (the weights'). `identity` /
        `prefix_dir`: the prefix cache's key root / its files. `layers`: the model layers a block holds (a stage's)."""
        s = dataclasses.replace(settings or KVSettings(), block_size=block_size, gpu_blocks=num_blocks)
        self.settings = s
        self.cfg, self.block_size, self.dtype = cfg, block_size, dtype
        self.device = torch.device(device)
        self.engine = engine or make_engine(self.device)  # the one copy stream, shared with the weights
        self.timeline = timeline or Timeline(enabled=False)
        self.clock, self.rope = clock, rope
        self.policy = make_policy(s.eviction, s.idle_seconds, clock)
        self.layers = range(cfg.num_layers) if layers is None else layers
        L = len(self.layers)  # planes: this stage's layers
        self.device_fmt = ColdFormat.for_device(cfg, block_size, dtype, s.restore)
        self.cold_fmt = ColdFormat.for_config(cfg, block_size, dtype, s.quantization, s.restore)
        counts = {"gpu": num_blocks, "cpu": s.cpu_blocks, "disk": s.disk_blocks}
        if counts["disk"] and disk_dir is None:
            raise CapacityError("kv_cache.disk_blocks needs a disk tier (tiers.disk.path) to put its slot file in")
        self.pools = {t: BlockPool(n) for t, n in counts.items() if n > 0}
        if "gpu" not in self.pools:
            raise CapacityError("the KV cache needs at least one device block; raise kv_cache.gpu_blocks")
        self.stores: dict[str, TierStore] = {"gpu": TierStore("gpu", self.device_fmt, L, num_blocks, self.device,
                                                              memory=memory)}
        self.traffic = traffic or Traffic()  # kind "kv": blocks demoted and promoted, cold blocks read by attention
        self.fetcher = ColdFetcher(self.cold_fmt, L, counts["cpu"], counts["disk"], self.engine, s.stage_blocks,
                                   s.cpu_attention, host_memory, self.timeline, self.traffic)
        if counts["cpu"]:
            self.stores["cpu"] = TierStore("cpu", self.cold_fmt, L, counts["cpu"], "cpu", pin_memory,
                                           memory=host_memory)
        self._scratch: ScratchDir | None = None  # this process's own directory under disk_dir (its slot files)
        self.prefix: PrefixCache | None = None  # made last; `close` may run before (a disk slot file refused)
        if counts["disk"]:
            self._scratch = ScratchDir(disk_dir)
            try:
                self.stores["disk"] = TierStore("disk", self.cold_fmt, L, counts["disk"], disk_dir=self._scratch.path,
                                                page_cache=page_cache, direct_io=s.direct_io)
            except BaseException:
                self.close()
                raise
        self.logical = BlockPool(sum(counts.values()))
        self.blocks: dict[int, Block] = {}
        # the same (tier, slot) per logical id as a tensor, kept in step with `blocks` (-1: not materialised),
        # so a step's block tables are tensor lookups, not a Python walk over every block
        self._where = torch.full((max(self.logical.num_blocks, 1), 2), -1, dtype=torch.long)  # [ids, (tier, slot)]
        self.recency = Recency()  # when each sequence was last attended over (eviction's `last_touch`)
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0
        self.prefix = PrefixCache.build(self, f"{identity}|{dtype}|block {block_size}|restore {s.restore}", prefix_dir)

    @staticmethod
    def block_nbytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, restore: str = "transfer",
                     planes: int | None = None) -> int:  # every layer, or `planes` of them (a pipeline stage's)
        return ColdFormat.for_device(cfg, block_size, dtype, restore).block_nbytes(planes or cfg.num_layers)

    def plane(self, layer: int) -> int:  # where model layer `layer` sits in the stores (a stage's first is 0)
        return layer - self.layers.start
    @property
    def pool(self) -> BlockPool:  # the device pool (where new tokens are written)
        return self.pools["gpu"]

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def close(self) -> None:
        try:
            self.close_prefix()
            self.fetcher.close()  # the copies out of its staging end before the memory goes
            for store in self.stores.values():
                store.close()
        finally:
            if self._scratch is not None:
                self._scratch.close()
                self._scratch = None

    # -- sequences ----------------------------------------------------------------------------
    def admit(self, tokens: int) -> Admission:
        """Could a sequence of `tokens` total tokens get its blocks (now / once others finish / never)?"""
        return self.can_allocate(self.blocks_for(tokens))

    def add_sequence(self, reserve_tokens: int = 0) -> int:
        """A new sequence, with logical blocks for `reserve_tokens` reserved up front (worst case)."""
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = Sequence(reserved=self.take_logical(self.blocks_for(reserve_tokens)))
        return sid

    def fork(self, sid: int, reserve_tokens: int) -> int:
        """A copy of `sid` sharing its blocks (copy-on-write), reserving blocks for tokens past the shared ones."""
        parent = self.seqs[sid]
        shared_full = parent.length // self.block_size
        need = self.blocks_for(reserve_tokens) - shared_full
        child_id = self._next_id
        self._next_id += 1
        self.logical.incref(parent.blocks)
        self.seqs[child_id] = Sequence(list(parent.blocks), parent.length, self.take_logical(max(need, 0)))
        return child_id

    def reserve(self, sid: int, total_tokens: int) -> Admission:
        """Reserve logical blocks so `sid` can grow to `total_tokens` (a kept sequence continued)."""
        seq = self.seqs[sid]
        total = self.blocks_for(total_tokens)
        if total > self.logical.num_blocks:
            return Admission.NEVER
        need = total - len(seq.blocks) - len(seq.reserved)
        if need <= 0:
            return Admission.OK
        status = self.can_allocate(need)
        if status is Admission.OK:
            seq.reserved += self.logical.allocate(need)
        return status

    def release_reservation(self, sid: int) -> None:
        """Give back the blocks `sid` reserved and did not fill (a finished sequence that is kept)."""
        self.unref(self.seqs[sid].reserved)
        self.seqs[sid].reserved = []

    def free_sequence(self, sid: int) -> None:
        self.recency.forget(sid, self.seqs, self.blocks)
        seq = self.seqs.pop(sid)
        self.unref(seq.blocks + seq.reserved)

    def truncate(self, sid: int, length: int, reserve: bool = False) -> int:
        """Forget the tokens of `sid` from `length` on (`keepable`: clamped, and to the block boundary when the
        block it would end part-filled is cold or shared: new tokens go to a device block the sequence owns
        alone); returns the length kept. Whole blocks past the end leave the table: with `reserve` (rejected
        speculative tokens) a block only this sequence holds frees its slot and its id returns to the
        reservation (the admitted worst case still holds), otherwise its id is freed (a shared one loses this
        reference). The kept device block's slots past the end are zeroed, as if never written."""
        seq = self.seqs[sid]
        length = self.keepable(sid, length)
        keep = self.blocks_for(length)
        dropped, seq.blocks = seq.blocks[keep:], seq.blocks[:keep]
        for bid in reversed(dropped):
            if reserve and self.logical.refcount(bid) == 1:
                self._release([bid])  # its slot goes back to its tier's pool
                seq.reserved.append(bid)  # still counted as this sequence's (logical refcount stays 1)
            else:
                self._release(self.logical.free([bid]))
        seq.length = length
        if length % self.block_size:  # the kept partial block is on the device and this sequence's alone
            b, off = self.blocks[seq.blocks[-1]], length % self.block_size
            arrays = self.stores["gpu"].arrays
            arrays["kv"].data[:, b.slot, :, off:] = 0  # [L, slots, 2, block_size, Hkv, D]
            if "hidden" in arrays:
                arrays["hidden"].data[:, b.slot, off:] = 0  # [L, slots, block_size, hidden]
        return length

    def keepable(self, sid: int, length: int) -> int:  # the length `truncate` would keep; changes nothing
        seq, bs, length = self.seqs[sid], self.block_size, max(min(length, self.seqs[sid].length), 0)
        last = seq.blocks[length // bs] if length % bs else None
        cut = last is not None and (self.blocks[last].tier != "gpu" or self.logical.refcount(last) > 1)
        return length - length % bs if cut else length

    def _release(self, ids: list[int]) -> None:
        """Logical blocks nobody references any more give their tier slots back."""
        for bid in ids:
            b = self.blocks.pop(bid, None)
            self._where[bid] = -1
            if b is not None:
                self.pools[b.tier].free([b.slot])
                self.stores[b.tier].invalidate(b.slot)

    def length(self, sid: int) -> int:
        return self.seqs[sid].length

    def count(self, tier: str) -> int:
        """Materialised blocks living in a tier."""
        return int((self._where[:, 0] == TIERS.index(tier)).sum())

    def count_cold(self) -> int:
        return int((self._where[:, 0] > 0).sum())

    def _writing(self) -> set[int]:
        """The newest block of each sequence while tokens are still appended to it: it stays on the device."""
        return {seq.blocks[-1] for seq in self.seqs.values() if seq.length % self.block_size}

    def _candidates(self, which: Callable[[int, Block], bool]) -> list[Candidate]:
        """What the eviction policy sees of the blocks `which` selects (their last touch brought up to date)."""
        self.recency.sync(self.seqs, self.blocks)
        return [Candidate(bid, b.last_touch, b.mass) for bid, b in self.blocks.items() if which(bid, b)]

    # -- moving blocks ------------------------------------------------------------------------
    def _take_slot(self, tier: str, protected: set[int]) -> int:
        """A free slot in `tier`, demoting a victim further down first if the tier is full."""
        pool = self.pools.get(tier)
        if pool is None:
            raise CapacityError(f"the KV cache has no {tier} blocks; raise kv_cache.{tier}_blocks")
        if pool.num_free == 0:
            self._demote_from(tier, 1, protected)
        return pool.allocate(1)[0]

    def _demote_from(self, tier: str, n: int, protected: set[int]) -> None:
        below = [t for t in TIERS[TIERS.index(tier) + 1 :] if t in self.pools]
        if not below:
            if self.drop_idle(self.pools[tier].num_free + n, tier):  # the last tier: idle cached blocks go instead
                return
            raise CapacityError(
                f"the KV cache is full: every {tier} block is in use and there is no tier below it; raise "
                "kv_cache.cpu_blocks or kv_cache.disk_blocks, or admit fewer tokens"
            )
        victims = self.policy.choose(self._candidates(lambda bid, b: b.tier == tier and bid not in protected), n)
        if len(victims) < n:
            raise CapacityError(f"the {tier} KV blocks are all in use by running sequences; raise "
                                f"kv_cache.{tier}_blocks or lower the batch size")
        for bid in victims:
            self._move(bid, below[0], protected)

    def _move(self, bid: int, dst: str, protected: set[int]) -> None:
        b = self.blocks[bid]
        src_store = self.stores[b.tier]
        slot = self._take_slot(dst, protected | {bid})
        parts = src_store.read_block(b.slot)
        if b.tier == "gpu":  # device format -> cold format
            parts = to_cold(self.cold_fmt, parts["kv"], parts.get("hidden"))
        elif dst == "gpu":  # cold -> device (promotion; transfer formats only)
            parts = {"kv": cold_kv(self.cold_fmt, {k: v.to(self.device) for k, v in parts.items()}, self.dtype)}
        nbytes = sum(v.numel() * v.element_size() for v in parts.values())
        track = "kv-spill" if TIERS.index(dst) > TIERS.index(b.tier) else "kv-fetch"
        with self.timeline.span(track, f"block {bid}", nbytes=nbytes, src=b.tier, dst=dst):
            self.stores[dst].write_block(slot, parts)
        self.traffic.add("kv", b.tier, dst, nbytes)
        self.pools[b.tier].free([b.slot])
        src_store.invalidate(b.slot)
        b.tier, b.slot = dst, slot
        self._where[bid] = torch.tensor([TIERS.index(dst), slot])

    def _promote(self, room: int, protected: set[int]) -> None:
        """Bring the hottest cold blocks back while the device has room (transfer formats only), unless expired."""
        if room <= 0 or self.cold_fmt.name == "hidden" or len(self.pools) == 1 or self.count_cold() == 0:
            return
        cold = self._candidates(lambda bid, b: b.tier != "gpu" and not self.idle_cached(bid))  # cold till a hit
        expired = set(self.policy.expired(cold))
        for bid in [b for b in reversed(self.policy.order(cold)) if b not in expired][:room]:  # last out, first in
            self._move(bid, "gpu", protected)

    def expire_idle(self, protected: set[int] | None = None) -> int:
        """Demote the device blocks the policy holds expired (`idle`) though nothing needs their room; how many left.
        Each step does it; so does a caller that waits for work. Partly filled newest blocks stay (being written)."""
        below = [t for t in TIERS[1:] if t in self.pools]
        if not below:  # (nowhere to demote to: no policy to ask, no blocks to walk)
            return 0
        protected = self._writing() if protected is None else protected
        gpu = self._candidates(lambda bid, b: b.tier == "gpu" and bid not in protected)
        victims = self.policy.expired(gpu)[: sum(self.pools[t].num_free for t in below)]  # each takes a slot below
        for bid in victims:
            self._move(bid, below[0], protected)
        return len(victims)

    # -- steps --------------------------------------------------------------------------------
    def prepare(self, sids: list[int], q_lens: list[int]) -> tuple[BatchLayout, StepKV]:
        """Make room and blocks for `q_lens[b]` new tokens of each sequence; index tensors for the step."""
        bs = self.block_size
        now = self.clock()
        protected = self._writing()
        self.recency.touch(sids, now)  # touched by this step: never expired by it
        self.expire_idle(protected)
        copies, fresh = [], 0
        for sid, n in zip(sids, q_lens):
            seq = self.seqs[sid]
            if seq.length % bs and n and self.logical.refcount(seq.blocks[-1]) > 1:
                copies.append(sid)  # writes into a shared partial block: copy it first
            fresh += max(self.blocks_for(seq.length + n) - len(seq.blocks), 0)
        need = fresh + len(copies)
        gpu = self.pools["gpu"]
        pinned = sum(1 for bid in protected if bid in self.blocks and self.blocks[bid].tier == "gpu")
        if need > gpu.num_blocks - pinned:
            raise CapacityError(
                f"a step needs {need} new device KV blocks but only {gpu.num_blocks} exist and running sequences "
                "pin their newest ones; raise kv_cache.gpu_blocks or lower activations.prefill_chunk"
            )
        if need > gpu.num_free:
            self._demote_from("gpu", need - gpu.num_free, protected)
        for sid in copies:
            self._copy_on_write(sid, protected)
        starts, kv_lens = [], []
        for sid, n in zip(sids, q_lens):
            seq = self.seqs[sid]
            while len(seq.blocks) < self.blocks_for(seq.length + n):
                bid = seq.reserved.pop() if seq.reserved else self.take_logical(1)[0]
                slot = gpu.allocate(1)[0]
                for arr in self.stores["gpu"].arrays.values():  # padded key slots are multiplied by zero
                    arr.clear(slot)  # weights, and 0 * NaN from stale memory would poison a row
                self.blocks[bid] = Block("gpu", slot, now)
                self._where[bid] = torch.tensor([0, slot])
                seq.blocks.append(bid)
                protected.add(bid)
            starts.append(seq.length)
            seq.length += n
            kv_lens.append(seq.length)
        self._promote(gpu.num_free - len(sids), protected)
        layout = BatchLayout.build(q_lens, kv_lens, self.device)
        tables = [self.seqs[sid].blocks for sid in sids]
        positions, valid, block_ids = kvb.step_tables(tables, kv_lens, bs)
        slots = [[self.blocks[b].slot for b in t] for t in tables]  # (new tokens are written on the device)
        slot_blocks, slot_offsets = kvb.new_slots(slots, starts, q_lens, bs)
        tiers = {self.blocks[b].tier for t in tables for b in t}
        if len(tiers) == 1:  # one tier holds them all (a run that has not evicted): the token order
            groups: tuple = (kvb.one_tier(tiers.pop(), tables, slots, positions, valid, self.device),)
        else:
            found = (tier_blocks(self._where, t, block_ids, kv_lens, (positions, valid), bs, self.device)
                     for t in TIERS if t in self.pools)
            groups = tuple(g for g in found if g is not None)
        sb, so, kp, kv = (on(t, self.device) for t in (slot_blocks, slot_offsets, positions, valid))
        step = StepKV(sb, so, groups, block_ids.shape[1], kp, kv, block_ids, slot_table(groups, block_ids))
        return layout, step

    def _copy_on_write(self, sid: int, protected: set[int]) -> None:
        seq = self.seqs[sid]
        old = seq.blocks[-1]
        src = self.blocks[old]
        assert src.tier == "gpu", "a shared partial block is the newest of its sequences: it stays on the device"
        bid = seq.reserved.pop() if seq.reserved else self.take_logical(1)[0]
        slot = self.pools["gpu"].allocate(1)[0]
        self.stores["gpu"].write_block(slot, self.stores["gpu"].read_block(src.slot))
        self.blocks[bid] = Block("gpu", slot, src.last_touch, src.mass)
        self._where[bid] = torch.tensor([0, slot])
        seq.blocks[-1] = bid
        protected.add(bid)
        self._release(self.logical.free([old]))

    def fetches(self, step: StepKV) -> bool:  # blocks to fetch from a cold tier (not read where they lie)?
        return any(g.tier != "gpu" and not self.fetcher.reads_in_place(self.stores[g.tier]) for g in step.groups)

    def fetch_cold(self, layer: int, step: StepKV) -> tuple[dict[str, Fetched], int]:
        """One layer of the step's cold groups ({tier: parts, Uploads, InPlace}, bytes), run ahead (side thread)."""
        return self.fetcher.fetch(self.stores, [g for g in step.groups if g.tier != "gpu"], self.plane(layer))

    def view(self, layer: int, layout: BatchLayout, step: StepKV, cold: dict | None = None) -> LayerKV:
        return LayerKV(self, layer, layout, step, cold)
