"""Exact attention on the CPU, each (query, head) on its own over its visible keys in token order: the same bits
whatever else is in the pass (padding, other queries, other sequences, where the blocks lie in the pool). A
numba kernel beside `offload.model.kernels`' products (compiled with their settings), used by the op-by-op
layer (`functional`) and inside the fused layer (`fused`)."""

from __future__ import annotations

import numpy as np
import torch

from offload.model.kernels import _bits, _threads, numba

if numba is not None:
    from numba import prange

    from offload.model.kernels import _jit

    @_jit
    def _attend(q, kv, table, mask, scale, shift, out, lse):  # pragma: no cover - compiled
        """q [B, Tq, Hq, D] f32; kv [slots, 2, bs, Hkv, D] paged K and V as raw bits (uint32 float32 with shift 0,
        uint16 bf16 with shift 16), table [B, cols] the slot of each sequence's blocks in token order; mask
        [B, Tq, cols * bs] -> out [B, Tq, Hq, D], lse [B, Tq, Hq] (f32; a query that sees no key: zeros and -inf).
        Each (query, head) walks its visible keys in token order, read where they lie in the pool: padding,
        other queries, other sequences and where the blocks sit change nothing in it. A key row is widened once
        for the G query heads that share it (SmolLM2-135M's heads over 73 keys, 9 queries: 193 -> 127 us a layer)."""
        B, Tq, Hq, D = q.shape
        bs, Hkv = kv.shape[2], kv.shape[3]
        Tk = mask.shape[2]
        G = Hq // Hkv
        for idx in prange(B * Tq * Hkv):  # a query and its KV head's G query heads: each key row widened once
            b, t, kh = idx // (Tq * Hkv), (idx // Hkv) % Tq, idx % Hkv
            scores = np.empty((G, Tk), np.float32)
            bits = np.empty(D, np.uint32)
            row = bits.view(np.float32)
            acc = np.zeros((G, D), np.float32)
            m = np.full(G, -np.inf)  # (float64, as the running max and the sum always were)
            seen = False
            for j in range(Tk):
                if mask[b, t, j]:
                    seen = True
                    slot, off = table[b, j // bs], j % bs
                    for d in range(D):
                        bits[d] = np.uint32(kv[slot, 0, off, kh, d]) << shift
                    for g in range(G):
                        h = kh * G + g
                        dot = np.float32(0.0)
                        for d in range(D):
                            dot += q[b, t, h, d] * row[d]
                        scores[g, j] = dot * scale
                        m[g] = max(m[g], scores[g, j])
            if not seen:
                for h in range(kh * G, kh * G + G):
                    for d in range(D):
                        out[b, t, h, d] = 0.0
                    lse[b, t, h] = -np.inf
                continue
            total = np.zeros(G)
            for j in range(Tk):
                if mask[b, t, j]:
                    slot, off = table[b, j // bs], j % bs
                    for d in range(D):
                        bits[d] = np.uint32(kv[slot, 1, off, kh, d]) << shift
                    for g in range(G):
                        p = np.exp(scores[g, j] - m[g])
                        total[g] += p
                        for d in range(D):
                            acc[g, d] += p * row[d]
            for g in range(G):
                h = kh * G + g
                for d in range(D):
                    out[b, t, h, d] = acc[g, d] / total[g]
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
        bits, shift = _bits(kv.contiguous())
        _attend(q.to(torch.float32).contiguous().numpy(), bits, table.contiguous().numpy(), mask.contiguous().numpy(),
                float(scale), shift, out.numpy(), lse.numpy())
    return out, lse
