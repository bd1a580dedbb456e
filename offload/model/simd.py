"""Sixteen float32 lanes as a numba value, for kernels whose arithmetic order must be the source's, not the compiler's.

LLVM vectorises a reduction by its own cost model (lanes, accumulators, where the lanes are summed), so two loops
over the same data can round differently, and a reduction that must be scaled group by group (int8 codes with a
scale per group) is summed across lanes once per group, which is slower than the memory. With these operations a
kernel says which lanes hold what and in which order they are added: every instruction is emitted as written, with
no fast-math flags (`llvm.fma` is one rounding; the sum of the lanes is a fixed tree). On AVX-512 a value is one
register; elsewhere LLVM splits it, with the same results.

    vzero()              all lanes 0
    vsplat(f)            all lanes f
    vload(a, i)          a[i : i + 16] of a C-contiguous 1-D array, float32, or uint8 converted exactly to float32
    vstore(a, i, v)      a[i : i + 16] = v (float32)
    vnibbles(a, i)       (low, high) nibbles of the bytes a[i : i + 16] as float32 (0..15, exact)
    vpairs(a, i)         the 16 (first, second) pairs of a[i : i + 32], raw bf16 or float32 bits, as float32
    vfma(a, b, c)        a * b + c, rounded once, lane by lane
    vsum(v)              the lanes' sum: halves added (8 + 8, 4 + 4, 2 + 2, 1 + 1)
    fma(a, b, c)         the scalar a * b + c, rounded once
    prefetch(a, i)       a hint to bring a[i]'s cache line in
    cycles()             the CPU's time-stamp counter (x86-64; elsewhere 0): where a compiled loop's steps end

and sixteen int32 lanes for integer products (exact: no order to choose):

    vizero()             all lanes 0
    visplat(a, i)        all lanes a[i] of an int32 array (two int16: x at a pair of columns)
    viload(a, i)         a[i : i + 16] of an int32 array; vistore(a, i, v) stores them
    vdot(acc, w, x)      acc + w[2j] x[2j] + w[2j + 1] x[2j + 1] in lane j, int16 halves (AVX-512 VNNI's vpdpwssds)
    vitof(v)             the lanes as float32
    vcodes8(a, i)        int8 tiles: columns k, k + 1 of a 64-row block as four vectors of (code, code) int16 pairs
    vcodes4(a, i)        the same from int4 tiles (torch's packing)

Bounds are the caller's: vload and vstore do not check them. A kernel using these is compiled without fastmath
(numba gives its flags to every float operation that has none, `vsum`'s adds included). Also the bit moves between
float32 and uint32 that the kernels round with (`_f32_bits`, `_bits_f32`).
"""

from __future__ import annotations

import platform

import llvmlite.binding as llvm
import llvmlite.ir as ir
from numba import config
from numba.core import cgutils, types
from numba.extending import intrinsic, models, register_model

LANES = 16
_F = ir.FloatType()
_VT = ir.VectorType(_F, LANES)


class F32x16(types.Type):
    """Sixteen float32 lanes (an LLVM <16 x float>)."""

    def __init__(self):
        super().__init__(name="f32x16")


f32x16 = F32x16()


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VT)


def _ptr(context, builder, aty, arr, i):
    """The address of element i of a 1-D array, as a pointer to 16 of its elements."""
    data = context.make_array(aty)(context, builder, arr).data
    elem = data.type.pointee
    return builder.bitcast(builder.gep(data, [i]), ir.VectorType(elem, LANES).as_pointer())


def _contiguous(a, dtypes) -> bool:
    return isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype in dtypes


@intrinsic
def vzero(typingctx):  # pragma: no cover - compiled
    def codegen(context, builder, sig, args):
        return ir.Constant(_VT, [0.0] * LANES)
    return f32x16(), codegen


@intrinsic
def vsplat(typingctx, f):  # pragma: no cover - compiled
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        one = builder.insert_element(ir.Constant(_VT, ir.Undefined), args[0], ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(_VT, ir.Undefined), ir.Constant(
            ir.VectorType(ir.IntType(32), LANES), [0] * LANES))
    return f32x16(f), codegen


