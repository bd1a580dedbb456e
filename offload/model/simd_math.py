"""Elementwise float32 lane math beside `offload.model.simd`, for the layer's non-product steps (SiLU, softmax):

    vexp(v)              e^x lane by lane (Cephes' expf in fused multiply-adds: within ~1 ulp of e^x)
    vmul(a, b)           a * b, vdiv(a, b) a / b, vadd(a, b) a + b: IEEE operations, one rounding each
    vdiv64(v, t)         each lane widened to float64, divided by the float64 t, rounded to float32 (a scalar
                         float32 / float64 division's bits, lane by lane); vmul64(v, t) the same multiplied
    vmax(a, b)           the larger of a and b lane by lane (a NaN loses to a number); vhmax(v): the largest lane
    vround(v, bf16)      with bf16: each lane rounded to bf16 (to nearest even, as torch rounds; NaN stays a quiet
                         NaN), as float32; without: v
    vbf16(a, i)          a[i : i + 16] of bf16 bits (an array, or an address) as float32 lanes (exact)
    vf32(a, i)           a[i : i + 16] of float32 at an address
    vraw(a, i, bf16)     a[i : i + 16] of the raw bits at an address, bf16 (`vbf16`) or float32 (`vf32`)
    vbyte4(a, i, c)      byte c (0..3) of each of the 16 four-byte words at byte i of a uint8 array, as float32 (an
                         int8 code column of `quant.int8_tiles`' quads)
    vput(a, i, v, bf16)  a[i : i + 16] = v as raw bits (an array of them, or an address): bf16 rounded to nearest
                         even (`vround`'s; a NaN a quiet NaN), or float32's

Every lane goes through the same operations, so a value's result never depends on its neighbours or on how many
there are. No fast-math flags (a kernel using these is compiled without them).
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from offload.model.simd import _VT, LANES, _at, _contiguous, _splat, f32x16

_I32 = ir.IntType(32)
_IT = ir.VectorType(_I32, LANES)


def _fn(builder, name: str, n: int):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VT, [_VT] * n), name)


def _c(f: float) -> ir.Constant:
    return ir.Constant(_VT, [f] * LANES)


def _ci(i: int) -> ir.Constant:
    return ir.Constant(_IT, [i] * LANES)


#: Cephes' expf: the range (a result below float32's smallest normal is 0, above ~2^127.5 inf), ln 2 in two parts
#: (the first exact in 9 bits), the polynomial's coefficients from the highest power
_EXP_LO, _EXP_HI, _LN2_HI, _LN2_LO = -87.33654, 88.37626, 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


@intrinsic
def vexp(typingctx, v):  # pragma: no cover - compiled
    """e^x lane by lane: x = n ln 2 + r (n rounded to nearest even), e^r by Cephes' degree-7 polynomial in fused
    multiply-adds, times 2^n built in the exponent bits: within ~1 ulp of e^x, the same operations in every lane
    (so a value's result never depends on its neighbours). Below -87.34 (-inf too): 0; above 88.38: inf; NaN
    stays NaN."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        x, c = args[0], _c
        fma_ = _fn(builder, "llvm.fma.v16f32", 3)
        xc = builder.call(_fn(builder, "llvm.minnum.v16f32", 2),
                          [builder.call(_fn(builder, "llvm.maxnum.v16f32", 2), [x, c(_EXP_LO)]), c(_EXP_HI)])
        n = builder.call(_fn(builder, "llvm.rint.v16f32", 1), [builder.fmul(xc, c(1.44269504088896341))])
        r = builder.call(fma_, [n, c(-_LN2_HI), xc])
        r = builder.call(fma_, [n, c(-_LN2_LO), r])
        p = c(_EXP_POLY[0])
        for coef in _EXP_POLY[1:]:
            p = builder.call(fma_, [p, r, c(coef)])
        y = builder.fadd(builder.call(fma_, [p, builder.fmul(r, r), r]), c(1.0))
        bits = builder.shl(builder.add(builder.fptosi(n, _IT), _ci(127)), _ci(23))
        out = builder.fmul(y, builder.bitcast(bits, _VT))
        out = builder.select(builder.fcmp_ordered(">", x, c(_EXP_HI)), c(float("inf")), out)
        out = builder.select(builder.fcmp_ordered("<", x, c(_EXP_LO)), c(0.0), out)
        return builder.select(builder.fcmp_unordered("uno", x, x), x, out)
    return f32x16(v), codegen


def _binary(op):
    def typer(typingctx, a, b):
        if not (a == b == f32x16):
            return None

        def codegen(context, builder, sig, args):
            return op(builder, *args) if callable(op) else getattr(builder, op)(*args)
        return f32x16(a, b), codegen
    return typer


vmul = intrinsic(_binary("fmul"))
vdiv = intrinsic(_binary("fdiv"))
vadd = intrinsic(_binary("fadd"))
vmax = intrinsic(_binary(lambda builder, a, b: builder.call(_fn(builder, "llvm.maxnum.v16f32", 2), [a, b])))


def _by64(op: str):
    def typer(typingctx, v, t):
        if v != f32x16 or t not in (types.float64, types.float32):
            return None

        def codegen(context, builder, sig, args):
            wide = sig.args[1] == types.float64  # (a float32 t: float32's operation, as the scalar's)
            vt = ir.VectorType(ir.DoubleType(), LANES) if wide else _VT
            r = getattr(builder, op)(builder.fpext(args[0], vt) if wide else args[0], _splat(builder, args[1], vt))
            return builder.fptrunc(r, _VT) if wide else r
        return f32x16(v, t), codegen
    return typer


vdiv64 = intrinsic(_by64("fdiv"))
vmul64 = intrinsic(_by64("fmul"))


@intrinsic
def vhmax(typingctx, v):  # pragma: no cover - compiled
    """The largest of v's lanes (a maximum has no order: any tree gives it)."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [_VT]),
                                            "llvm.vector.reduce.fmax.v16f32")
        return builder.call(fn, [args[0]])
    return types.float32(v), codegen


@intrinsic
def vround(typingctx, v, bf16):  # pragma: no cover - compiled
    """`cpu_elementwise._rnd` lane by lane: with bf16 each lane rounded to nearest even bf16 (a NaN to a quiet NaN)."""
    if v != f32x16 or not isinstance(bf16, types.Boolean):
        return None

    def codegen(context, builder, sig, args):
        x, flag = args
        b = builder.bitcast(x, _IT)
        high = builder.and_(builder.lshr(b, _ci(16)), _ci(1))
        even = builder.and_(builder.add(builder.add(b, _ci(0x7FFF)), high), _ci(-65536))  # 0xFFFF0000
        quiet = builder.or_(builder.and_(b, _ci(-65536)), _ci(0x400000))
        nan = builder.fcmp_unordered("uno", x, x)
        r = builder.bitcast(builder.select(nan, quiet, even), _VT)
        return builder.select(flag, r, x)
    return f32x16(v, bf16), codegen


@intrinsic
def vbf16(typingctx, a, i):  # pragma: no cover - compiled
    """a[i : i + 16] of bf16 bits (a C-contiguous uint16 array, or the integer address of such values) as float32."""
    if not (isinstance(a, types.Integer) or _contiguous(a, (types.uint16,))) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i16 = ir.IntType(16)
        ptr = builder.bitcast(_at(context, builder, sig.args[0], args[0], args[1], i16),
                              ir.VectorType(i16, LANES).as_pointer())
        wide = builder.zext(builder.load(ptr, align=1), _IT)
        return builder.bitcast(builder.shl(wide, _ci(16)), _VT)
    return f32x16(a, i), codegen


@intrinsic
def vf32(typingctx, a, i):  # pragma: no cover - compiled
    """a[i : i + 16] of float32 at the integer address a."""
    if not isinstance(a, types.Integer) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_at(context, builder, sig.args[0], args[0], args[1], ir.FloatType()), _VT.as_pointer())
        return builder.load(ptr, align=1)
    return f32x16(a, i), codegen


@njit(inline="always")
def vraw(a, i, bf16):  # pragma: no cover - compiled
    """a[i : i + 16] of the raw bits at address a (a tensor of the activations' dtype: bf16, or float32) as float32."""
    return vbf16(a, i) if bf16 else vf32(a, i)


def _put(bits: int):
    def typer(typingctx, a, i, v):
        dt = types.uint16 if bits == 16 else types.uint32
        if not (isinstance(a, types.Integer) or _contiguous(a, (dt,))) or not isinstance(i, types.Integer) \
                or v != f32x16:
            return None

        def codegen(context, builder, sig, args):
            it = ir.IntType(bits)
            ptr = builder.bitcast(_at(context, builder, sig.args[0], args[0], args[1], it),
                                  ir.VectorType(it, LANES).as_pointer())
            b = builder.bitcast(args[2], _IT)
            if bits == 16:  # (v rounded to bf16's values: its high halves)
                b = builder.trunc(builder.lshr(b, _ci(16)), ir.VectorType(it, LANES))
            builder.store(b, ptr, align=1)
            return context.get_dummy_value()
        return types.none(a, i, v), codegen
    return typer


_put16 = intrinsic(_put(16))
_put32 = intrinsic(_put(32))


@njit(inline="always")
def vput(a, i, v, bf16):  # pragma: no cover - compiled
    if bf16:
        _put16(a, i, vround(v, True))
    else:
        _put32(a, i, v)


@intrinsic
def vbyte4(typingctx, a, i, c):  # pragma: no cover - compiled
    if not _contiguous(a, (types.uint8,)) or not isinstance(i, types.Integer) or not isinstance(c, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_at(context, builder, sig.args[0], args[0], args[1], ir.IntType(8)), _IT.as_pointer())
        shift = builder.mul(context.cast(builder, args[2], sig.args[2], types.int32), ir.Constant(_I32, 8))
        w = builder.and_(builder.lshr(builder.load(ptr, align=1), _splat(builder, shift, _IT)), _ci(255))
        return builder.uitofp(w, _VT)
    return f32x16(a, i, c), codegen
