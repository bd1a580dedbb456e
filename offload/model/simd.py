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
    vpairs(a, i)         the 16 (first, second) pairs of bf16 bits a[i : i + 32] (uint16), as float32
    vpairs32(a, i)       the same of float32 bits held as uint16 halves, a[i : i + 64]
    vfma(a, b, c)        a * b + c, rounded once, lane by lane
    vsum(v)              the lanes' sum: halves added (8 + 8, 4 + 4, 2 + 2, 1 + 1)
    vsum8(a, ..., h)     eight vectors' vsums (the same adds), side by side
    fma(a, b, c)         the scalar a * b + c, rounded once
    prefetch(a, i)       a hint to bring a[i]'s cache line in (or byte i's at an integer address a)
    cycles()             the CPU's time-stamp counter (x86-64; elsewhere 0): where a compiled loop's steps end
    threads()            the threads this thread's parallel regions run on now; parts(n, unit): n items in one
                         contiguous share a thread

(Sixteen int32 lanes for integer products: `offload.model.simd_int`; elementwise math: `offload.model.simd_math`.)

Bounds are the caller's: vload and vstore do not check them. A kernel using these is compiled without fastmath
(numba gives its flags to every float operation that has none, `vsum`'s adds included). Also the bit moves between
float32 and uint32 that the kernels round with (`_f32_bits`, `_bits_f32`).
"""

from __future__ import annotations

import platform

import llvmlite.binding as llvm
import llvmlite.ir as ir
from numba import config, njit
from numba.core import cgutils, types
from numba.core.base import BaseContext
from numba.extending import intrinsic, models, register_model
from numba.np.ufunc.parallel import _launch_threads

LANES = 16
_F = ir.FloatType()
_VT = ir.VectorType(_F, LANES)

# Every array the kernels make (np.empty) starts at a cache line: numba's start at 32 bytes (its context's preferred
# alignment), and a 64-byte vector or tile row across two lines loads at a fraction of the speed (`simd_amx.quad_sums`'
# tile loads 6x slower). numba's context API is private: where it differs, only the alignment is lost.
if hasattr(BaseContext, "get_preferred_array_alignment"):
    BaseContext.get_preferred_array_alignment = lambda context, ty: 64


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
    elem = context.get_data_type(aty.dtype)
    return builder.bitcast(_at(context, builder, aty, arr, i, elem), ir.VectorType(elem, LANES).as_pointer())


def _contiguous(a, dtypes) -> bool:
    return isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype in dtypes


def _at(context, builder, aty, a, i, elem):
    """A pointer to element i of a 1-D array, or of the `elem` values at the integer address a (an array's
    `ctypes.data`, kept alive by the caller: no array in the callee, so no reference count to keep)."""
    if isinstance(aty, types.Integer):
        return builder.gep(builder.inttoptr(a, elem.as_pointer()), [i])
    return builder.gep(context.make_array(aty)(context, builder, a).data, [i])


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
        return _splat(builder, args[0], _VT)
    return f32x16(f), codegen


def _splat(builder, x, vt):
    """The scalar x in every lane of the vector type vt."""
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(
        ir.VectorType(ir.IntType(32), vt.count), [0] * vt.count))


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
def vsum8(typingctx, a, b, c, d, e, f, g, h):  # pragma: no cover - compiled
    """The eight vectors' `vsum`s, each the same adds in the same tree, computed side by side (three vector adds
    and six shuffles a level instead of eight trees)."""
    if not all(v == f32x16 for v in (a, b, c, d, e, f, g, h)):
        return None
    ret = types.UniTuple(types.float32, 8)

    def codegen(context, builder, sig, args):
        def level(pairs, lo_idx, hi_idx):
            out = []
            for x, y in pairs:
                lo = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(ir.IntType(32), len(lo_idx)), lo_idx))
                hi = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(ir.IntType(32), len(hi_idx)), hi_idx))
                out.append(builder.fadd(lo, hi))
            return out
        # lane i + lane i + 8 of two vectors -> one: [x's 8 | y's 8]; then within each group of 8, of 4, of 2
        v = level(list(zip(args[0::2], args[1::2])), [*range(8), *range(16, 24)], [*range(8, 16), *range(24, 32)])
        v = level(list(zip(v[0::2], v[1::2])), [8 * q + i for q in range(4) for i in range(4)],
                  [8 * q + 4 + i for q in range(4) for i in range(4)])
        v = level([(v[0], v[1])], [4 * q + i for q in range(8) for i in (0, 1)],
                  [4 * q + i for q in range(8) for i in (2, 3)])
        s = level([(v[0], v[0])], list(range(0, 16, 2)), list(range(1, 16, 2)))[0]
        return context.make_tuple(builder, ret, [builder.extract_element(s, ir.Constant(ir.IntType(32), j))
                                                 for j in range(8)])
    return ret(a, b, c, d, e, f, g, h), codegen


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
def bits_at(typingctx, a, wide):  # pragma: no cover - compiled
    """The value at the integer address a (kept alive by the caller) as float32's bits, uint32: a bf16's 16 bits
    shifted up (wide False) or a float32's 32 (True)."""
    if not isinstance(a, types.Integer) or not isinstance(wide, types.Boolean):
        return None

    def codegen(context, builder, sig, args):
        addr, flag = args
        i16, i32 = ir.IntType(16), ir.IntType(32)
        with builder.if_else(flag) as (f32, bf16):
            with f32:
                full = builder.load(builder.inttoptr(addr, i32.as_pointer()), align=1)
                at_f32 = builder.block
            with bf16:
                half = builder.shl(builder.zext(builder.load(builder.inttoptr(addr, i16.as_pointer()), align=1), i32),
                                   ir.Constant(i32, 16))
                at_bf16 = builder.block
        out = builder.phi(i32)
        out.add_incoming(full, at_f32)
        out.add_incoming(half, at_bf16)
        return out
    return types.uint32(a, wide), codegen


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


