"""The int4 and int8 products of bf16 activations on the CPU (`offload.model.cpu_packed`'s tiles and order of
blocks), and `packed`, the entry every caller uses, which chooses between these and cpu_packed's float32 products.

x is split per group into int16 steps and summed against the codes exactly in int32 (two columns a lane:
`simd_int.vdot`, AVX-512 VNNI's vpdpwssds, 32 multiply-adds an instruction against float32's 16), then the group's
scales apply in float32:

    acc[n] = fma(zero'[n, g], step * sum of xq over g, fma(scale[n, g], step * t[n], acc[n]))

An integer sum has no order, so a row's bits depend on nothing but the row, and the choice between this and float32
products is made by the activations' dtype, never by the batch. Past a few rows float32 products are bound by
multiply-adds, not bytes, so this is what makes prefill and a verify pass cheap. A step is 2^-15 of the group's
largest |x|: bf16's 8 significant bits are kept wherever an entry is within 2^7 of that largest, a smaller entry is
off by at most 2^-16 of it. On the trained SmolLM2-135M in bf16 (12 prompts, against transformers in float32 on the
same dequantized weights) the mean |logit difference| goes 0.21 -> 0.26 (int4) and 0.28 -> 0.30 (int8); the same
split in a float32 run would move the logits 1e-2 where float32 products stay within 1e-4, so float32 (and fp16)
activations keep float32 products. Knows nothing about models, tiers or files.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from offload.model.cpu_packed import (
    _AHEAD,
    _BLOCK,
    _int4,
    _int8,
    _load4,
    _scale,
    _scales,
    _store4,
)
from offload.model.simd import LANES, _bits_f32, parts, prefetch, vfma, vsplat, vzero
from offload.model.simd_int import vcodes4, vcodes8, vdot, viload, visplat, vistore, vitof, vizero

#: Rows of x from which they are split into int16 in parallel.
_SPLIT_PARALLEL = 16
#: Rows of x from which a block's codes are converted once per group into a buffer that every four rows read
#: (`_dot4_16`); fewer: converted as read, four rows at a time (`_direct4`). One [8192, 2048] int4 matrix (g64), 2
#: threads, a Zen 5, buffered / as read: 16 rows 1038 / 1033 us, 64 rows 3259 / 3377 us.
_WIDEN = 16


@njit(nogil=True)
def _split(xr, gs, cmax, xq, step, xs):  # pragma: no cover - compiled
    """Row xr in int16, a step per group of gs columns: xq[k] = round(x[k] / step[g]) with step[g] = the group's
    largest |x| / qmax, and xs[g] = step[g] * the (exact) sum of xq over g. qmax is 32767, or less where a group's
    products with codes up to cmax could pass int32. A group with a NaN or infinity gets step NaN (its outputs NaN,
    as a float product's would be). (The largest |x| as the largest of the bits without the sign, NaN and infinity
    above every number: integer loops, which LLVM vectorises without fast-math.)"""
    qmax = min(32767, 2147483647 // (gs * cmax))
    bits = xr.view(np.uint32)
    for g in range(step.shape[0]):
        k0 = g * gs
        top = np.uint32(0)
        for k in range(k0, k0 + gs):
            top = max(top, bits[k] & np.uint32(0x7FFFFFFF))
        if top >= np.uint32(0x7F800000):
            xq[k0:k0 + gs] = 0
            step[g], xs[g] = np.float32(np.nan), np.float32(np.nan)
            continue
        amax = _bits_f32(top)
        inv = np.float32(qmax) / amax if amax > 0 else np.float32(0.0)
        total, lo, hi = np.int32(0), np.int32(-qmax), np.int32(qmax)
        for k in range(k0, k0 + gs):
            v = min(max(np.int32(np.rint(xr[k] * inv)), lo), hi)
            xq[k] = v
            total += v
        step[g] = amax / np.float32(qmax)
        xs[g] = np.float32(total) * step[g]


@njit(inline="always")
def _scale16(a0, a1, a2, a3, t0, t1, t2, t3, Sg, Zg, step, xs):  # pragma: no cover - compiled
    """`_scale` for a group's exact integer sums t: a = fma(scale, step * t, a) then fma(zero', xs, a)."""
    sv, z = vsplat(step), vzero()
    return _scale(a0, a1, a2, a3, vfma(vitof(t0), sv, z), vfma(vitof(t1), sv, z), vfma(vitof(t2), sv, z),
                  vfma(vitof(t3), sv, z), Sg, Zg, xs)


@njit(inline="always")
def _close16(A, t0, t1, t2, t3, Sg, Zg, step, xs):  # pragma: no cover - compiled
    """A [64] = `_scale16` of A with a group's sums t."""
    a0, a1, a2, a3 = _load4(A)
    a0, a1, a2, a3 = _scale16(a0, a1, a2, a3, t0, t1, t2, t3, Sg, Zg, step, xs)
    _store4(A, a0, a1, a2, a3)


