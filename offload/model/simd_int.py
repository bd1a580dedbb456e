"""Sixteen int32 lanes as a numba value, for integer products (exact: no order to choose), beside
`offload.model.simd`'s float32 lanes:

    vizero()             all lanes 0
    visplat(a, i)        all lanes a[i] of an int32 array (two int16: x at a pair of columns)
    viload(a, i)         a[i : i + 16] of an int32 array; vistore(a, i, v) stores them
    vdot(acc, w, x)      acc + w[2j] x[2j] + w[2j + 1] x[2j + 1] in lane j, int16 halves (AVX-512 VNNI's vpdpwssds)
    vdot8(acc, w, x)     acc + the sum of w[4j + i] x[4j + i], i < 4, in lane j: w's bytes unsigned, x's signed
                         (AVX-512 VNNI's vpdpbusd)
    vsra(v, n)           each lane shifted right by n, the sign kept (an exact division of a multiple of 2^n)
    vsteps(x, f, m, a, i) float32 lanes x * f rounded to even, within -m .. m, stored in an int8 / int16 array and
                         returned as int32 lanes (x split into integer steps)
    vitof(v)             the lanes as float32
    vcodes8(a, i)        columns k, k + 1 of a 64-row block, 64 bytes a column (int8 tiles' last K % 4 columns),
                         as four vectors of (code, code) int16 pairs
    vcodes4(a, i)        the same from int4 tiles (torch's packing)
    vquads4(a, i)        int4 tiles: columns k .. k + 3 as four vectors of byte quads (rows 32-63's codes times 16)
    vquads8(a, i)        int8 tiles (stored in quads, `quant.int8_tiles`): columns k .. k + 3 as four vectors of
                         byte quads; vpairs8q0 / vpairs8q1(a, i) the int16 pairs of columns k, k + 1 / k + 2, k + 3
    vbfpairs(a, i)       a[i : i + 32] of bf16 bits (an array, or an address) as 16 lanes of (a[i + 2j], a[i + 2j + 1])
    bfat(a, i)           a[i] of bf16 bits as float32; f32put(a, i, v) stores float32 v at an address
    vdpbf(acc, w, x)     acc + w[2j + 1] x[2j + 1] + w[2j] x[2j] in float32 lane j, bf16 pairs, two roundings
                         (AVX-512 BF16's vdpbf16ps; two fused multiply-adds elsewhere: the same bits)

A lane holds two int16 (the codes of one output row at input columns k and k + 1, or x at k and k + 1, split to 16
bits); `vdot` multiplies the pairs and adds both products to the lane: AVX-512 VNNI's vpdpwssds, pmaddwd + add
elsewhere. Integer sums are exact, so the result is the same on every machine. Bounds are the caller's.
`vdpbf` is the float product of the same pairs: a product of two bf16 is exact in float32, so vdpbf16ps's two
fused multiply-adds (the pair's second element first) are two `llvm.fma` where the instruction is missing, with the
same bits except for subnormal inputs and results, which vdpbf16ps flushes to zero.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import llvmlite.ir as ir
from numba.core import cgutils, types
from numba.extending import intrinsic, models, register_model

from offload.model.simd import _VT, LANES, _at, _contiguous, _has, _ptr, _x86, f32x16

_I32 = ir.IntType(32)
_IT = ir.VectorType(_I32, LANES)
_I16x32 = ir.VectorType(ir.IntType(16), 2 * LANES)
_I8x64 = ir.VectorType(ir.IntType(8), 64)


class _BFloat(ir.Type):
    """LLVM's bfloat, which llvmlite.ir does not name: the operands of the AVX-512 BF16 intrinsics."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_BF16x32 = ir.VectorType(_BFloat(), 2 * LANES)


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


