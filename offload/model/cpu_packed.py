"""The int4 and int8 products on the CPU: x [R, K] @ W.T for W in the tile layouts of `offload.weights.quant`, each
row's bits independent of the batch.

Both layouts put output rows in blocks of 64 and, in a block, for each input column k, the codes of the 64 rows
side by side: int4 is torch's CPU int4 packing (32 bytes a column, byte j holding row j in its low nibble and row
j + 32 in its high one; w = (nibble - 8) * scale + zero), int8 one byte a row (64 bytes a column, byte j row j;
w = code * scale + min). One (scale, zero / min) pair per group of gs columns and row. The kernel runs across the
rows: 16 rows a lane vector, four vectors a block, each output in its own lane, a block one stream of bytes.

x is multiplied in 16-bit integers: each row is split, group by group, into int16 steps of step = the group's
largest |x| / 32767 (`_split`; relative error at most 2^-16 of the group's largest |x|, ~1e-5 of a product), and
for each group g of columns

    t[n] = sum over k in g of xq[k] * code[n, k]                                 (int32, exact)
    acc[n] = fma(zero'[n, g], step * sum of xq over g, fma(scale[n, g], step * t[n], acc[n]))

with zero' = zero - 8 scale (int4) or min (int8): one integer multiply-add a weight (two columns a lane: AVX-512
VNNI's vpdpwssd, 32 multiply-adds an instruction against float32's 16), the scales once a group. An integer sum
is the same in any order, so a row's bits depend on nothing but the row: not on the rows beside it, nor on which
path below it took, nor on the machine's vector width.

- up to `_DIRECT` rows of x (decode): the codes are paired as they are read, each byte once a row;
- more rows (prefill, a verify pass): a block's codes for one group of columns are paired once into an int32
  buffer (64 x gs / 2, in L1), and three rows of x at a time multiply against it.

Measured (2-core AVX-512 VNNI VM, 2 threads, against the float32 kernel this replaced, which converted each code
to float32 and did one float32 multiply-add a weight): see the closing notes of issue 22. Knows nothing about
models, tiers or files.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from offload.model.simd import (
    LANES,
    prefetch,
    vcodes4,
    vcodes8,
    vdot,
    vfma,
    viload,
    visplat,
    vistore,
    vitof,
    vizero,
    vload,
    vpairs,
    vsplat,
    vstore,
    vzero,
)

#: Output rows of a tile (both layouts) and of a parallel work item.
_BLOCK = 64
#: Bytes ahead at which the direct path asks for a block's codes (software prefetch; past the block's end it asks
#: for the next block's). 1.7B shape, a layer's seven int4 matrices twice, decode: none 5.8 ms, 1 KiB 4.5, 2 KiB 4.3.
_AHEAD = 2048
#: Rows of x up to which the codes are converted as they are read (beyond: once per group, into a buffer). One
#: [8192, 2048] int4 matrix, 2 threads, 3 / 4 rows: 0.91 / 1.17 ms at 2, 1.05 / 1.38 ms at 4; 2 rows: 0.72 ms at 2,
#: 0.88 at 1.
_DIRECT = 2
#: Rows of x from which they are split into int16 in parallel.
_SPLIT_PARALLEL = 16


@njit(inline="always")
def _scales(sz, b, S, Z, wide):  # pragma: no cover - compiled
    """S[g, j], Z[g, j] = scale and zero' of row b * 64 + j in group g, from the raw bits sz [G, rows * 2] ((scale,
    zero) pairs, bf16 or float32): zero' = zero - 8 scale for int4, the min itself for int8 (`wide`)."""
    eight = vsplat(np.float32(-8.0))
    for g in range(S.shape[0]):
        row, Sg, Zg = sz[g], S[g], Z[g]
        for v in range(_BLOCK // LANES):
            s, z = vpairs(row, 2 * (b * _BLOCK + v * LANES))
            vstore(Sg, v * LANES, s)
            vstore(Zg, v * LANES, z if wide else vfma(eight, s, z))


@njit(nogil=True)
def _split(xr, gs, cmax, xq, step, xs):  # pragma: no cover - compiled
    """Row xr in int16, a step per group of gs columns: xq[k] = round(x[k] / step[g]) with step[g] = the group's
    largest |x| / qmax, and xs[g] = step[g] * the (exact) sum of xq over g. qmax is 32767, or less where a group's
    products with codes up to cmax could pass int32. A group with a NaN or infinity gets step NaN (its outputs NaN,
    as a float product's would be)."""
    qmax = min(32767, 2147483647 // (gs * cmax))
    for g in range(step.shape[0]):
        k0 = g * gs
        amax = np.float32(0.0)
        for k in range(k0, k0 + gs):
            a = abs(xr[k])
            amax = a if a > amax or a != a else amax
        if not np.isfinite(amax):
            for k in range(k0, k0 + gs):
                xq[k] = 0
            step[g], xs[g] = np.float32(np.nan), np.float32(np.nan)
            continue
        inv = np.float32(qmax) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for k in range(k0, k0 + gs):
            v = np.int32(np.rint(xr[k] * inv))
            v = min(max(v, -qmax), qmax)
            xq[k] = v
            total += v
        step[g] = amax / np.float32(qmax)
        xs[g] = np.float32(total) * step[g]


@njit(inline="always")
def _scale(a0, a1, a2, a3, t0, t1, t2, t3, Sg, Zg, step, xs):  # pragma: no cover - compiled
    """A group's end for the 64 outputs: a = fma(scale, step * t, a) then fma(zero', step * sum of x's int16 over
    the group, a), t the group's exact integer sums."""
    sv, xv, z = vsplat(step), vsplat(xs), vzero()
    a0 = vfma(vload(Zg, 0), xv, vfma(vload(Sg, 0), vfma(vitof(t0), sv, z), a0))
    a1 = vfma(vload(Zg, LANES), xv, vfma(vload(Sg, LANES), vfma(vitof(t1), sv, z), a1))
    a2 = vfma(vload(Zg, 2 * LANES), xv, vfma(vload(Sg, 2 * LANES), vfma(vitof(t2), sv, z), a2))
    a3 = vfma(vload(Zg, 3 * LANES), xv, vfma(vload(Sg, 3 * LANES), vfma(vitof(t3), sv, z), a3))
    return a0, a1, a2, a3


@njit(inline="always")
def _close(A, t0, t1, t2, t3, Sg, Zg, step, xs):  # pragma: no cover - compiled
    """A [64] = `_scale` of A with a group's sums t."""
    a0, a1, a2, a3 = _scale(vload(A, 0), vload(A, LANES), vload(A, 2 * LANES), vload(A, 3 * LANES), t0, t1, t2, t3,
                            Sg, Zg, step, xs)
    vstore(A, 0, a0)
    vstore(A, LANES, a1)
    vstore(A, 2 * LANES, a2)
    vstore(A, 3 * LANES, a3)


@njit(inline="always")
def _codes(qb, p, wide):  # pragma: no cover - compiled
    """Columns 2p, 2p + 1 of a block's codes qb as four int16-pair vectors of 16 rows (0-15, 16-31, 32-47, 48-63):
    int8 (`wide`) 128 bytes, int4 64."""
    if wide:
        return vcodes8(qb, 128 * p)
    return vcodes4(qb, 64 * p)


@njit(inline="always")
def _direct(xp, step, xs, qb, S, Z, gs, A, wide):  # pragma: no cover - compiled
    """One row (its int16 pairs xp, steps and sums) against a block's codes qb, converted as they are read: each
    of the 64 outputs sums x * code over its group's columns exactly, then the group's scales apply (`_scale`)."""
    a0, a1, a2, a3 = vload(A, 0), vload(A, LANES), vload(A, 2 * LANES), vload(A, 3 * LANES)
    half = gs // 2
    for g in range(S.shape[0]):
        t0 = t1 = t2 = t3 = vizero()
        for p in range(g * half, g * half + half):
            if wide:  # a pair of int8 columns is two cache lines, of int4 one
                prefetch(qb, 128 * p + _AHEAD)
                prefetch(qb, 128 * p + _AHEAD + 64)
            else:
                prefetch(qb, 64 * p + _AHEAD)
            xv = visplat(xp, p)
            c0, c1, c2, c3 = _codes(qb, p, wide)
            t0 = vdot(t0, c0, xv)
            t1 = vdot(t1, c1, xv)
            t2 = vdot(t2, c2, xv)
            t3 = vdot(t3, c3, xv)
        a0, a1, a2, a3 = _scale(a0, a1, a2, a3, t0, t1, t2, t3, S[g], Z[g], step[g], xs[g])
    vstore(A, 0, a0)
    vstore(A, LANES, a1)
    vstore(A, 2 * LANES, a2)
    vstore(A, 3 * LANES, a3)


@njit(inline="always")
def _widen(qb, g, half, W, wide):  # pragma: no cover - compiled
    """W [half * 64] = the block's codes of group g's column pairs as int16 pairs (the values `_direct` makes).
    (Flat arrays and offsets in the loops: a view made in a loop costs two atomic reference counts an iteration.)"""
    ahead = 2 * half * (_BLOCK if wide else _BLOCK // 2)  # the next group's codes, while this one's rows compute
    for i in range(half):
        p = g * half + i
        if wide:
            prefetch(qb, 128 * p + ahead)
            prefetch(qb, 128 * p + ahead + 64)
        else:
            prefetch(qb, 64 * p + ahead)
        c0, c1, c2, c3 = _codes(qb, p, wide)
        vistore(W, _BLOCK * i, c0)
        vistore(W, _BLOCK * i + LANES, c1)
        vistore(W, _BLOCK * i + 2 * LANES, c2)
        vistore(W, _BLOCK * i + 3 * LANES, c3)


@njit(inline="always")
def _dot1(xp, step, xs, g, W, S, Z, A):  # pragma: no cover - compiled
    """`_direct`'s group g for one row against the buffered codes W."""
    half = W.shape[0] // _BLOCK
    p0 = g * half
    t0 = t1 = t2 = t3 = vizero()
    for i in range(half):
        j, xv = _BLOCK * i, visplat(xp, p0 + i)
        t0 = vdot(t0, viload(W, j), xv)
        t1 = vdot(t1, viload(W, j + LANES), xv)
        t2 = vdot(t2, viload(W, j + 2 * LANES), xv)
        t3 = vdot(t3, viload(W, j + 3 * LANES), xv)
    _close(A, t0, t1, t2, t3, S[g], Z[g], step[g], xs[g])


@njit(inline="always")
def _dot3(xa, xb, xc, sa, sb, sc, ya, yb, yc, g, W, S, Z, A, B, C):  # pragma: no cover - compiled
    """`_dot1` for three rows at once: each load of the codes serves three."""
    half = W.shape[0] // _BLOCK
    p0 = g * half
    t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = v0 = v1 = v2 = v3 = vizero()
    for i in range(half):
        j = _BLOCK * i
        xv, yv, zv = visplat(xa, p0 + i), visplat(xb, p0 + i), visplat(xc, p0 + i)
        c = viload(W, j)
        t0, u0, v0 = vdot(t0, c, xv), vdot(u0, c, yv), vdot(v0, c, zv)
        c = viload(W, j + LANES)
        t1, u1, v1 = vdot(t1, c, xv), vdot(u1, c, yv), vdot(v1, c, zv)
        c = viload(W, j + 2 * LANES)
        t2, u2, v2 = vdot(t2, c, xv), vdot(u2, c, yv), vdot(v2, c, zv)
        c = viload(W, j + 3 * LANES)
        t3, u3, v3 = vdot(t3, c, xv), vdot(u3, c, yv), vdot(v3, c, zv)
    _close(A, t0, t1, t2, t3, S[g], Z[g], sa[g], ya[g])
    _close(B, u0, u1, u2, u3, S[g], Z[g], sb[g], yb[g])
    _close(C, v0, v1, v2, v3, S[g], Z[g], sc[g], yc[g])


@njit(inline="always")
def _tiles(x, q, sz, out, wide):  # pragma: no cover - compiled
    """The product over tiles q uint8 [rows / 64, K, 64 (int8, `wide`) or 32 (int4)] with sz [K / gs, rows, 2]
    raw bits, bf16 (uint16) or float32 (uint32) -> out [R, rows] float32 (see the module doc)."""
    R, K = x.shape
    nb, G = q.shape[0], sz.shape[0]
    gs = K // G
    sz = sz.reshape(G, sz.shape[1] * 2)
    XP = np.empty((R, K // 2), np.int32)  # x's int16, a pair of columns an int32
    step, xs = np.empty((R, G), np.float32), np.empty((R, G), np.float32)
    cmax = 255 if wide else 15
    if R >= _SPLIT_PARALLEL:
        for r in prange(R):
            _split(x[r], gs, cmax, XP[r].view(np.int16), step[r], xs[r])
    else:  # (a parallel region costs more than splitting a few rows)
        for r in range(R):
            _split(x[r], gs, cmax, XP[r].view(np.int16), step[r], xs[r])
    for b in prange(nb):
        S, Z = np.empty((G, _BLOCK), np.float32), np.empty((G, _BLOCK), np.float32)
        _scales(sz, b, S, Z, wide)
        if b + 1 < nb:  # the next block's scales (G runs of 256 bytes, far apart) while this block computes
            for g in range(G):
                for e in range(0, 2 * _BLOCK, 64 // sz.itemsize):
                    prefetch(sz[g], 2 * (b + 1) * _BLOCK + e)
        A = np.zeros((R, _BLOCK), np.float32)
        qb = q[b].reshape(q.shape[1] * q.shape[2])
        if R <= _DIRECT:
            for r in range(R):
                _direct(XP[r], step[r], xs[r], qb, S, Z, gs, A[r], wide)
        else:
            W = np.empty(gs // 2 * _BLOCK, np.int32)
            for g in range(G):
                _widen(qb, g, gs // 2, W, wide)
                for r in range(0, R - R % 3, 3):
                    _dot3(XP[r], XP[r + 1], XP[r + 2], step[r], step[r + 1], step[r + 2], xs[r], xs[r + 1],
                          xs[r + 2], g, W, S, Z, A[r], A[r + 1], A[r + 2])
                for r in range(R - R % 3, R):
                    _dot1(XP[r], step[r], xs[r], g, W, S, Z, A[r])
        for r in range(R):
            out[r, b * _BLOCK:(b + 1) * _BLOCK] = A[r]


@njit(parallel=True, cache=True, nogil=True)
def _int4(x, q, sz, out):  # pragma: no cover - compiled
    """x [R, K] float32 @ int4 tiles q uint8 [rows / 64, K, 32] (torch's packing) -> out [R, rows] float32.
    Compiled without fastmath: the order is the source's."""
    _tiles(x, q, sz, out, False)


@njit(parallel=True, cache=True, nogil=True)
def _int8(x, q, sz, out):  # pragma: no cover - compiled
    """x [R, K] float32 @ int8 tiles q uint8 [rows / 64, K, 64] -> out [R, rows] float32. Compiled without fastmath:
    the order is the source's."""
    _tiles(x, q, sz, out, True)


@njit(nogil=True)
def packed(x, q, sz, out):  # pragma: no cover - compiled
    """`_int8` or `_int4` by the tiles' width (one numba type for both: compiled callers choose at run time)."""
    if q.shape[2] == _BLOCK:
        _int8(x, q, sz, out)
    else:
        _int4(x, q, sz, out)