@intrinsic
def vload(typingctx, a, i):  # pragma: no cover - compiled
    if not _contiguous(a, (types.float32, types.uint8)) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1]), align=1)
        return v if sig.args[0].dtype == types.float32 else builder.uitofp(v, _VT)
    return f32x16(a, i), codegen


@intrinsic
def vstore(typingctx, a, i, v):  # pragma: no cover - compiled
    if not _contiguous(a, (types.float32,)) or not isinstance(i, types.Integer) or v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()
    return types.none(a, i, v), codegen


@intrinsic
def vfma(typingctx, a, b, c):  # pragma: no cover - compiled
    if not (a == b == c == f32x16):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VT, [_VT] * 3), "llvm.fma.v16f32")
        return builder.call(fn, args)
    return f32x16(a, b, c), codegen


@intrinsic
def vsum(typingctx, v):  # pragma: no cover - compiled
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        x, width = args[0], LANES
        while width > 1:
            half = width // 2
            lo = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half))))
            hi = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(ir.IntType(32), half),
                                                          list(range(half, width))))
            x, width = builder.fadd(lo, hi), half
        return builder.extract_element(x, ir.Constant(ir.IntType(32), 0))
    return types.float32(v), codegen


@intrinsic
def fma(typingctx, a, b, c):  # pragma: no cover - compiled
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return builder.fma(*args)
    return types.float32(a, b, c), codegen


@intrinsic
def _f32_bits(typingctx, f):  # pragma: no cover - compiled
    """A float32's bits as uint32 (a register move)."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, bits):  # pragma: no cover - compiled
    """Integer bits (the low 32) as the float32 they encode (a register move)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if bits.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif bits.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, _F)
    return types.float32(bits), codegen