def byte_dots() -> bool:
    """Is `vdot8` one instruction here (AVX-512 VNNI's vpdpbusd)? Elsewhere its bytes are widened to int32 first:
    int8 steps cost 1.3-8x `vdot`'s int16 steps (AVX2 EPYC, int4 [1536, 576], 1 / 9 / 64 rows: 0.14 / 1.79 / 8.31
    ms against 0.08 / 0.25 / 1.04; int8 codes 0.13 / 1.24 / 7.42 against 0.10 / 0.37 / 2.29)."""
    return _x86() and _has("avx512vnni")


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
def vdot8(typingctx, acc, w, x):  # pragma: no cover - compiled
    """acc + w[4j] * x[4j] + ... + w[4j + 3] * x[4j + 3] in lane j, w's bytes unsigned and x's signed, multiplied
    exactly. The caller keeps every sum within int32 (the instruction wraps, the widened form below too)."""
    if not (acc == w == x == i32x16):
        return None

    def codegen(context, builder, sig, args):
        a, wv, xv = args
        if byte_dots():
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_IT, [_IT] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
            return builder.call(fn, [a, wv, xv])
        wide = ir.VectorType(_I32, 4 * LANES)
        w32, x32 = builder.zext(builder.bitcast(wv, _I8x64), wide), builder.sext(builder.bitcast(xv, _I8x64), wide)
        p = builder.mul(w32, x32)
        q = [builder.shuffle_vector(p, p, ir.Constant(_IT, list(range(i, 4 * LANES, 4)))) for i in range(4)]
        return builder.add(a, builder.add(builder.add(q[0], q[1]), builder.add(q[2], q[3])))
    return i32x16(acc, w, x), codegen


@intrinsic
def viadd(typingctx, a, b):  # pragma: no cover - compiled
    """a + b, lane by lane (int32, wrapping)."""
    if not (a == b == i32x16):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return i32x16(a, b), codegen


@intrinsic
def vsra(typingctx, v, n):  # pragma: no cover - compiled
    """Each int32 lane shifted right by the constant n, the sign kept (an exact division where lanes are multiples of
    2^n)."""
    if v != i32x16 or not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        return builder.ashr(args[0], ir.Constant(_IT, [n.literal_value] * LANES))
    return i32x16(v, n), codegen


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


def _codes(name: str, nbytes: int, lanes):
    """The intrinsic `name` over tile codes (a C-contiguous uint8 array and an index; four lane vectors back) whose
    codegen loads a[i : i + nbytes] as one byte vector v and returns `lanes(builder, v)`."""
    def typer(typingctx, a, i):
        if not _contiguous(a, (types.uint8,)) or not isinstance(i, types.Integer):
            return None
        ret = types.UniTuple(i32x16, 4)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.VectorType(ir.IntType(8), nbytes).as_pointer())
            return context.make_tuple(builder, ret, lanes(builder, builder.load(ptr, align=1)))
        return ret(a, i), codegen
    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = lanes.__doc__
    return intrinsic(typer)


def _codes8(builder, v):
    """int8 tiles: from a[i : i + 128] (columns k, k + 1 of a 64-row block, 64 bytes each) the four lane vectors of
    rows 0-15, 16-31, 32-47, 48-63, lane j holding (code[row, k], code[row, k + 1]) as int16."""
    return [_pairs(builder, v, 16 * r, 64 + 16 * r) for r in range(4)]


vcodes8 = _codes("vcodes8", 128, _codes8)


def _codes4(builder, v):
    """int4 tiles (torch's packing): from a[i : i + 64] (columns k, k + 1 of a 64-row block, 32 bytes each, byte j
    row j's nibble low and row j + 32's high) the four lane vectors of rows 0-15, 16-31, 32-47, 48-63, lane j
    holding (code[row, k], code[row, k + 1]) as int16. The nibbles are split on all 64 bytes at once (an and, a
    shift), then each vector is one zeroing byte permutation: 7 instructions, not 10 (a byte permutation, a widening,
    a shift and masks for each vector). With one prefetch a line (`cpu_packed16._pair_prefetch`): 216 MB of
    1.7B-shaped int4 matrices from DRAM, 2 Zen 4 threads, interleaved in one process, 8.8-11.5 -> 7.2-10.4 ms (15
    of 15 faster); the prefetch alone 10.5 -> 9.3."""
    nibbles = (builder.and_(v, ir.Constant(_I8x64, [0x0F] * 64)),  # rows 0-31 of both columns
               builder.lshr(v, ir.Constant(_I8x64, [4] * 64)))  # rows 32-63
    if not (_x86() and _has("avx512vbmi")):  # no vpermb: AVX2's punpcklbw, vpmovzxbw (47 instructions a unit, not
        # 90; six [8192, 2048] g32 matrices, 2 threads, AVX2 EPYC: one row 4.2-4.4 -> 3.3-3.6 ms, 9 rows 16-18 -> 14)
        return [_pairs(builder, src, half, 32 + half) for src in nibbles for half in (0, 16)]
    zero = ir.Constant(_I8x64, [0] * 64)
    out = []
    for src in nibbles:  # each vector one byte permutation with zeros between (vpermb, zero-masked)
        for half in (0, 16):
            idx = [x for j in range(LANES) for x in (half + j, 64, 32 + half + j, 64)]
            out.append(builder.bitcast(builder.shuffle_vector(src, zero, ir.Constant(ir.VectorType(_I32, 64), idx)),
                                       _IT))
    return out


