"""The int4 and int8 products of bf16 activations on the CPU (`offload.model.cpu_packed`'s tiles and order of
blocks; their entries and `packed`, which chooses: `offload.model.cpu_packed_entry`).

x is split per group into int16 steps and summed against the codes exactly in int32 (two columns a lane:
`simd_int.vdot`, AVX-512 VNNI's vpdpwssds, 32 multiply-adds an instruction against float32's 16), then the group's
scales apply in float32:

    acc[n] = fma(zero'[n, g], step * sum of xq over g, fma(scale[n, g], step * t[n], acc[n]))

An integer sum has no order, so a row's bits depend on nothing but the row, and the choice between this and float32
products is made by the activations' dtype, never by the batch. Past a few rows float32 products are bound by
multiply-adds, not bytes, so this is what makes prefill and a verify pass cheap. A step is 2^-15 of the group's largest
|x|: bf16's 8 significant bits are kept wherever an entry is within 2^7 of that largest, a smaller entry is off by at
most 2^-16 of it. On the trained SmolLM2-135M in bf16 (12 prompts, against transformers in float32 on the same
dequantized weights) the mean |logit difference| goes 0.21 -> 0.26 (int4) and 0.28 -> 0.30 (int8); in a float32 run
the split would move the logits 1e-2 where float32 products stay within 1e-4, so float32 (and fp16) keep float32.

Where the CPU multiplies bytes (`kernels.activation_steps`) x is split into int8 steps (2^-7 of the group's largest
|x|, llama.cpp's Q4_0 / Q8_0 class): four columns a lane by AVX-512 VNNI's vpdpbusd (`simd_int.vdot8`, 64
multiply-adds an instruction), the int4 codes gathered four columns a row (`vquads4`), the int8 codes stored so
(`quant.int8_tiles`; 1.7B-shaped int8 matrices, 2 Zen 4 threads, int16 -> int8 steps: 9 rows 37.9 -> 30.9 ms, 64
rows 167 -> 108); on AVX2 int4 codes by AVX2's vpmaddubsw in byte pairs (`cpu_packed_fours`). Trained SmolLM2-135M,
bf16, a 182-token text (`scripts/quant_quality.py`): int4 g32 perplexity 24.19 -> 24.34 (bf16 weights 24.54), int8
g64 24.59 -> 24.38 with top-1 agreement 95.6% -> 91.2% (`weights.int8_activations: int16` keeps int16 steps). Knows
nothing about models, tiers or files.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from offload.model.cpu_packed import _AHEAD, _BLOCK, _load4, _put, _scale, _scales, _split, _store4
from offload.model.cpu_packed_close import _close_asking, _close_tiles, _stepped
from offload.model.cpu_packed_fours import _fours, _sums1b
from offload.model.cpu_packed_units import (
    _AHEAD_L2,
    _INT4,
    _INT4_8,
    _INT4_B,
    _INT8,
    _INT8_8,
    _cols,
    _dot,
    _dots,
    _pair_codes,
    _pair_prefetch,
    _per,
    _wide,
)
from offload.model.simd import LANES, _has, parts, vload, vstore
from offload.model.simd_amx import configure, quad_shape, quad_sums, tile_units, tiles_config, tiles_release
from offload.model.simd_bytes import pair_bytes
from offload.model.simd_int import byte_dots, viload, visplat, vistore, vizero

#: Byte pairs (`cpu_packed_fours`) for int8 steps against int4 codes at every row count where AVX2 lacks VNNI. 4
#: [8192, 2048] int4 g64 matrices from DRAM, 2 threads, a Zen 3 EPYC, int16 steps in pairs -> int8 in byte pairs: 1 /
#: 2 / 4 / 9 / 16 / 64 rows 2.0 / 3.6 / 6.7 / 14.4 / 26.5 / 92.3 -> 1.2 / 2.5 / 2.7 / 5.6 / 9.1 / 33.6 ms.
_BYTES4 = pair_bytes() and not byte_dots()
#: Rows of x from which int8 steps meet int4 codes as quads (`vquads4`, `vdot8`); fewer: as int16 pairs (the same
#: sums). Quads take half the instructions a code; with `_pair_prefetch`'s L2 asks they read DRAM as fast as pairs,
#: so from one row wherever AVX-512 VBMI permutes bytes in one instruction. A 2-core Zen 4, one row, interleaved in
#: one process: [8192, 2048] from L3 2 threads 198 -> 128 us; a decode step's products over the model's own int4
#: matrices from DRAM, median of 10-16, pairs -> quads: the 1.7B 43.1 -> 37.3 and 44.9 -> 33.9 ms, SmolLM2-135M 3.01
#: -> 2.50 ms (in a fast minute 151 MB of 1.7B-shaped ones: 5.5 ms either way, the memory's). `_QUADS8`: int8 codes
#: stay pairs below 2 rows (the 1.7B's, the same test: quads 1.07x slower) except where the cores have AMX (a Xeon
#: VM, 570 MB of 1.7B-shaped ones: one row 12.6-12.9 -> 10.1-10.4 ms).
_QUADS = 1 if _has("avx512vbmi") else 2
_QUADS8 = 1 if _has("amx-int8") else 2
#: Rows of x from which int8 steps meet the codes on AMX tiles where the process may use them (the same sums). 243
#: MB of 1.7B-shaped int8 (int4: 122 MB) matrices, a 2-core Xeon VM, vectors / tiles: 10 rows 23.3 / 17.9 ms (14.7 /
#: 11.7), 64 62.3 / 52.8 (66.0 / 44.4); SmolLM2-135M's and the 1.7B's over one row's time: 5 rows 1.04-1.22 /
#: 1.25-1.52, 6-9 rows tiles at or below vectors in 30 of 32 cases (below 6 the sums' leaving the tiles costs more).
_TILE_ROWS = 6
#: Rows up to which int16 pairs (int4, int8 codes) run a row at a time (`_direct16`; a block's codes from L2 after the
#: first) where the CPU lacks AVX-512: 4 [8192, 2048] g64 matrices, 2 threads, an AVX2 EPYC, int8 2 / 3 / 4 rows
#: against `_direct4` 8.9-9.6 -> 3.6-4.1 / 5.0-5.2 / 6.4 ms, int4 2 rows 6.0-6.8 -> 4.3-4.4 (one row 2.0-2.9); against
#: `_FOURS`, 6 interleaved rounds of a slower minute (one row 3.2), median alone / fours: int8 2 rows 5.7 / 7.8, 3
#: 8.3 / 7.9, 4 10.8 / 8.1. By kind: int4, int8 pairs; quads (int8 steps) one row.
_ALONE = (1, 1, 1, 1, 1) if _has("avx512f") else (2, 2, 1, 1, 1)
#: Rows in fours into a sums buffer, a part of the block at a time (`cpu_packed_fours`), where 16 vector registers
#: spill `_direct4`'s and `_dot4_16`'s four rows of sums (AVX2). The same matrices, int8 codes, interleaved: 5 / 9 /
#: 16 / 64 rows 14.7-16.9 / 27.0-27.3 / 38.8-43.2 / 142-164 -> 6.6-11.2 / 10.4-18.1 / 17.3-29.2 / 111-114 ms.
_FOURS = not _has("avx512f")
#: Rows of x from which they are split into integer steps in parallel, once for every thread (fewer: by each thread).
_SPLIT_PARALLEL = 16
#: Rows of x from which a block's codes are converted once per group into a buffer that every four rows read
#: (`_dot4_16`); fewer: as read, four rows at a time (`_direct4`). One [8192, 2048] int4 matrix, a Zen 5, buffered /
#: as read: 64 rows 3259 / 3377 us; quads (`_WIDEN8`, `_WIDEN4`), a Zen 4, as read / buffered: int8 24-48 rows
#: 1.03-1.09, 96 1.26; int4 16-96 rows 0.85-0.93, 256 1.05.
_WIDEN, _WIDEN8, _WIDEN4 = 16, 24, 128


@njit(forceinline=True, nogil=True)
def _scale16(a0, a1, a2, a3, t0, t1, t2, t3, Sg, Zg, step, xs, kind):  # pragma: no cover - compiled
    """`_scale` for a group's exact integer sums t: a = fma(scale, step * t, a) then fma(zero', xs, a). (int4 codes
    in quads: rows 32-63's sums are of their codes times 16, `vquads4`: divided exactly first.)"""
    t0, t1, t2, t3 = _stepped(t0, t1, t2, t3, step, kind == _INT4_8)
    return _scale(a0, a1, a2, a3, t0, t1, t2, t3, Sg, Zg, xs)


@njit(forceinline=True, nogil=True)
def _close16(A, i, t0, t1, t2, t3, Sg, Zg, step, xs, kind):  # pragma: no cover - compiled
    """A [i : i + 64] = `_scale16` of them with a group's sums t. (A flat: a row's view A[r] made in the loop costs
    its reference counts.)"""
    a0, a1, a2, a3 = vload(A, i), vload(A, i + LANES), vload(A, i + 2 * LANES), vload(A, i + 3 * LANES)
    a0, a1, a2, a3 = _scale16(a0, a1, a2, a3, t0, t1, t2, t3, Sg, Zg, step, xs, kind)
    vstore(A, i, a0)
    vstore(A, i + LANES, a1)
    vstore(A, i + 2 * LANES, a2)
    vstore(A, i + 3 * LANES, a3)


@njit(forceinline=True, nogil=True)
def _widens(R, kind):  # pragma: no cover - compiled
    """Whether R rows read each group's codes from a buffer (`_WIDEN`; rows in fours, `_FOURS`, never)."""
    if _FOURS or kind == _INT4_B:
        return False
    return R >= (_WIDEN4 if kind == _INT4_8 else (_WIDEN8 if kind == _INT8_8 else _WIDEN))


@njit(forceinline=True, nogil=True)
def _sums1(xp, qb, p0, half, kind):  # pragma: no cover - compiled
    """One row's exact sums (four int32 vectors: rows 0-15 .. 48-63 of the block) over lane units p0 .. p0 + half
    - 1: its int16 pairs (int8 quads, byte pairs) xp against the block's codes qb, converted as they are read."""
    if kind == _INT4_B:
        return _sums1b(xp, qb, p0, half)
    t0 = t1 = t2 = t3 = vizero()
    for p in range(p0, p0 + half):
        _pair_prefetch(qb, p, _AHEAD, kind)
        xv = visplat(xp, p)
        c0, c1, c2, c3 = _pair_codes(qb, p, kind)
        t0 = _dot(t0, c0, xv, kind)
        t1 = _dot(t1, c1, xv, kind)
        t2 = _dot(t2, c2, xv, kind)
        t3 = _dot(t3, c3, xv, kind)
    return t0, t1, t2, t3


@njit(forceinline=True, nogil=True)
def _direct16(xp, step, xs, qb, S, Z, gs, A, kind):  # pragma: no cover - compiled
    """`_direct` in integers: one row (its int16 pairs xp, steps and sums) against a block's codes qb, converted as
    they are read."""
    a0, a1, a2, a3 = _load4(A)
    half = gs // _per(kind)
    for g in range(S.shape[0]):
        t0, t1, t2, t3 = _sums1(xp, qb, g * half, half, kind)
        a0, a1, a2, a3 = _scale16(a0, a1, a2, a3, t0, t1, t2, t3, S[g], Z[g], step[g], xs[g], kind)
    _store4(A, a0, a1, a2, a3)


@njit(forceinline=True, nogil=True)
def _close4(A, r, n, g, S, Z, step, xs, t0, t1, t2, t3, u0, u1, u2, u3, v0, v1, v2, v3, s0, s1, s2, s3,
            kind):  # pragma: no cover - compiled
    """`_close16` of group g for rows r .. r + n - 1 (n <= 4) with their sums t, u, v, s (each four vectors, passed
    one by one: they stay in registers)."""
    _close16(A, _BLOCK * (r), t0, t1, t2, t3, S[g], Z[g], step[r, g], xs[r, g], kind)
    if n > 1:
        _close16(A, _BLOCK * (r + 1), u0, u1, u2, u3, S[g], Z[g], step[r + 1, g], xs[r + 1, g], kind)
    if n > 2:
        _close16(A, _BLOCK * (r + 2), v0, v1, v2, v3, S[g], Z[g], step[r + 2, g], xs[r + 2, g], kind)
    if n > 3:
        _close16(A, _BLOCK * (r + 3), s0, s1, s2, s3, S[g], Z[g], step[r + 3, g], xs[r + 3, g], kind)


@njit(forceinline=True, nogil=True)
def _direct4(XP, step, xs, r, n, g, qb, S, Z, half, A, kind):  # pragma: no cover - compiled
    """`_direct16`'s group g (half: its column pairs) for rows r .. r + n - 1 of XP (n <= 4; a missing row's place
    computes the last row again, unstored): each pair of columns' codes converted once for four rows, in registers;
    the callers take every row for one group before the next (its codes from L1 after the first rows). One [8192,
    2048] int4 matrix, a Zen 5, against a buffer and three rows at a time: 9 rows 864-1089 -> 580-703 us."""
    last = r + n - 1
    xa, xb, xc, xd = XP[r], XP[min(r + 1, last)], XP[min(r + 2, last)], XP[min(r + 3, last)]
    t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = v0 = v1 = v2 = v3 = s0 = s1 = s2 = s3 = vizero()
    for p in range(g * half, g * half + half):
        _pair_prefetch(qb, p, _AHEAD, kind)
        c0, c1, c2, c3 = _pair_codes(qb, p, kind)
        xv, yv, zv, wv = visplat(xa, p), visplat(xb, p), visplat(xc, p), visplat(xd, p)
        t0, u0, v0, s0 = _dots(t0, u0, v0, s0, c0, xv, yv, zv, wv, kind)
        t1, u1, v1, s1 = _dots(t1, u1, v1, s1, c1, xv, yv, zv, wv, kind)
        t2, u2, v2, s2 = _dots(t2, u2, v2, s2, c2, xv, yv, zv, wv, kind)
        t3, u3, v3, s3 = _dots(t3, u3, v3, s3, c3, xv, yv, zv, wv, kind)
    _close4(A, r, n, g, S, Z, step, xs, t0, t1, t2, t3, u0, u1, u2, u3, v0, v1, v2, v3, s0, s1, s2, s3, kind)


@njit(forceinline=True, nogil=True)
def _direct5(XP, step, xs, r, g, qb, S, Z, half, A, kind):  # pragma: no cover - compiled
    """`_direct4` for the five rows r .. r + 4: rows that leave one over fours (9 = 4 + 5, not 4 + 4 + 1) gather the
    codes once less (20 sums, 4 code vectors and 5 rows' x: 29 of AVX-512's 32 registers)."""
    xa, xb, xc, xd, xe = XP[r], XP[r + 1], XP[r + 2], XP[r + 3], XP[r + 4]
    t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = v0 = v1 = v2 = v3 = s0 = s1 = s2 = s3 = e0 = e1 = e2 = e3 = vizero()
    for p in range(g * half, g * half + half):
        _pair_prefetch(qb, p, _AHEAD, kind)
        c0, c1, c2, c3 = _pair_codes(qb, p, kind)
        xv, yv, zv, wv, ev = visplat(xa, p), visplat(xb, p), visplat(xc, p), visplat(xd, p), visplat(xe, p)
        t0, u0, v0, s0 = _dots(t0, u0, v0, s0, c0, xv, yv, zv, wv, kind)
        t1, u1, v1, s1 = _dots(t1, u1, v1, s1, c1, xv, yv, zv, wv, kind)
        t2, u2, v2, s2 = _dots(t2, u2, v2, s2, c2, xv, yv, zv, wv, kind)
        t3, u3, v3, s3 = _dots(t3, u3, v3, s3, c3, xv, yv, zv, wv, kind)
        e0, e1, e2, e3 = _dot(e0, c0, ev, kind), _dot(e1, c1, ev, kind), _dot(e2, c2, ev, kind), _dot(e3, c3, ev, kind)
    _close4(A, r, 4, g, S, Z, step, xs, t0, t1, t2, t3, u0, u1, u2, u3, v0, v1, v2, v3, s0, s1, s2, s3, kind)
    _close16(A, _BLOCK * (r + 4), e0, e1, e2, e3, S[g], Z[g], step[r + 4, g], xs[r + 4, g], kind)


@njit(forceinline=True, nogil=True)
def _widen16(qb, g, half, W, kind):  # pragma: no cover - compiled
    """W [half * 64] = the block's codes of group g's lane units (`_pair_codes`: the values `_direct16` makes), the
    next group's codes asked for meanwhile."""
    ahead = _per(kind) * half * (_BLOCK if _wide(kind) else _BLOCK // 2)  # (a group's bytes)
    for i in range(half):
        p = g * half + i
        _pair_prefetch(qb, p, ahead, kind)
        c0, c1, c2, c3 = _pair_codes(qb, p, kind)
        vistore(W, _BLOCK * i, c0)
        vistore(W, _BLOCK * i + LANES, c1)
        vistore(W, _BLOCK * i + 2 * LANES, c2)
        vistore(W, _BLOCK * i + 3 * LANES, c3)


@njit(forceinline=True, nogil=True)
def _dot4_16(XP, step, xs, r, n, g, W, S, Z, A, kind):  # pragma: no cover - compiled
    """`_direct4` for group g against the buffered codes W: each load of the codes serves four rows."""
    half = W.shape[0] // _BLOCK
    p0 = g * half
    last = r + n - 1
    xa, xb, xc, xd = XP[r], XP[min(r + 1, last)], XP[min(r + 2, last)], XP[min(r + 3, last)]
    t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = v0 = v1 = v2 = v3 = s0 = s1 = s2 = s3 = vizero()
    for i in range(half):
        j, p = _BLOCK * i, p0 + i
        xv, yv, zv, wv = visplat(xa, p), visplat(xb, p), visplat(xc, p), visplat(xd, p)
        t0, u0, v0, s0 = _dots(t0, u0, v0, s0, viload(W, j), xv, yv, zv, wv, kind)
        t1, u1, v1, s1 = _dots(t1, u1, v1, s1, viload(W, j + LANES), xv, yv, zv, wv, kind)
        t2, u2, v2, s2 = _dots(t2, u2, v2, s2, viload(W, j + 2 * LANES), xv, yv, zv, wv, kind)
        t3, u3, v3, s3 = _dots(t3, u3, v3, s3, viload(W, j + 3 * LANES), xv, yv, zv, wv, kind)
    _close4(A, r, n, g, S, Z, step, xs, t0, t1, t2, t3, u0, u1, u2, u3, v0, v1, v2, v3, s0, s1, s2, s3, kind)


@njit(forceinline=True, nogil=True)
def _block16(XP, step, xs, q, sz, b, nb, S, Z, A, W, T, kq, kind):  # pragma: no cover - compiled
    """A [R, 64] = block b's outputs for the rows XP (`_tiles16`), its scales into S, Z and (from `_widens` rows, or
    on tiles: kq > 0) each group's codes into W on the way."""
    R, G = A.shape[0], S.shape[0]
    gs = _cols(kind) * XP.shape[1] // G
    _scales(sz, b, nb, S, Z, _wide(kind))
    A[:] = 0
    qb = q[b].reshape(q.shape[1] * q.shape[2])
    A1 = A.reshape(R * _BLOCK)
    if kq:  # AMX tiles, 16 rows a tile (XP padded to them)
        half = gs // 4
        for g in range(G):
            if kind == _INT8_8:  # int8 codes are quads as they lie (`quant.int8_tiles`): the tiles load them in place
                for c in range((R + 15) // 16):
                    quad_sums(XP, 16 * c, g * half, half, kq, qb, T, 1024 * c, 256 * g * half)
                _close_asking(A1, T, R, S[g], Z[g], step, xs, g, False, qb, 256 * half * (g + 1), 4 * half, _AHEAD_L2)
            else:
                _widen16(qb, g, half, W, kind)
                for c in range((R + 15) // 16):
                    quad_sums(XP, 16 * c, g * half, half, kq, W, T, 1024 * c, 0)
                _close_tiles(A1, T, R, S[g], Z[g], step, xs, g, kind == _INT4_8)
    elif kind == _INT4_B or (_FOURS and R > _ALONE[kind]):  # AVX2: rows in fours (a lone row over them alone)
        for r in range(_fours(XP, step, xs, qb, S, Z, gs, A1, T, kind), R):
            _direct16(XP[r], step[r], xs[r], qb, S, Z, gs, A[r], kind)
    elif R <= _ALONE[kind]:  # (decode: a call of its own, the four-row loop's code out of it)
        for r in range(R):
            _direct16(XP[r], step[r], xs[r], qb, S, Z, gs, A[r], kind)
    elif not _widens(R, kind):
        half = gs // _per(kind)
        fours = R - 5 if R % 4 == 1 else R  # (one row over fours: the last five together, not a lone row)
        for g in range(G):
            for r in range(0, fours, 4):
                _direct4(XP, step, xs, r, min(4, R - r), g, qb, S, Z, half, A1, kind)
            if fours < R:
                _direct5(XP, step, xs, fours, g, qb, S, Z, half, A1, kind)
    else:
        for g in range(G):
            _widen16(qb, g, gs // _per(kind), W, kind)
            for r in range(0, R, 4):
                _dot4_16(XP, step, xs, r, min(4, R - r), g, W, S, Z, A1, kind)


@njit(forceinline=True, nogil=True)
def _split_row(x, r, gs, XP, step, xs, kind, form):  # pragma: no cover - compiled
    """`_split` of row r into XP[r]: int8 steps against int4 codes (bounded as `vquads4`'s, up to 240) or int8 codes
    (255), as bytes or (`form` _INT4, _INT8) int16 pairs, else int16 steps against codes up to 15 (int4) or 255."""
    cmax = 255 if _wide(kind) else (240 if kind == _INT4_8 else 15)
    if _cols(form) == 4:
        _split(x[r], gs, cmax, 127, XP[r].view(np.int8), step[r], xs[r])
    else:
        _split(x[r], gs, cmax, 127 if _per(kind) == 4 else 32767, XP[r].view(np.int16), step[r], xs[r])


@njit(forceinline=True, nogil=True)
def _split_buffers(R, rows, cols, G):  # pragma: no cover - compiled
    """`_split_row`'s outputs for R rows of x: XP [rows (R, or R to a whole tile; those past R zeros: 0 for none),
    cols], steps and sums [R, G]."""
    XP = np.empty((rows if R else 0, cols), np.int32)
    XP[R:] = 0
    return XP, np.empty((R, G), np.float32), np.empty((R, G), np.float32)


@njit(inline="always")  # (its prange must land in each parallel entry; the helpers inline in LLVM, not numba)
def _tiles16(x, q, sz, out, kind, quads, amx):  # pragma: no cover - compiled
    """`_tiles` with x in integer steps (even groups), its rows four at a time: below `_widens` rows against the codes
    as read (`_direct4`), from there against each group's codes converted once into a buffer (`_dot4_16`); int4 codes
    in byte pairs (`_BYTES4`) by `cpu_packed_fours`. Integer sums are exact: every path gives a row the same bits."""
    R, K = x.shape
    nb, G = q.shape[0], sz.shape[0]
    gs = K // G
    sz = sz.reshape(G, sz.shape[1] * sz.shape[2])
    form = _INT4_B if kind == _INT4_8 and _BYTES4 else kind  # below _QUADS rows int8 steps go as int16 pairs:
    if R < quads and _per(form) == 4:  # the same integer sums, so the same bits
        form = _INT8 if kind == _INT8_8 else _INT4
    kq = tile_units(gs // 4) if amx and _per(form) == 4 and R >= _TILE_ROWS else 0
    rows = (R + 15) // 16 * 16 if kq else R  # x's int16 pairs (int8 quads), a lane unit an int32; on tiles, rows to
    own = R < _SPLIT_PARALLEL  # a whole tile. Few rows: each thread splits x itself (below)
    XP, step, xs = _split_buffers(0 if own else R, rows, K // _cols(form), G)
    if not own:
        for r in prange(R):
            _split_row(x, r, gs, XP, step, xs, kind, form)
    share, shares = parts(nb, 1)
    for t in prange(shares):  # (one share of blocks a thread, its buffers made once)
        XPt, stept, xst = XP, step, xs
        if own:  # (every thread at once, each into its own cache: split once and read from the other core's, the
            XPt, stept, xst = _split_buffers(R, rows, K // _cols(form), G)  # rows cost more; SmolLM2 int8 from
            for r in range(R):  # cache, a layer's products at 9 rows, three interleaved pairs: 110-116 -> 103-113 us)
                _split_row(x, r, gs, XPt, stept, xst, kind, form)
        S, Z = np.empty((G, _BLOCK), np.float32), np.empty((G, _BLOCK), np.float32)
        A = np.empty((R, _BLOCK), np.float32)
        W = np.empty(gs // _per(form) * _BLOCK if (kq and form != _INT8_8) or _widens(R, form) else 0, np.int32)
        T = np.empty(1024 * ((R + 15) // 16) if kq or _FOURS or form == _INT4_B else 0, np.int32)  # sums: tiles, fours
        cfg = np.empty(64, np.uint8)
        if kq:  # (a thread's tiles: configured in the thread)
            configure(cfg, quad_shape(min(16, R), kq))
            tiles_config(cfg)
        for b in range(t * share, min(nb, t * share + share)):
            _block16(XPt, stept, xst, q, sz, b, nb, S, Z, A, W, T, kq, form)
            for r in range(R):
                _put(out, r, b, A)
        if kq:
            tiles_release()
