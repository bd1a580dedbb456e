"""The entries of the packed products: one compiled function per pair of code width and steps of x
(`offload.model.cpu_packed16._tiles16`), and `packed`, the entry every caller uses, which chooses between these and
`offload.model.cpu_packed`'s float32 products. Knows nothing about models, tiers or files.
"""

from __future__ import annotations

from numba import njit

from offload.model.cpu_packed import _BLOCK, _int4, _int8
from offload.model.cpu_packed16 import _INT4, _INT4_8, _INT8, _INT8_8, _QUADS, _QUADS8, _tiles16

#: `packed`'s choices for x (`ints`, bits): float32 products (0), integer steps (INT16_STEPS: int16 against both
#: widths), int8 steps against int4 codes (| INT4_AS_INT8) and against int8 codes (| INT8_AS_INT8), those on AMX
#: tiles from `cpu_packed16._TILE_ROWS` rows (| AMX_TILES: only where `simd_amx.granted`).
FLOAT32_STEPS, INT16_STEPS, INT4_AS_INT8, INT8_AS_INT8, AMX_TILES = 0, 1, 2, 4, 8


@njit(parallel=True, cache=True, nogil=True)
def _int4_16(x, q, sz, out):  # pragma: no cover - compiled
    """`_int4` with x in int16 steps (`_tiles16`)."""
    _tiles16(x, q, sz, out, _INT4, _QUADS, False)


@njit(parallel=True, cache=True, nogil=True)
def _int8_16(x, q, sz, out):  # pragma: no cover - compiled
    """`_int8` with x in int16 steps (`_tiles16`)."""
    _tiles16(x, q, sz, out, _INT8, _QUADS, False)


@njit(parallel=True, cache=True, nogil=True)
def _int4_8(x, q, sz, out, amx):  # pragma: no cover - compiled
    """`_int4` with x in int8 steps (`_tiles16`, `vquads4`; `amx`: on tiles from `_TILE_ROWS`)."""
    _tiles16(x, q, sz, out, _INT4_8, _QUADS, amx)


@njit(parallel=True, cache=True, nogil=True)
def _int8_8(x, q, sz, out, amx):  # pragma: no cover - compiled
    """`_int8` with x in int8 steps (`_tiles16`, `vquads8`; `amx`: on tiles from `_TILE_ROWS`)."""
    _tiles16(x, q, sz, out, _INT8_8, _QUADS8, amx)


@njit(nogil=True, cache=True)
def packed(x, q, sz, out, ints):  # pragma: no cover - compiled
    """x [R, K] float32 @ int8 or int4 tiles (by their width) -> out [R, rows] float32: for bf16 activations (`ints`
    not FLOAT32_STEPS) x in integer steps where the groups are even: int8 steps against a width whose bit is set
    (INT4_AS_INT8, INT8_AS_INT8) where the groups are a multiple of 4, else int16 steps; float32 products otherwise.
    One numba type for every case: compiled callers choose at run time. Cached like the kernels it calls (their
    files stamp it: `kernels`): a process's first packed product 3.0 -> 0.8 s with a warm cache."""
    gs = x.shape[1] // sz.shape[0]
    wide = q.shape[2] == _BLOCK
    if ints != FLOAT32_STEPS and gs % 2 == 0:
        quads = gs % 4 == 0 and (ints & (INT8_AS_INT8 if wide else INT4_AS_INT8)) != 0
        if wide:
            if quads:
                _int8_8(x, q, sz, out, (ints & AMX_TILES) != 0)
            else:
                _int8_16(x, q, sz, out)
        elif quads:
            _int4_8(x, q, sz, out, (ints & AMX_TILES) != 0)
        else:
            _int4_16(x, q, sz, out)
    elif wide:
        _int8(x, q, sz, out)
    else:
        _int4(x, q, sz, out)