vcodes4 = _codes("vcodes4", 64, _codes4)


def _quads4(builder, v):
    """int4 tiles (torch's packing): from a[i : i + 128] (columns k .. k + 3 of a 64-row block, 32 bytes each) the
    four lane vectors of rows 0-15, 16-31, 32-47, 48-63 for `vdot8`, lane j holding the row's four codes as bytes;
    rows 32-63's codes are 16 times theirs (the high nibbles, unshifted: the caller divides those sums by 16, exact).
    Two byte permutations of both 64-byte halves (vpermt2b) bring each row's bytes of the four columns together, one
    and a vector keeps its nibble: 6 instructions a 256 codes, where `vcodes4` takes 14 (and twice the `vdot`s)."""
    quads = [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 64),
                                                      [c * 32 + half + j for j in range(LANES) for c in range(4)]))
             for half in (0, 16)]  # rows 0-15 (and 32-47), rows 16-31 (and 48-63)
    masks = [ir.Constant(_I8x64, [m] * 64) for m in (0x0F, 0xF0)]
    return [builder.bitcast(builder.and_(q, m), _IT) for m in masks for q in quads]


vquads4 = _codes("vquads4", 128, _quads4)


def _quads8(builder, v):
    """int8 tiles (`quant.int8_tiles`): from a[i : i + 256] (lane unit p of a 64-row block: columns 4p .. 4p + 3, the
    four codes of a row side by side) the four lane vectors of rows 0-15, 16-31, 32-47, 48-63 for `vdot8` as they
    lie: the layout is the one `vdot8` and AMX tiles take, made once at conversion (8 byte permutations per 256
    codes before, at every product)."""
    w = builder.bitcast(v, ir.VectorType(_I32, 4 * LANES))
    return [builder.shuffle_vector(w, w, ir.Constant(_IT, list(range(LANES * r, LANES * r + LANES)))) for r in range(4)]


vquads8 = _codes("vquads8", 256, _quads8)


def _quad_pairs(h: int):
    def lanes(builder, v):
        zero = ir.Constant(v.type, None)
        n = v.type.count
        return [builder.bitcast(builder.shuffle_vector(v, zero, ir.Constant(ir.VectorType(_I32, 64), [
            x for j in range(LANES) for x in (64 * r + 4 * j + 2 * h, n, 64 * r + 4 * j + 2 * h + 1, n)])), _IT)
            for r in range(4)]
    lanes.__doc__ = f"""int8 tiles in quads: from lane unit p's 256 bytes the (code, code) int16 pairs of columns 4p +
    {2 * h}, 4p + {2 * h + 1} (`vcodes8`'s lanes), one zeroing byte permutation a vector."""
    return lanes


vpairs8q0 = _codes("vpairs8q0", 256, _quad_pairs(0))
vpairs8q1 = _codes("vpairs8q1", 256, _quad_pairs(1))


def _u16(a) -> bool:
    """A C-contiguous 1-D uint16 array, or an integer address of uint16 values (`simd._at`)."""
    return isinstance(a, types.Integer) or _contiguous(a, (types.uint16,))


@intrinsic
def vbfpairs(typingctx, a, i):  # pragma: no cover - compiled
    """a[i : i + 32] of bf16 bits (`_u16`) as 16 int32 lanes, lane j the pair (a[i + 2j], a[i + 2j + 1]): one load."""
    if not _u16(a) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = _at(context, builder, sig.args[0], args[0], args[1], ir.IntType(16))
        return builder.load(builder.bitcast(ptr, _IT.as_pointer()), align=1)
    return i32x16(a, i), codegen


