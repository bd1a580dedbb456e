"""The int8 product on the CPU: x [R, K] @ (codes * scale + min).T, each row's bits independent of the batch.

Codes are uint8 [N, K] row-major with one (scale, min) per group of gs columns of a row (`offload.weights.quant`).
Each weight is made as fma(code, scale, min) (one rounding, the code converted exactly) and multiplied into 16
float32 lanes per output, column k into lane k mod 16, the lanes summed once at the end, then the columns past the
last whole 16 added in order. The order is written out in explicit lanes (`offload.model.simd`), not left to the
compiler, so two ways of computing it give the same bits:

- up to `_DIRECT` rows of x (decode, a short verify): the codes are converted as they are read from memory, each
  byte once a row, eight weight rows at a time against the row of x;
- more rows (prefill, a verify pass): eight weight rows are made once into a float32 buffer, 512 columns at a time
  (it stays in L1), and three rows of x at a time multiply against it (each buffer load serves three rows).

A row's result does not depend on how many rows run beside it, nor on which path or tile computes it.

Measured on a 2-core AVX-512 VM, 1.7B shape (a layer's seven int8 matrices), against the kernel this replaced
(dequantize eight rows into a buffer with LLVM's vectorised loops, then a dot; its per-group overhead made it
compute-bound at ~9 Gweights/s): a decode step 207-219 -> 148 ms, a 64-token prompt 1.8-1.9 -> 1.4-1.5 s; products
over 1 / 2 / 9 / 64 rows (two layers, from L3): 15 / 19.5 / 27 / 131 -> 11 / 14.7 / 28 / 105-110 ms.
Knows nothing about models, tiers or files.
"""


from __future__ import annotations

import numpy as np
from numba import njit, prange

from offload.model.simd import LANES, _bits_f32, fma, prefetch, vfma, vload, vsplat, vstore, vsum

#: Weight rows per register tile.
_TILE = 8
#: Rows of x up to which the codes are converted as they are read (beyond: once, into a buffer). One [8192, 2048]
#: matrix, 2 threads, 3 / 4 rows: 2.0 / 2.27 ms at 2, 1.66 / 2.1 ms at 4 (1, 2 and 9 rows the same).
_DIRECT = 4
#: Output rows per parallel work item.
_ROWS = 16
#: Columns of a pass over many rows at a time: eight float32 weight rows of it stay in L1 (16 KiB).
_KC = 512


@njit(inline="always")
def _bits_to(src, shift, dst):  # pragma: no cover - compiled
    """dst[g] = the float32 of raw bits src[g] widened by `shift` (`kernels._bits`)."""
    for g in range(dst.shape[0]):
        dst[g] = _bits_f32(np.uint32(src[g]) << np.uint32(shift))


@njit(inline="always")
def _get8(A):  # pragma: no cover - compiled
    """The 8 outputs' lanes kept in A [8 * 16] between passes over chunks of columns."""
    return (vload(A, 0), vload(A, LANES), vload(A, 2 * LANES), vload(A, 3 * LANES), vload(A, 4 * LANES),
            vload(A, 5 * LANES), vload(A, 6 * LANES), vload(A, 7 * LANES))


@njit(inline="always")
def _put8(A, t0, t1, t2, t3, t4, t5, t6, t7):  # pragma: no cover - compiled
    for j, t in enumerate((t0, t1, t2, t3, t4, t5, t6, t7)):
        vstore(A, j * LANES, t)


