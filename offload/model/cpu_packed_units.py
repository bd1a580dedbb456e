"""A lane unit of a packed matrix's 64-row block (two columns of codes as int16 pairs, four as int8 quads) in each
kind of integer product: the kinds, a unit's codes as four lane vectors of 16 rows, their products with x, and the
prefetches ahead of them; the loops over units that use them: `offload.model.cpu_packed16` (AVX-512's 32 registers)
and `offload.model.cpu_packed_fours` (four rows into a sums buffer, for AVX2's 16). Knows nothing about models, tiers
or files.
"""

from __future__ import annotations

from numba import njit

from offload.model.cpu_packed import _quads_end
from offload.model.simd import prefetch, prefetch_l2
from offload.model.simd_int import vcodes4, vcodes8, vdot, vdot8, vpairs8q0, vpairs8q1, vquads4, vquads8

#: How a product runs (`kind`): int4 / int8 codes by x in int16 pairs, in int8 quads; int4 by int8 steps in byte pairs.
_INT4, _INT8, _INT4_8, _INT8_8, _INT4_B = 0, 1, 2, 3, 4
#: Bytes ahead int4 pairs also ask for into L2 (`_pair_prefetch`: more in flight than L1's misses allow). One row, 170
#: MB of 1.7B int4 matrices, a Zen 4: 2 threads 26.8-32.6 -> 29.0-34.7 GB/s (int8 pairs lost 6-10%: not there); int4
#: quads 9 rows 17.1-17.4 -> 18.0-18.1 GB/s; int8 quads (189 MB) 9 rows 9.1-10.1 -> 8.0-9.6 ms, 32 rows 28.7 -> 21.8.
_AHEAD_L2 = 16384


@njit(forceinline=True, nogil=True)
def _per(kind):  # pragma: no cover - compiled
    """Columns of a lane unit: an int16 pair, or (`_INT4_8`, `_INT8_8`) an int8 quad."""
    return 4 if kind == _INT4_8 or kind == _INT8_8 else 2


@njit(forceinline=True, nogil=True)
def _cols(kind):  # pragma: no cover - compiled
    """Columns of x in an int32 of its steps: int8 steps 4 (quads and byte pairs), int16 2."""
    return 2 if kind == _INT4 or kind == _INT8 else 4


@njit(forceinline=True, nogil=True)
def _wide(kind):  # pragma: no cover - compiled
    return kind == _INT8 or kind == _INT8_8  # int8 codes (a byte a code), not int4


@njit(forceinline=True, nogil=True)
def _pair_codes(qb, p, kind):  # pragma: no cover - compiled
    """Lane unit p's columns (2p, 2p + 1; int8 quads: 4p .. 4p + 3) of a block's codes qb as four vectors of 16 rows
    (0-15, 16-31, 32-47, 48-63): int8 128 bytes of int16 pairs, int4 64; in quads int8 256, int4 128."""
    if kind == _INT8:  # (a unit of four columns holds two pairs: `quant.int8_tiles`; the last K % 4 columns as read)
        if 2 * p < _quads_end(qb):
            return vpairs8q1(qb, 256 * (p >> 1)) if p & 1 else vpairs8q0(qb, 256 * (p >> 1))
        return vcodes8(qb, 128 * p)
    if kind == _INT8_8:
        return vquads8(qb, 256 * p)
    if kind == _INT4_8:
        return vquads4(qb, 128 * p)
    return vcodes4(qb, 64 * p)


@njit(forceinline=True, nogil=True)
def _dot(acc, c, x, kind):  # pragma: no cover - compiled
    """acc + the lane's products of codes c and x: int16 pairs (`vdot`) or byte quads (`vdot8`)."""
    return vdot8(acc, c, x) if _per(kind) == 4 else vdot(acc, c, x)


@njit(forceinline=True, nogil=True)
def _dots(t, u, v, s, c, xv, yv, zv, wv, kind):  # pragma: no cover - compiled
    """`_dot` of codes c for four rows (their x: xv .. wv) into their sums t, u, v, s."""
    return _dot(t, c, xv, kind), _dot(u, c, yv, kind), _dot(v, c, zv, kind), _dot(s, c, wv, kind)


@njit(forceinline=True, nogil=True)
def _pair_prefetch(qb, p, ahead, kind):  # pragma: no cover - compiled
    """Ask for the codes `ahead` bytes past lane unit p's (int8 quads: four cache lines, int8 pairs and int4 quads:
    two, int4 pairs: one; all but int8 pairs also into L2 `_AHEAD_L2` past). (A second ask of int4's 4x as far: a
    Zen 5 350-370 -> 250-270 us, a Zen 4 12% slower.)"""
    if kind == _INT8_8:
        for e in range(0, 256, 64):
            prefetch(qb, 256 * p + ahead + e)
            prefetch_l2(qb, 256 * p + _AHEAD_L2 + e)
    elif kind != _INT4:
        prefetch(qb, 128 * p + ahead)
        prefetch(qb, 128 * p + ahead + 64)
        if kind == _INT4_8:
            prefetch_l2(qb, 128 * p + _AHEAD_L2)
            prefetch_l2(qb, 128 * p + _AHEAD_L2 + 64)
    else:
        prefetch(qb, 64 * p + ahead)
        prefetch_l2(qb, 64 * p + _AHEAD_L2)
