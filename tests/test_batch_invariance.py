"""Every row's result is independent of the batch it runs in (CPU): a prompt's greedy tokens are the same alone,
in batches of any size, split into other prefill chunks, joining a running batch, and in a verify pass.

GEMM libraries choose their reduction order by the number of rows, and padded attention by the longest
sequence, so without row-invariant kernels (`offload.model.kernels`) a batched bf16 or float32 run changes
some greedy completions of a model whose logits have near ties."""

from __future__ import annotations

import json

import llvmlite.binding
import numpy as np
import pytest
import torch

from offload.config import WeightsConfig
from offload.model import cpu_packed16, cpu_packed_entry, fused, kernels, simd, simd_amx, simd_bytes, simd_int
from offload.model import functional as M
from offload.model.checkpoint import Checkpoint
from offload.runtime.engine import Engine, Request, Sampling
from offload.runtime.executor import ForwardBatch
from offload.runtime.resident import ResidentLayers
from offload.runtime.runner import Runner
from offload.weights import quant
from offload.weights.groups import model_layouts
from offload.weights.quant import PackedLinear
from tests.conftest import run_config, within_split

pytestmark = pytest.mark.skipif(not kernels.ROW_INVARIANT, reason="row-invariant CPU kernels need numba")

# matrices wide enough that a GEMM library splits its reduction differently for 1 row and for several
WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_hidden_layers": 3}
LENS = (21, 6, 13, 30, 9)
NEW = 24


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENS]


