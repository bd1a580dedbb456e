"""Paged KV cache over three tiers: hot blocks on the device, cold ones in host RAM and on disk.

A block holds `block_size` tokens of K and V for *all* layers. A sequence's block table
lists *logical* block ids in token order; token t lives in block `table[t // block_size]`
at offset `t % block_size`. Each logical block lives in exactly one tier slot at a time:

    logical pool (storage.BlockPool)   ids and reference counts (prompt blocks shared by samples)
    tier pools (storage.BlockPool)     free slots of the gpu / cpu / disk stores
    stores (offload.kv_tiers)          the bytes, plane (layer) major

New tokens are always written on the device. When the device is short of slots, the
eviction policy picks victims (never the newest block of a running sequence, never a block
written this step) and they move device -> host -> disk, converted to the cold format
(full precision, int8 with per-block per-head scales, or the layer inputs for recompute).
When the device has room again, the hottest cold blocks come back (transfer format only).

Attention reads every block where it lives: for each layer, the blocks of each tier are
gathered and put back in token order on the device, so the arithmetic is that of a cache
that never left it (the tokens are identical bit for bit). With `cpu_attention`, cold
groups are attended on the CPU without moving them, and the groups are merged exactly
with log-sum-exp (`offload.model.merge_attention`). The per-block
share of attention (from the per-block log-sum-exp) feeds the `attention` eviction policy.

Prompts admitted with a worst-case reservation of logical blocks (OK / LATER / NEVER) never
run out half way. This module knows sequences, blocks and token positions; the math is in
`offload.model`, the bytes in `storage`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload import model as M
from offload.checkpoint import ModelConfig
from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.kv_tiers import ColdFormat, TierStore, cold_kv, to_cold
from offload.model import BatchLayout
from schedulers.eviction import Candidate, make_policy
from schedulers.timeline import Timeline
from storage.block_pool import Admission, BlockPool
from storage.errors import CapacityError

TIERS = ("gpu", "cpu", "disk")


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
class Group:
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


@dataclass(frozen=True)
class StepKV:
    """Per-step index tensors, built once and shared by every layer."""

    slot_blocks: torch.Tensor  # [N] device slot of each new token
    slot_offsets: torch.Tensor  # [N] offset in that block
    groups: tuple[Group, ...]  # one per tier holding blocks of the batch
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


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device | str, memory: torch.Tensor | None = None,
                 settings: KVSettings | None = None, disk_dir: Path | None = None, pin_memory: bool = False,
                 timeline: Timeline | None = None, clock: Callable[[], float] = time.monotonic,
                 rope: M.Rope | None = None, page_cache: bool = False) -> None:
        # the arguments are the truth about block size and device blocks; settings bring the rest
        s = dataclasses.replace(settings or KVSettings(), block_size=block_size, gpu_blocks=num_blocks)
        self.settings = s
        self.cfg, self.block_size, self.dtype = cfg, block_size, dtype
        self.device = torch.device(device)
        self.timeline = timeline or Timeline(enabled=False)
        self.clock = clock
        self.rope = rope
        self.policy = make_policy(s.eviction, s.idle_seconds, clock)
        L = cfg.num_layers
        self.device_fmt = self.device_format(cfg, block_size, dtype, s.restore)
        self.cold_fmt = ColdFormat.for_config(cfg, block_size, dtype, s.quantization, s.restore)
        counts = {"gpu": num_blocks, "cpu": s.cpu_blocks, "disk": s.disk_blocks}
        if counts["disk"] and disk_dir is None:
            raise CapacityError("kv_cache.disk_blocks needs a disk tier (tiers.disk.path) to put its slot file in")
        self.pools = {t: BlockPool(n) for t, n in counts.items() if n > 0}
        if "gpu" not in self.pools:
            raise CapacityError("the KV cache needs at least one device block; raise kv_cache.gpu_blocks")
        self.stores: dict[str, TierStore] = {"gpu": TierStore("gpu", self.device_fmt, L, num_blocks, self.device,
                                                              memory=memory)}
        if counts["cpu"]:
            self.stores["cpu"] = TierStore("cpu", self.cold_fmt, L, counts["cpu"], "cpu", pin_memory)
        if counts["disk"]:
            self.stores["disk"] = TierStore("disk", self.cold_fmt, L, counts["disk"], disk_dir=disk_dir,
                                            page_cache=page_cache)
        self.logical = BlockPool(sum(counts.values()))
        self.blocks: dict[int, Block] = {}
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0
        self.moved: dict[str, int] = {}  # bytes per direction: demote (device->cold), promote, cold->cold

    @staticmethod
    def device_format(cfg: ModelConfig, block_size: int, dtype: torch.dtype, restore: str) -> ColdFormat:
        arrays = {"kv": ((2, block_size, cfg.num_kv_heads, cfg.head_dim), dtype)}
        if restore == "recompute":
            arrays["hidden"] = ((block_size, cfg.hidden_size), dtype)
        return ColdFormat("device", arrays)

    @staticmethod
    def block_nbytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, restore: str = "transfer") -> int:
        """Device bytes of one block (all layers)."""
        return PagedKVCache.device_format(cfg, block_size, dtype, restore).block_nbytes(cfg.num_layers)

    @property
    def pool(self) -> BlockPool:
        """The device pool (where new tokens are written)."""
        return self.pools["gpu"]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def close(self) -> None:
        for store in self.stores.values():
            store.close()

    # -- sequences ----------------------------------------------------------------------------
    def admit(self, tokens: int) -> Admission:
        """Could a sequence of `tokens` total tokens get its blocks (now / once others finish / never)?"""
        return self.logical.can_allocate(self.blocks_for(tokens))

    def add_sequence(self, reserve_tokens: int = 0) -> int:
        """A new sequence, with logical blocks for `reserve_tokens` reserved up front (worst case)."""
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = Sequence(reserved=self.logical.allocate(self.blocks_for(reserve_tokens)))
        return sid

    def fork(self, sid: int, reserve_tokens: int) -> int:
        """A copy of `sid` sharing its blocks (copy-on-write), reserving blocks for tokens past the shared ones."""
        parent = self.seqs[sid]
        shared_full = parent.length // self.block_size
        need = self.blocks_for(reserve_tokens) - shared_full
        child_id = self._next_id
        self._next_id += 1
        self.logical.incref(parent.blocks)
        self.seqs[child_id] = Sequence(list(parent.blocks), parent.length, self.logical.allocate(max(need, 0)))
        return child_id

    def free_sequence(self, sid: int) -> None:
        seq = self.seqs.pop(sid)
        self._release(self.logical.free(seq.blocks))
        self.logical.free(seq.reserved)

    def _release(self, ids: list[int]) -> None:
        """Logical blocks nobody references any more give their tier slots back."""
        for bid in ids:
            b = self.blocks.pop(bid, None)
            if b is not None:
                self.pools[b.tier].free([b.slot])
                self.stores[b.tier].invalidate(b.slot)

    def length(self, sid: int) -> int:
        return self.seqs[sid].length

    def count(self, tier: str) -> int:
        """Materialised blocks living in a tier."""
        return sum(1 for b in self.blocks.values() if b.tier == tier)

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
            raise CapacityError(
                f"the KV cache is full: every {tier} block is in use and there is no tier below it; raise "
                "kv_cache.cpu_blocks or kv_cache.disk_blocks, or admit fewer tokens"
            )
        candidates = [Candidate(bid, b.last_touch, b.mass) for bid, b in self.blocks.items()
                      if b.tier == tier and bid not in protected]
        victims = self.policy.choose(candidates, n)
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
        key = f"{b.tier}->{dst}"
        self.moved[key] = self.moved.get(key, 0) + nbytes
        self.pools[b.tier].free([b.slot])
        src_store.invalidate(b.slot)
        b.tier, b.slot = dst, slot

    def _promote(self, room: int, protected: set[int]) -> None:
        """Bring the hottest cold blocks back while the device has room (transfer formats only)."""
        if room <= 0 or self.cold_fmt.name == "hidden":
            return
        cold = [Candidate(bid, b.last_touch, b.mass) for bid, b in self.blocks.items() if b.tier != "gpu"]
        for bid in reversed(self.policy.order(cold)):  # the last to evict is the first to bring back
            if room <= 0:
                return
            self._move(bid, "gpu", protected)
            room -= 1

    # -- steps --------------------------------------------------------------------------------
    def prepare(self, sids: list[int], q_lens: list[int]) -> tuple[BatchLayout, StepKV]:
        """Make room and blocks for `q_lens[b]` new tokens of each sequence; index tensors for the step."""
        bs = self.block_size
        now = self.clock()
        # the newest block of a running sequence stays on the device while tokens are still appended to it
        protected = {seq.blocks[-1] for seq in self.seqs.values() if seq.blocks and seq.length % bs}
        copies, fresh = [], 0
        for sid, n in zip(sids, q_lens):
            seq = self.seqs[sid]
            if seq.length % bs and n and self.logical.refcount(seq.blocks[-1]) > 1:
                copies.append(sid)  # writes into a shared partial block: copy it first
            fresh += max(self.blocks_for(seq.length + n) - len(seq.blocks), 0)
        need = fresh + len(copies)
        gpu = self.pools["gpu"]
        if need > gpu.num_blocks - len(protected & {bid for bid, b in self.blocks.items() if b.tier == "gpu"}):
            raise CapacityError(
                f"a step needs {need} new device KV blocks but only {gpu.num_blocks} exist and running sequences "
                "pin their newest ones; raise kv_cache.gpu_blocks or lower activations.prefill_chunk"
            )
        if need > gpu.num_free:
            self._demote_from("gpu", need - gpu.num_free, protected)
        for sid in copies:
            self._copy_on_write(sid, protected)
        slot_blocks, slot_offsets, kv_lens = [], [], []
        for sid, n in zip(sids, q_lens):
            seq = self.seqs[sid]
            while len(seq.blocks) < self.blocks_for(seq.length + n):
                bid = seq.reserved.pop() if seq.reserved else self.logical.allocate(1)[0]
                slot = gpu.allocate(1)[0]
                for arr in self.stores["gpu"].arrays.values():  # padded key slots are multiplied by zero
                    arr.clear(slot)  # weights, and 0 * NaN from stale memory would poison a row
                self.blocks[bid] = Block("gpu", slot, now)
                seq.blocks.append(bid)
                protected.add(bid)
            pos = torch.arange(seq.length, seq.length + n)
            table = torch.tensor([self.blocks[b].slot for b in seq.blocks], dtype=torch.long)
            slot_blocks.append(table[pos // bs])
            slot_offsets.append(pos % bs)
            seq.length += n
            kv_lens.append(seq.length)
            for bid in seq.blocks:
                self.blocks[bid].last_touch = now
        self._promote(gpu.num_free - len(sids), protected)
        layout = BatchLayout.build(q_lens, kv_lens, self.device)
        groups = tuple(g for g in (self._group(t, sids, kv_lens) for t in TIERS if t in self.pools) if g is not None)
        cols = max(len(self.seqs[s].blocks) for s in sids)
        positions = torch.arange(cols * bs).expand(len(sids), -1)
        valid = positions < torch.tensor(kv_lens)[:, None]
        block_ids = torch.full((len(sids), cols), -1, dtype=torch.long)
        for b, sid in enumerate(sids):
            block_ids[b, : len(self.seqs[sid].blocks)] = torch.tensor(self.seqs[sid].blocks, dtype=torch.long)
        step = StepKV(torch.cat(slot_blocks).to(self.device), torch.cat(slot_offsets).to(self.device), groups,
                      cols, positions.to(self.device), valid.to(self.device), block_ids)
        return layout, step

    def _copy_on_write(self, sid: int, protected: set[int]) -> None:
        seq = self.seqs[sid]
        old = seq.blocks[-1]
        src = self.blocks[old]
        assert src.tier == "gpu", "a shared partial block is the newest of its sequences: it stays on the device"
        bid = seq.reserved.pop() if seq.reserved else self.logical.allocate(1)[0]
        slot = self.pools["gpu"].allocate(1)[0]
        self.stores["gpu"].write_block(slot, self.stores["gpu"].read_block(src.slot))
        self.blocks[bid] = Block("gpu", slot, src.last_touch, src.mass)
        seq.blocks[-1] = bid
        protected.add(bid)
        self._release(self.logical.free([old]))

    def _group(self, tier: str, sids: list[int], kv_lens: list[int]) -> Group | None:
        bs = self.block_size
        slots, ids, seq_idx, col, block_idx = [], [], [], [], []
        per_row = [0] * len(sids)
        for b, sid in enumerate(sids):
            for j, bid in enumerate(self.seqs[sid].blocks):
                blk = self.blocks[bid]
                if blk.tier == tier:
                    slots.append(blk.slot)
                    ids.append(bid)
                    seq_idx.append(b)
                    col.append(per_row[b])
                    block_idx.append(j)
                    per_row[b] += 1
        if not slots:
            return None
        cols = max(per_row)
        positions = torch.zeros(len(sids), cols * bs, dtype=torch.long)
        valid = torch.zeros(len(sids), cols * bs, dtype=torch.bool)
        offs = torch.arange(bs)
        for b, c, j in zip(seq_idx, col, block_idx):
            pos = j * bs + offs
            positions[b, c * bs : (c + 1) * bs] = pos
            valid[b, c * bs : (c + 1) * bs] = pos < kv_lens[b]
        dev = self.device
        return Group(tier, slots, ids, torch.tensor(seq_idx, device=dev), torch.tensor(block_idx, device=dev),
                     torch.tensor(col, device=dev), cols, positions.to(dev), valid.to(dev))

    def fetch_cold(self, layer: int, step: StepKV) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        """One layer of every cold group of the step, still in the cold format: ({tier: parts}, bytes read).

        This is what the prefetcher runs ahead of compute (the "kv-fetch" track)."""
        out, nbytes = {}, 0
        for g in step.groups:
            if g.tier == "gpu":
                continue
            parts = self.stores[g.tier].read_plane(layer, g.slots)
            out[g.tier] = parts
            nbytes += sum(v.numel() * v.element_size() for v in parts.values())
        return out, nbytes

    def view(self, layer: int, layout: BatchLayout, step: StepKV, cold: dict | None = None) -> LayerKV:
        return LayerKV(self, layer, layout, step, cold)


class LayerKV:
    """The KV cache as one layer of one step sees it (implements `offload.model.KVView`)."""

    def __init__(self, cache: PagedKVCache, layer: int, layout: BatchLayout, step: StepKV,
                 cold: dict[str, dict[str, torch.Tensor]] | None) -> None:
        self.cache, self.layer, self.layout, self.step, self._cold = cache, layer, layout, step, cold

    def write(self, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | None = None) -> None:
        """k, v: [N, Hkv, D]; h: [N, hidden] layer inputs (kept only when cold blocks are restored by recompute)."""
        arrays = self.cache.stores["gpu"].arrays
        data = arrays["kv"].data[self.layer]  # [slots, 2, block_size, Hkv, D]
        data[self.step.slot_blocks, 0, self.step.slot_offsets] = k
        data[self.step.slot_blocks, 1, self.step.slot_offsets] = v
        if "hidden" in arrays:
            assert h is not None
            arrays["hidden"].data[self.layer][self.step.slot_blocks, self.step.slot_offsets] = h

    @property
    def needs_inputs(self) -> bool:
        return "hidden" in self.cache.stores["gpu"].arrays

    def attend(self, q: torch.Tensor, scale: float, window: int | None,
               restore: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Attention of padded queries q [B, Tq, Hq, D] over every block: [(out, lse)] to merge.

        By default the blocks of every tier are placed back in token order on the device and attended
        as one group: the very same arithmetic as a cache that never left the device, so the tokens are
        identical bit for bit. With `cpu_attention`, cold groups are attended on the CPU where they are
        and merged by log-sum-exp (exact in arithmetic, rounded differently).
        """
        cache, step, bs = self.cache, self.step, self.cache.block_size
        track_mass = cache.settings.eviction == "attention"
        cold = self._cold
        if cold is None and any(g.tier != "gpu" for g in step.groups):
            cold = cache.fetch_cold(self.layer, step)[0]
        split = cache.settings.cpu_attention and any(g.tier != "gpu" for g in step.groups)
        if not split:
            kvs = [(g, self._kv(g, cold, restore).to(cache.device)) for g in step.groups]
            padded = torch.zeros(q.shape[0], step.cols, *kvs[0][1].shape[1:], dtype=kvs[0][1].dtype,
                                 device=cache.device)
            for g, kv in kvs:
                padded[g.seq, g.block] = kv
            blocks = [(padded, step.positions, step.valid, step.block_ids, cache.device)]
        else:
            blocks = []
            for g in step.groups:
                dev = cache.device if g.tier == "gpu" else torch.device("cpu")
                kv = self._kv(g, cold, restore).to(dev)
                padded = torch.zeros(q.shape[0], g.cols, *kv.shape[1:], dtype=kv.dtype, device=dev)
                padded[g.seq.to(dev), g.col.to(dev)] = kv
                ids = torch.full((q.shape[0], g.cols), -1, dtype=torch.long)
                ids[g.seq.cpu(), g.col.cpu()] = torch.tensor(g.ids)
                blocks.append((padded, g.positions, g.valid, ids, dev))
        parts, masses = [], []
        for padded, positions, valid, ids, dev in blocks:
            B, cols = padded.shape[:2]
            k = padded[:, :, 0].reshape(B, cols * bs, *padded.shape[-2:])
            v = padded[:, :, 1].reshape(B, cols * bs, *padded.shape[-2:])
            mask = self.layout.mask(positions, valid, window).to(dev)
            out, lse, block_lse = M.attend_group(q.to(dev), k, v, mask, scale, block=bs if track_mass else None)
            parts.append((out.to(cache.device), lse.to(cache.device)))
            if track_mass:
                masses.append((ids, block_lse.to(cache.device)))
        if masses:
            self._account_mass(parts, masses)
        return parts

    def _kv(self, g: Group, cold: dict | None, restore) -> torch.Tensor:
        """K/V [n, 2, block_size, Hkv, D] of a group's blocks, from wherever they live, in the compute dtype."""
        cache = self.cache
        if g.tier == "gpu":
            return cache.stores["gpu"].arrays["kv"].data[self.layer].index_select(
                0, torch.tensor(g.slots, device=cache.device))
        if cache.cold_fmt.name != "hidden":
            return cold_kv(cache.cold_fmt, cold[g.tier], cache.dtype)
        assert restore is not None, "kv_restore: recompute needs the layer's weights"
        h = cold[g.tier]["hidden"].to(cache.device, non_blocking=True)  # [n, bs, hidden]
        pos = g.positions.view(-1, g.cols, cache.block_size)[g.seq, g.col]  # [n, bs]
        k, v = restore(h.reshape(-1, h.shape[-1]), pos.reshape(-1))
        n, bs = len(g.slots), cache.block_size
        return torch.stack([k.view(n, bs, *k.shape[1:]), v.view(n, bs, *v.shape[1:])], dim=1)

    def _account_mass(self, parts, masses) -> None:
        """Add each block's share of this layer's attention (summed over heads and real queries) to its mass."""
        total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)  # [B, Tq, Hq]
        total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
        real = (self.layout.q_pos >= 0)[:, :, None, None]  # [B, Tq, 1, 1]
        for ids, block_lse in masses:  # ids [B, cols] (-1: padding); block_lse [B, Tq, Hq, cols]
            share = torch.exp(block_lse - total[..., None]).masked_fill(~real, 0).sum(dim=(1, 2))  # [B, cols]
            for bid, m in zip(ids.flatten().tolist(), share.flatten().tolist()):
                blk = self.cache.blocks.get(bid) if bid >= 0 else None
                if blk is not None:
                    blk.mass += m