@intrinsic
def prefetch(typingctx, a, i):  # pragma: no cover - compiled
    """A hint to bring the cache line of a[i] (a C-contiguous 1-D array) into the caches; no bounds needed."""
    if not isinstance(a, types.Array) or a.ndim != 1 or a.layout != "C" or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
            ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(32), ir.IntType(32)]), "llvm.prefetch.p0i8")
        i32 = ir.IntType(32)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.none(a, i), codegen


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def cycles(typingctx):  # pragma: no cover - compiled
    """The time-stamp counter (`rdtsc`, constant-rate on the CPUs that have `constant_tsc`) as an int64: spans inside
    one compiled call, placed on the timeline against the host clock read around it. 0 off x86-64 (another
    architecture's cycle counter may trap in user mode)."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        if not _x86():
            return ir.Constant(i64, 0)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, []), "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen


def _has(feature: str) -> bool:
    """Does numba compile for a CPU with this LLVM feature ("avx512f"; numba's features, or the host's)?"""
    features = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    return "+" + feature in features.split(",")


def _avx512() -> bool:
    return _has("avx512f")


@intrinsic
def vnibbles(typingctx, a, i):  # pragma: no cover - compiled
    """(low, high) nibbles of the bytes a[i : i + 16] (uint8) as float32 lanes (0..15, exact): with AVX-512 a table
    lookup (vpermps: no conversion instruction), else a conversion."""
    if not _contiguous(a, (types.uint8,)) or not isinstance(i, types.Integer):
        return None
    ret = types.UniTuple(f32x16, 2)

    def codegen(context, builder, sig, args):
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1]), align=1)
        i32 = ir.VectorType(ir.IntType(32), LANES)
        w = builder.zext(v, i32)
        hi = builder.lshr(w, ir.Constant(i32, [4] * LANES))
        if _avx512():
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VT, [_VT, i32]),
                                                "llvm.x86.avx512.permvar.sf.512")
            table = ir.Constant(_VT, [float(n) for n in range(LANES)])
            lo_f, hi_f = builder.call(fn, [table, w]), builder.call(fn, [table, hi])  # (index: the low 4 bits)
        else:
            lo_f = builder.uitofp(builder.and_(w, ir.Constant(i32, [15] * LANES)), _VT)
            hi_f = builder.uitofp(hi, _VT)
        return context.make_tuple(builder, ret, [lo_f, hi_f])
    return ret(a, i), codegen


@intrinsic
def vpairs(typingctx, a, i):  # pragma: no cover - compiled
    """The 16 (first, second) pairs of a[i : i + 32] as two float32 lane vectors: raw bf16 bits (uint16) or float32
    bits (uint32), as (scale, zero) pairs are stored."""
    if not _contiguous(a, (types.uint16, types.uint32)) or not isinstance(i, types.Integer):
        return None
    ret = types.UniTuple(f32x16, 2)

    def codegen(context, builder, sig, args):
        bits = sig.args[0].dtype.bitwidth
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.VectorType(ir.IntType(bits), 2 * LANES).as_pointer())
        v = builder.load(ptr, align=1)
        i32, idx = ir.VectorType(ir.IntType(32), LANES), ir.VectorType(ir.IntType(32), LANES)
        out = []
        for first in (0, 1):
            half = builder.shuffle_vector(v, v, ir.Constant(idx, list(range(first, 2 * LANES, 2))))
            if bits == 16:
                half = builder.shl(builder.zext(half, i32), ir.Constant(i32, [16] * LANES))
            out.append(builder.bitcast(half, _VT))
        return context.make_tuple(builder, ret, out)
    return ret(a, i), codegen


# ----------------------------------------------------------------------------- 16 int32 lanes: integer products
# A lane holds two int16 (the codes of one output row at input columns k and k + 1, or x at k and k + 1, split to
# 16 bits); `vdot` multiplies the pairs and adds both products to the lane: AVX-512 VNNI's vpdpwssds, pmaddwd +
# add elsewhere. Integer sums are exact, so no order is chosen: the result is the same on every machine.
_I32 = ir.IntType(32)
_IT = ir.VectorType(_I32, LANES)
_I16x32 = ir.VectorType(ir.IntType(16), 2 * LANES)


class I32x16(types.Type):
    """Sixteen int32 lanes (an LLVM <16 x i32>), each two int16 to `vdot` or one int32 sum."""

    def __init__(self):
        super().__init__(name="i32x16")


i32x16 = I32x16()


@register_model(I32x16)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _IT)


@intrinsic
def vizero(typingctx):  # pragma: no cover - compiled
    """All sixteen int32 lanes 0."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_IT, [0] * LANES)
    return i32x16(), codegen


@intrinsic
def visplat(typingctx, a, i):  # pragma: no cover - compiled
    """All lanes a[i] of a C-contiguous int32 array (e.g. x's int16 pair at columns 2i, 2i + 1)."""
    if not _contiguous(a, (types.int32,)) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]]))
        one = builder.insert_element(ir.Constant(_IT, ir.Undefined), v, ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, ir.Constant(_IT, ir.Undefined), ir.Constant(_IT, [0] * LANES))
    return i32x16(a, i), codegen


@intrinsic
def viload(typingctx, a, i):  # pragma: no cover - compiled
    """a[i : i + 16] of a C-contiguous int32 array."""
    if not _contiguous(a, (types.int32,)) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1]), align=1)
    return i32x16(a, i), codegen


@intrinsic
def vistore(typingctx, a, i, v):  # pragma: no cover - compiled
    """a[i : i + 16] = v, a C-contiguous int32 array."""
    if not _contiguous(a, (types.int32,)) or not isinstance(i, types.Integer) or v != i32x16:
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()
    return types.none(a, i, v), codegen