@njit(inline="always")
def _pair_codes(qb, p, wide):  # pragma: no cover - compiled
    """Columns 2p, 2p + 1 of a block's codes qb as four int16-pair vectors of 16 rows (0-15, 16-31, 32-47, 48-63):
    int8 (`wide`) 128 bytes, int4 64."""
    if wide:
        return vcodes8(qb, 128 * p)
    return vcodes4(qb, 64 * p)


@njit(inline="always")
def _pair_prefetch(qb, p, ahead, wide):  # pragma: no cover - compiled
    """Ask for the codes `ahead` bytes past column pair p's (int8: two cache lines a pair, int4: one). (Also asking
    int4's codes 4x as far ahead helped a Zen 5 (one [2048, 8192] matrix from DRAM, 350-370 -> 250-270 us) but costs a
    Zen 4 12% (216 MB of 1.7B-shaped matrices, 2 threads, interleaved: 10.5 -> 9.3 ms without it, 15 of 15 faster;
    16 KB ahead alone: 5%).)"""
    if wide:
        prefetch(qb, 128 * p + ahead)
        prefetch(qb, 128 * p + ahead + 64)
    else:
        prefetch(qb, 64 * p + ahead)


@njit(inline="always")
def _sums1(xp, qb, p0, half, wide):  # pragma: no cover - compiled
    """One row's exact sums (four int32 vectors: rows 0-15 .. 48-63 of the block) over column pairs p0 .. p0 + half
    - 1: its int16 pairs xp against the block's codes qb, converted as they are read."""
    t0 = t1 = t2 = t3 = vizero()
    for p in range(p0, p0 + half):
        _pair_prefetch(qb, p, _AHEAD, wide)
        xv = visplat(xp, p)
        c0, c1, c2, c3 = _pair_codes(qb, p, wide)
        t0 = vdot(t0, c0, xv)
        t1 = vdot(t1, c1, xv)
        t2 = vdot(t2, c2, xv)
        t3 = vdot(t3, c3, xv)
    return t0, t1, t2, t3


@njit(inline="always")
def _direct16(xp, step, xs, qb, S, Z, gs, A, wide):  # pragma: no cover - compiled
    """`_direct` in integers: one row (its int16 pairs xp, steps and sums) against a block's codes qb, converted as
    they are read."""
    a0, a1, a2, a3 = _load4(A)
    half = gs // 2
    for g in range(S.shape[0]):
        t0, t1, t2, t3 = _sums1(xp, qb, g * half, half, wide)
        a0, a1, a2, a3 = _scale16(a0, a1, a2, a3, t0, t1, t2, t3, S[g], Z[g], step[g], xs[g])
    _store4(A, a0, a1, a2, a3)


@njit(inline="always")
def _close4(A, r, n, g, S, Z, step, xs, t0, t1, t2, t3, u0, u1, u2, u3, v0, v1, v2, v3, s0, s1, s2,
            s3):  # pragma: no cover - compiled
    """`_close16` of group g for rows r .. r + n - 1 (n <= 4) with their sums t, u, v, s (each four vectors, passed
    one by one: they stay in registers)."""
    _close16(A[r], t0, t1, t2, t3, S[g], Z[g], step[r, g], xs[r, g])
    if n > 1:
        _close16(A[r + 1], u0, u1, u2, u3, S[g], Z[g], step[r + 1, g], xs[r + 1, g])
    if n > 2:
        _close16(A[r + 2], v0, v1, v2, v3, S[g], Z[g], step[r + 2, g], xs[r + 2, g])
    if n > 3:
        _close16(A[r + 3], s0, s1, s2, s3, S[g], Z[g], step[r + 3, g], xs[r + 3, g])


