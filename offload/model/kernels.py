"""Row-invariant matrix products on the CPU: a row of `x @ W.T` has the same bits whatever rows are beside it.

GEMM libraries choose blocking, vector paths and thread splits by the number of rows, so a row's result can
change in its last bits with the batch it runs in (MKL float32 [8192, 2048] on a 2-core AVX2 machine: one row
alone and the same row among 4 differ). The products here compute every row with the same instructions in the
same order whatever else is in the pass, so a decode step alone, the same step in a batch, the token columns of
a speculative verify pass and a prompt chunk give a row the same bits, and a verify pass is one product over
all its rows (the weights read once), not one product per column.

    dense    numba (LLVM, compiled at first use and cached; no compiler needed): eight output features at a time,
             their weight rows widened exactly to float32 into an L1 buffer (bf16 and fp16 inline: no dense copy
             of the matrix), then every input row against the eight on its own (8 FMAs per load of x): no
             padding, so a decode row costs one row; bf16 by bf16 in pairs (`cpu_bf16`).
    int4     the group-wise tile layouts of `offload.weights.quant` (int4: torch's CPU int4 packing; int8: one
    int8     byte a weight in the same 64-row tiles): `offload.model.cpu_packed`, across the 64 rows of a tile
             in explicit 16-lane vectors, each output accumulating along k in order, scaled once a group
             (torch's `_weight_int4pack_mm_for_cpu` only without numba).
    layer    `offload.model.fused`: a whole decoder layer in one compiled call over these kernels.

Without numba (or with OFFLOAD_CPU_KERNELS=library, to measure what invariance costs), products fall back
to `F.linear` / torch's kernels and `ROW_INVARIANT` is False (a verify pass multiplies column by column).
Knows nothing about models, tiers or files.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch

from offload.model.kernel_stamp import stamp_kernel_sources

try:  # an install dependency; its absence only costs row invariance and the verify pass's speed
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only on an install without numba
    numba = None
if os.environ.get("OFFLOAD_CPU_KERNELS", "invariant") == "library":  # measure the library path (benchmarks)
    numba = None

log = logging.getLogger(__name__)

#: Every CPU product of this module keeps rows independent of the batch.
ROW_INVARIANT = numba is not None
#: Which CPU kernels a calibration measured (raised when their speed changes: a calibration of older ones is
#: measured again by `offload chat --auto` and scripts/bench_cpu.py; `git log -S VERSION` tells each step, from 2:
#: three-row tiles, to 29: bf16 products, and int8 steps from 10 rows, on AMX tiles where granted, `simd_amx`; 30:
#: int8 steps on tiles from 6 rows, attention 1.2-1.4x faster; 31-36: the results' labels of later steps, VERSION
#: kept; 37: without AVX-512, int4 pairs unpacked in AVX2's shuffles, int16 steps, 2-4 rows of pairs one by one;
#: 38: without VNNI, int4 codes by int8 steps in AVX2's byte pairs, `simd_bytes`; 39: without AVX-512, packed and bf16
#: products of 3+ rows in fours, `cpu_packed_fours`, `cpu_bf16._rows4x`).
VERSION = 39
#: Columns of the dense kernel's weight buffer (8 rows x 512 float32 = 16 KiB: in L1 beside three rows of x). The
#: 1.7B shape's four bf16 matrices x 2, one thread: whole rows (64-180 KiB buffers, read from L2) -> 512 columns:
#: 64 rows 195 -> 150 ms, 9 rows 51 -> 42 ms, 1 row 34 -> 25 ms. In a 1.7B bf16 run (weights from DRAM) 512 is
#: best too: a decode layer 7.9 / 10.0 / 11.5 ms at 512 / 1024 / 2048.
_KC = 512

if numba is not None:
    import llvmlite.binding as llvm_binding

    stamp_kernel_sources()

    # A row's bits must not depend on which loop computes it: `_dot8` (one row) and `_dot8x3` (three rows at once)
    # each reduce along k in VF lanes, then sum the lanes, then add the tail in order. LLVM picks the interleave
    # count (the accumulators per output) by register pressure, so it differs between the two loops: forced to 1,
    # and no vectorised epilogue (its use is a cost decision too). These are LLVM's process-wide settings.
    llvm_binding.set_option("offload", "-force-vector-interleave=1")
    llvm_binding.set_option("offload", "-enable-epilogue-vectorization=false")
    if numba.config.CPU_FEATURES is None and "+avx512f" in llvm_binding.get_host_cpu_features().flatten():
        # LLVM tunes server AVX-512 parts to 256-bit vectors; the products are FMA-bound beyond one row and run
        # ~1.5x faster at 512 (2-core Emerald Rapids VM, 64 rows: 139 -> 93 ms). Takes effect if numba has not
        # compiled anything yet in this process (its cache keys on the features, so no stale code is loaded).
        numba.config.CPU_FEATURES = llvm_binding.get_host_cpu_features().flatten() + ",-prefer-256-bit"
    # reassociation (vectorised reductions: the order is the compiled loop's, the same for every row) and FMA
    # contraction, but no "no infinities / NaNs" assumption: masked keys and fp16 infinities are real values
    _jit = njit(parallel=True, fastmath={"reassoc", "contract", "nsz"}, cache=True, nogil=True)

    from numba.core import types
    from numba.extending import overload

    from offload.model.cpu_bf16 import bf16_bits, rows_bf16
    from offload.model.cpu_bf16_tiles import products_tiles
    from offload.model.cpu_packed_entry import AMX_TILES, FLOAT32_STEPS, INT4_AS_INT8, INT8_AS_INT8, INT16_STEPS, packed
    from offload.model.simd import _avx512, _bits_f32, _f32_bits, parts, prefetch  # noqa: F401 - the fused layer's too
    from offload.model.simd_amx import bf16_tiles, int8_tiles
    from offload.model.simd_bytes import pair_bytes
    from offload.model.simd_int import byte_dots

    _WIDE = _avx512()  # registers for `cpu_bf16._rows3`'s tile (frozen into the compiled code: numba's cache keys
    # on the CPU)

    @njit(inline="always")
    def _widen_f16(src, dst):  # pragma: no cover - compiled
        """IEEE half bits -> float32 bits: exponent and mantissa moved into float32's fields and rebiased by
        multiplying by 2^112 (normals and subnormals exact), infinities and NaNs restored, the sign put back."""
        row = dst.view(np.float32)
        for k in range(src.shape[0]):
            dst[k] = (np.uint32(src[k]) & np.uint32(0x7FFF)) << 13
        for k in range(src.shape[0]):
            h = np.uint32(src[k])
            val = row[k] * np.float32(5.192296858534828e33)
            if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
                val = np.inf if (h & np.uint32(0x3FF)) == 0 else np.nan
            row[k] = -val if h & np.uint32(0x8000) else val

    @njit(inline="always")
    def _put(out, r, n, count, acc, k0):  # pragma: no cover - compiled
        """out[r, n + j] = acc[j] for the first chunk of k, += for the next ones (j < count)."""
        for j, a in enumerate(acc):
            if j < count:
                out[r, n + j] = a if k0 == 0 else out[r, n + j] + a

    @njit(fastmath={"reassoc", "contract", "nsz"}, nogil=True)
    def _dot8(x, r, buf, n, count, out, k0, kc):  # pragma: no cover - compiled
        """out[r, n : n + count] (+)= x[r, k0 : k0 + kc] @ buf[:count, :kc].T, buf [8, kc] float32 weight rows: 8
        outputs share each load of x. Every row of every product goes through this one loop on its own, so a row's
        bits do not depend on the rows beside it (nor on count: a short group computes 8 and stores `count`)."""
        xr = x[r, k0:k0 + kc]  # (a view: an index k0 + k would be checked for wraparound, unvectorised)
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for k in range(kc):
            xk = xr[k]
            a0 += xk * buf[0, k]
            a1 += xk * buf[1, k]
            a2 += xk * buf[2, k]
            a3 += xk * buf[3, k]
            a4 += xk * buf[4, k]
            a5 += xk * buf[5, k]
            a6 += xk * buf[6, k]
            a7 += xk * buf[7, k]
        _put(out, r, n, count, (a0, a1, a2, a3, a4, a5, a6, a7), k0)

    @njit(fastmath={"reassoc", "contract", "nsz"}, nogil=True)
    def _dot8x3(x, r, buf, n, count, out, k0, kc):  # pragma: no cover - compiled
        """`_dot8` for rows r, r + 1, r + 2 at once: each weight load of the buffer serves three rows (the products
        beyond one row are bound by loads from L1, not by memory). Every output is the same reduction as in
        `_dot8` (see the interleave setting above), so a row has the same bits in a tile as alone."""
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
        c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = np.float32(0.0)
        xr0, xr1, xr2 = x[r, k0:k0 + kc], x[r + 1, k0:k0 + kc], x[r + 2, k0:k0 + kc]
        for k in range(kc):
            xa, xb, xc = xr0[k], xr1[k], xr2[k]
            w = buf[0, k]
            a0 += xa * w
            b0 += xb * w
            c0 += xc * w
            w = buf[1, k]
            a1 += xa * w
            b1 += xb * w
            c1 += xc * w
            w = buf[2, k]
            a2 += xa * w
            b2 += xb * w
            c2 += xc * w
            w = buf[3, k]
            a3 += xa * w
            b3 += xb * w
            c3 += xc * w
            w = buf[4, k]
            a4 += xa * w
            b4 += xb * w
            c4 += xc * w
            w = buf[5, k]
            a5 += xa * w
            b5 += xb * w
            c5 += xc * w
            w = buf[6, k]
            a6 += xa * w
            b6 += xb * w
            c6 += xc * w
            w = buf[7, k]
            a7 += xa * w
            b7 += xb * w
            c7 += xc * w
        _put(out, r, n, count, (a0, a1, a2, a3, a4, a5, a6, a7), k0)
        _put(out, r + 1, n, count, (b0, b1, b2, b3, b4, b5, b6, b7), k0)
        _put(out, r + 2, n, count, (c0, c1, c2, c3, c4, c5, c6, c7), k0)

    @njit(inline="always")
    def _widen(w, row, bits, buf, j, kind, k0, kc):  # pragma: no cover - compiled
        """Columns k0 : k0 + kc of weight row `row` -> float32 in buffer row j (bits / buf: the buffer's two views):
        kind 0 float32 bits (copied), 1 bf16 bits, 2 fp16 bits."""
        if kind == 1:
            src = w[row, k0:k0 + kc]  # (stored through the 2-D buffer, not a row view of it: ~10% faster)
            for k in range(kc):
                bits[j, k] = np.uint32(src[k]) << 16
        elif kind == 2:
            _widen_f16(w[row, k0:k0 + kc], bits[j])
        else:
            src = w[row, k0:k0 + kc]
            for k in range(kc):
                bits[j, k] = src[k]

    @_jit
    def _dense(x, w, out, kind):  # pragma: no cover - compiled
        """x [R, K] f32, w [N, K] of `kind` (`_widen`) -> out [R, N] f32. For 8 weight rows at a time and `_KC`
        columns at a time, the weights are widened exactly into a float32 buffer (read from DRAM once, from L1 by
        every row: 16 KiB), then `_dot8x3` takes each three rows of x and `_dot8` the one or two left; each chunk's
        sums are added to the outputs in order. The chunks are the same for every R, so a row's bits are too. (One
        function with a kind, not one closure per dtype: numba's cache does not keep closures.)"""
        R, K = x.shape
        N = w.shape[0]
        share, shares = parts(N, 8)  # (one contiguous share of rows a thread)
        if kind == DENSE_BF16_TILES:  # bf16 x and w on AMX tiles (`cpu_bf16_tiles`), every row count alike
            products_tiles(x, w, out)
            return
        if kind == DENSE_BF16:  # bf16 x and w: multiplied as bf16 pairs (`cpu_bf16`)
            xb = bf16_bits(x)
            for t in prange(shares):
                rows_bf16(xb, w, out, t * share, min(N, t * share + share), _WIDE)
            return
        wa, rb, isz = w.ctypes.data, w.strides[0], w.itemsize  # (prefetched by address: a view costs refcounts)
        for t in prange(shares):
            buf = np.empty((8, min(K, _KC)), np.float32)
            bits = buf.view(np.uint32)
            end = min(N, t * share + share)
            for n in range(t * share, end, 8):
                count = min(8, end - n)
                for k0 in range(0, K, _KC):
                    kc = min(_KC, K - k0)
                    for j in range(8):
                        _widen(w, min(n + j, end - 1), bits, buf, j, kind, k0, kc)
                        # the columns the next pass widens, while these compute
                        pr, pk = (n + j, k0 + kc) if k0 + kc < K else (n + 8 + j, 0)
                        if pr < N:
                            for e in range(pk * isz, min(K, pk + _KC) * isz, 64):
                                prefetch(wa, pr * rb + e)
                    for r in range(0, R - R % 3, 3):
                        _dot8x3(x, r, buf, n, count, out, k0, kc)
                    for r in range(R - R % 3, R):
                        _dot8(x, r, buf, n, count, out, k0, kc)

    @njit(inline="always")
    def _ints(kind):  # pragma: no cover - compiled
        """`cpu_packed_entry.packed`'s `ints` of a packed kind."""
        return kind - PACKED_STEPS if kind > PACKED_STEPS else FLOAT32_STEPS

    def _product(x, w, sz, out, kind):
        """out = x @ w.T for compiled callers: int8 / int4 tiles (uint8 [rows / 64, K, 64 / 32]) by `cpu_packed`
        (the width chosen at run time), other weights by `_dense` (chosen by type when the caller compiles, so none
        is compiled for another's weights)."""

    @overload(_product)
    def _product_by_type(x, w, sz, out, kind):  # pragma: no cover - compiled
        if w.dtype == types.uint8:
            return lambda x, w, sz, out, kind: packed(x, w, sz, out, _ints(kind))
        return lambda x, w, sz, out, kind: _dense(x, w, out, kind)

#: The dense kernel's weight kinds (`_widen`) by a dense matrix's dtype; PACKED: a packed matrix's, x in float32;
#: PACKED_STEPS + `cpu_packed_entry`'s `ints` bits: x (bf16) in integer steps (`packed_kind`); DENSE_BF16: a bf16
#: matrix's with bf16 activations, multiplied as bf16 pairs (`cpu_bf16`; x holds bf16 values), DENSE_BF16_TILES: on
#: AMX tiles where the process may use them (`cpu_bf16_tiles`).
DENSE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2} if numba is not None else {}
PACKED, DENSE_BF16, DENSE_BF16_TILES, PACKED_STEPS = 3, 5, 6, 8