def kv_settings(config: OffloadConfig, cfg: ModelConfig, device: torch.device) -> KVSettings:
    """The KV cache's settings with every `auto` resolved and impossible combinations refused."""
    kv = config.kv_cache
    restore = config.activations.kv_restore
    if restore == "auto":  # keep whichever is fewer bytes: the layer inputs, or K and V
        restore = "recompute" if cfg.hidden_size < 2 * cfg.kv_size else "transfer"
    if restore == "recompute" and kv.quantization == "int8":
        raise ConfigError("kv_cache.quantization: int8 applies to K/V; with activations.kv_restore: recompute the "
                          "cold blocks hold layer inputs instead. Choose one of the two")
    if (kv.cpu_blocks or kv.disk_blocks) and config.tiers is None:
        raise ConfigError("kv_cache.cpu_blocks / disk_blocks need a `tiers:` section (their memory is counted "
                          "in tiers.cpu.capacity, their file lives under tiers.disk.path)")
    if kv.disk_blocks and config.tiers.disk is None:
        raise ConfigError("kv_cache.disk_blocks needs tiers.disk (a directory for the KV slot file)")
    cpu_attention = kv.cpu_attention
    if cpu_attention is None:  # FlexGen's choice: read host blocks where they are when RAM beats the link
        if device.type == "cuda":
            from offload.calibrate import Calibration

            links = Calibration.load(config.calibration).links
            cpu_attention = links["memcpy"] > links["host->device"]
        else:
            cpu_attention = False  # on a CPU device host blocks are attended in place anyway
    return KVSettings(block_size=kv.block_size, gpu_blocks=kv.gpu_blocks or 0, cpu_blocks=kv.cpu_blocks,
                      disk_blocks=kv.disk_blocks, eviction=kv.eviction, idle_seconds=kv.idle_seconds,
                      quantization=kv.quantization, restore=restore, cpu_attention=cpu_attention)
