"""int4 codes by x in int8 steps as byte pairs (`simd_bytes`: AVX2's vpmaddubsw, 32 multiply-adds an instruction) on a
CPU without AVX-512 VNNI, a group's exact int32 sums of a 64-output block: one row's in registers (`_sums1b`), four
rows' into a buffer in AMX tiles' layout (`_sums4b`), which `cpu_packed_close._close_tiles` closes. The same integer
sums as the quads and int16 pairs of `offload.model.cpu_packed16` (from the same int8 steps), so the same bits.

Each 8 lane units (`simd_bytes.UNITS`) add their int16 sums, then widen them. Where the block's 64 rows of sums are
2 x 4 int16 vectors for one row, four rows take 32 of the block's rows at a time (low nibbles, then high): 4 x 2
ymm registers of sums beside 2 of codes and 4 of x, within AVX2's 16 (`_direct4`'s four rows of 64 int32 sums, 32
registers' worth, spill there). Knows nothing about models, tiers or files.
"""

from __future__ import annotations

from numba import njit

from offload.model.cpu_packed import _AHEAD
from offload.model.cpu_packed_close import _close_tiles
from offload.model.simd import prefetch, prefetch_l2
from offload.model.simd_bytes import UNITS, vbpairs4, vbsplat, vmaddubs, vwiden16
from offload.model.simd_int import viadd, viload, vistore, vizero


@njit(forceinline=True, nogil=True)
def _sums1b(xp, qb, p0, half, far):  # pragma: no cover - compiled
    """One row's exact sums (four int32 vectors: rows 0-15 .. 48-63 of the block) over lane units p0 .. p0 + half - 1:
    its int8 steps xp (as int32, four a lane) against the block's int4 codes qb, asking `_AHEAD` bytes ahead into L1
    and `far` into L2 (`cpu_packed16._pair_prefetch`'s int4 pairs)."""
    t0 = t1 = t2 = t3 = vizero()
    end = p0 + half
    for c in range(p0, end, UNITS):
        lo = hi = vizero()
        for p in range(c, min(c + UNITS, end)):
            prefetch(qb, 64 * p + _AHEAD)
            prefetch_l2(qb, 64 * p + far)
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
    """`_sums4b` for the block's rows 32 h .. 32 h + 31 (h = 0: low nibbles, 1: high)."""
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
def _sums4b(XP, r, n, qb, p0, half, T):  # pragma: no cover - compiled
    """Rows r .. r + 3's exact sums over lane units p0 .. p0 + half - 1 into T (`_put16`), rows of XP past r + n - 1
    (n < 4) standing in by the last one's (T has room to a whole tile, 16 rows, past the rows closed)."""
    last = r + n - 1
    xa, xb, xc, xd = XP[r], XP[min(r + 1, last)], XP[min(r + 2, last)], XP[min(r + 3, last)]
    _half4(xa, xb, xc, xd, qb, p0, half, 0, r, T)
    _half4(xa, xb, xc, xd, qb, p0, half, 1, r, T)


@njit(forceinline=True, nogil=True)
def _fours4b(XP, step, xs, qb, S, Z, half, A, T):  # pragma: no cover - compiled
    """A block's outputs A (flat, [R * 64]) += the rows of XP in fours (`_sums4b` for each group, then closed from T)
    but a lone row over them (1, 5, 9 rows: one-row sums, `_sums1b`, cost less than a four) -> rows done. 2-3 rows
    over fours go as a four with stand-ins."""
    R, G = step.shape
    fours = R - 1 if R % 4 == 1 else R
    for g in range(G if fours else 0):
        for r in range(0, fours, 4):
            _sums4b(XP, r, min(4, fours - r), qb, g * half, half, T)
        _close_tiles(A, T, fours, S[g], Z[g], step, xs, g, False)
    return fours
