"""Intel AMX tiles as numba intrinsics: int8 products of many rows (`offload.model.cpu_packed16`), bf16 products of
any number of rows (`offload.model.cpu_bf16_tiles`).

A tile is up to 16 rows of up to 64 bytes in one of eight tile registers; `tile_dpbsud(c, a, b)` adds to each int32
c[m, n] the products of row m of a (int8, signed) and column n of b (uint8 quads: row k of b holds, for 16 columns,
the bytes of inputs 4k .. 4k + 3), 1024 multiply-adds an instruction at 16 rows, exact in int32 like AVX-512 VNNI's
vpdpbusd. An integer sum has no order, so a product run on tiles has the bits of the same product run on vectors:
the kernels choose tiles by the rows they multiply and every row keeps the bits it has alone.

    tiles_config(cfg)                   load the shapes (`configure` writes the 64-byte record) for this thread
    tiles_release()                     give the tiles back (the thread's AMX state cleared)
    tile_zero(t)                        tile t = 0
    tile_load(t, a, at, stride)         tile t = the rows at byte `at` of array a, `stride` bytes apart
    tile_store(t, a, at, stride)        the other way
    tile_dpbsud(c, a, b)                c += a (int8 rows) . b (uint8 quads), exact in int32
    tile_dpbf16ps(c, a, b)              c += a (bf16 pairs) . b (bf16 pairs), float32 (`cpu_bf16_tiles`)

Tile numbers are compile-time constants. Linux lends a process the tiles' 8 KiB of state only when asked
(`granted`: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), asked when this module loads); before that the first tile
instruction is SIGILL, so the callers pass whether it was granted at run time. Where numba's CPU has no AMX the
intrinsics compile to nothing (`AMX` is False and no caller runs them). Bounds are the caller's.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import llvmlite.ir as ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from offload.model.simd import _has, _x86

#: Does numba compile for cores with AMX tiles, and with their int8 and bf16 products?
AMX = _x86() and _has("amx-tile")
AMX_INT8, AMX_BF16 = AMX and _has("amx-int8"), AMX and _has("amx-bf16")
_I8, _I64 = ir.IntType(8), ir.IntType(64)
_P = ir.PointerType(_I8)
_VOID = ir.VoidType()
#: arch_prctl's request for a permission and the tiles' data component (linux/arch/x86/include/uapi/asm/prctl.h).
_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
_granted: list[bool] = []


def granted() -> bool:
    """May this process run tile instructions? Asks Linux once (x86-64 with AMX only); False elsewhere, if refused,
    or with OFFLOAD_AMX=0 in the environment (the vector kernels then: to compare, or to rule the tiles out)."""
    if not _granted:
        ok = False
        if AMX and os.environ.get("OFFLOAD_AMX", "1") != "0" and sys.platform == "linux" \
                and platform.machine().lower() in ("x86_64", "amd64"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                ok = libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
            except (OSError, AttributeError):
                ok = False
        _granted.append(ok)
    return _granted[0]


def int8_tiles() -> bool:
    """May int8 products run on tiles in this process?"""
    return AMX_INT8 and granted()


def bf16_tiles() -> bool:
    """May bf16 products run on tiles in this process?"""
    return AMX_BF16 and granted()


def _call(builder, name, args, types_, present=True):
    if AMX and present:  # (never run where not: `granted` is False there, the products' flags are)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, types_), name)
        builder.call(fn, args)


def _byte_ptr(context, builder, aty, a, at):
    return builder.gep(builder.bitcast(context.make_array(aty)(context, builder, a).data, _P), [at])


def _literal(*ts) -> bool:
    return all(isinstance(t, types.IntegerLiteral) for t in ts)


@intrinsic
def tiles_config(typingctx, cfg):  # pragma: no cover - compiled
    """ldtilecfg of the 64-byte record cfg (uint8)."""
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.ldtilecfg", [_byte_ptr(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))],
              [_P])
        return context.get_dummy_value()
    return types.none(cfg), codegen


@intrinsic
def tiles_release(typingctx):  # pragma: no cover - compiled
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def tile_zero(typingctx, t):  # pragma: no cover - compiled
    if not _literal(t):
        return None

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilezero", [ir.Constant(_I8, t.literal_value)], [_I8])
        return context.get_dummy_value()
    return types.none(t), codegen


def _moves(name):
    def move(typingctx, t, a, at, stride):  # pragma: no cover - compiled
        if not _literal(t):
            return None

        def codegen(context, builder, sig, args):
            at_, stride_ = (context.cast(builder, v, ty, types.int64) for v, ty in zip(args[2:], sig.args[2:]))
            _call(builder, name, [ir.Constant(_I8, t.literal_value),
                                  _byte_ptr(context, builder, sig.args[1], args[1], at_), stride_], [_I8, _P, _I64])
            return context.get_dummy_value()
        return types.none(t, a, at, stride), codegen
    return intrinsic(move)


tile_load = _moves("llvm.x86.tileloadd64")
tile_store = _moves("llvm.x86.tilestored64")


def _products(name, present):
    def product(typingctx, c, a, b):  # pragma: no cover - compiled
        if not _literal(c, a, b):
            return None

        def codegen(context, builder, sig, args):
            _call(builder, name, [ir.Constant(_I8, v.literal_value) for v in (c, a, b)], [_I8] * 3, present)
            return context.get_dummy_value()
        return types.none(c, a, b), codegen
    return intrinsic(product)


tile_dpbsud = _products("llvm.x86.tdpbsud", AMX_INT8)
tile_dpbf16ps = _products("llvm.x86.tdpbf16ps", AMX_BF16)


@njit(inline="always")
def configure(cfg, shape):  # pragma: no cover - compiled
    """cfg [64] uint8 = palette 1 and, for tiles 0, 1, ..., the (rows, bytes a row) pairs of `shape`; the others
    unused. (`tiles_config` loads it.)"""
    cfg[:] = 0
    cfg[0] = 1
    for t in range(len(shape)):
        rows, colsb = shape[t]
        cfg[16 + 2 * t] = colsb & 255
        cfg[17 + 2 * t] = colsb >> 8
        cfg[48 + t] = rows


@njit(inline="always")
def quad_shape(rows, kq):  # pragma: no cover - compiled
    """The tiles `quad_sums` uses: 0-3 the sums (rows x 16 int32), 4 x (rows x kq quads), 5-7 the codes (kq rows of
    16 quads)."""
    return ((rows, 64), (rows, 64), (rows, 64), (rows, 64), (rows, 4 * kq), (kq, 64), (kq, 64), (kq, 64))


@njit(inline="always")
def quad_sums(XP, r, p0, half, kq, W, T, at, w0):  # pragma: no cover - compiled
    """T [at : at + 4 * 16 * 16] int32 = for rows r .. r + 15 of XP (int8 quads, an int32 a quad; the tiles' rows as
    `configure`d) and 64 outputs, the exact sums over lane units p0 .. p0 + half - 1 of x against the codes in W
    from byte w0 on, unit i's quads for outputs 16v .. 16v + 15 at byte w0 + 256 i + 64 v (`cpu_packed16._widen16`'s
    buffer, or int8 codes as they lie: `quant.int8_tiles`). kq: units a tile (half, or 16 when half is a multiple
    of it). Its rows must start at cache lines (every array the kernels make does: `simd`): on the 2-core Xeon VM,
    9 rows, a group of 64, everything in L1, TSC cycles a group, the whole call 100-110 at 64-byte boundaries against
    232-253 with rows across two lines (numba's arrays start at 32 bytes), its three code tiles' loads alone 20
    against 127-137. Widening the next group or closing the last one between a group's loads and its products
    measured 20-30% slower, not faster (with rows across lines)."""
    tile_zero(0)
    tile_zero(1)
    tile_zero(2)
    tile_zero(3)
    xstride = 4 * XP.shape[1]
    for i in range(0, half, kq):
        tile_load(4, XP, r * xstride + 4 * (p0 + i), xstride)
        tile_load(5, W, w0 + 256 * i, 256)
        tile_load(6, W, w0 + 256 * i + 64, 256)
        tile_load(7, W, w0 + 256 * i + 128, 256)
        tile_dpbsud(0, 4, 5)
        tile_dpbsud(1, 4, 6)
        tile_dpbsud(2, 4, 7)
        tile_load(5, W, w0 + 256 * i + 192, 256)  # (tiles are not renamed: the fourth waits for the first's product)
        tile_dpbsud(3, 4, 5)
    tile_store(0, T, 4 * at, 64)
    tile_store(1, T, 4 * at + 1024, 64)
    tile_store(2, T, 4 * at + 2048, 64)
    tile_store(3, T, 4 * at + 3072, 64)


@njit(inline="always")
def tile_units(half):  # pragma: no cover - compiled
    """Lane units a tile takes for a group of `half` (0: tiles do not fit the group: > 16 and not a multiple)."""
    return half if half <= 16 else (16 if half % 16 == 0 else 0)


granted()  # (asked as the kernels load: any kind a caller holds was chosen in a process that may use the tiles)