@pytest.mark.parametrize("K", [576, 583, 2048, 17])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "int8"])
def test_a_products_row_has_the_same_bits_at_any_place_in_any_pass(K, kind):
    """The kernels compute three rows at a time and the one or two left alone (int8: up to two rows converting the
    codes as they read them, more from a buffer): a row must come out the same whichever way it went (every pass
    size 1-10, every offset), also when K or an int8 group is not a multiple of the vector width."""
    g = torch.Generator().manual_seed(K)
    x = torch.randn(11, K, generator=g)
    if kind == "int8":  # groups of 64 / 53 / 128 / 17 columns (some not whole 16s), scales in float32 or bf16
        gs = {576: 64, 583: 53, 2048: 128, 17: 17}[K]
        codes = torch.randint(0, 256, (128, K), dtype=torch.uint8, generator=g)  # two 64-row tiles
        sz = torch.rand(K // gs, 128, 2, generator=g).to(torch.float32 if K % 2 == 0 else torch.bfloat16)
        pairs = sz.transpose(0, 1).float()  # [rows, groups, 2]
        w = (codes.view(128, K // gs, gs) * pairs[..., :1] + pairs[..., 1:]).view(128, K)
        q = quant.int8_tiles(codes)  # [tiles, K, 64]
        product, ref = (lambda v: kernels.packed_linear(v, q, sz)), x @ w.T
    else:
        w = torch.randn(37, K, generator=g).to(getattr(torch, kind))
        product, ref = (lambda v: kernels.dense_linear(v, w)), x @ w.float().T
    full = product(x)
    torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-3 * K ** 0.5)
    for rows in range(1, 11):
        for start in range(11 - rows + 1):
            assert torch.equal(product(x[start:start + rows]).view(torch.int32),
                               full[start:start + rows].view(torch.int32)), f"rows {start}:{start + rows}"


def _bf16_pairs_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T of bf16 x [R, K] and w [N, K] in float32, rounded as `offload.model.cpu_bf16` says, with numpy's
    float32 (a product of two bf16 is exact, every add rounded once): lane j of each 32 columns adds column 2j + 1's
    product, then column 2j's; the 16 lanes are summed 8 + 8, 4 + 4, 2 + 2, 1 + 1; then the columns past the last
    whole 32 in pairs, the second first, and a lone last column."""
    xf, wf = x.float().numpy(), w.float().numpy()
    (R, K), N = xf.shape, wf.shape[0]
    K32 = K - K % 32
    acc = np.zeros((R, N, 16), np.float32)
    for k in range(0, K32, 32):
        xs, ws = xf[:, None, k:k + 32].reshape(R, 1, 16, 2), wf[None, :, k:k + 32].reshape(1, N, 16, 2)
        acc = acc + xs[..., 1] * ws[..., 1]
        acc = acc + xs[..., 0] * ws[..., 0]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    s = acc[..., 0]
    for k in range(K32, K - 1, 2):
        s = s + xf[:, None, k + 1] * wf[None, :, k + 1]
        s = s + xf[:, None, k] * wf[None, :, k]
    if (K - K32) % 2:
        s = s + xf[:, None, K - 1] * wf[None, :, K - 1]
    return torch.from_numpy(s)


@pytest.mark.parametrize("K", [576, 583, 2048, 17, 64])
def test_bf16_products_of_bf16_activations_round_as_pairs_and_rows_keep_their_bits(K):
    """bf16 x times bf16 w multiply as bf16 pairs (AVX-512 BF16's vdpbf16ps where the CPU has it, two fused
    multiply-adds elsewhere): every output has exactly the roundings the reference spells out, on this machine's
    path, and a row the same bits in every pass size and offset (three rows at a time, one or two left alone), with
    either tiling of rows (AVX-512's eight weight rows for three of x; elsewhere four rows of x a weight row in chunks
    of columns, rows over fours four weight rows for one of x: both run on any CPU), in work items that 8 weight rows
    at a time do not divide."""
    g = torch.Generator().manual_seed(K)
    x = torch.randn(11, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(37, K, generator=g) * 3).to(torch.bfloat16)
    tiles = simd_amx.bf16_tiles()  # (where the process may use AMX tiles every bf16 product runs on them: below)
    assert kernels.dense_kind(torch.bfloat16, torch.bfloat16) == (kernels.DENSE_BF16_TILES if tiles else
                                                                  kernels.DENSE_BF16)
    assert kernels.dense_kind(torch.bfloat16, torch.float32) == kernels.DENSE_KIND[torch.bfloat16]

    def product(v: torch.Tensor, kind: int = kernels.DENSE_BF16) -> torch.Tensor:
        out = torch.empty(v.shape[0], w.shape[0])
        kernels._dense(v.float().numpy(), kernels._as_numpy(w), out.numpy(), kind)
        return out

    full = product(x)
    ref = _bf16_pairs_reference(x, w)
    assert torch.equal(full.view(torch.int32), ref.view(torch.int32)), (full - ref).abs().max()
    for rows in range(1, 11):
        for start in range(11 - rows + 1):
            assert torch.equal(product(x[start:start + rows]).view(torch.int32),
                               full[start:start + rows].view(torch.int32)), f"rows {start}:{start + rows}"
    for wide in (True, False):
        for rows in (1, 2, 3, 9, 11):
            out = torch.full((rows, w.shape[0]), float("nan"))
            for n in range(0, w.shape[0], 13):  # work items as `_dense`'s, ranges the 8-row tiles do not divide
                kernels.rows_bf16(kernels._as_numpy(x[:rows].contiguous()), kernels._as_numpy(w), out.numpy(), n,
                                  min(n + 13, w.shape[0]), wide)
            assert torch.equal(out.view(torch.int32), full[:rows].view(torch.int32)), f"wide {wide}, rows {rows}"
    # the public product rounds the same sums to bf16
    assert torch.equal(kernels.dense_linear(x, w), product(x, kernels.dense_kind(w.dtype, x.dtype)).to(torch.bfloat16))


@pytest.mark.skipif(not simd_amx.bf16_tiles(), reason="needs AMX tiles (x86-64 Linux, AMX-BF16)")
@pytest.mark.parametrize("K", [576, 583, 2048, 17, 64, 40])
def test_bf16_products_on_amx_tiles_are_exact_sums_rounded_and_rows_keep_their_bits(K):
    """Where the process may use AMX tiles every bf16-by-bf16 product runs on them (`cpu_bf16_tiles`), one row of x
    as many: each output within float32's rounding of the exact sum, and a row the same bits in every pass size and
    offset (1-10 rows, and 33 / 40 across tiles of 16 rows), with output rows no multiple of 16 (a last partial tile)
    and K no multiple of 32 (a narrower last tile, an odd last column)."""
    g = torch.Generator().manual_seed(K)
    x = (torch.randn(40, K, generator=g) * 4).to(torch.bfloat16)
    w = torch.randn(70, K, generator=g).to(torch.bfloat16)
    full = kernels.dense_linear(x, w).float()
    out = torch.empty(40, 70)
    kernels._dense(x.float().numpy(), kernels._as_numpy(w), out.numpy(), kernels.DENSE_BF16_TILES)
    assert torch.equal(full, out.to(torch.bfloat16).float())
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 2.0 ** -22  # a few float32 roundings of the sum's terms
    assert bool(((out.double() - exact).abs() <= bound).all()), (out.double() - exact).abs().max()
    for rows in range(1, 11):
        for start in range(11 - rows + 1):
            part = torch.empty(rows, 70)
            kernels._dense(x[start:start + rows].float().numpy(), kernels._as_numpy(w), part.numpy(),
                           kernels.DENSE_BF16_TILES)
            assert torch.equal(part.view(torch.int32), out[start:start + rows].view(torch.int32)), (start, rows)
    for start, end in ((0, 33), (7, 40)):
        assert torch.equal(kernels.dense_linear(x[start:end], w).float(), full[start:end])


@pytest.mark.parametrize("K,group", [(576, 64), (2048, 128), (40, 20)])
@pytest.mark.parametrize("scales", ["bfloat16", "float32"])
def test_an_int4_products_row_has_the_same_bits_at_any_place_in_any_pass(K, group, scales):
    """The int4 kernel converts the nibbles as it reads them for one or two rows and into a buffer for more, and
    takes three rows at a time from it: a row comes out the same whichever way it went (every pass size 1-10, every
    offset), whole 16-column runs in a group or not."""
    g = torch.Generator().manual_seed(K)
    packed = quant.quantize(torch.randn(70, K, generator=g), 4, group, getattr(torch, scales))
    x = torch.randn(11, K, generator=g)
    full = kernels.packed_linear(x, packed["q"], packed["sz"])
    ref = x.double() @ quant.dequantize(packed["q"], packed["sz"].float()).double().T
    torch.testing.assert_close(full.double()[:, :70], ref[:, :70], rtol=1e-4, atol=1e-4 * K ** 0.5)
    for rows in range(1, 11):
        for start in range(11 - rows + 1):
            got = kernels.packed_linear(x[start:start + rows], packed["q"], packed["sz"])
            assert torch.equal(got.view(torch.int32), full[start:start + rows].view(torch.int32)), \
                f"rows {start}:{start + rows}"


@pytest.mark.parametrize("bits,K,group", [(4, 576, 64), (4, 2048, 128), (4, 40, 20), (4, 36, 18), (8, 576, 64),
                                          (8, 584, 146), (8, 18, 18)])
@pytest.mark.parametrize("dtype,steps", [("bfloat16", "int8"), ("bfloat16", "int16"), ("float16", "int8")])
def test_packed_products_of_bf16_activations_are_integer_steps_and_rows_keep_their_bits(monkeypatch, bits, K, group,
                                                                                        dtype, steps):
    """bf16 activations are multiplied in integer steps: int8 steps where the groups are a multiple of 4 (asked for
    both widths, as `auto` does where the CPU has AVX-512 VNNI), else int16 steps (or asked for both); within what the
    steps change of the exact product, and a row comes out the same at any place in any pass (every size 1-10 at
    every offset: the direct, four-row and one-row paths, rows in fours on AVX2 with stand-ins and a lone row; 17-130
    rows: the buffered path from 16 rows of int16 steps, 24 of int8 quads, 128 of int4 quads). fp16 activations
    (more significant bits than the steps keep) as float32 ones."""
    monkeypatch.setattr(kernels, "ACTIVATIONS", {"int4": steps, "int8": steps})
    g = torch.Generator().manual_seed(K)
    packed = quant.quantize(torch.randn(70, K, generator=g), bits, group, torch.bfloat16)
    x = torch.randn(130, K, generator=g).to(getattr(torch, dtype))
    w = quant.dequantize(packed["q"], packed["sz"].float())
    full = kernels.packed_linear(x, packed["q"], packed["sz"])
    as_float32 = kernels.packed_linear(x.float(), packed["q"], packed["sz"])
    if dtype == "bfloat16":
        int8_steps = group % 4 == 0 and steps == "int8"  # (both widths: `weights.int4_activations`, `int8_...`)
        within_split(full, x.float(), w, group, 127 if int8_steps else 32767)
        assert not torch.equal(full, as_float32)
        if int8_steps:  # (coarser than int16 steps: their bound would not hold)
            with pytest.raises(AssertionError):
                within_split(full, x.float(), w, group, 32767)
    else:
        assert torch.equal(full, as_float32)
    passes = [(start, start + rows) for rows in range(1, 11) for start in range(11 - rows + 1)]
    passes += [(4, 21), (0, 21), (0, 23), (1, 25), (2, 129), (0, 130)]
    for start, end in passes:
        got = kernels.packed_linear(x[start:end], packed["q"], packed["sz"])
        assert torch.equal(got.view(torch.int32), full[start:end].view(torch.int32)), f"rows {start}:{end}"


def test_auto_activation_steps_are_int8_where_the_cpu_multiplies_bytes_in_one_instruction(monkeypatch):
    """`weights.int4_activations` / `int8_activations: auto` (the default): int8 steps where a byte product is one
    instruction (AVX-512 VNNI; against int4 codes also AVX2's byte pairs), int16 elsewhere (int8 codes on an AVX2 CPU
    widen the bytes first: int8 steps 1.3-8x slower); an explicit choice stands on any CPU, and a config's default
    is auto."""
    monkeypatch.setattr(kernels, "ACTIVATIONS", dict(kernels.ACTIVATIONS))
    for vnni in (True, False):
        for pairs in (True, False):
            monkeypatch.setattr(kernels, "byte_dots", lambda vnni=vnni: vnni)
            monkeypatch.setattr(kernels, "pair_bytes", lambda pairs=pairs: pairs)
            kernels.use_activations("auto", "int8")
            assert kernels.ACTIVATIONS == {"int4": "int8" if vnni or pairs else "int16", "int8": "int8"}
            kernels.use_activations("int16", "auto")
            assert kernels.ACTIVATIONS == {"int4": "int16", "int8": "int8" if vnni else "int16"}
    features = llvmlite.binding.get_host_cpu_features().flatten().split(",")
    assert simd_int.byte_dots() == (simd._x86() and "+avx512vnni" in features)
    assert simd_bytes.pair_bytes() == (simd._x86() and "+avx2" in features)
    assert cpu_packed16._BYTES4 == (simd_bytes.pair_bytes() and not simd_int.byte_dots())
    assert WeightsConfig().int4_activations == WeightsConfig().int8_activations == "auto"


def test_amx_tiles_are_asked_for_once_and_configured_for_the_sums_codes_and_rows():
    """Where the process may use AMX tiles (`simd_amx.granted`: x86-64 Linux with AMX, asked once) packed kinds of
    bf16 activations carry AMX_TILES, nowhere else; the tile record `quad_sums` loads: palette 1, four sum tiles of
    the rows by 16 int32, x's tile of the rows by the group's quads, three code tiles of the quads' rows."""
    ok = simd_amx.int8_tiles()
    assert simd_amx.granted() is simd_amx.granted() and (not ok or simd_amx.AMX)
    ints = kernels.packed_kind(torch.bfloat16) - kernels.PACKED_STEPS
    assert bool(ints & cpu_packed_entry.AMX_TILES) == ok and kernels.packed_kind(torch.float32) == kernels.PACKED
    cfg = np.full(64, 7, np.uint8)
    simd_amx.configure(cfg, simd_amx.quad_shape(9, 8))
    colsb, rows = cfg[16:32].view(np.uint16), cfg[48:56]
    assert cfg[0] == 1 and not cfg[1:16].any() and not cfg[56:].any()
    assert colsb.tolist() == [64, 64, 64, 64, 32, 64, 64, 64] and rows.tolist() == [9, 9, 9, 9, 9, 8, 8, 8]
    assert [simd_amx.tile_units(h) for h in (8, 16, 24, 32)] == [8, 16, 0, 16]


@pytest.mark.skipif(not simd_amx.int8_tiles(), reason="needs AMX tiles (x86-64 Linux, AMX-INT8)")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("K,group", [(512, 64), (512, 32), (1024, 128), (576, 96)])
def test_amx_tiles_give_each_row_the_bits_of_the_vector_products(bits, K, group):
    """int8 steps against int8 / int4 codes on AMX tiles (exact int32 sums, then the same scaling) give every row the
    bits the VNNI vectors give it, alone or in a pass of any size: from `_TILE_ROWS` rows, across 16-row tiles, a
    group of 128 in two tiles, one of 96 (not whole tiles) on vectors; the largest codes, a zero and a NaN row."""
    g = torch.Generator().manual_seed(K + bits)
    packed = quant.quantize(torch.randn(128, K, generator=g), bits, group, torch.bfloat16)
    q, sz = kernels.packed_args(packed["q"], packed["sz"])
    x = torch.randn(37, K, generator=g)
    x[3] = 0.0
    x[5, 11] = float("nan")
    x[6] *= 1e4
    x = x.to(torch.bfloat16).float().numpy()
    ints = cpu_packed_entry.INT16_STEPS | cpu_packed_entry.INT4_AS_INT8 | cpu_packed_entry.INT8_AS_INT8
    for R in (cpu_packed16._TILE_ROWS, 9, 16, 17, 37):
        vec, tiles = np.empty((R, 128), np.float32), np.empty((R, 128), np.float32)
        cpu_packed_entry.packed(x[:R], q, sz, vec, ints)
        cpu_packed_entry.packed(x[:R], q, sz, tiles, ints | cpu_packed_entry.AMX_TILES)
        assert np.array_equal(vec.view(np.uint32), tiles.view(np.uint32)), f"{R} rows"
    one = np.empty((1, 128), np.float32)
    for r in (0, 3, 5, 6, 36):
        cpu_packed_entry.packed(x[r:r + 1].copy(), q, sz, one, ints | cpu_packed_entry.AMX_TILES)
        assert np.array_equal(one[0].view(np.uint32), tiles[r].view(np.uint32)), f"row {r}"
    assert bool(np.isnan(tiles[5]).all()) and not tiles[3].any()


@pytest.mark.parametrize("int8_steps", ["int8", "int16"])
def test_the_integer_split_does_not_overflow_and_keeps_zero_and_nan_rows_to_themselves(monkeypatch, int8_steps):
    """The integer split (`cpu_packed16._split`) at its edges: a group as large as int32 allows (512 columns of the
    largest int8 code against the largest |x|: the step grows instead of the sum wrapping; the same for int4 codes
    in int8 steps), a row of zeros gives exact zeros, and a NaN in one row makes that row NaN and leaves the others'
    bits as they are alone; int8 codes in both steps (`weights.int8_activations`). Tiles with odd groups (not
    quantization's, which pairs columns) multiply in float32."""
    monkeypatch.setattr(kernels, "ACTIVATIONS", {"int4": "int8", "int8": int8_steps})
    K = 512
    q = torch.full((1, K, 64), 255, dtype=torch.uint8)  # one 64-row tile, every code 255
    sz = torch.stack([torch.ones(1, 64), torch.zeros(1, 64)], dim=-1)  # one group: scale 1, min 0
    x = torch.ones(3, K, dtype=torch.bfloat16)
    x[1] = 0.0
    x[2, 7] = float("nan")
    out = kernels.packed_linear(x, q, sz)
    torch.testing.assert_close(out[0], torch.full((64,), 255.0 * K), rtol=1e-5, atol=0)  # a wrap would be < 0
    assert torch.equal(out[1], torch.zeros(64))
    assert bool(out[2].isnan().all())
    assert torch.equal(kernels.packed_linear(x[:1], q, sz), out[:1])
    q4 = torch.full((1, 64, K // 2), 0xFF, dtype=torch.uint8)  # int4: every code 15, w = (15 - 8) * 1 + 0
    sz4 = torch.stack([torch.ones(1, 1, 64), torch.zeros(1, 1, 64)], dim=-1)
    out = kernels.packed_linear(x, q4, sz4)  # (int8 steps: rows 32-63's sums come as 16x theirs, then divided)
    torch.testing.assert_close(out[0], torch.full((64,), 7.0 * K), rtol=1e-5, atol=0)
    assert torch.equal(out[1], torch.zeros(64))
    assert bool(out[2].isnan().all())
    assert torch.equal(kernels.packed_linear(x[:1], q4, sz4), out[:1])
    odd = torch.rand(3, 64, 2).to(torch.bfloat16)  # 51 columns in groups of 17
    x = torch.randn(4, 51).to(torch.bfloat16)
    assert torch.equal(kernels.packed_linear(x, q[:, :51], odd), kernels.packed_linear(x.float(), q[:, :51], odd))


@pytest.mark.parametrize("dtype,weights", [("bfloat16", "bfloat16"), ("float32", "float32"), ("float32", "bfloat16"),
                                           ("bfloat16", "int8"), ("bfloat16", "int4"), ("float32", "int4")])
def test_the_compiled_head_gives_the_norm_and_products_bits(dtype, weights):
    """A CPU head is one compiled call (`fused.head_logits`: the last RMSNorm and the head's product): the bits of
    `rms_norm` then `linear` one by one, rows of any count (1, 3, 9) alike, with a vocabulary that is no multiple of
    64 (packed matrices are padded to whole tiles)."""
    g = torch.Generator().manual_seed(7)
    H, V = 72, 200
    x = (torch.randn(9, H, generator=g) * 3).to(getattr(torch, dtype))
    norm = (1 + torch.randn(H, generator=g) / 4).to(getattr(torch, dtype))
    m = torch.randn(V, H, generator=g) / 8
    if weights in ("int8", "int4"):
        packed = quant.quantize(m, 8 if weights == "int8" else 4, 24, torch.bfloat16)
        w = PackedLinear(packed["q"], packed["sz"], V, None)
    else:
        w = m.to(getattr(torch, weights))
    assert fused.head_supported(x, w)
    ref = M.linear(M.rms_norm(x, norm, 1e-5), w, None, float32=True)
    for rows in (slice(0, 1), slice(2, 5), slice(0, 9)):
        got = fused.head_logits(x[rows], norm, 1e-5, w)
        assert got.dtype == torch.float32 and got.shape == (rows.stop - rows.start, V)
        assert torch.equal(got.view(torch.int32), ref[rows].view(torch.int32)), rows
    if dtype == "bfloat16":  # logits hold bf16 values, as the op-by-op head's do
        assert torch.equal(got, got.bfloat16().float())


@pytest.fixture(scope="module")
def wide(model_factory):
    return model_factory("llama", overrides=WIDE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_are_the_same_alone_in_any_batch_and_any_prefill_chunking(wide, dtype):
    batch = prompts(512)
    base = run_config(wide, dtype=dtype, kv_cache={"block_size": 4})
    with Runner.from_config(base) as r:
        alone = [r.generate([p], max_new_tokens=NEW, stop_on_eos=False)[0].token_ids for p in batch]
    with Runner.from_config(base | {"activations": {"prefill_chunk": 7}}) as r:  # other chunk boundaries
        for group in ([0, 1], [2, 3, 4], [4, 0, 3, 1, 2]):
            got = r.generate([batch[i] for i in group], max_new_tokens=NEW, stop_on_eos=False)
            assert [g.token_ids for g in got] == [alone[i] for i in group], f"batch {group}"


@torch.inference_mode()
@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"),
                                                ("float32", "int8"), ("bfloat16", "int4")])
def test_a_decode_rows_logits_are_bit_equal_alone_and_beside_other_rows(wide, dtype, quantization):
    """One decode step of a sequence, alone and in a pass with a longer sequence's step and a prompt chunk
    (dense weights, and packed int8 / int4 ones)."""
    batch = prompts(512)
    weights = {"quantization": quantization, "group_size": 64}
    with Runner.from_config(run_config(wide, dtype=dtype, kv_cache={"block_size": 4}, weights=weights)) as r:
        ex = r.target
        kv = ex.ensure_kv(64)
        a, b, c = kv.add_sequence(), kv.add_sequence(), kv.add_sequence()
        ex.forward(ForwardBatch.last([a], [batch[0]]))
        ex.forward(ForwardBatch.last([b], [batch[3]]))
        alone = ex.forward(ForwardBatch.last([a], [[5]]))
        kv.truncate(a, len(batch[0]))
        mixed = ex.forward(ForwardBatch.last([b, a, c], [[9], [5], batch[1]]))
        assert torch.equal(mixed[1], alone[0])


@torch.inference_mode()
def test_a_9_token_verify_pass_gives_the_bits_of_9_single_steps_in_float32(wide):
    """A chain checked in one pass (one product per matrix, the weights read once) equals 9 plain steps."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 512, (27,), generator=g).tolist()
    chain = torch.randint(3, 512, (9,), generator=g).tolist()
    with Runner.from_config(run_config(wide, kv_cache={"block_size": 4})) as r:
        ex = r.target
        kv = ex.ensure_kv(32)
        a, b = kv.add_sequence(), kv.add_sequence()
        ex.forward(ForwardBatch.last([a], [prompt]))
        ex.forward(ForwardBatch.last([b], [prompt]))
        steps = torch.cat([ex.forward(ForwardBatch.last([a], [[t]])) for t in chain])
        verify = ex.forward(ForwardBatch.verify([b], [chain], [len(chain)]))
        assert torch.equal(verify, steps)


def test_a_request_joining_a_running_batch_gets_its_tokens_alone(wide):
    """Continuous batching: a prompt prefilled in passes beside another request's decode rows."""
    batch = prompts(512)
    base = run_config(wide, dtype="bfloat16", kv_cache={"block_size": 4, "gpu_blocks": 64},
                      activations={"prefill_chunk": 8})
    with Runner.from_config(base) as r:
        alone = [r.generate([p], max_new_tokens=NEW, stop_on_eos=False)[0].token_ids for p in batch[:2]]
        engine = Engine(r)
        first = engine.submit(Request(batch[0], Sampling(max_new_tokens=NEW, stop_token_ids=frozenset())))
        for _ in range(5):
            engine.step()
        later = engine.submit(Request(batch[1], Sampling(max_new_tokens=NEW, stop_token_ids=frozenset())))
        while engine.busy:
            engine.step()
    assert [first.outputs[0].token_ids, later.outputs[0].token_ids] == alone


def test_the_throughput_mode_gives_each_request_its_tokens_alone_at_any_batch(wide, tmp_path):
    """The CLI path: `offload run --input` at --batch 5 and at --batch 1 (one request at a time), bf16, greedy."""
    from tests.test_cli_flows import offload, write_yaml  # the subprocess helper (tests may import inside)

    config = write_yaml(tmp_path / "c.yaml", run_config(wide, dtype="bfloat16", compute_dtype="bfloat16",
                                                        kv_cache={"block_size": 4}))
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"id": str(i), "prompt": p, "max_tokens": NEW}) + "\n"
                                for i, p in enumerate(prompts(512))))
    got = []
    for batch in ("5", "1"):
        out = tmp_path / f"out{batch}.jsonl"
        proc = offload("run", "--config", str(config), "--input", str(requests), "--output", str(out),
                       "--batch", batch, "--temperature", "0")
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        got.append({r["id"]: r["choices"][0]["token_ids"] for r in rows})
    assert len(got[0]) == len(LENS) and got[0] == got[1]


