"""A group's exact int32 sums closed into a block's float32 outputs (`_stepped`, `cpu_packed._scale_by`: every
integer path's operations, `offload.model.cpu_packed16._scale16`), row by row from AMX tiles (`simd_amx.quad_sums`)
for the tile path. Knows nothing about models, tiers or files."""

from __future__ import annotations

from numba import njit

from offload.model.cpu_packed import _BLOCK, _load4, _scale_by
from offload.model.simd import LANES, prefetch, prefetch_l2, vfma, vload, vsplat, vstore, vzero
from offload.model.simd_int import viload, vitof, vsra


@njit(forceinline=True, nogil=True)
def _stepped(t0, t1, t2, t3, step, quads4):  # pragma: no cover - compiled
    """A group's exact integer sums t of 64 outputs as float32 times x's step (`cpu_packed16._scale16`'s). quads4:
    int4 codes in quads, whose rows 32-63's sums are of their codes times 16 (`vquads4`): divided exactly first."""
    if quads4:
        t2, t3 = vsra(t2, 4), vsra(t3, 4)
    sv, z = vsplat(step), vzero()
    return vfma(vitof(t0), sv, z), vfma(vitof(t1), sv, z), vfma(vitof(t2), sv, z), vfma(vitof(t3), sv, z)


@njit(forceinline=True, nogil=True)
def _close_tile(A, T, r, s0, s1, s2, s3, z0, z1, z2, z3, step, xs, quads4):  # pragma: no cover - compiled
    """A [64 r : 64 r + 64] = `cpu_packed16._scale16` of them with row r's sums in T (16 rows a tile, 1024 int32
    apart), its step and sum of x over the group, and the group's scales s and zeros z as vectors, loaded once for
    every row (LLVM does not take them out of the row loop: A's stores might change them; SmolLM2-135M's int8 / int4
    matrices from cache, 9 rows, 2 threads, a layer's products 113-120 / 127-144 -> 107-117 / 126-131 us)."""
    i, j = (r >> 4) * 1024 + 16 * (r & 15), _BLOCK * r
    t0, t1, t2, t3 = _stepped(viload(T, i), viload(T, i + 256), viload(T, i + 512), viload(T, i + 768), step, quads4)
    a0, a1, a2, a3 = _scale_by(vload(A, j), vload(A, j + LANES), vload(A, j + 2 * LANES), vload(A, j + 3 * LANES),
                               t0, t1, t2, t3, s0, s1, s2, s3, z0, z1, z2, z3, xs)
    vstore(A, j, a0)
    vstore(A, j + LANES, a1)
    vstore(A, j + 2 * LANES, a2)
    vstore(A, j + 3 * LANES, a3)


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
