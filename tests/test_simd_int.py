"""The integer lane operations of `offload.model.simd_int` give the same lanes in every form they compile to: the
AVX-512 VNNI instructions, AVX-512 BW's pmaddwd, and plain LLVM vector code (what a CPU without either runs). Each
form is compiled here by hiding CPU features from the code generator, so every form this CPU can run runs on it (a
form whose instructions it lacks is skipped: LLVM aborts the process compiling them for such a host), and every lane
is checked against numpy's exact integer arithmetic: a packed product's bits do not depend on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")

from offload.model import simd_bytes, simd_int  # noqa: E402  (after the skip: the modules need numba)
from offload.model.cpu_packed import _split  # noqa: E402
from offload.model.simd import _has, _x86  # noqa: E402
from offload.weights import quant  # noqa: E402

FORMS = {"vnni": {"avx512vnni", "avx512bw"}, "avx512bw": {"avx512bw"}, "plain": set()}


def _as_cpu_with(monkeypatch, module, features: set[str]) -> None:
    """The module's code generator sees a CPU with only these features (skipped where this CPU lacks one: LLVM aborts
    the process compiling them for such a host)."""
    if features and not _x86():
        pytest.skip("the x86 forms compile on x86 only")
    lacking = sorted(f for f in features if not _has(f))
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(lacking)}")
    monkeypatch.setattr(module, "_has", lambda feature: feature in features)


def _compiled(monkeypatch, features: set[str]):
    """Fresh (uncached) functions over the lane operations, compiled as for a CPU with only these features."""
    _as_cpu_with(monkeypatch, simd_int, features)

    @numba.njit(cache=False)
    def dots(acc, w, x, out8, out16):
        a = simd_int.viload(acc, 0)
        simd_int.vistore(out8, 0, simd_int.vdot8(a, simd_int.viload(w, 0), simd_int.viload(x, 0)))
        simd_int.vistore(out16, 0, simd_int.vdot(a, simd_int.viload(w, 0), simd_int.viload(x, 0)))

    @numba.njit(cache=False)
    def quads(codes, codes8, v, out, out8, shifted):
        c0, c1, c2, c3 = simd_int.vquads4(codes, 0)
        simd_int.vistore(out, 0, c0)
        simd_int.vistore(out, 16, c1)
        simd_int.vistore(out, 32, c2)
        simd_int.vistore(out, 48, c3)
        for i, c in enumerate(simd_int.vquads8(codes8, 0) + simd_int.vpairs8q0(codes8, 0)
                              + simd_int.vpairs8q1(codes8, 0)):
            simd_int.vistore(out8, 16 * i, c)
        simd_int.vistore(shifted, 0, simd_int.vsra(simd_int.viload(v, 0), 4))

    return dots, quads


@pytest.mark.parametrize("form", list(FORMS))
def test_integer_dots_and_code_quads_give_exact_lanes_in_every_form(monkeypatch, form):
    dots, quads = _compiled(monkeypatch, FORMS[form])
    rng = np.random.default_rng(7)
    acc = rng.integers(-2**20, 2**20, 16).astype(np.int32)
    w8 = rng.integers(0, 256, 64).astype(np.uint8)  # vdot8: unsigned bytes by signed bytes
    x8 = rng.integers(-127, 128, 64).astype(np.int8)
    out8, out16 = np.empty(16, np.int32), np.empty(16, np.int32)
    dots(acc, w8.view(np.int32), x8.view(np.int32), out8, out16)
    want8 = acc + (w8.astype(np.int64) * x8.astype(np.int64)).reshape(16, 4).sum(1)
    assert np.array_equal(out8, want8)
    w16, x16 = w8.view(np.int16).astype(np.int64), x8.view(np.int16).astype(np.int64)  # vdot: signed int16 pairs
    assert np.array_equal(out16, acc + (w16 * x16).reshape(16, 2).sum(1))

    # int4 tiles: 4 columns of a 64-row block, 32 bytes a column, byte j = row j's code low, row j + 32's high
    codes = rng.integers(0, 16, (4, 64)).astype(np.uint8)  # [column, row]
    packed = (codes[:, :32] | (codes[:, 32:] << 4)).astype(np.uint8).reshape(-1)
    v = rng.integers(-2**31, 2**31, 16, dtype=np.int64).astype(np.int32)
    codes8 = rng.integers(0, 256, (4, 64)).astype(np.uint8)  # int8: 4 columns of a 64-row block, as tiles hold them
    tiles8 = quant.int8_tiles(torch.from_numpy(codes8.T.copy())).numpy().reshape(-1)
    out, out8, shifted = np.empty(64, np.int32), np.empty(192, np.int32), np.empty(16, np.int32)
    quads(packed, tiles8, v, out, out8, shifted)
    lanes = out.view(np.uint8).reshape(64, 4)  # lane r: row r's codes at the four columns, rows 32-63 times 16
    assert np.array_equal(lanes[:32], codes.T[:32])
    assert np.array_equal(lanes[32:], codes.T[32:] * 16)
    assert np.array_equal(out8[:64].view(np.uint8).reshape(64, 4), codes8.T)  # lane r: row r's four codes
    pairs = out8[64:].view(np.uint16).reshape(2, 64, 2)  # lane r: (row r's code at 2h, at 2h + 1) as int16
    assert np.array_equal(pairs[0], codes8[:2].T) and np.array_equal(pairs[1], codes8[2:].T)
    assert np.array_equal(shifted, v >> 4)


@pytest.mark.parametrize("dtype, top", [(np.int8, 127), (np.int16, 32767)])
def test_a_rows_integer_steps_are_numpys_rounding_of_it_whatever_the_group_size(dtype, top):
    """`cpu_packed._split` (16 columns at a time by `vsteps`, the rest one by one) against numpy: per group the step
    is the largest |x| over qmax, each x / step rounded to even and kept within qmax, and a group with a NaN or an
    infinity all zeros with a NaN step."""

    split = numba.njit(cache=False)(lambda x, gs, cmax, xq, step, xs: _split(x, gs, cmax, top, xq, step, xs))
    rng = np.random.default_rng(3)
    for gs, cmax in ((64, 240), (40, 15), (18, 255), (8, 255)):
        G = 3
        x = (rng.standard_normal(gs * G) * 1e3).astype(np.float32)
        x[gs] = np.nan  # group 1
        qmax = min(top, 2147483647 // (gs * cmax))
        x[2 * gs: 3 * gs] = np.arange(gs, dtype=np.float32) - gs // 2 + 0.5  # group 2: halves, at a step of 1
        x[2 * gs] = qmax
        xq, step, xs = np.full(gs * G, 7, dtype), np.empty(G, np.float32), np.empty(G, np.float32)
        split(x, gs, cmax, xq, step, xs)
        for g in (0, 2):
            xg = x[g * gs:(g + 1) * gs]
            amax = np.abs(xg).max()
            inv = np.float32(qmax) / amax
            want = np.clip(np.rint(xg * inv), -qmax, qmax).astype(np.int64)
            assert np.array_equal(xq[g * gs:(g + 1) * gs].astype(np.int64), want), (gs, g)
            assert step[g] == amax / np.float32(qmax)
            assert xs[g] == np.float32(want.sum()) * step[g]
        assert not xq[gs:2 * gs].any() and np.isnan(step[1]) and np.isnan(xs[1])


def test_arrays_the_kernels_make_start_at_cache_lines():
    """A 64-byte vector or tile row across two cache lines loads at a fraction of the speed; numba's own arrays start
    at 32 bytes, `simd` makes every array compiled after it loads start at 64 (a fresh function: the cached kernels
    hold whatever alignment they were compiled with)."""

    @numba.njit(cache=False)
    def starts(n):
        out = np.empty(6, np.int64)
        for i in range(3):  # several sizes a kernel's buffers take, in three dtypes, each held while the next is made
            a, b, c = np.empty(n * (i + 1), np.int32), np.empty((n, i + 3), np.float32), np.empty(n + i, np.uint8)
            out[2 * i], out[2 * i + 1] = a.ctypes.data % 64 + b.ctypes.data % 64, c.ctypes.data % 64
        return out

    for n in (5, 64, 1000, 4096, 16384, 100_000):
        assert not starts(n).any(), n


BYTE_FORMS = {"avx512bw": {"avx512bw", "avx2"}, "avx2": {"avx2"}, "plain": set()}


@pytest.mark.parametrize("form", list(BYTE_FORMS))
def test_int4_byte_pairs_give_exact_int32_sums_in_every_form(monkeypatch, form):
    """`simd_bytes` (int4 codes by int8 steps where AVX-512 VNNI is missing): eight lane units of the largest codes
    and steps of either sign added in int16 (`UNITS`: no saturation, no wrap), then widened, give numpy's exact sums
    of every row of the block in order, in AVX-512 BW's, AVX2's and plain LLVM's forms."""
    _as_cpu_with(monkeypatch, simd_bytes, BYTE_FORMS[form])

    @numba.njit(cache=False)
    def sums(qb, xp, units, out):
        lo = hi = simd_int.vizero()
        for p in range(units):
            w0, w1 = simd_bytes.vbpairs4(qb, 64 * p)
            xv = simd_bytes.vbsplat(xp, p)
            lo, hi = simd_bytes.vmaddubs(lo, w0, xv), simd_bytes.vmaddubs(hi, w1, xv)
        for i, v in enumerate(simd_bytes.vwiden16(lo) + simd_bytes.vwiden16(hi)):
            simd_int.vistore(out, 16 * i, v)

    rng = np.random.default_rng(11)
    units = simd_bytes.UNITS
    for top in (False, True):
        codes = rng.integers(0, 16, (2 * units, 64)).astype(np.uint8)  # [column, row] of one 64-row block
        x = rng.integers(-127, 128, 2 * units).astype(np.int8)
        if top:  # the largest |sum| int16 must hold: every code 15, every step -127 (and +127 for the high rows)
            codes[:] = 15
            x[:] = -127
        packed = (codes[:, :32] | (codes[:, 32:] << 4)).astype(np.uint8).reshape(-1)
        xp = np.zeros(units, np.int32)
        xp.view(np.int8)[: 2 * units] = x
        out = np.empty(64, np.int32)
        sums(packed, xp, units, out)
        assert np.array_equal(out, codes.T.astype(np.int64) @ x.astype(np.int64)), (form, top)