@intrinsic
def vdot(typingctx, acc, w, x):  # pragma: no cover - compiled
    """acc + w[2j] * x[2j] + w[2j + 1] * x[2j + 1] in lane j, the lanes' int16 halves multiplied exactly. The
    caller keeps every sum within int32 (no lane wraps or saturates: then all three forms below agree)."""
    if not (acc == w == x == i32x16):
        return None

    def codegen(context, builder, sig, args):
        a, wv, xv = args
        if _x86() and _has("avx512vnni"):  # the saturating form: LLVM splits half of a chain of the wrapping one
            # into pmaddwd + paddd (two instructions); the callers' sums never reach int32's limits: the same lanes
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_IT, [_IT] * 3),
                                                "llvm.x86.avx512.vpdpwssds.512")
            return builder.call(fn, [a, wv, xv])
        w16, x16 = builder.bitcast(wv, _I16x32), builder.bitcast(xv, _I16x32)
        if _x86() and _has("avx512bw"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_IT, [_I16x32] * 2),
                                                "llvm.x86.avx512.pmaddw.d.512")
            return builder.add(a, builder.call(fn, [w16, x16]))
        wide = ir.VectorType(_I32, 2 * LANES)
        p = builder.mul(builder.sext(w16, wide), builder.sext(x16, wide))
        even = builder.shuffle_vector(p, p, ir.Constant(_IT, list(range(0, 2 * LANES, 2))))
        odd = builder.shuffle_vector(p, p, ir.Constant(_IT, list(range(1, 2 * LANES, 2))))
        return builder.add(a, builder.add(even, odd))
    return i32x16(acc, w, x), codegen


@intrinsic
def vitof(typingctx, v):  # pragma: no cover - compiled
    """The int32 lanes as float32 (round to nearest even beyond 2**24)."""
    if v != i32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VT)
    return f32x16(v), codegen


def _pairs(builder, v, lo, hi):
    """Bytes v[lo + j] and v[hi + j] interleaved, j = 0..15, each widened to int16: a lane of `vdot` per row j."""
    idx = [x for j in range(LANES) for x in (lo + j, hi + j)]
    b = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 2 * LANES), idx))
    return builder.bitcast(builder.zext(b, _I16x32), _IT)


@intrinsic
def vcodes8(typingctx, a, i):  # pragma: no cover - compiled
    """int8 tiles: from a[i : i + 128] (columns k, k + 1 of a 64-row block, 64 bytes each) the four lane vectors of
    rows 0-15, 16-31, 32-47, 48-63, lane j holding (code[row, k], code[row, k + 1]) as int16."""
    if not _contiguous(a, (types.uint8,)) or not isinstance(i, types.Integer):
        return None
    ret = types.UniTuple(i32x16, 4)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.VectorType(ir.IntType(8), 128).as_pointer())
        v = builder.load(ptr, align=1)
        out = [_pairs(builder, v, 16 * r, 64 + 16 * r) for r in range(4)]
        return context.make_tuple(builder, ret, out)
    return ret(a, i), codegen


@intrinsic
def vcodes4(typingctx, a, i):  # pragma: no cover - compiled
    """int4 tiles (torch's packing): from a[i : i + 64] (columns k, k + 1 of a 64-row block, 32 bytes each, byte j
    row j's nibble low and row j + 32's high) the four lane vectors of rows 0-15, 16-31, 32-47, 48-63, lane j
    holding (code[row, k], code[row, k + 1]) as int16."""
    if not _contiguous(a, (types.uint8,)) or not isinstance(i, types.Integer):
        return None
    ret = types.UniTuple(i32x16, 4)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.VectorType(ir.IntType(8), 64).as_pointer())
        v = builder.load(ptr, align=1)
        low, high = ir.Constant(_IT, [0x000F000F] * LANES), ir.Constant(_IT, [4] * LANES)
        out = []
        for half in (0, 16):
            b = _pairs(builder, v, half, 32 + half)  # rows half..half+15 low, +32 high: int16 bytes 0..255
            out.append(builder.and_(b, low))
            out.append(builder.and_(builder.lshr(b, high), low))
        lo0, hi0, lo1, hi1 = out
        return context.make_tuple(builder, ret, [lo0, lo1, hi0, hi1])
    return ret(a, i), codegen