@njit(inline="always")
def _direct(xr, c0, c1, c2, c3, c4, c5, c6, c7, S, Z, gs, A):  # pragma: no cover - compiled
    """One row xr against code rows c0..c7 (gs a multiple of 16), each weight made as it is read: output j's lanes
    A[16 j : 16 j + 16] += xr * fma(code, scale, min) over the row's whole 16s, in order (S, Z [8, G])."""
    t0, t1, t2, t3, t4, t5, t6, t7 = _get8(A)
    for g in range(S.shape[1]):
        s0, s1, s2, s3 = vsplat(S[0, g]), vsplat(S[1, g]), vsplat(S[2, g]), vsplat(S[3, g])
        s4, s5, s6, s7 = vsplat(S[4, g]), vsplat(S[5, g]), vsplat(S[6, g]), vsplat(S[7, g])
        z0, z1, z2, z3 = vsplat(Z[0, g]), vsplat(Z[1, g]), vsplat(Z[2, g]), vsplat(Z[3, g])
        z4, z5, z6, z7 = vsplat(Z[4, g]), vsplat(Z[5, g]), vsplat(Z[6, g]), vsplat(Z[7, g])
        for k in range(g * gs, g * gs + gs, LANES):
            xv = vload(xr, k)
            t0 = vfma(xv, vfma(vload(c0, k), s0, z0), t0)
            t1 = vfma(xv, vfma(vload(c1, k), s1, z1), t1)
            t2 = vfma(xv, vfma(vload(c2, k), s2, z2), t2)
            t3 = vfma(xv, vfma(vload(c3, k), s3, z3), t3)
            t4 = vfma(xv, vfma(vload(c4, k), s4, z4), t4)
            t5 = vfma(xv, vfma(vload(c5, k), s5, z5), t5)
            t6 = vfma(xv, vfma(vload(c6, k), s6, z6), t6)
            t7 = vfma(xv, vfma(vload(c7, k), s7, z7), t7)
    _put8(A, t0, t1, t2, t3, t4, t5, t6, t7)


@njit(inline="always")
def _widen(src, S, Z, j, gs, k0, dst):  # pragma: no cover - compiled
    """dst[i] = fma(code, scale, min) of src[i], column k0 + i of weight row j (the values `_direct` makes)."""
    n, k = dst.shape[0], 0
    while k < n:
        g = (k0 + k) // gs
        end = min(n, (g + 1) * gs - k0)
        s, z = S[j, g], Z[j, g]
        if gs % LANES == 0 and k0 % LANES == 0 and n % LANES == 0:  # whole 16s (the codes at 1 byte a column)
            sv, zv = vsplat(s), vsplat(z)
            for i in range(k, end, LANES):
                vstore(dst, i, vfma(vload(src, i), sv, zv))
        else:
            for i in range(k, end):
                dst[i] = fma(np.float32(src[i]), s, z)
        k = end


@njit(inline="always")
def _dot1(xr, w0, w1, w2, w3, w4, w5, w6, w7, n, A):  # pragma: no cover - compiled
    """Output j's lanes A[16 j : 16 j + 16] += xr * wj over the first n columns (a multiple of 16), in order."""
    t0, t1, t2, t3, t4, t5, t6, t7 = _get8(A)
    for k in range(0, n, LANES):
        xv = vload(xr, k)
        t0, t1 = vfma(xv, vload(w0, k), t0), vfma(xv, vload(w1, k), t1)
        t2, t3 = vfma(xv, vload(w2, k), t2), vfma(xv, vload(w3, k), t3)
        t4, t5 = vfma(xv, vload(w4, k), t4), vfma(xv, vload(w5, k), t5)
        t6, t7 = vfma(xv, vload(w6, k), t6), vfma(xv, vload(w7, k), t7)
    _put8(A, t0, t1, t2, t3, t4, t5, t6, t7)


