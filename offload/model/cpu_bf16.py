"""Dense products of bf16 activations and bf16 weights, multiplied as bf16 pairs (`kernels.DENSE_BF16`).

A product of two bf16 numbers is exact in float32, so x @ w.T needs no widened copy of either: each 32 columns of a
weight row are one load of 16 (column 2j, 2j + 1) pairs, and `simd_int.vdpbf` adds both products of lane j to the
row's float32 accumulator, the pair's second column first (AVX-512 BF16's vdpbf16ps: 32 multiply-adds an instruction
and no conversions; two fused multiply-adds where the CPU lacks it, the same bits). A row's sum is the 16 lanes'
(`simd.vsum`'s fixed tree, eight rows' side by side), then the columns past the last whole 32 in the same pair
order, so every output is one fixed sequence of roundings whatever the batch, the row's neighbours or the thread
that computes it. `_rows1` takes one weight row at a time (a one-row product: bound by memory); products of more
rows take several weight rows side by side, as many as the CPU's registers hold (`rows_bf16`); all round alike.
Where the process may use AMX tiles every bf16 product runs on them instead (`cpu_bf16_tiles`, another order).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from offload.model.simd import _bits_f32, fma, prefetch, prefetch_l2, vfma, vload, vstore, vsum, vsum8, vzero
from offload.model.simd_bf16 import vbffirst, vbfsecond
from offload.model.simd_int import bfat, f32put, vbfpairs, vdpbf

#: Bytes ahead of its loads that a one-row product asks for (`_rows1`; past the matrix's end: a hint, no fault).
AHEAD = 4096
#: Columns of a chunk that four rows of x and 8 weight rows take together without AVX-512 (`_rows4x`: 4 KiB each).
_KC4 = 256


@njit(inline="always")
def _finish(s, x, w, start, K):  # pragma: no cover - compiled
    """The row's sum s of its lanes, then columns start..K of the rows at addresses x and w (pairs, the second
    first; then a lone last column)."""
    for k in range(start, K - 1, 2):
        s = fma(bfat(w, k + 1), bfat(x, k + 1), s)
        s = fma(bfat(w, k), bfat(x, k), s)
    if (K - start) % 2:
        s = fma(bfat(w, K - 1), bfat(x, K - 1), s)
    return s


@njit(inline="always")
def _store8(out, n, last, x, ws, accs, K32, K):  # pragma: no cover - compiled
    """out[n + j] = row j's sum (j <= last - n), out the address of the output row."""
    sums = vsum8(*accs)
    for j in range(8):
        if n + j <= last:
            f32put(out, n + j, _finish(sums[j], x, ws[j], K32, K))


@njit(inline="always")
def _rows8(w, ws, n, last):  # pragma: no cover - compiled
    """The addresses of weight rows n .. n + 7 (w: row 0's, ws: bytes a row; the last repeated past `last`:
    computed, not stored)."""
    return (w + min(n, last) * ws, w + min(n + 1, last) * ws, w + min(n + 2, last) * ws,
            w + min(n + 3, last) * ws, w + min(n + 4, last) * ws, w + min(n + 5, last) * ws,
            w + min(n + 6, last) * ws, w + min(n + 7, last) * ws)


@njit(nogil=True)
def _rows1(x, w, ws, n, last, out, K):  # pragma: no cover - compiled
    """out[n .. last] = x @ w[n .. last].T for one row of x (x, w, out: addresses of bf16 bits and of float32, ws:
    bytes a weight row), one weight row after the other: a one-row product is bound by memory, and rows in order
    are one stream the hardware prefetcher follows (2 threads, a Zen 3, SmolLM2-135M's matrices from DRAM, one
    process alternating: 8 rows side by side with software prefetch 13-20 -> one at a time 15-23 GB/s, every
    repeat faster; rows of 2048+ columns equal to four side by side). Addresses, not arrays: no reference
    counts, which the threads would share. Each line loaded asks for the one `AHEAD` bytes on (the same process,
    [8192, 2048] x 16 from DRAM, 2 Zen 3 threads: 7 of 8 repeats faster, +9% on average)."""
    K32 = K - K % 32
    for r in range(n, last + 1):
        wr = w + r * ws
        a = vzero()
        for k in range(0, K32, 32):
            a = vdpbf(a, vbfpairs(wr, k), vbfpairs(x, k))
            prefetch(wr, 2 * k + AHEAD)
        f32put(out, r, _finish(vsum(a), x, wr, K32, K))


