"""PyTorch's fused attention with its log-sum-exp (CUDA's memory-efficient kernel, the CPU's flash kernel), under
`functional.attend_group`'s contract. Knows nothing about the KV cache or tiers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Fused attention kernels read an additive bias whose last dimension is padded to this many keys.
BIAS_ALIGN = 16


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_group` without per-block masses, through PyTorch's fused attention that also returns the
    log-sum-exp (memory-efficient kernel on CUDA, flash kernel on CPU): memory linear in the context.

    q [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; mask [B, Tq, Tk] -> out [B, Tq, Hq, D] float32, lse [B, Tq, Hq]
    float32 (-inf and a zero output where a query sees no key), the same contract as `attend_group`.
    """
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    pad = -Tk % BIAS_ALIGN
    qh = q.transpose(1, 2)  # [B, Hq, Tq, D]
    kh = F.pad(k, (0, 0, 0, 0, 0, pad)).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)  # [B, Hq, Tk', D]
    vh = F.pad(v, (0, 0, 0, 0, 0, pad)).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    seen = F.pad(mask, (0, pad))  # [B, Tq, Tk']
    bias = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    bias = bias[:, None].expand(B, Hq, Tq, Tk + pad)
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, bias, True, 0.0, False,
                                                                          scale=scale)[:2]
        lse = lse[:, :, :Tq]  # the kernel pads queries to a multiple of 32
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, attn_mask=bias,
                                                                              scale=scale)
    any_key = mask.any(dim=-1)[:, None, :]  # [B, 1, Tq]
    lse = torch.where(any_key, lse.float(), float("-inf")).transpose(1, 2)  # [B, Tq, Hq]
    out = torch.where(any_key[..., None], out.float(), 0.0).transpose(1, 2)  # [B, Tq, Hq, D]
    return out, lse
