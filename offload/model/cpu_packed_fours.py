"""Integer products of a packed matrix's 64-output blocks shaped for AVX2's 16 vector registers (`_fours`): rows of x
four at a time, each group's exact int32 sums into a buffer in AMX tiles' layout that `cpu_packed_close._close_tiles`
closes. `offload.model.cpu_packed16`'s four-row loops hold four rows' sums of the whole block (16 vectors of 16 int32:
AVX-512's 32 registers, 32 of AVX2's 16 ymm, so they spill there); here four rows take a part of the block at a time:

- int16 pairs (int4 and int8 codes, `_quarter`): 16 of the block's outputs, 4 x 2 ymm of sums beside 2 of codes;
- int4 codes by int8 steps in byte pairs (`simd_bytes`: AVX2's vpmaddubsw, 32 multiply-adds an instruction, where
  AVX-512 VNNI is missing; `_half4`): 32 outputs, their int16 sums widened every 8 lane units (`simd_bytes.UNITS`);
  one row's byte-pair sums of the whole block stay in registers (`_sums1b`).

The same exact integer sums as the other paths, so the same bits. Knows nothing about models, tiers or files.
"""

from __future__ import annotations

from numba import njit

from offload.model.cpu_packed import _AHEAD
from offload.model.cpu_packed_close import _close_tiles
from offload.model.cpu_packed_units import _INT4, _INT4_8, _INT4_B, _dot, _pair_codes, _pair_prefetch, _per
from offload.model.simd_bytes import UNITS, vbpairs4, vbsplat, vmaddubs, vwiden16
from offload.model.simd_int import viadd, viload, visplat, vistore, vizero


@njit(forceinline=True, nogil=True)
def _sums1b(xp, qb, p0, half):  # pragma: no cover - compiled
    """One row's exact sums (four int32 vectors: rows 0-15 .. 48-63 of the block) over lane units p0 .. p0 + half - 1:
    its int8 steps xp (as int32, four a lane) against the block's int4 codes qb in byte pairs."""
    t0 = t1 = t2 = t3 = vizero()
    end = p0 + half
    for c in range(p0, end, UNITS):
        lo = hi = vizero()
        for p in range(c, min(c + UNITS, end)):
            _pair_prefetch(qb, p, _AHEAD, _INT4)  # (the same bytes as int4 pairs)
            w0, w1 = vbpairs4(qb, 64 * p)
            xv = vbsplat(xp, p)
            lo, hi = vmaddubs(lo, w0, xv), vmaddubs(hi, w1, xv)
        u0, u1 = vwiden16(lo)
        u2, u3 = vwiden16(hi)
        t0, t1, t2, t3 = viadd(t0, u0), viadd(t1, u1), viadd(t2, u2), viadd(t3, u3)
    return t0, t1, t2, t3


@njit(forceinline=True, nogil=True)
def _put16(T, r, h, first, v):  # pragma: no cover - compiled
    """Row r's int32 sums of the block's rows 32 h .. 32 h + 31 in T (AMX tiles' layout: 16 rows a tile of 1024, a
    row's outputs 16 at a time 256 apart) = (first) or += `vwiden16` of v."""
    i = (r >> 4) * 1024 + 16 * (r & 15) + 512 * h
    u0, u1 = vwiden16(v)
    if not first:
        u0, u1 = viadd(u0, viload(T, i)), viadd(u1, viload(T, i + 256))
    vistore(T, i, u0)
    vistore(T, i + 256, u1)