@njit(inline="always")
def _direct4(XP, step, xs, r, n, g, qb, S, Z, half, A, wide):  # pragma: no cover - compiled
    """`_direct16`'s group g (half: its column pairs) for rows r .. r + n - 1 of XP (n <= 4; a missing row's place
    computes the last row again, unstored): each pair of columns' codes is converted once for four rows, in
    registers, with no buffer to write and read back; the callers take every row for one group before the next,
    so the group's codes come from memory once and from L1 for the other rows. One [8192, 2048] int4 matrix (g64)
    from DRAM, 2 threads, a Zen 5, interleaved processes, against a buffer per group and three rows at a time: 5
    rows 657-911 -> 372-469 us, 9 rows 864-1089 -> 580-703 (one row: 200-300)."""
    last = r + n - 1
    xa, xb, xc, xd = XP[r], XP[min(r + 1, last)], XP[min(r + 2, last)], XP[min(r + 3, last)]
    t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = v0 = v1 = v2 = v3 = s0 = s1 = s2 = s3 = vizero()
    for p in range(g * half, g * half + half):
        _pair_prefetch(qb, p, _AHEAD, wide)
        c0, c1, c2, c3 = _pair_codes(qb, p, wide)
        xv, yv, zv, wv = visplat(xa, p), visplat(xb, p), visplat(xc, p), visplat(xd, p)
        t0, u0, v0, s0 = vdot(t0, c0, xv), vdot(u0, c0, yv), vdot(v0, c0, zv), vdot(s0, c0, wv)
        t1, u1, v1, s1 = vdot(t1, c1, xv), vdot(u1, c1, yv), vdot(v1, c1, zv), vdot(s1, c1, wv)
        t2, u2, v2, s2 = vdot(t2, c2, xv), vdot(u2, c2, yv), vdot(v2, c2, zv), vdot(s2, c2, wv)
        t3, u3, v3, s3 = vdot(t3, c3, xv), vdot(u3, c3, yv), vdot(v3, c3, zv), vdot(s3, c3, wv)
    _close4(A, r, n, g, S, Z, step, xs, t0, t1, t2, t3, u0, u1, u2, u3, v0, v1, v2, v3, s0, s1, s2, s3)