def activation_steps(asked: str, bits: int) -> str:
    """The steps a config's "int8", "int16" or "auto" means here against `bits`-bit codes: auto is int8 where a CPU
    multiplies bytes in one instruction (`simd_int.byte_dots`: AVX-512 VNNI, which every AMX CPU has; against int4
    codes also AVX2's byte pairs, `simd_bytes.pair_bytes`), int16 elsewhere (int8 codes by int8 steps on AVX2 widen
    the bytes first: 1.3-8x slower than int16 steps, which are also the closer of the two)."""
    if asked != "auto":
        return asked
    return "int8" if numba is not None and (byte_dots() or (bits == 4 and pair_bytes())) else "int16"


#: The steps of bf16 activations against int4 and int8 codes: "int8" or "int16" each (`packed_kind`; config
#: `weights.int4_activations` / `int8_activations`, set for the process by each executor built; "auto" until then).
ACTIVATIONS = {"int4": activation_steps("auto", 4), "int8": activation_steps("auto", 8)}


def use_activations(int4: str, int8: str) -> None:
    """bf16 activations meet int4 / int8 codes in "int8" steps (llama.cpp's Q4_0 / Q8_0 error class) or "int16"
    ones ("auto": `activation_steps`), from the next layer built; process-wide, like the kernels' threads
    (`cpu_packed16`)."""
    ACTIVATIONS.update(int4=activation_steps(int4, 4), int8=activation_steps(int8, 8))


