"""Model math pieces checked against plain reference formulas."""

from __future__ import annotations

import pytest
import torch

from offload.model import cpu_attention, cpu_elementwise, fused, kernels
from offload.model.cpu_elementwise import _bf16_bits
from offload.model.functional import attend_group, merge_attention, sdpa_with_lse
from offload.model.simd import vload, vstore
from offload.model.simd_math import vdiv64, vexp, vhmax, vmax, vmul64, vput


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


needs_numba = pytest.mark.skipif(kernels.numba is None, reason="the CPU kernels need numba")


@needs_numba
@pytest.mark.parametrize("D,Tk", [(64, 45), (80, 45), (8, 45), (64, 150), (48, 150)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_kernel_is_the_exact_attention_and_a_querys_bits_do_not_depend_on_its_batch(D, Tk, dtype):
    """The CPU kernel (16-lane sums eight keys at a time, vector exponentials, value rows in chunks, rows read in
    place; head sizes with and without a part past the last 16 lanes, contexts of one chunk and of several) against
    float64 softmax attention, and a query's output and lse bit-equal alone and beside other queries, sequences and
    padding keys."""
    g = torch.Generator().manual_seed(D + Tk)
    B, Tq, Hq, Hkv = 3, 6, 6, 2
    q = torch.randn(B, Tq, Hq, D, generator=g)
    k, v = (torch.randn(B, Tk, Hkv, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(B, Tq, Tk, generator=g) > 0.3
    mask[1, 2] = False  # sees no key: zeros and -inf
    out, lse = cpu_attention.attend(q, k, v, mask, D**-0.5)
    ref = reference_attention(q.double(), k.double(), v.double(), mask, D**-0.5)
    seen = mask.any(-1)
    assert torch.allclose(out.double()[seen], ref[seen], atol=1e-6)
    assert torch.equal(out[1, 2], torch.zeros(Hq, D)) and torch.isinf(lse[1, 2]).all()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(Hq // Hkv, 2)) * D**-0.5
    want = scores.masked_fill(~mask[:, None], float("-inf")).logsumexp(-1).transpose(1, 2)
    assert torch.allclose(lse.double()[seen], want[seen], atol=1e-6)
    visible = int(mask[2, 4].nonzero().max()) + 1  # query (2, 4) alone, over its own keys only
    alone, alone_lse = cpu_attention.attend(q[2:3, 4:5], k[2:3, :visible], v[2:3, :visible], mask[2:3, 4:5, :visible],
                                            D**-0.5)
    assert torch.equal(alone[0, 0], out[2, 4]) and torch.equal(alone_lse[0, 0], lse[2, 4])
    # a causal mask (a prompt chunk over its prefix): the reference, and each query's bits alone
    causal = torch.arange(Tk)[None, None, :] <= torch.arange(Tk - Tq, Tk)[None, :, None]
    causal = causal.expand(B, Tq, Tk).clone()
    out, lse = cpu_attention.attend(q, k, v, causal, D**-0.5)
    ref = reference_attention(q.double(), k.double(), v.double(), causal, D**-0.5)
    assert torch.allclose(out.double(), ref, atol=1e-6)
    for t in (0, 3, 5):
        n = Tk - Tq + t + 1
        alone, alone_lse = cpu_attention.attend(q[1:2, t:t + 1], k[1:2, :n], v[1:2, :n], causal[1:2, t:t + 1, :n],
                                                D**-0.5)
        assert torch.equal(alone[0, 0], out[1, t]) and torch.equal(alone_lse[0, 0], lse[1, t])


@needs_numba
@pytest.mark.parametrize("D,Tq", [(64, 1), (80, 6), (8, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_reads_cold_blocks_where_they_lie_with_the_pools_bits(D, Tq, dtype):
    """Blocks of a paged pool moved out (some read in place from another plane by index, some from a buffer of
    their own: a host tier and a disk read) and named in the table as -1 - i: the same bits as every block in the
    pool, for the query-by-query kernel and the four-query one, with and without a part past the last 16 lanes.
    Blocks of another layout are refused."""
    g = torch.Generator().manual_seed(D * Tq)
    B, Hq, Hkv, bs, cols = 2, 4, 2, 4, 5
    q = torch.randn(B, Tq, Hq, D, generator=g)
    pool = torch.randn(B * cols + 1, 2, bs, Hkv, D, generator=g).to(dtype)  # slot 0 unused (padding)
    table = torch.arange(1, B * cols + 1).view(B, cols)
    mask = torch.rand(B, Tq, cols * bs, generator=g) > 0.2
    want = cpu_attention.attend_paged(q, pool, table, mask, D**-0.5)
    host = torch.randn(9, 2, bs, Hkv, D, generator=g).to(dtype)  # a host plane: blocks at slots 7, 2, 5
    host[[7, 2, 5]] = pool[table[0, [1, 3]].tolist() + [int(table[1, 0])]]
    disk = pool[table[1, [2, 4]]].clone()  # a read's buffer
    split = table.clone()
    split[0, 1], split[0, 3], split[1, 0] = -1, -2, -3  # host[7], host[2], host[5]
    split[1, 2], split[1, 4] = -4, -5  # disk[0], disk[1]
    pool[table[0, [1, 3]]] = float("nan")  # the pool's copies are not read
    pool[table[1, [0, 2, 4]]] = float("nan")
    got = cpu_attention.attend_paged(q, pool, split, mask, D**-0.5, cold=[(host, [7, 2, 5]), (disk, None)])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="not the pool's blocks"):
        cpu_attention.attend_paged(q, pool, split, mask, D**-0.5, cold=[(disk.transpose(2, 3).contiguous(), None)])


@needs_numba
def test_vector_exp_is_within_an_ulp_and_keeps_its_edges():
    import numpy as np
    from numba import njit

    @njit
    def exp16(x, out):
        for i in range(0, x.shape[0], 16):
            vstore(out, i, vexp(vload(x, i)))

    x = np.concatenate([np.linspace(-87.3, 88.3, 1 << 18, dtype=np.float32),
                        np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, -87.4, 88.4, -1e-30, 1e-30, -200, 200, 1, -1,
                                  0.5, 20, -20], np.float32)])
    out = np.empty_like(x)
    exp16(x, out)
    body = slice(0, 1 << 18)
    exact = np.exp(x[body].astype(np.float64))
    ulps = np.abs(out[body] - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.5, ulps.max()  # (an ulp at the float32 below e^x: half of it at a power of 2)
    edges = out[1 << 18:]
    assert edges[0] == 0.0 and edges[1] == np.inf and np.isnan(edges[2]) and edges[3] == edges[4] == 1.0
    assert edges[5] == 0.0 and edges[6] == np.inf and edges[9] == 0.0 and edges[10] == np.inf
    assert np.allclose(edges[7:9], 1.0) and np.allclose(edges[11:], np.exp(x[-5:].astype(np.float64)), rtol=2e-7)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_silu_mul_is_torchs_with_its_roundings(dtype):
    """SiLU x up in 16-lane vectors: bf16 results equal torch's bit for bit (each op rounded as torch rounds it);
    float32 ones within an ulp of torch's (its exp is another polynomial); zeros, infinities and NaN as torch's."""
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(33, 2 * 1100, generator=g) * 4).to(dtype)  # 1100 columns: runs and a part past the last 16
    gu[0, :7] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -100.0, 100.0])
    got = cpu_elementwise.silu_mul(gu)
    want = torch.nn.functional.silu(gu[:, :1100]) * gu[:, 1100:]
    same = (got == want) | (got.isnan() & want.isnan())
    if dtype == torch.bfloat16:
        assert same.all()
    else:
        assert same[0, :7].all() and torch.allclose(got, want, rtol=3e-7, atol=0, equal_nan=True)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_rms_norm_is_transformers_formula_row_by_row(dtype):
    """RMSNorm with its sum of squares in 16 lanes (then the columns past the last 16): transformers' formula
    `w * (x * rsqrt(mean(x^2) + eps)).to(dtype)` to the last bit on almost every value (the sum's order is not
    torch's), within a rounding everywhere, and each row's bits its own (alone = in a batch)."""
    g = torch.Generator().manual_seed(0)
    for H in (576, 100):
        x = (torch.randn(48, H, generator=g) * 3).to(dtype)
        w = (torch.randn(H, generator=g) * 0.1 + 1).to(dtype)
        got = cpu_elementwise.rms_norm(x, w, 1e-5)
        xf = x.float()
        want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert (got == want).float().mean() > (0.999 if dtype == torch.bfloat16 else 0.5)
        assert torch.allclose(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
        assert torch.equal(cpu_elementwise.rms_norm(x[7:8], w, 1e-5), got[7:8])


def test_logits_rounded_in_place_take_the_values_of_a_bf16_copy():
    """`cpu_elementwise.round_values` (a bf16 head's logits kept in float32, no bf16 copy) against torch's
    `.to(bf16).float()`: every number, its rounding ties, subnormals, infinities and overflow to infinity; a NaN stays
    a NaN."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 4099, generator=g) * torch.logspace(-44, 38, 4099)
    y[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4e38, 1e-45, -1e-40])
    y[1, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])  # ties to even, past a tie
    want = y.to(torch.bfloat16).float()
    got = cpu_elementwise.round_values(y.clone(), torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    half = cpu_elementwise.round_values(y.clone(), torch.float16)
    assert torch.equal(half.nan_to_num(), y.half().float().nan_to_num())


@needs_numba
def test_lane_stores_and_float64_lanes_give_the_scalar_bits():
    """`vput` stores bf16 bits rounded as the scalar `_bf16_bits` (ties to even, NaN kept quiet) and float32 bits as
    they are; `vmul64` / `vdiv64` are a float32 times / over a float64, rounded once to float32, as the scalar code
    does; `vhmax` is the largest lane."""
    import numpy as np
    from numba import njit

    @njit
    def lanes(x, t, o16, o32, mul, div):
        top = vload(x, 0)
        for i in range(0, x.shape[0], 16):
            v = vload(x, i)
            vput(o16, i, v, True)
            vput(o32.ctypes.data, i, v, False)
            vstore(mul, i, vmul64(v, t))
            vstore(div, i, vdiv64(v, t))
            top = vmax(top, v)
        return vhmax(top)

    @njit
    def scalars(x, t, o16, mul, div):
        for i in range(x.shape[0]):
            o16[i] = _bf16_bits(x[i])
            mul[i] = x[i] * t
            div[i] = x[i] / t

    rng = np.random.default_rng(3)
    x = rng.standard_normal(4096).astype(np.float32)
    x.view(np.uint32)[:1024] = rng.integers(0, 2**32, 1024, dtype=np.uint64).astype(np.uint32)  # any bits
    x[1024:1040] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.00390625, 1.01171875,
                    -1.00390625, 2.0**-126, 5.0, 6.0, 7.0]  # (ties of bf16's rounding among them)
    t = 1.0 / 3.0
    got = [np.empty(x.size, d) for d in (np.uint16, np.uint32, np.float32, np.float32)]
    want = [np.empty(x.size, d) for d in (np.uint16, np.float32, np.float32)]
    top = lanes(x, t, *got)
    scalars(x, t, *want)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], x.view(np.uint32))
    assert np.array_equal(got[2].view(np.uint32), want[1].view(np.uint32))
    assert np.array_equal(got[3].view(np.uint32), want[2].view(np.uint32))
    assert top == np.nanmax(x)


@needs_numba
def test_resident_layers_of_two_numba_types_are_refused_for_one_call():
    """`fused.LayerRun` holds every layer's weights in one typed list: layers whose weights differ in numba type (an
    o matrix kept in bf16 beside float32 ones) raise TypeError, which `functional.layer_run` turns into layer by
    layer, instead of the list's AssertionError; layers of one type make one list of them all."""

    g = torch.Generator().manual_seed(0)

    def layer(o_dtype):
        qkv, o, gate_up, down = (torch.randn(*shape, generator=g).to(dt) for shape, dt in (
            ((48, 16), torch.float32), ((16, 16), o_dtype), ((64, 16), torch.float32), ((16, 32), torch.float32)))
        return (qkv, None, o, None, gate_up, None, down, None), (torch.ones(16), torch.ones(16))

    same = [layer(torch.float32) for _ in range(3)]
    assert len(fused.LayerRun(same, torch.float32).args) == 3
    with pytest.raises(TypeError, match="one numba type"):
        fused.LayerRun(same + [layer(torch.bfloat16)], torch.float32)
