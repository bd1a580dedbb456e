"""Model math pieces checked against plain reference formulas."""

from __future__ import annotations

import pytest
import torch

from offload.model.functional import attend_group, merge_attention, sdpa_with_lse


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_attention_returns_the_exact_attention_and_log_sum_exp(dtype):
    """The fused path (CUDA's memory-efficient kernel; its CPU twin here) keeps attend_group's contract,
    including queries that see no key of the group (lse -inf, output 0), so the LSE merge across tiers holds."""
    g = torch.Generator().manual_seed(0)
    B, Tq, Hq, Hkv, D, Tk = 2, 5, 8, 2, 16, 37
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((B, Tq, Hq, D), (B, Tk, Hkv, D), (B, Tk, Hkv, D)))
    mask = torch.rand(B, Tq, Tk, generator=g) > 0.4
    mask[1, 2] = False  # a query with no key in this group
    out, lse, _ = attend_group(q, k, v, mask, 0.25)
    fout, flse = sdpa_with_lse(q, k, v, mask, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isinf(flse[1, 2]).all() and torch.equal(fout[1, 2], torch.zeros(Hq, D))
    assert torch.allclose(flse, lse, atol=tol) and torch.allclose(fout, out, atol=tol)
    # split the keys in two groups and merge: the same as one group
    a, b = mask.clone(), mask.clone()
    a[..., 20:] = False
    b[..., :20] = False
    merged = merge_attention([sdpa_with_lse(q, k, v, a, 0.25), sdpa_with_lse(q, k, v, b, 0.25)])
    assert torch.allclose(merged, out, atol=tol)