def _prefetcher(locality: int, doc: str):
    """A prefetch intrinsic: llvm.prefetch of a read at `locality` (3: every cache level, x86's prefetcht0; 2: from
    L2 on, prefetcht1)."""
    @intrinsic
    def fetch(typingctx, a, i):  # pragma: no cover - compiled
        if not (isinstance(a, types.Integer) or isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C") \
                or not isinstance(i, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            ptr = builder.bitcast(_at(context, builder, sig.args[0], args[0], args[1], ir.IntType(8)),
                                  ir.IntType(8).as_pointer())
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
                ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(32), ir.IntType(32)]), "llvm.prefetch.p0i8")
            i32 = ir.IntType(32)
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, locality), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return types.none(a, i), codegen
    fetch.__doc__ = doc
    return fetch


prefetch = _prefetcher(3, """A hint to bring the cache line of a[i] (a C-contiguous 1-D array; or byte i at the integer
address a) into the caches; no bounds needed.""")
prefetch_l2 = _prefetcher(2, """`prefetch` into L2 and beyond, not L1: lines wanted after the ones L1 holds now.""")


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


@intrinsic
def threads(typingctx):  # pragma: no cover - compiled
    """The threads the calling thread's parallel regions run on now (numba's thread-local count, which
    `kernels._threads` sets): a call of the threading layer's `get_num_threads` by its symbol, as numba's own
    `get_num_threads` makes it but without its Python-object error path, so a function using it stays cacheable
    (numba's `get_num_threads` in a compiled function is not: it refers to a ctypes pointer)."""
    _launch_threads()  # (registers the symbol)

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []), "get_num_threads")
        return builder.call(fn, [])
    return types.int64(), codegen


@njit(inline="always")
def parts(n, unit):  # pragma: no cover - compiled
    """n items split into one contiguous share a thread (`threads`), each a multiple of `unit` but the last: (share,
    shares). A parallel loop over the shares gives each thread one share: one stream of bytes a thread, and the
    loop's per-iteration cost (~0.1-0.2 us: SmolLM2-135M's 120 products a decode step at 16 rows an iteration
    cost ~1 ms of an ~8 ms step) once a thread."""
    t = max(1, threads())
    each = (n + t - 1) // t
    share = (each + unit - 1) // unit * unit
    return share, (n + share - 1) // share if share else 0


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


def _pairs(bits):
    """Codegen of `vpairs` for pairs of `bits`-bit values (16: bf16 bits, 32: float32 bits) from element i of a
    uint16 array on."""
    def codegen(context, builder, sig, args):
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
        return context.make_tuple(builder, types.UniTuple(f32x16, 2), out)
    return codegen


@intrinsic
def vpairs(typingctx, a, i):  # pragma: no cover - compiled
    """The 16 (first, second) pairs of bf16 values at a[i : i + 32] (raw bits, uint16) as two float32 lane vectors,
    as (scale, zero) pairs are stored."""
    if not _contiguous(a, (types.uint16,)) or not isinstance(i, types.Integer):
        return None
    return types.UniTuple(f32x16, 2)(a, i), _pairs(16)


@intrinsic
def vpairs32(typingctx, a, i):  # pragma: no cover - compiled
    """`vpairs` of float32 pairs held as uint16 halves: a[i : i + 64] (uint16) are 32 float32s' raw bits."""
    if not _contiguous(a, (types.uint16,)) or not isinstance(i, types.Integer):
        return None
    return types.UniTuple(f32x16, 2)(a, i), _pairs(32)