def dense_kind(weights: torch.dtype, activations: torch.dtype) -> int:
    """How `_dense` multiplies a dense matrix by activations of this dtype: bf16 by bf16 in pairs (no widening, the
    products exact; on AMX tiles where granted), anything else widened to float32 (`_widen`)."""
    if weights == activations == torch.bfloat16:
        return DENSE_BF16_TILES if bf16_tiles() else DENSE_BF16
    return DENSE_KIND[weights]


def packed_kind(activations: torch.dtype) -> int:
    """How a packed matrix multiplies activations of this dtype: bf16 in integer steps (int16: bf16's 8 significant
    bits kept wherever an entry is within 2^7 of its group's largest; int8 by default, `use_activations`; on AMX
    tiles where granted), float32 and fp16 (11 significant bits, more than the steps keep) in float32."""
    if activations != torch.bfloat16:
        return PACKED
    return (PACKED_STEPS + INT16_STEPS + (INT4_AS_INT8 if ACTIVATIONS["int4"] == "int8" else 0)
            + (INT8_AS_INT8 if ACTIVATIONS["int8"] == "int8" else 0) + (AMX_TILES if int8_tiles() else 0))
NO_SCALES = np.zeros((0, 1, 2), np.uint16)  # the scales argument of a dense (not int8) product