@njit(inline="always")
def _dot3(xa, xb, xc, w0, w1, w2, w3, w4, w5, w6, w7, n, A, B, C):  # pragma: no cover - compiled
    """`_dot1` for three rows at once (into A, B, C): each load of a weight row serves three, and every output runs
    the operations `_dot1` runs for it, in the same order."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _get8(A)
    b0, b1, b2, b3, b4, b5, b6, b7 = _get8(B)
    c0, c1, c2, c3, c4, c5, c6, c7 = _get8(C)
    for k in range(0, n, LANES):
        xv, yv, zv = vload(xa, k), vload(xb, k), vload(xc, k)
        w = vload(w0, k)
        a0, b0, c0 = vfma(xv, w, a0), vfma(yv, w, b0), vfma(zv, w, c0)
        w = vload(w1, k)
        a1, b1, c1 = vfma(xv, w, a1), vfma(yv, w, b1), vfma(zv, w, c1)
        w = vload(w2, k)
        a2, b2, c2 = vfma(xv, w, a2), vfma(yv, w, b2), vfma(zv, w, c2)
        w = vload(w3, k)
        a3, b3, c3 = vfma(xv, w, a3), vfma(yv, w, b3), vfma(zv, w, c3)
        w = vload(w4, k)
        a4, b4, c4 = vfma(xv, w, a4), vfma(yv, w, b4), vfma(zv, w, c4)
        w = vload(w5, k)
        a5, b5, c5 = vfma(xv, w, a5), vfma(yv, w, b5), vfma(zv, w, c5)
        w = vload(w6, k)
        a6, b6, c6 = vfma(xv, w, a6), vfma(yv, w, b6), vfma(zv, w, c6)
        w = vload(w7, k)
        a7, b7, c7 = vfma(xv, w, a7), vfma(yv, w, b7), vfma(zv, w, c7)
    _put8(A, a0, a1, a2, a3, a4, a5, a6, a7)
    _put8(B, b0, b1, b2, b3, b4, b5, b6, b7)
    _put8(C, c0, c1, c2, c3, c4, c5, c6, c7)


@njit(inline="always")
def _finish(xr, A, tail, out, r, n, last):  # pragma: no cover - compiled
    """out[r, n + j] = A's lanes for j summed, then xr's columns past the last whole 16 times tail[j] (the weights
    there) added in order, for the rows of the tile that exist."""
    K, nt = xr.shape[0], tail.shape[1]
    for j in range(min(_TILE, last - n + 1)):
        y = vsum(vload(A, j * LANES))
        for i in range(nt):
            y = fma(xr[K - nt + i], tail[j, i], y)
        out[r, n + j] = y


@njit(parallel=True, cache=True, nogil=True)
def _int8(x, w, sz, shift, out):  # pragma: no cover - compiled
    """x [R, K] float32 @ codes w uint8 [N, K] with sz [N, K / gs, 2] (scale, min) raw bits widened by `shift`
    -> out [R, N] float32 (see the module doc). Compiled without fastmath: the order is the source's."""
    R, K = x.shape
    N, G = w.shape[0], sz.shape[1]
    gs = K // G
    nv = K // LANES * LANES
    direct = R <= _DIRECT and gs % LANES == 0
    for c in prange((N + _ROWS - 1) // _ROWS):
        last = min(N, c * _ROWS + _ROWS) - 1
        buf = np.empty((_TILE, 0 if direct else min(nv, _KC)), np.float32)
        tail = np.empty((_TILE, K - nv), np.float32)
        S, Z = np.empty((_TILE, G), np.float32), np.empty((_TILE, G), np.float32)
        A = np.empty((R, _TILE * LANES), np.float32)
        for n in range(c * _ROWS, last + 1, _TILE):
            rows = (n, min(n + 1, last), min(n + 2, last), min(n + 3, last), min(n + 4, last), min(n + 5, last),
                    min(n + 6, last), min(n + 7, last))
            for j in range(_TILE):
                _bits_to(sz[rows[j], :, 0], shift, S[j])
                _bits_to(sz[rows[j], :, 1], shift, Z[j])
                _widen(w[rows[j], nv:], S, Z, j, gs, nv, tail[j])
            A[:] = 0
            if direct:
                if n + _TILE <= last:  # the next tile's rows, while this one computes
                    for j in range(n + _TILE, min(n + 2 * _TILE, last + 1)):
                        for k in range(0, K, 64):
                            prefetch(w[j], k)
                for r in range(R):
                    _direct(x[r], w[rows[0]], w[rows[1]], w[rows[2]], w[rows[3]], w[rows[4]], w[rows[5]], w[rows[6]],
                            w[rows[7]], S, Z, gs, A[r])
            else:
                for k0 in range(0, nv, _KC):
                    k1 = min(nv, k0 + _KC)
                    for j in range(_TILE):
                        _widen(w[rows[j], k0:k1], S, Z, j, gs, k0, buf[j, :k1 - k0])
                    m = k1 - k0
                    b0, b1, b2, b3 = buf[0, :m], buf[1, :m], buf[2, :m], buf[3, :m]
                    b4, b5, b6, b7 = buf[4, :m], buf[5, :m], buf[6, :m], buf[7, :m]
                    for r in range(0, R - R % 3, 3):
                        _dot3(x[r, k0:k1], x[r + 1, k0:k1], x[r + 2, k0:k1], b0, b1, b2, b3, b4, b5, b6, b7, m, A[r],
                              A[r + 1], A[r + 2])
                    for r in range(R - R % 3, R):
                        _dot1(x[r, k0:k1], b0, b1, b2, b3, b4, b5, b6, b7, m, A[r])
            for r in range(R):
                _finish(x[r], A[r], tail, out, r, n, last)