@intrinsic
def bfat(typingctx, a, i):  # pragma: no cover - compiled
    """a[i] of bf16 bits (`_u16`) as the float32 it is."""
    if not _u16(a) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_at(context, builder, sig.args[0], args[0], args[1], ir.IntType(16)))
        return builder.bitcast(builder.shl(builder.zext(v, _I32), ir.Constant(_I32, 16)), ir.FloatType())
    return types.float32(a, i), codegen


@intrinsic
def f32put(typingctx, a, i, v):  # pragma: no cover - compiled
    """Store float32 v as element i at the integer address a."""
    if not isinstance(a, types.Integer) or not isinstance(i, types.Integer) or v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _at(context, builder, sig.args[0], args[0], args[1], ir.FloatType()))
        return context.get_dummy_value()
    return types.none(a, i, v), codegen


@intrinsic
def vdpbf(typingctx, acc, w, x):  # pragma: no cover - compiled
    """acc + w[2j + 1] * x[2j + 1] (rounded) + w[2j] * x[2j] (rounded) in float32 lane j, (w, x) lanes of bf16 pairs
    (`vbfpairs`): AVX-512 BF16's vdpbf16ps where the CPU has it (and LLVM >= 17 names its operands bfloat), else
    the same two fused multiply-adds."""
    if not (acc == f32x16 and w == x == i32x16):
        return None

    def codegen(context, builder, sig, args):
        a, wv, xv = args
        if _x86() and _has("avx512bf16") and llvm.llvm_version_info[0] >= 17:  # (its operands became bfloat in 17)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VT, [_VT, _BF16x32, _BF16x32]),
                                                "llvm.x86.avx512bf16.dpbf16ps.512")
            return builder.call(fn, [a, builder.bitcast(wv, _BF16x32), builder.bitcast(xv, _BF16x32)])
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VT, [_VT] * 3), "llvm.fma.v16f32")
        high, sixteen = ir.Constant(_IT, [-65536] * LANES), ir.Constant(_IT, [16] * LANES)  # (0xFFFF0000)
        second = [builder.bitcast(builder.and_(v, high), _VT) for v in (wv, xv)]
        first = [builder.bitcast(builder.shl(v, sixteen), _VT) for v in (wv, xv)]
        return builder.call(fma, [*first, builder.call(fma, [*second, a])])
    return f32x16(acc, w, x), codegen


@intrinsic
def vsteps(typingctx, x, inv, lim, a, i):  # pragma: no cover - compiled
    """a[i : i + 16] = the lanes x * inv rounded to the nearest integer (ties to even: np.rint) and kept within
    -lim .. lim, into a C-contiguous int8 or int16 array -> those integers as int32 lanes (an integer split of x)."""
    if x != f32x16 or inv != types.float32 or not isinstance(lim, types.Integer) \
            or not _contiguous(a, (types.int8, types.int16)) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v, f, top = args[0], args[1], context.cast(builder, args[2], sig.args[2], types.int32)
        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VT, [_VT]), "llvm.rint.v16f32")
        splat = [builder.shuffle_vector(builder.insert_element(ir.Constant(t, ir.Undefined), s, ir.Constant(_I32, 0)),
                                        ir.Constant(t, ir.Undefined), ir.Constant(_IT, [0] * LANES))
                 for t, s in ((_VT, f), (_IT, top), (_IT, builder.neg(top)))]
        q = builder.fptosi(builder.call(rint, [builder.fmul(v, splat[0])]), _IT)
        q = builder.select(builder.icmp_signed("<", q, splat[2]), splat[2], q)
        q = builder.select(builder.icmp_signed(">", q, splat[1]), splat[1], q)
        narrow = ir.VectorType(context.get_data_type(sig.args[3].dtype), LANES)
        builder.store(builder.trunc(q, narrow), _ptr(context, builder, sig.args[3], args[3], args[4]), align=1)
        return q
    return i32x16(x, inv, lim, a, i), codegen