@njit(nogil=True)
def _rows4(x, w, ws, n, last, out, K):  # pragma: no cover - compiled
    """`_rows1` four weight rows side by side, for a CPU without AVX-512 where x has 2-3 rows (or rows over fours,
    `_rows4x`): each load of x serves four rows, and the four accumulators (two of AVX2's 16 registers each) stay in
    registers, where `_rows3`'s 24 spill (2 Zen 3 threads, x of 9 / 64 rows, [3072, 576] and [6144, 2048]: 15-17 ->
    25-34 GMAC/s)."""
    K32 = K - K % 32
    for h in range(n, last + 1, 4):
        rows = _rows8(w, ws, h, min(h + 3, last))
        w0, w1, w2, w3 = rows[0], rows[1], rows[2], rows[3]
        a0 = a1 = a2 = a3 = vzero()
        for k in range(0, K32, 32):
            xv = vbfpairs(x, k)
            a0 = vdpbf(a0, vbfpairs(w0, k), xv)
            a1 = vdpbf(a1, vbfpairs(w1, k), xv)
            a2 = vdpbf(a2, vbfpairs(w2, k), xv)
            a3 = vdpbf(a3, vbfpairs(w3, k), xv)
        _store8(out, h, min(h + 3, last), x, rows, (a0, a1, a2, a3, a0, a1, a2, a3), K32, K)


@njit(nogil=True)
def bf16_halves(x, R, K32):  # pragma: no cover - compiled
    """x's bf16 bits [R+, K] -> the even and the odd columns of its first R rows' first K32 as float32 (exact), flat
    [R * K32 / 2] each: every pair's first and second values, made once for every weight row (`_rows4x`)."""
    h = K32 // 2
    XE, XO = np.empty(R * h, np.float32), np.empty(R * h, np.float32)
    for r in range(R):
        for j in range(h):
            XE[r * h + j] = _bits_f32(np.uint32(x[r, 2 * j]) << np.uint32(16))
            XO[r * h + j] = _bits_f32(np.uint32(x[r, 2 * j + 1]) << np.uint32(16))
    return XE, XO


@njit(nogil=True)
def _rows4x(xa, xs, XE, XO, R, w, ws, n, last, out, os, K, acc):  # pragma: no cover - compiled
    """`_rows1` for the R rows of x (a multiple of 4; at xa, xa + xs, ...; their halves XE, XO: `bf16_halves`) and
    weight rows n .. last (<= 8), without AVX-512: four rows of x at a time (rows over fours: `_rows4`), each weight
    load's halves (`vbfsecond`, `vbffirst`) serving the four, `_KC4` columns at a time (four rows' and 8 weight
    rows' columns in L1; the sums carried in acc [8 * 4 * 16]): 4 x 2 ymm of sums, where `vdpbf` on both operands
    converted each x load for each weight row. The same roundings (`vdpbf`'s two fused multiply-adds), so the same
    bits. 4 [6144, 2048] matrices, 2 threads, a Zen 3 EPYC, interleaved, `_rows4` a row -> fours: 9 / 16 / 64 rows
    13.3-15.6 / 21.9-22.1 / 81-85 -> 11.0-11.4 / 15.8-16.3 / 56-60 ms."""
    K32 = K - K % 32
    h = K32 // 2
    for r in range(0, R, 4):
        e0, e1, e2, e3 = r * h, (r + 1) * h, (r + 2) * h, (r + 3) * h
        acc[:] = 0
        for k0 in range(0, K32, _KC4):
            for i in range(last - n + 1):
                wr, b = w + (n + i) * ws, 64 * i
                a0, a1, a2, a3 = vload(acc, b), vload(acc, b + 16), vload(acc, b + 32), vload(acc, b + 48)
                for k in range(k0, min(k0 + _KC4, K32), 32):
                    v, j = vbfpairs(wr, k), k // 2
                    sv, fv = vbfsecond(v), vbffirst(v)
                    a0 = vfma(fv, vload(XE, e0 + j), vfma(sv, vload(XO, e0 + j), a0))
                    a1 = vfma(fv, vload(XE, e1 + j), vfma(sv, vload(XO, e1 + j), a1))
                    a2 = vfma(fv, vload(XE, e2 + j), vfma(sv, vload(XO, e2 + j), a2))
                    a3 = vfma(fv, vload(XE, e3 + j), vfma(sv, vload(XO, e3 + j), a3))
                vstore(acc, b, a0)
                vstore(acc, b + 16, a1)
                vstore(acc, b + 32, a2)
                vstore(acc, b + 48, a3)
        for i in range(last - n + 1):
            for q in range(4):
                f32put(out + (r + q) * os, n + i,
                       _finish(vsum(vload(acc, 64 * i + 16 * q)), xa + (r + q) * xs, w + (n + i) * ws, K32, K))