#: multiply-adds below which a kernel runs on one thread (a parallel region costs more than it saves). SmolLM2-135M
#: decode, 2 quiet cores, 1 << 22 -> 1 << 18: bf16 54 -> 44, int8 60 -> 45, int4 57 -> 45 ms a step (1 << 16: same)
PARALLEL_WORK = 1 << 18
_set = threading.local()  # the thread count this thread last gave numba (its setting is per thread)


def _threads(work: int) -> None:
    """numba's pool follows torch's thread count (both default to the cores this process may use), one thread
    for small work. Results do not depend on it: every output is computed whole by one thread."""
    want = 1 if work < PARALLEL_WORK else max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if getattr(_set, "n", None) != want:  # asking numba costs a call into its launcher: ~120 products a step
        numba.set_num_threads(want)
        _set.n = want


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bits over the same memory, for the kernels: uint16 (bf16, fp16) or uint32 (float32)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy().view(np.uint32)


def dense_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Does `dense_linear` take this pair (CPU, a 2-D weight of a dtype it widens)?"""
    return x.device.type == "cpu" and widens(w, x.dtype)


def widens(w: torch.Tensor, compute: torch.dtype) -> bool:
    """Does `dense_linear` multiply the matrix `w` by activations of dtype `compute` as it is (no upcast copy)?"""
    return numba is not None and w.device.type == "cpu" and w.dim() == 2 and w.dtype in DENSE_KIND and \
        compute in (torch.float32, torch.bfloat16, torch.float16)


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32 / bf16 / fp16) @ w [N, K].T (+ bias) -> [..., N] in x's dtype, accumulated in float32,
    every row independent of the others. The weight keeps its dtype (no widened copy)."""
    _threads(x.numel() * w.shape[0])
    lead, K = x.shape[:-1], x.shape[-1]
    if w.shape[1] != K:  # the kernels do not check bounds
        raise ValueError(f"x has {K} columns but the weight {tuple(w.shape)} takes {w.shape[1]}")
    x2 = x.reshape(-1, K).to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32)
    if y.numel():
        _dense(x2.numpy(), _as_numpy(w.contiguous()), y.numpy(), dense_kind(w.dtype, x.dtype))
    if bias is not None:
        y += bias
    return (y if x.dtype == torch.float32 else y.to(x.dtype)).reshape(*lead, w.shape[0])