@njit(forceinline=True, nogil=True)
def _half4(xa, xb, xc, xd, qb, p0, half, h, r, T):  # pragma: no cover - compiled
    """Four rows' (x: xa .. xd, int8 steps) exact sums of the block's outputs 32 h .. 32 h + 31 (h = 0: the low
    nibbles, 1: the high) over lane units p0 .. p0 + half - 1 into T (rows r .. r + 3, `_put16`)."""
    end = p0 + half
    for c in range(p0, end, UNITS):
        a = b = d = e = vizero()
        for p in range(c, min(c + UNITS, end)):
            w0, w1 = vbpairs4(qb, 64 * p)
            w = w1 if h else w0
            a, b = vmaddubs(a, w, vbsplat(xa, p)), vmaddubs(b, w, vbsplat(xb, p))
            d, e = vmaddubs(d, w, vbsplat(xc, p)), vmaddubs(e, w, vbsplat(xd, p))
        first = c == p0
        _put16(T, r, h, first, a)
        _put16(T, r + 1, h, first, b)
        _put16(T, r + 2, h, first, d)
        _put16(T, r + 3, h, first, e)


@njit(forceinline=True, nogil=True)
def _quarter(xa, xb, xc, xd, qb, p0, half, q, r, T, kind):  # pragma: no cover - compiled
    """Four rows' (x: xa .. xd) exact sums of the block's outputs 16 q .. 16 q + 15 over lane units p0 .. p0 + half - 1
    into T (rows r .. r + 3, `_put16`'s layout): int16 pairs (or quads) by `_pair_codes`' q-th vector (q a constant
    where inlined: the other three are never made)."""
    t = u = v = s = vizero()
    for p in range(p0, p0 + half):
        if q == 0:  # (the group's first pass of these rows)
            _pair_prefetch(qb, p, _AHEAD, kind)
        c0, c1, c2, c3 = _pair_codes(qb, p, kind)
        c = c0 if q == 0 else (c1 if q == 1 else (c2 if q == 2 else c3))
        t, u = _dot(t, c, visplat(xa, p), kind), _dot(u, c, visplat(xb, p), kind)
        v, s = _dot(v, c, visplat(xc, p), kind), _dot(s, c, visplat(xd, p), kind)
    i = (r >> 4) * 1024 + 16 * (r & 15) + 256 * q
    vistore(T, i, t)
    vistore(T, i + 16, u)
    vistore(T, i + 32, v)
    vistore(T, i + 48, s)


@njit(forceinline=True, nogil=True)
def _fours(XP, step, xs, qb, S, Z, gs, A, T, kind):  # pragma: no cover - compiled
    """A block's outputs A (flat, [R * 64]) += its products with the rows of XP in fours (each group's sums into T,
    then closed) but a lone row over them (1, 5, 9 rows: alone cost less than a four: 4 [8192, 2048] int4 matrices,
    byte pairs, 5 / 9 rows 4.3-6.0 / 5.4-9.9 -> 6.3-8.7 / 9.0-10.8 ms as fours) -> the rows done (the rest: the
    caller's, one by one). 2-3 rows over fours go as a four with stand-ins (T has room to a whole tile, 16 rows)."""
    R, G = step.shape
    half = gs // _per(kind)
    fours = R - 1 if R % 4 == 1 else R
    for g in range(G if fours else 0):
        p0 = g * half
        for r in range(0, fours, 4):
            last = r + min(4, fours - r) - 1
            xa, xb, xc, xd = XP[r], XP[min(r + 1, last)], XP[min(r + 2, last)], XP[min(r + 3, last)]
            if kind == _INT4_B:
                _half4(xa, xb, xc, xd, qb, p0, half, 0, r, T)
                _half4(xa, xb, xc, xd, qb, p0, half, 1, r, T)
            else:
                _quarter(xa, xb, xc, xd, qb, p0, half, 0, r, T, kind)
                _quarter(xa, xb, xc, xd, qb, p0, half, 1, r, T, kind)
                _quarter(xa, xb, xc, xd, qb, p0, half, 2, r, T, kind)
                _quarter(xa, xb, xc, xd, qb, p0, half, 3, r, T, kind)
        _close_tiles(A, T, fours, S[g], Z[g], step, xs, g, kind == _INT4_8)
    return fours
