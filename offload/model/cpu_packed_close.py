"""A group's exact int32 sums from AMX tiles (`simd_amx.quad_sums`) closed into a block's float32 outputs: for
`offload.model.cpu_packed16`'s tile path, `_scale16`'s operations row by row. Knows nothing about models, tiers or
files."""

from __future__ import annotations

from numba import njit

from offload.model.cpu_packed import _BLOCK, _load4
from offload.model.simd import LANES, prefetch, prefetch_l2, vfma, vload, vsplat, vstore, vzero
from offload.model.simd_int import viload, vitof, vsra


@njit(forceinline=True, nogil=True)
def _close_tile(A, T, r, s0, s1, s2, s3, z0, z1, z2, z3, step, xs, quads4):  # pragma: no cover - compiled
    """A [64 r : 64 r + 64] = `cpu_packed16._scale16` of them with row r's sums in T (16 rows a tile, 1024 int32
    apart), its step and sum of x over the group, and the group's scales s and zeros z as vectors, loaded once for
    every row (LLVM does not take them out of the row loop: A's stores might change them; SmolLM2-135M's int8 / int4
    matrices from cache, 9 rows, 2 threads, a layer's products 113-120 / 127-144 -> 107-117 / 126-131 us). quads4:
    int4 codes in quads (rows 32-63's sums are of their codes times 16: divided exactly first)."""
    i = (r >> 4) * 1024 + 16 * (r & 15)
    t0, t1, t2, t3 = viload(T, i), viload(T, i + 256), viload(T, i + 512), viload(T, i + 768)
    if quads4:
        t2, t3 = vsra(t2, 4), vsra(t3, 4)
    sv, z, xv, j = vsplat(step), vzero(), vsplat(xs), _BLOCK * r
    vstore(A, j, vfma(z0, xv, vfma(s0, vfma(vitof(t0), sv, z), vload(A, j))))
    vstore(A, j + LANES, vfma(z1, xv, vfma(s1, vfma(vitof(t1), sv, z), vload(A, j + LANES))))
    vstore(A, j + 2 * LANES, vfma(z2, xv, vfma(s2, vfma(vitof(t2), sv, z), vload(A, j + 2 * LANES))))
    vstore(A, j + 3 * LANES, vfma(z3, xv, vfma(s3, vfma(vitof(t3), sv, z), vload(A, j + 3 * LANES))))


@njit(forceinline=True, nogil=True)
def _close_tiles(A, T, R, Sg, Zg, step, xs, g, quads4):  # pragma: no cover - compiled
    """`_close_tile` of group g (scales Sg, zeros Zg [64]) for every row."""
    s0, s1, s2, s3 = _load4(Sg)
    z0, z1, z2, z3 = _load4(Zg)
    for r in range(R):
        _close_tile(A, T, r, s0, s1, s2, s3, z0, z1, z2, z3, step[r, g], xs[r, g], quads4)


@njit(forceinline=True, nogil=True)
def _close_asking(A, T, R, Sg, Zg, step, xs, g, quads4, qb, nxt, lines, far):  # pragma: no cover - compiled
    """`_close_tiles`, asking between rows for the next group's codes: `lines` cache lines from byte nxt of qb into
    L1, and `far` bytes further on into L2. Spread among the rows, not asked for at once before the tiles: 30 layers
    of SmolLM2-135M's int8 matrices from memory, 9 rows, 2 threads, 6 interleaved runs each, 5.00 -> 4.49 ms best,
    5.30 -> 4.95 median (into L1 alone, spread: 5.29 / 5.79). (int4's codes are asked for as they are widened:
    spread in the close they lost 5%.)"""
    s0, s1, s2, s3 = _load4(Sg)
    z0, z1, z2, z3 = _load4(Zg)
    per = (lines + R - 1) // R
    for r in range(R):
        _close_tile(A, T, r, s0, s1, s2, s3, z0, z1, z2, z3, step[r, g], xs[r, g], quads4)
        for e in range(r * per, min(lines, r * per + per)):
            prefetch(qb, nxt + 64 * e)
            prefetch_l2(qb, nxt + far + 64 * e)