@njit(nogil=True)
def _rows3(x, xs, w, ws, n, last, out, os, K, pf, step):  # pragma: no cover - compiled
    """`_rows1` for three rows of x (at x, x + xs, x + 2 xs; outputs at out, out + os, ...): each weight load
    serves three rows, every output the same roundings. Each 32 columns ask for `step` bytes into L2 from the
    address `pf` on (none where `step` is 0): weight rows wanted next, while these are read from the caches."""
    K32 = K - K % 32
    rows = _rows8(w, ws, n, last)
    w0, w1, w2, w3, w4, w5, w6, w7 = rows
    xa, xb, xc = x, x + xs, x + 2 * xs
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = vzero()
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = vzero()
    for k in range(0, K32, 32):
        for q in range(0, step, 64):
            prefetch_l2(pf, k // 32 * step + q)
        xva, xvb, xvc = vbfpairs(xa, k), vbfpairs(xb, k), vbfpairs(xc, k)
        v = vbfpairs(w0, k)
        a0, b0, c0 = vdpbf(a0, v, xva), vdpbf(b0, v, xvb), vdpbf(c0, v, xvc)
        v = vbfpairs(w1, k)
        a1, b1, c1 = vdpbf(a1, v, xva), vdpbf(b1, v, xvb), vdpbf(c1, v, xvc)
        v = vbfpairs(w2, k)
        a2, b2, c2 = vdpbf(a2, v, xva), vdpbf(b2, v, xvb), vdpbf(c2, v, xvc)
        v = vbfpairs(w3, k)
        a3, b3, c3 = vdpbf(a3, v, xva), vdpbf(b3, v, xvb), vdpbf(c3, v, xvc)
        v = vbfpairs(w4, k)
        a4, b4, c4 = vdpbf(a4, v, xva), vdpbf(b4, v, xvb), vdpbf(c4, v, xvc)
        v = vbfpairs(w5, k)
        a5, b5, c5 = vdpbf(a5, v, xva), vdpbf(b5, v, xvb), vdpbf(c5, v, xvc)
        v = vbfpairs(w6, k)
        a6, b6, c6 = vdpbf(a6, v, xva), vdpbf(b6, v, xvb), vdpbf(c6, v, xvc)
        v = vbfpairs(w7, k)
        a7, b7, c7 = vdpbf(a7, v, xva), vdpbf(b7, v, xvb), vdpbf(c7, v, xvc)
    _store8(out, n, last, xa, rows, (a0, a1, a2, a3, a4, a5, a6, a7), K32, K)
    _store8(out + os, n, last, xb, rows, (b0, b1, b2, b3, b4, b5, b6, b7), K32, K)
    _store8(out + 2 * os, n, last, xc, rows, (c0, c1, c2, c3, c4, c5, c6, c7), K32, K)


@njit(nogil=True)
def bf16_bits(x):  # pragma: no cover - compiled
    """x [R, K] float32 holding bf16 values -> their bf16 bits (uint16 [R, K]; exact: the low 16 bits are zero)."""
    bits = x.view(np.uint32)
    xb = np.empty(x.shape, np.uint16)
    for r in range(x.shape[0]):
        for k in range(x.shape[1]):
            xb[r, k] = bits[r, k] >> np.uint32(16)
    return xb


@njit(nogil=True)
def rows_bf16(x, w, out, n, end, wide):  # pragma: no cover - compiled
    """out[:, n:end] = x @ w[n:end].T, x [R, K] and w [N, K] bf16 bits (rows contiguous), out [R, N] float32 (one
    work item of `kernels._dense`). One row of x: `_rows1` over the range, one stream from memory. More: the weights
    go by 8 rows (contiguous bytes), read from memory by the first rows of x and from the caches by the others:
    where the CPU has AVX-512 (`wide`: 32 registers of 16 lanes), three rows of x at a time (`_rows3`), and rows
    left over threes as the last three rows (those computed and stored twice, the same bits), two rows `_rows1` each;
    elsewhere `_rows4x` (four rows of x at a time). (Rows left over had each read the whole range from memory again:
    2 Zen 4 threads, 960 MB of 1.7B-shaped matrices, x of 2 / 4 / 5 rows 62 / 63 / 83 -> 45 / 45 / 51 ms. Then
    `_rows1` over each, reading the 8 weight rows again for one row of x; as the last three rows,
    interleaved processes, 252 MB of them, 5 rows 13.2 / 15.9 -> 11.0 / 9.6 ms, 8 rows 16.1 / 14.5 -> 12.0 / 10.7
    (one row 6-10); SmolLM2-135M's 212 MB, 5 rows 18.1 / 17.0 -> 13.9 / 13.3, 8 rows 16.5 / 15.0 -> 13.5 / 12.9.)
    The groups of three after the first ask for the next 8 weight rows into L2
    meanwhile (into L1 they pushed out the rows being read: 9 rows 48 -> 60 ms; into L2, two runs: 53 -> 48,
    59 -> 54). The same bits either way and whatever the batch: each output is one weight row's and one x row's
    fixed sums. The arrays stay alive here; the row kernels get their addresses."""
    R, K = x.shape
    xa, wa, oa = x.ctypes.data, w.ctypes.data, out.ctypes.data
    xs, ws, os = x.strides[0], w.strides[0], out.strides[0]
    assert (K < 2 or x.strides[1] == 2 and w.strides[1] == 2) and (out.shape[1] < 2 or out.strides[1] == 4)
    if R == 1:
        _rows1(xa, wa, ws, n, end - 1, oa, K)
        return
    XE, XO = bf16_halves(x, 0 if wide else R - R % 4, K - K % 32)  # (only the rows that `_rows4x` takes)
    acc = np.empty(0 if wide else 512, np.float32)
    groups = -(-R // 3) if wide and R >= 3 else 0  # (rows left over threes: the last three rows again, see above)
    first, steps = R if groups else 0, max(K // 32, 1)
    for m in range(n, end, 8):
        last = min(m + 7, end - 1)
        # the next 8 rows' bytes, asked for in shares by the groups after the first (which reads these from memory)
        share = -(-min(end - 1 - last, 8) * ws // (groups - 1) // steps) if groups > 1 else 0
        for g in range(groups):
            r = min(3 * g, R - 3)
            _rows3(xa + r * xs, xs, wa, ws, m, last, oa + r * os, os, K,
                   wa + (last + 1) * ws + max(g - 1, 0) * share * steps, share if g else 0)
        if not wide:  # (rows over fours: `_rows4` in this function; called from `_rows4x` they ran 1.2-1.5x slower)
            _rows4x(xa, xs, XE, XO, R - R % 4, wa, ws, m, last, oa, os, K, acc)
        for r in range(first if wide else R - R % 4, R):
            if wide:
                _rows1(xa + r * xs, wa, ws, m, last, oa + r * os, K)
            else:
                _rows4(xa + r * xs, wa, ws, m, last, oa + r * os, K)