def packed_supported(sz: torch.Tensor) -> bool:
    return numba is not None and sz.device.type == "cpu" and sz.dtype in (torch.bfloat16, torch.float32)


def is_int8(sz: torch.Tensor) -> bool:
    """Is a packed matrix int8 (scales [K/g, rows, 2]) or int4 (its plane's [1, K/g, rows, 2])?"""
    return sz.dim() == 3


def packed_rows_cols(q: torch.Tensor, sz: torch.Tensor) -> tuple[int, int]:
    """(padded rows, K) of a packed matrix."""
    return (q.shape[0] * q.shape[2], q.shape[1]) if is_int8(sz) else (q.shape[1], 2 * q.shape[2])


def packed_linear(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ a packed matrix: int8 tiles (q uint8 [rows / 64, K, 64], sz [K/g, rows, 2] (scale, min)) or the
    int4 plane (q uint8 [1, rows, K/2] in tile order, sz [1, K/g, rows, 2] (scale, zero)), scales bf16 or float32
    -> [M, rows] float32, every row independent of the others (`cpu_packed`; bf16 x in steps: `packed_kind`)."""
    int8 = is_int8(sz)
    rows, K = packed_rows_cols(q, sz)
    G = sz.shape[-3]
    if (q.shape[2] != 64 if int8 else q.shape[0] != 1) or rows % 64 or x.shape[-1] != K or G == 0 or K % G \
            or sz.shape[-2] != rows:
        raise ValueError(f"x {tuple(x.shape)} does not fit packed codes {tuple(q.shape)} / {tuple(sz.shape)}")
    _threads(x.numel() * rows)
    x32 = x.to(torch.float32).contiguous()
    out = torch.empty(x32.shape[0], rows, dtype=torch.float32)
    if out.numel():
        tiles, bits = packed_args(q, sz)
        packed(x32.numpy(), tiles, bits, out.numpy(), _ints(packed_kind(x.dtype)))
    return out


def packed_args(q: torch.Tensor, sz: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A packed matrix as the kernels take it: (its tiles, uint8 [rows / 64, K, 64 (int8) or 32], `scale_bits`)."""
    if is_int8(sz):
        return q.contiguous().numpy(), scale_bits(sz)
    _, rows, half = q.shape
    return q.contiguous().view(rows // 64, 2 * half, 32).numpy(), scale_bits(sz[0])


def scale_bits(sz: torch.Tensor) -> np.ndarray:
    """(scale, min / zero) pairs [K / g, rows, 2], bf16 or float32, as the kernels take them: their raw bits in uint16
    units, [K / g, rows, 2] or [K / g, rows, 4] (float32's low half first). One array type for both, so each packed
    kernel is compiled once, not once a scale dtype (~90 s each on a 2-core Zen 3)."""
    return sz.contiguous().view(torch.int16).numpy().view(np.uint16)
