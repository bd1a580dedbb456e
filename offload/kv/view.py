"""The KV cache as one layer of one step sees it: write the step's K/V, attend over every block.

`LayerKV` implements `offload.model.functional.KVView`. Blocks are read where they live:
device blocks in place, cold ones (already fetched ahead by the prefetcher, or read now)
converted from their cold format; see `attend` for how tiers are combined exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from offload.kv.blocks import StepKV, TierBlocks
from offload.kv.fetch import InPlace, receive
from offload.kv.formats import cold_kv
from offload.model import functional as M
from offload.model.layout import BatchLayout
from storage.heap import TRIM_ROWS, trim_heap


class LayerKV:
    """The KV cache as one layer of one step sees it (implements `offload.model.functional.KVView`)."""

    def __init__(self, cache: Any, layer: int, layout: BatchLayout, step: StepKV,
                 cold: dict[str, dict[str, torch.Tensor]] | None) -> None:
        self.cache, self.layer, self.layout, self.step, self._cold = cache, layer, layout, step, cold
        self.plane = cache.plane(layer)  # the layer's index in the stores (a pipeline stage holds a slice)

    def write(self, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | None = None) -> None:
        """k, v: [N, Hkv, D]; h: [N, hidden] layer inputs (kept only when cold blocks are restored by recompute)."""
        arrays = self.cache.stores["gpu"].arrays
        data = arrays["kv"].data[self.plane]  # [slots, 2, block_size, Hkv, D]
        data[self.step.slot_blocks, 0, self.step.slot_offsets] = k
        data[self.step.slot_blocks, 1, self.step.slot_offsets] = v
        if "hidden" in arrays:
            assert h is not None
            arrays["hidden"].data[self.plane][self.step.slot_blocks, self.step.slot_offsets] = h

    def paged(self, window: int | None) -> tuple[torch.Tensor | None, ...] | None:
        """What a fused layer reads and writes in place: (pool [slots, 2, block_size, Hkv, D], the step's blocks
        in the cold tiers (`_cold_blocks`) or None, slot_blocks, slot_offsets, table, mask); None when
        inputs are kept, attention mass is tracked or a block lies off another device than a CPU (the op-by-op
        layer handles those)."""
        step = self.step
        if self.needs_inputs or self.cache.settings.eviction == "attention":
            return None
        if step.table is not None:
            return self._pool(), None, step.slot_blocks, step.slot_offsets, step.table, self._step_mask(window)
        if self.cache.device.type != "cpu":
            return None
        return (self._pool(), self._cold_blocks(None), step.slot_blocks, step.slot_offsets, step.split_table,
                self._step_mask(window))

    def planes(self, n: int) -> torch.Tensor:
        """The device pool's planes of n layers from this one, [n, slots, 2, block_size, Hkv, D] (layers that run
        in one call: `offload.model.fused.LayerRun`)."""
        return self.cache.stores["gpu"].arrays["kv"].data[self.plane : self.plane + n]

    def cold_planes(self, n: int) -> list[list[tuple[torch.Tensor, list[int] | None]]]:
        """The step's cold blocks of n layers from this one (`_cold_blocks`: layers that run in one call read them
        where they lie, `offload.model.fused.LayerRun`)."""
        views = [self, *(self.cache.view(self.layer + j, self.layout, self.step) for j in range(1, n))]
        return [v._cold_blocks(None) for v in views]

    def _pool(self) -> torch.Tensor:
        """This layer's plane of the device pool, [slots, 2, block_size, Hkv, D]."""
        return self.cache.stores["gpu"].arrays["kv"].data[self.plane]

    def _step_mask(self, window: int | None) -> torch.Tensor:
        """The mask over the step's token-order key layout, built once a step for each window and shared by every
        layer with it."""
        step, layout = self.step, self.layout
        if (mask := step.masks.get(window)) is None:
            # a decode step's query is its sequence's last token: a key before it is one that is valid (4 ops fewer)
            mask = step.valid[:, None, :] if window is None and max(layout.q_lens) == 1 else \
                layout.mask(step.positions, step.valid, window)
            mask = step.masks[window] = mask.to(self.cache.device)
        return mask

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
        if step.table is not None and not track_mass:  # every block on the device: read in place where a kernel can
            if (done := M.attend_pool(q, self._pool(), step.table, self._step_mask(window), scale)) is not None:
                return [done]
        split = cache.settings.cpu_attention and any(g.tier != "gpu" for g in step.groups)
        if not split and not track_mass and M.reads_pool(q, self._pool()):
            done = self._attend_split(q, restore, scale, window)
            if q.shape[0] * q.shape[1] >= TRIM_ROWS:  # a prompt's pass: the context's copy leaves the heap
                trim_heap()
            return [done]
        cold = self._fetched() if any(g.tier != "gpu" for g in step.groups) else None
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
            mask = self.layout.mask(positions, valid, window).to(dev) if split else self._step_mask(window)
            if self.layout.row_groups is not None and not track_mass and not split:
                out, lse = M.attend_columns(q.to(dev), k, v, mask, scale, self.layout.column_keys(bs))
                block_lse = None
            else:
                out, lse, block_lse = M.attend_group(q.to(dev), k, v, mask, scale, block=bs if track_mass else None)
            parts.append((out.to(cache.device), lse.to(cache.device)))
            if track_mass:
                masses.append((ids, block_lse.to(cache.device)))
        if masses:
            self._account_mass(parts, masses)
        return parts

    def _attend_split(self, q: torch.Tensor, restore, scale: float, window: int | None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a kernel reads a pool through a table (`attend_pool`): the device blocks and the step's cold blocks
        where they lie, through the step's split table (the same bits as the blocks in place; no token-order copy
        of the context)."""
        done = M.attend_pool(q, self._pool(), self.step.split_table, self._step_mask(window), scale,
                             cold=self._cold_blocks(restore))
        assert done is not None
        return done

    def _cold_blocks(self, restore) -> list[tuple[torch.Tensor, list[int] | None]]:
        """The step's blocks in the cold tiers as attention reads them in `groups` order (`cpu_attention.ColdBlocks`;
        cold block i is -1 - i in `StepKV.split_table`): the host tier's where they lie (`InPlace`), the others as
        they arrived, in the compute dtype (fetched now where the prefetcher did not)."""
        cold, out = self._fetched(), []
        for g in self.step.groups:
            if g.tier == "gpu":
                continue
            got = cold[g.tier]  # (in place: the compute format, "kv")
            out.append((got.plane("kv"), got.slots) if isinstance(got, InPlace) else
                       (self._kv(g, cold, restore).contiguous(), None))
        return out

    def _fetched(self) -> dict[str, Any]:
        """This layer's cold groups as the prefetcher fetched them ({tier: `fetch.Fetched`}), or fetched now."""
        if self._cold is None:
            self._cold = self.cache.fetch_cold(self.layer, self.step)[0]
        return self._cold

    def _slot_index(self, g: TierBlocks) -> torch.Tensor:
        """The device slots of a device-tier group's blocks, on the device (built once a step where it can be)."""
        return g.slot_index if g.slot_index is not None else torch.tensor(g.slots, device=self.cache.device)

    def _kv(self, g: TierBlocks, cold: dict | None, restore) -> torch.Tensor:
        """K/V [n, 2, block_size, Hkv, D] of a group's blocks, from wherever they live, in the compute dtype."""
        cache = self.cache
        if g.tier == "gpu":
            return self._pool().index_select(0, self._slot_index(g))
        parts = receive(cache.engine, cold[g.tier])  # on CUDA: on the device (the compute stream waits, the host not)
        if cache.cold_fmt.name != "hidden":
            return cold_kv(cache.cold_fmt, parts, cache.dtype)  # int8 is dequantized where the parts are
        assert restore is not None, "kv_restore: recompute needs the layer's weights"
        h = parts["hidden"].to(cache.device, non_blocking=True)  # [n, bs, hidden]
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
