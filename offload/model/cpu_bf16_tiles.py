"""Dense products of bf16 activations and bf16 weights on AMX tiles (`kernels.DENSE_BF16` where the process may use
them: `simd_amx.bf16_tiles`), for every number of rows.

A tile product `tile_dpbf16ps(c, a, b)` takes 16 weight rows by 32 columns (a: the rows as they lie in memory, one
64-byte line each) and 32 columns of up to 16 rows of x as bf16 pairs (b: pair k of row m at row k, column m), and
adds each output's 32 products into its float32 sum in c, in the hardware's own order: not vdpbf16ps's pair by pair
(`cpu_bf16`), so on these cores every bf16 product of the process runs here, one row of x as much as many. Each
column m of c is row m of x alone (the same bits in a tile of 1, 9 or 16 rows: measured on a 2-core Xeon VM), and
every output is one sequence: the tiles of 32 columns in order, the columns past the last whole 32 pairs in one
narrower tile, an odd last column by one fused multiply-add. So a row's bits depend on nothing but the row, as with
the vectors. Output rows go 16 at a time (a last partial 16 in its own shape); rows of x 16 a tile, one after the
other.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from offload.model.simd import _bits_f32, fma, parts
from offload.model.simd_amx import (
    configure,
    tile_dpbf16ps,
    tile_load,
    tile_store,
    tile_zero,
    tiles_config,
    tiles_release,
)


@njit(nogil=True)
def tile_pairs(x):  # pragma: no cover - compiled
    """x [R, K] float32 holding bf16 values -> P uint32 [ceil(R / 16), K // 2, W]: P[c, k, m] = row 16 c + m's
    columns 2k (low half) and 2k + 1 (high) as bf16 bits; W = R up to 16 rows (one row: its own pairs, contiguous),
    else 16, the last chunk's columns past R zero."""
    R, K = x.shape
    bits = x.view(np.uint32)
    W = R if R <= 16 else 16
    P = np.empty(((R + 15) // 16, K // 2, W), np.uint32)
    if R > 16 and R % 16:
        P[-1, :, R % 16:] = 0
    for r in range(R):
        c, m = r >> 4, r & 15
        for k in range(K // 2):
            P[c, k, m] = (bits[r, 2 * k] >> np.uint32(16)) | (bits[r, 2 * k + 1] & np.uint32(0xFFFF0000))
    return P


@njit(inline="always")
def _shape(nr, mc, kt):  # pragma: no cover - compiled
    """The tiles for nr output rows and mc rows of x: 0 the sums (nr x mc float32), 1 / 2 the weights / x of 32
    columns, 3 / 4 of the last kt pairs."""
    return ((nr, 4 * mc), (nr, 64), (16, 4 * mc), (nr, 4 * max(kt, 1)), (max(kt, 1), 4 * mc))


@njit(inline="always")
def _tile(P, c, w, n, ws, full, kt, T):  # pragma: no cover - compiled
    """T [16, 16] = the sums of weight rows n .. (tile 0's rows) by chunk c of x's pairs. (No software prefetch: the
    hardware's follows the 16 rows; 1 / 2 / 4 KiB ahead into L2 cost one row 0-27%.)"""
    tile_zero(0)
    xs = 4 * P.shape[2]  # (bytes a row of x's tile)
    base, pb = n * ws, c * P.shape[1] * xs
    for k in range(full):
        tile_load(1, w, base + 64 * k, ws)
        tile_load(2, P, pb + 16 * xs * k, xs)
        tile_dpbf16ps(0, 1, 2)
    if kt:
        tile_load(3, w, base + 64 * full, ws)
        tile_load(4, P, pb + 16 * xs * full, xs)
        tile_dpbf16ps(0, 3, 4)
    tile_store(0, T, 0, 64)


@njit(inline="always")
def _rows(x, P, w, out, n0, n1, cfg, T):  # pragma: no cover - compiled
    """out[:, n0:n1] = x @ w[n0:n1].T on tiles (one thread's share): each 16 weight rows by every 16 rows of x (the
    weights from memory once, then from L2), x's tile as wide as P's rows."""
    R, K = x.shape
    ws, full, kt = w.strides[0], (K // 2) // 16, (K // 2) % 16
    mc, shape = P.shape[2], -1
    for n in range(n0, n1, 16):
        nr = min(16, n1 - n)
        if nr != shape:
            configure(cfg, _shape(nr, mc, kt))
            tiles_config(cfg)
            shape = nr
        for c in range(P.shape[0]):
            _tile(P, c, w, n, ws, full, kt, T)
            for m in range(min(16, R - 16 * c)):
                r = 16 * c + m
                for i in range(nr):
                    s = T[i, m]
                    if K % 2:
                        s = fma(_bits_f32(np.uint32(w[n + i, K - 1]) << np.uint32(16)), x[r, K - 1], s)
                    out[r, n + i] = s
    tiles_release()


@njit(inline="always")  # (its prange must land in the caller's parallel entry)
def products_tiles(x, w, out):  # pragma: no cover - compiled
    """out [R, N] = x [R, K] (float32 holding bf16 values) @ w [N, K].T (bf16 bits, rows contiguous) on tiles, 16
    output rows a work item, one contiguous share a thread."""
    N = w.shape[0]
    P = tile_pairs(x)
    share, shares = parts(N, 16)
    for t in prange(shares):
        cfg, T = np.empty(64, np.uint8), np.empty((16, 16), np.float32)
        _rows(x, P, w, out, t * share, min(N, t * share + share), cfg, T)