def counted_calls(monkeypatch) -> dict[str, int]:
    """Calls of a run of layers in one call ("run": `fused.LayerRun`) and of one layer in one call ("layer":
    `fused.decoder_layer`), counted from now on."""
    calls = {"run": 0, "layer": 0}
    monkeypatch.setattr(fused, "decoder_layer", lambda *a, real=fused.decoder_layer: (
        calls.__setitem__("layer", calls["layer"] + 1), real(*a))[1])
    real_run = fused.LayerRun.__call__
    monkeypatch.setattr(fused.LayerRun, "__call__", lambda *a: (calls.__setitem__("run", calls["run"] + 1),
                                                               real_run(*a))[1])
    return calls


@pytest.mark.parametrize("family,quantization", [("llama", "none"), ("qwen2", "none"), ("mistral", "none"),
                                                  ("llama", "int8"), ("llama", "int4")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_cpu_layer_gives_the_op_by_op_layers_bits(model_factory, family, quantization, dtype, monkeypatch):
    """A CPU pass runs its resident layers back to back in one compiled call (`fused.LayerRun`), else each layer as
    one call (`fused.decoder_layer`) where it can and op by op where it cannot (cold KV blocks, MoE, q/k norms): all
    three give the same bits, so a step's tokens do not depend on which ran (a prompt chunk and decode rows in one
    pass, biases (Qwen2), a sliding window (Mistral), int8 and int4 matrices). A pass that keeps every row's logits
    computes the model's head in the run's call (`fused.LayerRun`'s head), not on its own (`fused.head_logits`)."""
    model = model_factory(family, dtype=dtype, overrides={"sliding_window": 4} if family == "mistral" else {})
    calls = counted_calls(monkeypatch)
    heads = []  # the rows of each head computed on its own
    monkeypatch.setattr(fused, "head_logits", lambda x, *a, real=fused.head_logits: (heads.append(x.shape[0]),
                                                                                      real(x, *a))[1])

    def passes() -> list[torch.Tensor]:
        calls.update(run=0, layer=0)
        weights = {"quantization": quantization, "group_size": 8}  # (8 divides the tiny model's 344)
        cfg = run_config(model, dtype=dtype, compute_dtype=dtype, weights=weights)
        with Runner.from_config(cfg) as r, torch.inference_mode():
            cache = r.ensure_kv(16)
            sids = [cache.add_sequence() for _ in range(3)]
            out = [r.target.forward(ForwardBatch.every_token(sids[:2], [[1, 5, 9, 200, 7, 8, 9], [1, 3]]))]
            out.append(r.target.forward(ForwardBatch.last(sids[:2], [[11], [12]])))  # a uniform decode step
            out.append(r.target.forward(ForwardBatch.every_token(sids, [[4], [5, 6], [1, 2, 3]])))  # mixed
            return out

    whole = passes()
    assert calls == {"run": 3, "layer": 0}, "the pass did not run its layers in one call"
    assert heads == [], "a pass that keeps every row's logits computed its head on its own"
    monkeypatch.setattr(ResidentLayers, "possible", False)
    by_layer = passes()
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert calls == {"run": 0, "layer": 3 * layers} and heads == [9, 2, 6]
    monkeypatch.setattr(fused, "layer_supported", lambda *a: False)
    op_by_op = passes()
    assert calls == {"run": 0, "layer": 0}
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(whole, by_layer, op_by_op))


def test_runs_of_resident_layers_between_streamed_ones_go_in_one_call_each(model_factory, tmp_path, monkeypatch):
    """A plan that streams some layers from disk keeps the rest resident between them: each run of two or more
    resident layers goes in one compiled call (`fused.LayerRun`), the streamed layers one by one as they arrive, and
    the tokens are the all-resident run's and the layer-by-layer run's (before, one streamed layer sent every layer
    through its own call: ~0.1 ms of Python each, SmolLM2-135M int4 with a quarter resident 10.5 -> 9.2 ms a step)."""
    model = model_factory("llama", overrides={"num_hidden_layers": 12})
    layouts = model_layouts(Checkpoint(model).config, torch.float32)
    room = 14 * layouts["layer.0"].nbytes + layouts["head"].nbytes + 2 * 2**20  # (a fixed pool and chunk: a plan
    tiered = run_config(model, activations={"prefill_chunk": 64}, kv_cache={"gpu_blocks": 16},  # that stays put)
                        tiers={"gpu": {"capacity": room}, "cpu": {"capacity": 0},
                               "disk": {"path": str(tmp_path / "store")}})
    calls = counted_calls(monkeypatch)
    texts = [[1, 17, 99, 23, 5, 61, 7, 300, 41], [1, 8, 2]]

    def tokens(cfg: dict, runs_counted: bool = False) -> list[list[int]]:
        with Runner.from_config(cfg) as r:
            if runs_counted:
                ex = r.target
                runs = [layers for together, layers in ex.resident.segments if together]
                alone = [layers[0] for together, layers in ex.resident.segments if not together]
                streamed = [i for i in alone if not ex.plan.is_resident(ex.layer_groups[i])]
                assert runs and streamed, f"the plan no longer mixes runs and streamed layers: {ex.resident.segments}"
            calls.update(run=0, layer=0)
            out = [x.token_ids for x in r.generate(texts, max_new_tokens=6, stop_on_eos=False)]
            if runs_counted:
                passes = calls["run"] // len(runs)
                assert passes > 0 and calls == {"run": passes * len(runs), "layer": passes * len(alone)}
            return out

    mixed = tokens(tiered, runs_counted=True)
    assert mixed == tokens(run_config(model))
    monkeypatch.setattr(ResidentLayers, "possible", False)
    assert mixed == tokens(tiered) and calls["run"] == 0


@pytest.mark.parametrize("K,group", [(576, 64), (2048, 128), (40, 20)])
def test_int4_codes_give_the_bits_of_the_same_codes_stored_as_int8(monkeypatch, K, group):
    """int8 steps against int4 codes (this CPU's form: AVX-512 VNNI's quads, or AVX2's byte pairs, `simd_bytes`) and
    against the same codes stored as int8 (quads, or int16 pairs), the int4 zero' (zero - 8 scale) as the int8 min:
    the same exact integer sums and the same scaling, so the same bits, at every size of pass (the byte pairs' fours,
    stand-ins, a lone row) and in each row alone."""
    monkeypatch.setattr(kernels, "ACTIVATIONS", {"int4": "int8", "int8": "int8"})
    g = torch.Generator().manual_seed(K + group)
    codes = torch.randint(0, 16, (128, K), generator=g, dtype=torch.uint8)
    G = K // group
    scale = (torch.rand(G, 128, generator=g) + 0.5).to(torch.bfloat16)
    zero = torch.randn(G, 128, generator=g).to(torch.bfloat16)
    q4, sz4 = quant.pack_tiles(codes).unsqueeze(0), torch.stack([scale, zero], -1).unsqueeze(0)
    q8 = quant.int8_tiles(codes)
    sz8 = torch.stack([scale.float(), zero.float() - 8 * scale.float()], -1)  # (exact: bf16's 8 bits)
    x = torch.randn(19, K, generator=g).to(torch.bfloat16)
    for R in (1, 2, 3, 4, 5, 6, 7, 9, 19):
        four, eight = (kernels.packed_linear(x[:R], q, sz) for q, sz in ((q4, sz4), (q8, sz8)))
        assert torch.equal(four.view(torch.int32), eight.view(torch.int32)), f"{R} rows"
    alone = torch.cat([kernels.packed_linear(x[r:r + 1], q4, sz4) for r in range(19)])
    assert torch.equal(alone.view(torch.int32), four.view(torch.int32))
