"""int4 codes by x in int8 steps as byte pairs, for CPUs that lack AVX-512 VNNI's vpdpbusd (`simd_int.byte_dots`):
AVX2's vpmaddubsw multiplies 32 pairs of bytes (a code unsigned, a step signed) and adds each pair into an int16,
32 multiply-adds an instruction where int16 pairs (`simd_int.vdot`'s pmaddwd) do 16. Exact while a pair's sum and
the int16 sums added to it stay within int16: int4 codes are 0..15 and int8 steps within -127..127, so a pair is at
most 3810 and eight pairs (`UNITS` lane units) 30480 < 32767; then the int16 sums are widened into int32 ones.

    vbsplat(a, i)        every int16 lane x's steps at columns 2i, 2i + 1 (the i-th int16 of an int32 array)
    vbpairs4(a, i)       int4 tiles: columns k, k + 1 of a 64-row block (64 bytes at a[i]) as two vectors of 32
                         byte pairs (code[row, k], code[row, k + 1]): rows 0-31 (low nibbles), rows 32-63 (high), each
                         in the order AVX2's byte unpacking leaves them: rows 0-7, 16-23, 8-15, 24-31
    vmaddubs(acc, w, x)  acc + w[2j] x[2j] + w[2j + 1] x[2j + 1] in int16 lane j (w's bytes unsigned, x's signed)
    vwiden16(v)          `vmaddubs` sums in `vbpairs4`'s order as two int32 vectors of rows 0-15 and 16-31

The values are `simd_int.i32x16` (512 bits however they are read). Knows nothing about models, tiers or files.
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from offload.model.simd import _contiguous, _has, _x86
from offload.model.simd_int import _I32, _IT, _I8x64, _I16x32, i32x16

#: Lane units (pairs of columns) whose int16 sums `vmaddubs` may add before they are widened (8 * 3810 < 32767).
UNITS = 8

_I8x32 = ir.VectorType(ir.IntType(8), 32)
_I16x16 = ir.VectorType(ir.IntType(16), 16)


def pair_bytes() -> bool:
    """Is `vmaddubs` one instruction a 32 multiply-adds here (x86 with AVX2)? Then int8 steps against int4 codes go as
    byte pairs where `byte_dots` is missing (elsewhere its form is correct but widened, no faster than int16 pairs)."""
    return _x86() and _has("avx2")


def _idx(values):
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


@intrinsic
def vbsplat(typingctx, a, i):  # pragma: no cover - compiled
    """Every int16 lane the i-th int16 of a C-contiguous int32 array (x's int8 steps at columns 2i, 2i + 1)."""
    if not _contiguous(a, (types.int32,)) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        data = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data,
                               ir.IntType(16).as_pointer())
        one = builder.insert_element(ir.Constant(_I16x32, ir.Undefined), builder.load(builder.gep(data, [args[1]])),
                                     ir.Constant(_I32, 0))
        return builder.bitcast(builder.shuffle_vector(one, ir.Constant(_I16x32, ir.Undefined), _idx([0] * 32)), _IT)
    return i32x16(a, i), codegen


@intrinsic
def vbpairs4(typingctx, a, i):  # pragma: no cover - compiled
    """int4 tiles (torch's packing: byte j of a column row j's code low, row j + 32's high): from a[i : i + 64]
    (columns k, k + 1, 32 bytes each) the byte pairs of rows 0-31 and 32-63: a nibble split of all 64 bytes, then one
    byte unpacking (vpunpcklbw, vpunpckhbw) a 32 bytes, whose 128-bit lanes leave the rows 0-7, 16-23, 8-15, 24-31."""
    if not _contiguous(a, (types.uint8,)) or not isinstance(i, types.Integer):
        return None
    ret = types.UniTuple(i32x16, 2)
    order = [x for h in (0, 1) for lane in (0, 1) for j in range(8) for x in (16 * lane + 8 * h + j,
                                                                                32 + 16 * lane + 8 * h + j)]

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        v = builder.load(builder.bitcast(builder.gep(data, [args[1]]), _I8x64.as_pointer()), align=1)
        nibbles = (builder.and_(v, ir.Constant(_I8x64, [0x0F] * 64)), builder.lshr(v, ir.Constant(_I8x64, [4] * 64)))
        return context.make_tuple(builder, ret, [builder.bitcast(builder.shuffle_vector(s, s, _idx(order)), _IT)
                                                 for s in nibbles])
    return ret(a, i), codegen


@intrinsic
def vmaddubs(typingctx, acc, w, x):  # pragma: no cover - compiled
    """acc + w[2j] * x[2j] + w[2j + 1] * x[2j + 1] in int16 lane j, w's bytes unsigned and x's signed: AVX2's
    vpmaddubsw (AVX-512 BW's on 64 bytes), else widened to int16 and multiplied. The caller keeps every sum within
    int16 (`UNITS`): then the instruction's saturation never acts and all forms agree."""
    if not (acc == w == x == i32x16):
        return None

    def codegen(context, builder, sig, args):
        a, wv, xv = (builder.bitcast(v, t) for v, t in zip(args, (_I16x32, _I8x64, _I8x64)))
        if _x86() and _has("avx512bw"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I16x32, [_I8x64] * 2),
                                                "llvm.x86.avx512.pmaddubs.w.512")
            p = builder.call(fn, [wv, xv])
        elif pair_bytes():
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I16x16, [_I8x32] * 2),
                                                "llvm.x86.avx2.pmadd.ub.sw")
            halves = [builder.call(fn, [builder.shuffle_vector(v, v, _idx(list(range(32 * h, 32 * h + 32))))
                                        for v in (wv, xv)]) for h in (0, 1)]
            p = builder.shuffle_vector(halves[0], halves[1], _idx(list(range(32))))
        else:
            wide = ir.VectorType(ir.IntType(16), 64)
            m = builder.mul(builder.zext(wv, wide), builder.sext(xv, wide))
            p = builder.add(builder.shuffle_vector(m, m, _idx(list(range(0, 64, 2)))),
                            builder.shuffle_vector(m, m, _idx(list(range(1, 64, 2)))))
        return builder.bitcast(builder.add(a, p), _IT)
    return i32x16(acc, w, x), codegen


@intrinsic
def vwiden16(typingctx, v):  # pragma: no cover - compiled
    """The 32 int16 sums of `vmaddubs` over `vbpairs4`'s rows (0-7, 16-23, 8-15, 24-31) as int32: rows 0-15, 16-31
    (on AVX2 each a sign extension of two 8-lane halves, no other shuffle)."""
    if v != i32x16:
        return None
    ret = types.UniTuple(i32x16, 2)

    def codegen(context, builder, sig, args):
        s = builder.bitcast(args[0], _I16x32)
        return context.make_tuple(builder, ret, [
            builder.sext(builder.shuffle_vector(s, s, _idx(list(range(lo, lo + 8)) + list(range(lo + 16, lo + 24)))),
                         _IT) for lo in (0, 8)])
    return ret(v), codegen
