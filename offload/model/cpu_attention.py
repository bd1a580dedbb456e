"""Exact attention on the CPU, each (query, head) on its own over its visible keys in token order: the same bits
whatever else is in the pass (padding, other queries, other sequences, where the blocks lie in the pool). A
numba kernel beside `offload.model.kernels`' products (compiled with their settings), used by the op-by-op
layer (`functional`) and inside the fused layer (`fused`)."""

from __future__ import annotations

import numpy as np
import torch

from offload.model.kernels import _as_numpy, _threads, numba

#: keys ahead whose K and V rows the attention kernel asks for while it scores one
_AHEAD = 8

if numba is not None:
    from numba import njit, prange

    from offload.model.simd import LANES, fma, prefetch, vfma, vload, vsplat, vstore, vsum, vzero
    from offload.model.simd_math import vexp, vraw

    @njit(parallel=True, cache=True, nogil=True)  # no fast-math: the lanes' operations as written (`simd`)
    def _attend(q, kv, table, mask, scale, shift, out, lse):  # pragma: no cover - compiled
        """q [B, Tq, Hq, D] f32; kv [slots, 2, bs, Hkv, D] paged K and V as raw bits (uint32 float32 with shift 0,
        uint16 bf16 with shift 16), table [B, cols] the slot of each sequence's blocks in token order; mask
        [B, Tq, cols * bs] -> out [B, Tq, Hq, D], lse [B, Tq, Hq] (f32; a query that sees no key: zeros and -inf).
        Each (query, head) walks its visible keys in token order, read where they lie in the pool: padding,
        other queries, other sequences and where the blocks sit change nothing in it. One work item is a query and
        the G query heads of one KV head, so each key row is read once for all of them. A score is 16 lanes of fused
        multiply-adds over the head's dimensions, read in place from the pool, summed by `vsum`'s fixed tree (the
        dimensions past the last 16 added after, in order); the softmax's exponentials are `simd_math.vexp`, 16
        keys at a time (an unseen key's score is -inf: exactly 0); a value row is added to the head's output 16
        lanes at a time. The same operations for every query, and rows a few keys ahead asked for (the pool is cold
        after a layer's weights went through the caches). SmolLM2-135M, bf16, one thread pair: a decode layer's
        attention over 97 keys 21.8 -> 9.3 us, a 64-token prompt's over 64-128 keys 1003 -> 520 us (scalar sums of
        the dimensions, a widened copy of each row and libm's exp before)."""
        B, Tq, Hq, D = q.shape
        bs, Hkv = kv.shape[2], kv.shape[3]
        Tk = mask.shape[2]
        G = Hq // Hkv
        D16 = D - D % LANES
        TkP = Tk + (-Tk) % LANES  # a head's scores padded to whole vectors
        base, isz, bf16 = kv.ctypes.data, kv.itemsize, shift == 16  # rows read in place, by address
        s0, s1, s2, s3 = kv.strides[0], kv.strides[1], kv.strides[2], kv.strides[3]
        for idx in prange(B * Tq * Hkv):  # a query and its KV head's G query heads: each key row read once
            b, t, kh = idx // (Tq * Hkv), (idx // Hkv) % Tq, idx % Hkv
            scores = np.full(G * TkP, -np.inf, np.float32)  # head g's at g * TkP: -inf where a key is not seen
            bits = np.empty(D, np.uint32)
            row = bits.view(np.float32)
            qs = np.empty(G * D, np.float32)  # the G heads' queries, flat (vector loads at offsets, no views)
            acc = np.zeros(G * D, np.float32)
            for g in range(G):
                for d in range(D):
                    qs[g * D + d] = q[b, t, kh * G + g, d]
            m = np.full(G, -np.inf, np.float32)
            seen = False
            slot, off, ahead_col, ahead_off = table[b, 0], -1, _AHEAD // bs, _AHEAD % bs - 1
            for j in range(Tk):  # (key j's block and offset, and key j + _AHEAD's, counted: no division a key)
                off += 1
                if off == bs:
                    slot, off = table[b, j // bs], 0
                ahead_off += 1
                if ahead_off == bs:
                    ahead_col, ahead_off = ahead_col + 1, 0
                if j + _AHEAD < Tk:  # the K and V rows a few keys on: the pool is cold after a layer's weights
                    ahead = table[b, ahead_col] * s0 + ahead_off * s2 + kh * s3
                    for e in range(0, D * isz, 64):
                        prefetch(base, ahead + e)
                        prefetch(base, ahead + s1 + e)
                if mask[b, t, j]:
                    seen = True
                    key = base + slot * s0 + off * s2 + kh * s3  # the key row's address in the pool
                    for d in range(D16, D):  # (the dimensions past the last 16, widened)
                        bits[d] = np.uint32(kv[slot, 0, off, kh, d]) << shift
                    for g in range(G):
                        a = vzero()
                        for d in range(0, D16, LANES):
                            a = vfma(vload(qs, g * D + d), vraw(key, d, bf16), a)
                        dot = vsum(a)
                        for d in range(D16, D):
                            dot = fma(qs[g * D + d], row[d], dot)
                        scores[g * TkP + j] = dot * scale
                        m[g] = max(m[g], scores[g * TkP + j])
            if not seen:
                for h in range(kh * G, kh * G + G):
                    for d in range(D):
                        out[b, t, h, d] = 0.0
                    lse[b, t, h] = -np.inf
                continue
            probs = np.empty(G * TkP, np.float32)  # e^(score - max), 16 keys at a time (an unseen key's: 0)
            one = vsplat(np.float32(1.0))
            for g in range(G):
                low = vsplat(-m[g])
                for j in range(g * TkP, (g + 1) * TkP, LANES):
                    vstore(probs, j, vexp(vfma(vload(scores, j), one, low)))
            total = np.zeros(G)
            slot, off = table[b, 0], -1
            for j in range(Tk):
                off += 1
                if off == bs:
                    slot, off = table[b, j // bs], 0
                if mask[b, t, j]:
                    value = base + slot * s0 + s1 + off * s2 + kh * s3
                    for d in range(D16, D):
                        bits[d] = np.uint32(kv[slot, 1, off, kh, d]) << shift
                    for g in range(G):
                        p = probs[g * TkP + j]
                        total[g] += p
                        pv = vsplat(p)
                        for d in range(0, D16, LANES):
                            vstore(acc, g * D + d, vfma(pv, vraw(value, d, bf16), vload(acc, g * D + d)))
                        for d in range(D16, D):
                            acc[g * D + d] = fma(p, row[d], acc[g * D + d])
            for g in range(G):
                h = kh * G + g
                for d in range(D):
                    out[b, t, h, d] = acc[g * D + d] / total[g]
                lse[b, t, h] = m[g] + np.log(total[g])


def attention_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Do `attend` / `attend_paged` take these (numba, CPU, float32 or bf16 K/V of q's dtype)?"""
    return (numba is not None and q.device.type == "cpu" and k.device.type == "cpu" and k.dtype == q.dtype
            and k.dtype in (torch.float32, torch.bfloat16))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of padded queries with its log-sum-exp, each query row on its own (the contract of
    `functional.attend_group`): q [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; mask [B, Tq, Tk] -> out [B, Tq, Hq, D],
    lse [B, Tq, Hq], float32."""
    B = k.shape[0]
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"attention shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    table = torch.arange(B)[:, None]  # each sequence one block of Tk keys
    return attend_paged(q, torch.stack([k, v], dim=1), table, mask, scale)  # the pool [B, 2, Tk, Hkv, D]


def attend_paged(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, mask: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` over K/V read in place from a paged pool: kv [slots, 2, block_size, Hkv, D], table [B, cols]
    (long) the slot of each sequence's blocks in token order, mask [B, Tq, cols * block_size]. The same bits as
    `attend` over those keys gathered in token order: no copy of the context per layer."""
    _threads(q.numel() * mask.shape[2])
    B, Tq, Hq, D = q.shape
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[4] != D or Hq % kv.shape[3] or table.shape[0] != B \
            or mask.shape != (B, Tq, table.shape[1] * kv.shape[2]):
        raise ValueError(f"attention shapes do not fit: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"table {tuple(table.shape)}, mask {tuple(mask.shape)}")
    out = torch.empty(B, Tq, Hq, D, dtype=torch.float32)
    lse = torch.empty(B, Tq, Hq, dtype=torch.float32)
    if out.numel():
        shift = 16 if kv.dtype == torch.bfloat16 else 0  # (widens the raw bits to float32's)
        _attend(q.to(torch.float32).contiguous().numpy(), _as_numpy(kv.contiguous()), table.contiguous().numpy(),
                mask.contiguous().numpy(), float(scale), shift, out.numpy(), lse.numpy())
    return out, lse