@njit(inline="always")
def _widen16(qb, g, half, W, wide):  # pragma: no cover - compiled
    """W [half * 64] = the block's codes of group g's column pairs as int16 pairs (the values `_direct16` makes),
    the next group's codes asked for meanwhile."""
    ahead = 2 * half * (_BLOCK if wide else _BLOCK // 2)
    for i in range(half):
        p = g * half + i
        _pair_prefetch(qb, p, ahead, wide)
        c0, c1, c2, c3 = _pair_codes(qb, p, wide)
        vistore(W, _BLOCK * i, c0)
        vistore(W, _BLOCK * i + LANES, c1)
        vistore(W, _BLOCK * i + 2 * LANES, c2)
        vistore(W, _BLOCK * i + 3 * LANES, c3)


@njit(inline="always")
def _dot4_16(XP, step, xs, r, n, g, W, S, Z, A):  # pragma: no cover - compiled
    """`_direct4` for group g against the buffered codes W: each load of the codes serves four rows."""
    half = W.shape[0] // _BLOCK
    p0 = g * half
    last = r + n - 1
    xa, xb, xc, xd = XP[r], XP[min(r + 1, last)], XP[min(r + 2, last)], XP[min(r + 3, last)]
    t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = v0 = v1 = v2 = v3 = s0 = s1 = s2 = s3 = vizero()
    for i in range(half):
        j, p = _BLOCK * i, p0 + i
        xv, yv, zv, wv = visplat(xa, p), visplat(xb, p), visplat(xc, p), visplat(xd, p)
        c = viload(W, j)
        t0, u0, v0, s0 = vdot(t0, c, xv), vdot(u0, c, yv), vdot(v0, c, zv), vdot(s0, c, wv)
        c = viload(W, j + LANES)
        t1, u1, v1, s1 = vdot(t1, c, xv), vdot(u1, c, yv), vdot(v1, c, zv), vdot(s1, c, wv)
        c = viload(W, j + 2 * LANES)
        t2, u2, v2, s2 = vdot(t2, c, xv), vdot(u2, c, yv), vdot(v2, c, zv), vdot(s2, c, wv)
        c = viload(W, j + 3 * LANES)
        t3, u3, v3, s3 = vdot(t3, c, xv), vdot(u3, c, yv), vdot(v3, c, zv), vdot(s3, c, wv)
    _close4(A, r, n, g, S, Z, step, xs, t0, t1, t2, t3, u0, u1, u2, u3, v0, v1, v2, v3, s0, s1, s2, s3)


@njit(inline="always")
def _block16(XP, step, xs, q, sz, b, nb, S, Z, A, W, wide):  # pragma: no cover - compiled
    """A [R, 64] = block b's outputs for the rows XP (`_tiles16`), its scales into S, Z and (from `_WIDEN` rows) each
    group's codes into W on the way."""
    R, G = A.shape[0], S.shape[0]
    gs = 2 * XP.shape[1] // G
    _scales(sz, b, nb, S, Z, wide)
    A[:] = 0
    qb = q[b].reshape(q.shape[1] * q.shape[2])
    if R == 1:  # (decode: its own call, the loop's code stays out of it)
        _direct16(XP[0], step[0], xs[0], qb, S, Z, gs, A[0], wide)
    elif R < _WIDEN:
        half = gs // 2
        for g in range(G):
            for r in range(0, R - R % 4 if R % 4 == 1 else R, 4):
                _direct4(XP, step, xs, r, min(4, R - r), g, qb, S, Z, half, A, wide)
            if R % 4 == 1:  # (a lone row: its own four sums, not four rows' work)
                t0, t1, t2, t3 = _sums1(XP[R - 1], qb, g * half, half, wide)
                _close16(A[R - 1], t0, t1, t2, t3, S[g], Z[g], step[R - 1, g], xs[R - 1, g])
    else:
        for g in range(G):
            _widen16(qb, g, gs // 2, W, wide)
            for r in range(0, R, 4):
                _dot4_16(XP, step, xs, r, min(4, R - r), g, W, S, Z, A)


@njit(inline="always")
def _tiles16(x, q, sz, out, wide):  # pragma: no cover - compiled
    """`_tiles` with x in int16 steps (even groups), its rows four at a time: below `_WIDEN` rows against the codes
    as they are read (`_direct4`, one group for every row, then the next), from there against each group's codes
    converted once into a buffer (`_dot4_16`). Integer sums are exact, so every path gives a row the same bits."""
    R, K = x.shape
    nb, G = q.shape[0], sz.shape[0]
    gs = K // G
    sz = sz.reshape(G, sz.shape[1] * sz.shape[2])
    XP = np.empty((R, K // 2), np.int32)  # x's int16, a pair of columns an int32
    step, xs = np.empty((R, G), np.float32), np.empty((R, G), np.float32)
    cmax = 255 if wide else 15
    if R >= _SPLIT_PARALLEL:
        for r in prange(R):
            _split(x[r], gs, cmax, XP[r].view(np.int16), step[r], xs[r])
    else:  # (a parallel region costs more than splitting a few rows)
        for r in range(R):
            _split(x[r], gs, cmax, XP[r].view(np.int16), step[r], xs[r])
    share, shares = parts(nb, 1)
    for t in prange(shares):  # (one share of blocks a thread, its buffers made once)
        S, Z = np.empty((G, _BLOCK), np.float32), np.empty((G, _BLOCK), np.float32)
        A = np.empty((R, _BLOCK), np.float32)
        W = np.empty(gs // 2 * _BLOCK if R >= _WIDEN else 0, np.int32)
        for b in range(t * share, min(nb, t * share + share)):
            _block16(XP, step, xs, q, sz, b, nb, S, Z, A, W, wide)
            for r in range(R):
                out[r, b * _BLOCK:(b + 1) * _BLOCK] = A[r]


@njit(parallel=True, cache=True, nogil=True)
def _int4_16(x, q, sz, out):  # pragma: no cover - compiled
    """`_int4` with x in int16 steps (`_tiles16`)."""
    _tiles16(x, q, sz, out, False)


@njit(parallel=True, cache=True, nogil=True)
def _int8_16(x, q, sz, out):  # pragma: no cover - compiled
    """`_int8` with x in int16 steps (`_tiles16`)."""
    _tiles16(x, q, sz, out, True)


@njit(nogil=True, cache=True)
def packed(x, q, sz, out, ints):  # pragma: no cover - compiled
    """x [R, K] float32 @ int8 or int4 tiles (by their width) -> out [R, rows] float32: x in int16 steps (`ints`, for
    bf16 activations) where the groups are even, else in float32. One numba type for every case:
    compiled callers choose at run time. Cached like the kernels it calls (their files stamp it: `kernels`): a
    process's first packed product 3.0 -> 0.8 s with a warm cache."""
    if ints and (x.shape[1] // sz.shape[0]) % 2 == 0:
        if q.shape[2] == _BLOCK:
            _int8_16(x, q, sz, out)
        else:
            _int4_16(x, q, sz, out)
    elif q.shape[2] == _BLOCK:
        _int8(x, q, sz, out)
    else:
        _int4(x, q, sz, out)
