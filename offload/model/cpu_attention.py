"""Exact attention on the CPU, each (query, head) on its own over its visible keys in token order: the same bits
whatever else is in the pass (padding, other queries, other sequences, where the blocks lie in the pool). Numba
kernels beside `offload.model.kernels`' products (compiled with their settings): query by query
(`cpu_attention_rows`) or four queries of a sequence at a time (`cpu_attention_blocks`), the same operations for
every query either way; used by the op-by-op layer (`functional`) and inside the fused layer (`fused`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from offload.model.kernels import _as_numpy, _threads, numba

if numba is not None:
    from numba import njit

    from offload.model.cpu_attention_blocks import _QUERIES, _attend_blocks
    from offload.model.cpu_attention_rows import _attend_rows

    @njit(nogil=True, cache=True)
    def _attend(q, kv, rows, table, mask, scale, shift, out, lse):  # pragma: no cover - compiled
        """Exact attention (`_attend_rows`' contract): passes of `_QUERIES` queries a sequence and more by
        `_attend_blocks`, fewer (a decode step) by `_attend_rows`. Both give every query the same bits; each is the
        faster where it is used (SmolLM2-135M's shape, bf16, 2 threads: one query over 2049 keys 132 / 153 us, 256
        queries over 1280 keys 13.6 / 10.7 ms, rows / blocks)."""
        if q.shape[1] >= _QUERIES:
            _attend_blocks(q, kv, rows, table, mask, scale, shift, out, lse)
        else:
            _attend_rows(q, kv, rows, table, mask, scale, shift, out, lse)


def attends(device_type: str, dtype: torch.dtype) -> bool:
    """Do the kernels attend on this device in this dtype (numba, a CPU, float32 or bf16)? (The planner asks: then a
    pass materialises no scores.)"""
    return numba is not None and device_type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def attention_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Do `attend` / `attend_paged` take these (`attends`, K/V of q's dtype on q's device)?"""
    return attends(q.device.type, q.dtype) and k.device.type == q.device.type and k.dtype == q.dtype


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


#: a step's blocks beside the pool: tensors of the pool's blocks [n, 2, block_size, Hkv, D] (the host tier's plane
#: in place, a read's buffer), each with the indices of the blocks read of it (None: all), in their order
ColdBlocks = Sequence[tuple[torch.Tensor, Sequence[int] | None]]


def attend_paged(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, mask: torch.Tensor, scale: float,
                 cold: ColdBlocks = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` over K/V read in place from a paged pool: kv [slots, 2, block_size, Hkv, D], table [B, cols]
    (long) the slot of each sequence's blocks in token order, mask [B, Tq, cols * block_size]; -1 - i in the table:
    the i-th of the `cold` blocks, read where they lie too. The same bits as `attend` over those keys gathered in
    token order: no copy of the context per layer."""
    _threads(q.numel() * mask.shape[2])
    B, Tq, Hq, D = q.shape
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[4] != D or Hq % kv.shape[3] or table.shape[0] != B \
            or mask.shape != (B, Tq, table.shape[1] * kv.shape[2]):
        raise ValueError(f"attention shapes do not fit: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"table {tuple(table.shape)}, mask {tuple(mask.shape)}")
    out = torch.empty(B, Tq, Hq, D, dtype=torch.float32)
    lse = torch.empty(B, Tq, Hq, dtype=torch.float32)
    if out.numel():
        kv = kv.contiguous()
        shift = 16 if kv.dtype == torch.bfloat16 else 0  # (widens the raw bits to float32's)
        _attend(q.to(torch.float32).contiguous().numpy(), _as_numpy(kv), cold_rows(kv, cold),
                table.contiguous().numpy(), mask.contiguous().numpy(), float(scale), shift, out.numpy(), lse.numpy())
    return out, lse


def cold_rows(kv: torch.Tensor, cold: ColdBlocks) -> np.ndarray:
    """The kernels' addresses of the cold blocks' first K rows, in order (int64 [n]), checked to be blocks of the
    pool kv's layout on its device (each block contiguous: read at the pool's strides). The tensors must live while
    the kernel reads them."""
    rows = []
    for t, index in cold:
        if t.dim() != 5 or t.shape[1:] != kv.shape[1:] or t.dtype != kv.dtype or t.device != kv.device \
                or (t.numel() and not t[0].is_contiguous()):
            raise ValueError(f"cold KV blocks {tuple(t.shape)} {t.dtype} are not the pool's blocks "
                             f"{tuple(kv.shape[1:])} {kv.dtype}")
        at = np.arange(len(t), dtype=np.int64) if index is None else np.asarray(index, np.int64)
        if len(at) and (at.min() < 0 or at.max() >= len(t)):
            raise IndexError(f"cold KV block index out of range (0 .. {len(t) - 1})")
        rows.append(t.data_ptr() + at * (t.stride(0) * t.element_size()))
    return np.concatenate(rows) if rows else np.zeros(0, np.int64)
