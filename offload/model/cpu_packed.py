"""The int4 and int8 products on the CPU: x [R, K] @ W.T for W in the tile layouts of `offload.weights.quant`, each
row's bits independent of the batch.

Both layouts put output rows in blocks of 64 and, in a block, for each input column k, the codes of the 64 rows
side by side: int4 is torch's CPU int4 packing (32 bytes a column, byte j holding row j in its low nibble and row
j + 32 in its high one; w = (nibble - 8) * scale + zero), int8 one byte a row in units of four columns (256 bytes,
row j's four codes at 4 j: `quant.int8_tiles`; the last K % 4 columns 64 bytes each; w = code * scale + min). One
(scale, zero / min) pair per group of gs columns and row. The codes of a column are the 64 rows' weights, so the
kernel runs across rows: 16 rows a lane vector, four vectors a block, each output in
its own lane, and a block is one stream of bytes read in order. For each group g of columns:

    t[n] = sum over k in g, in order, of x[k] * code[n, k]                    (the code converted exactly)
    acc[n] = fma(zero'[n, g], sum of x over g, fma(scale[n, g], t[n], acc[n]))

with zero' = zero - 8 scale (int4) or min (int8): one multiply-add a weight, the scales once a group. It is written
in explicit lanes (`offload.model.simd`), so the order is the source's:

- up to `_DIRECT` rows of x (decode): the codes are converted as they are read, each byte once a row;
- more rows (prefill, a verify pass): a block's codes for one group of columns are converted once into a float32
  buffer (64 x gs, in L1), and three rows of x at a time multiply against it.

A code is the same float either way and every output runs the same operations in the same order, so a row's bits
do not depend on the rows beside it. int8 in this layout replaced row-major codes made into weights as they were
read (fma(code, scale, min), then the product: two multiply-adds a weight, eight rows' streams at once): one
[2048, 8192] matrix from L3, one row, one thread, 8.0 -> 20.9 Gweights/s (int4: 22.8); from L2 ([256, 2048])
13.0 -> 21.1.

bf16 activations are multiplied in int16 instead (`offload.model.cpu_packed16`, whose `packed` chooses). Knows
nothing about models, tiers or files.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from offload.model.simd import (
    LANES,
    _bits_f32,
    parts,
    prefetch,
    vfma,
    vload,
    vnibbles,
    vpairs,
    vpairs32,
    vsplat,
    vstore,
    vsum,
    vzero,
)
from offload.model.simd_int import viadd, vistore, vizero, vsteps
from offload.model.simd_math import vbyte4

#: Output rows of a tile (both layouts) and of a parallel work item.
_BLOCK = 64
#: Bytes ahead at which the direct path asks for a block's codes (software prefetch; past the block's end it asks
#: for the next block's). 1.7B shape, a layer's seven int4 matrices twice, decode: none 5.8 ms, 1 KiB 4.5, 2 KiB 4.3
#: (Intel); 3 layers' int4 matrices on a Zen 5, decode: 2 KiB 3.6-5.3 ms, 4 KiB 3.4-3.8 (with int4's second, far
#: prefetch, `cpu_packed16._pair_prefetch`: 3.1-3.5).
_AHEAD = 4096
#: Rows of x up to which the codes are converted as they are read (beyond: once per group, into a buffer). One
#: [8192, 2048] int4 matrix, 2 threads, 3 / 4 rows: 0.91 / 1.17 ms at 2, 1.05 / 1.38 ms at 4; 2 rows: 0.72 ms at 2,
#: 0.88 at 1.
_DIRECT = 2


@njit(inline="always")
def _scales(sz, b, nb, S, Z, wide):  # pragma: no cover - compiled
    """S[g, j], Z[g, j] = scale and zero' of row b * 64 + j in group g, from the raw bits sz [G, rows * units] of
    (scale, zero) pairs in uint16 units: bf16 one unit a value, float32 two (`kernels.scale_bits`; the row length
    says which); zero' = zero - 8 scale for int4, the min itself for int8 (`wide`). Also asks for the next of the nb
    blocks' scales (G runs of 256 or 512 bytes, far apart) while this block computes."""
    eight = vsplat(np.float32(-8.0))
    units = sz.shape[1] // (nb * _BLOCK)  # uint16 units a pair: 2 (bf16) or 4 (float32)
    for g in range(S.shape[0]):
        row, Sg, Zg = sz[g], S[g], Z[g]
        for v in range(_BLOCK // LANES):
            i = units * (b * _BLOCK + v * LANES)
            s, z = vpairs32(row, i) if units == 4 else vpairs(row, i)
            vstore(Sg, v * LANES, s)
            vstore(Zg, v * LANES, z if wide else vfma(eight, s, z))
        if b + 1 < nb:
            for e in range(0, units * _BLOCK, 32):
                prefetch(row, units * (b + 1) * _BLOCK + e)


@njit(nogil=True)
def _sums(xr, gs, X):  # pragma: no cover - compiled
    """X[g] = the sum of xr over group g: 16 lanes, then the lanes, then the columns past the last whole 16."""
    nv = gs // LANES * LANES
    one = vsplat(np.float32(1.0))
    for g in range(X.shape[0]):
        k0 = g * gs
        t = vzero()
        for k in range(k0, k0 + nv, LANES):
            t = vfma(vload(xr, k), one, t)
        u = np.float32(0.0)
        for k in range(k0 + nv, k0 + gs):
            u = u + xr[k]
        X[g] = vsum(t) + u


@njit(inline="always")
def _put(out, r, b, A):  # pragma: no cover - compiled
    """out[r, 64 b : 64 b + 64] = A[r] (a block's outputs of row r), 16 lanes at a time. (As a slice assignment each
    row made two views and copied value by value: a layer of SmolLM2-135M's 81 blocks, 9 rows, 43 -> 7 us.)"""
    o, a = out[r], A[r]
    for v in range(0, _BLOCK, LANES):
        vstore(o, b * _BLOCK + v, vload(a, v))


@njit(inline="always")
def _load4(A):  # pragma: no cover - compiled
    """A block's 64 outputs A [64] as four lane vectors."""
    return vload(A, 0), vload(A, LANES), vload(A, 2 * LANES), vload(A, 3 * LANES)


@njit(inline="always")
def _store4(A, a0, a1, a2, a3):  # pragma: no cover - compiled
    vstore(A, 0, a0)
    vstore(A, LANES, a1)
    vstore(A, 2 * LANES, a2)
    vstore(A, 3 * LANES, a3)


@njit(inline="always")
def _scale(a0, a1, a2, a3, t0, t1, t2, t3, Sg, Zg, xs):  # pragma: no cover - compiled
    """A group's end for the 64 outputs: a = fma(scale, t, a) then fma(zero', sum of x over the group, a)."""
    s0, s1, s2, s3 = _load4(Sg)
    z0, z1, z2, z3 = _load4(Zg)
    return _scale_by(a0, a1, a2, a3, t0, t1, t2, t3, s0, s1, s2, s3, z0, z1, z2, z3, xs)


@njit(inline="always")
def _scale_by(a0, a1, a2, a3, t0, t1, t2, t3, s0, s1, s2, s3, z0, z1, z2, z3, xs):  # pragma: no cover - compiled
    """`_scale` with the group's scales s and zeros' z as vectors (loaded once for many rows: `cpu_packed_close`)."""
    xv = vsplat(xs)
    return (vfma(z0, xv, vfma(s0, t0, a0)), vfma(z1, xv, vfma(s1, t1, a1)), vfma(z2, xv, vfma(s2, t2, a2)),
            vfma(z3, xv, vfma(s3, t3, a3)))


@njit(inline="always")
def _close(A, t0, t1, t2, t3, Sg, Zg, xs):  # pragma: no cover - compiled
    """A [64] = `_scale` of A with a group's sums t."""
    a0, a1, a2, a3 = _load4(A)
    a0, a1, a2, a3 = _scale(a0, a1, a2, a3, t0, t1, t2, t3, Sg, Zg, xs)
    _store4(A, a0, a1, a2, a3)


@njit(inline="always")
def _quads_end(qb):  # pragma: no cover - compiled
    """The columns of an int8 block qb (flat, 64 bytes a column) held in units of four (`quant.int8_tiles`): K less
    K % 4; the ones past it lie 64 bytes each."""
    k = qb.shape[0] // _BLOCK
    return k - k % 4


@njit(inline="always")
def _column(qb, k, wide):  # pragma: no cover - compiled
    """Column k of a block's codes qb as four vectors of 16 rows (0-15, 16-31, 32-47, 48-63), converted exactly:
    int8 (`wide`) one byte of each row's quad (the last K % 4 columns: 64 bytes); int4 32 bytes, rows 0-31 in the
    low nibbles and 32-63 in the high ones."""
    if wide:
        if k < _quads_end(qb):  # in a unit of four columns
            at, c = 256 * (k >> 2), k & 3
            return vbyte4(qb, at, c), vbyte4(qb, at + 64, c), vbyte4(qb, at + 128, c), vbyte4(qb, at + 192, c)
        return vload(qb, 64 * k), vload(qb, 64 * k + LANES), vload(qb, 64 * k + 2 * LANES), vload(qb, 64 * k + 48)
    lo0, hi0 = vnibbles(qb, 32 * k)
    lo1, hi1 = vnibbles(qb, 32 * k + LANES)
    return lo0, lo1, hi0, hi1


@njit(inline="always")
def _direct(xr, Xr, qb, S, Z, gs, A, wide):  # pragma: no cover - compiled
    """One row xr (its group sums Xr) against a block's codes qb, converted as they are read: each of the 64
    outputs (lanes of 16 rows) sums x * code along its group's columns in order, then the group's scale and zero
    are applied (`_scale`)."""
    a0, a1, a2, a3 = _load4(A)
    for g in range(S.shape[0]):
        t0 = t1 = t2 = t3 = vzero()
        for k in range(g * gs, g * gs + gs):
            if wide:  # a cache line is one int8 column, two int4 ones
                prefetch(qb, 64 * k + _AHEAD)
            elif k % 2 == 0:
                prefetch(qb, 32 * k + _AHEAD)
            xv = vsplat(xr[k])
            c0, c1, c2, c3 = _column(qb, k, wide)
            t0 = vfma(xv, c0, t0)
            t1 = vfma(xv, c1, t1)
            t2 = vfma(xv, c2, t2)
            t3 = vfma(xv, c3, t3)
        a0, a1, a2, a3 = _scale(a0, a1, a2, a3, t0, t1, t2, t3, S[g], Z[g], Xr[g])
    _store4(A, a0, a1, a2, a3)


@njit(inline="always")
def _widen(qb, g, gs, W, wide):  # pragma: no cover - compiled
    """W [gs * 64] = the block's codes of group g's columns as float32 (the values `_direct` converts). (Flat arrays
    and offsets in the loops: a view made in a loop costs two atomic reference counts an iteration.)"""
    ahead = gs * (_BLOCK if wide else _BLOCK // 2)  # the next group's codes, while this group's rows compute
    for i in range(gs):
        k = g * gs + i
        if wide:  # a cache line is one int8 column, two int4 ones
            prefetch(qb, 64 * k + ahead)
        elif k % 2 == 0:
            prefetch(qb, 32 * k + ahead)
        c0, c1, c2, c3 = _column(qb, k, wide)
        vstore(W, _BLOCK * i, c0)
        vstore(W, _BLOCK * i + LANES, c1)
        vstore(W, _BLOCK * i + 2 * LANES, c2)
        vstore(W, _BLOCK * i + 3 * LANES, c3)


@njit(inline="always")
def _dot1(xr, Xr, g, W, S, Z, A):  # pragma: no cover - compiled
    """`_direct`'s group g for one row of x against the buffered codes W."""
    gs = W.shape[0] // _BLOCK
    k0 = g * gs
    t0 = t1 = t2 = t3 = vzero()
    for i in range(gs):
        j, xv = _BLOCK * i, vsplat(xr[k0 + i])
        t0 = vfma(xv, vload(W, j), t0)
        t1 = vfma(xv, vload(W, j + LANES), t1)
        t2 = vfma(xv, vload(W, j + 2 * LANES), t2)
        t3 = vfma(xv, vload(W, j + 3 * LANES), t3)
    _close(A, t0, t1, t2, t3, S[g], Z[g], Xr[g])


@njit(inline="always")
def _dot3(xa, xb, xc, Xa, Xb, Xc, g, W, S, Z, A, B, C):  # pragma: no cover - compiled
    """`_dot1` for three rows at once: each weight load serves three, every output the same operations in order."""
    gs = W.shape[0] // _BLOCK
    k0 = g * gs
    t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = v0 = v1 = v2 = v3 = vzero()
    for i in range(gs):
        j = _BLOCK * i
        xv, yv, zv = vsplat(xa[k0 + i]), vsplat(xb[k0 + i]), vsplat(xc[k0 + i])
        c = vload(W, j)
        t0, u0, v0 = vfma(xv, c, t0), vfma(yv, c, u0), vfma(zv, c, v0)
        c = vload(W, j + LANES)
        t1, u1, v1 = vfma(xv, c, t1), vfma(yv, c, u1), vfma(zv, c, v1)
        c = vload(W, j + 2 * LANES)
        t2, u2, v2 = vfma(xv, c, t2), vfma(yv, c, u2), vfma(zv, c, v2)
        c = vload(W, j + 3 * LANES)
        t3, u3, v3 = vfma(xv, c, t3), vfma(yv, c, u3), vfma(zv, c, v3)
    _close(A, t0, t1, t2, t3, S[g], Z[g], Xa[g])
    _close(B, u0, u1, u2, u3, S[g], Z[g], Xb[g])
    _close(C, v0, v1, v2, v3, S[g], Z[g], Xc[g])


@njit(inline="always")
def _tiles(x, q, sz, out, wide):  # pragma: no cover - compiled
    """The product over tiles q uint8 [rows / 64, K, 64 (int8, `wide`) or 32 (int4)] with sz [K / gs, rows, 2 or 4]
    the raw bits of bf16 or float32 (scale, zero) pairs in uint16 units (`_scales`) -> out [R, rows] float32 (see
    the module doc)."""
    R, K = x.shape
    nb, G = q.shape[0], sz.shape[0]
    gs = K // G
    sz = sz.reshape(G, sz.shape[1] * sz.shape[2])
    X = np.empty((R, G), np.float32)
    for r in range(R):
        _sums(x[r], gs, X[r])
    share, shares = parts(nb, 1)
    for t in prange(shares):  # (one share of blocks a thread, its buffers made once)
        S, Z = np.empty((G, _BLOCK), np.float32), np.empty((G, _BLOCK), np.float32)
        A = np.empty((R, _BLOCK), np.float32)
        W = np.empty(gs * _BLOCK if R > _DIRECT else 0, np.float32)
        for b in range(t * share, min(nb, t * share + share)):
            _scales(sz, b, nb, S, Z, wide)
            A[:] = 0
            qb = q[b].reshape(q.shape[1] * q.shape[2])
            if R <= _DIRECT:
                for r in range(R):
                    _direct(x[r], X[r], qb, S, Z, gs, A[r], wide)
            else:
                for g in range(G):
                    _widen(qb, g, gs, W, wide)
                    for r in range(0, R - R % 3, 3):
                        _dot3(x[r], x[r + 1], x[r + 2], X[r], X[r + 1], X[r + 2], g, W, S, Z, A[r], A[r + 1],
                              A[r + 2])
                    for r in range(R - R % 3, R):
                        _dot1(x[r], X[r], g, W, S, Z, A[r])
            for r in range(R):
                _put(out, r, b, A)


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
def _split(xr, gs, cmax, top, xq, step, xs):  # pragma: no cover - compiled
    """Row xr in int16 (or int8: top), a step per group of gs columns: xq[k] = round(x[k] / step[g]) with step[g] =
    the group's largest |x| / qmax, and xs[g] = step[g] * the (exact) sum of xq over g. qmax is top (32767 or 127),
    or less where a group's products with codes up to cmax could pass int32. A group with a NaN or infinity gets
    step NaN (its outputs NaN, as a float product's would be). (The largest |x| as the largest of the bits without
    the sign, NaN and infinity above every number: an integer loop, which LLVM vectorises without fast-math, over an
    unsigned index into the row: a signed one makes numba wrap negative ones, which kept LLVM from vectorising. The
    integers 16 columns at a time by `simd_int.vsteps`, the columns past the last 16 one by one. No slice a group:
    each is a reference count taken and given back, ~0.4 us a row of 576. 9 rows of 576 / 1536 columns 9.6 / 31.9 ->
    3.2 / 7.7 -> 2.3 / 4.5 us, the same bits.)"""
    qmax = min(top, 2147483647 // (gs * cmax))
    bits = xr.view(np.uint32)
    n = np.uint64(gs)
    whole = gs - gs % LANES
    sums = np.empty(LANES, np.int32)
    for g in range(step.shape[0]):
        k0 = np.uint64(g * gs)
        top = np.uint32(0)
        for k in range(n):
            top = max(top, bits[k0 + k] & np.uint32(0x7FFFFFFF))
        if top >= np.uint32(0x7F800000):
            for k in range(n):
                xq[k0 + k] = 0
            step[g], xs[g] = np.float32(np.nan), np.float32(np.nan)
            continue
        amax = _bits_f32(top)
        inv = np.float32(qmax) / amax if amax > 0 else np.float32(0.0)
        acc = vizero()
        for k in range(0, whole, LANES):  # 16 columns at a time (`vsteps`), the rest one by one: the same integers
            acc = viadd(acc, vsteps(vload(xr, k0 + k), inv, qmax, xq, k0 + k))
        vistore(sums, 0, acc)
        total, lo, hi = np.int32(sums.sum()), np.int32(-qmax), np.int32(qmax)
        for k in range(np.uint64(whole), n):
            v = min(max(np.int32(np.rint(xr[k0 + k] * inv)), lo), hi)
            xq[k0 + k] = v
            total += v
        step[g] = amax / np.float32(qmax)
        xs[g] = np.float32(total) * step[g]
