"""Model math pieces checked against plain reference formulas."""

from __future__ import annotations

import torch

from offload.model.functional import attend_group, merge_attention


def reference_attention(q, k, v, mask, scale):
    """Dense softmax attention with repeated K/V heads: q [B, Tq, Hq, D]."""
    G = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(G, dim=2)
    v = v.repeat_interleave(G, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def test_grouped_query_attention_matches_dense_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 8, 16, generator=g), torch.randn(2, 11, 2, 16, generator=g),
               torch.randn(2, 11, 2, 16, generator=g))
    mask = torch.rand(2, 5, 11, generator=g) > 0.3
    mask[..., 0] = True
    out, lse, _ = attend_group(q, k, v, mask, 0.25)
    assert torch.allclose(out, reference_attention(q, k, v, mask, 0.25), atol=1e-5)
    assert lse.shape == (2, 5, 8)


def test_attention_split_into_groups_merges_exactly_by_log_sum_exp():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 3, 4, 8, generator=g), torch.randn(1, 12, 2, 8, generator=g),
               torch.randn(1, 12, 2, 8, generator=g))
    mask = torch.ones(1, 3, 12, dtype=torch.bool)
    mask[0, 0, 5:] = False  # query 0 sees nothing in the second group
    whole, _, _ = attend_group(q, k, v, mask, 0.3)
    parts = [attend_group(q, k[:, :5], v[:, :5], mask[..., :5], 0.3)[:2],
             attend_group(q, k[:, 5:], v[:, 5:], mask[..., 5:], 0.3)[:2]]
    assert torch.isinf(parts[1][1][0, 0]).all()
    merged = merge_attention(parts)
    assert torch.allclose(merged, whole, atol=1e-6)
