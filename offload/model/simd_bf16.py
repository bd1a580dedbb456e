"""A lane vector of bf16 pairs (`simd_int.vbfpairs`) as its two halves in float32 lanes (exact: bf16 is float32's
high half), for products that multiply one operand's halves by float32 values made once (`cpu_bf16._rows4x`):

    vbfsecond(v)    lane j the pair's second value (its high 16 bits, the low cleared)
    vbffirst(v)     lane j the pair's first value (its low 16 bits, shifted up)

`simd_int.vdpbf` without AVX-512 BF16 is fma(first, first', fma(second, second', acc)) of these. Knows nothing about
models, tiers or files.
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba.extending import intrinsic

from offload.model.simd import _VT, f32x16
from offload.model.simd_int import _IT, i32x16


def _half(first: bool):
    def typer(typingctx, v):
        if v != i32x16:
            return None

        def codegen(context, builder, sig, args):
            if first:
                return builder.bitcast(builder.shl(args[0], ir.Constant(_IT, [16] * 16)), _VT)
            return builder.bitcast(builder.and_(args[0], ir.Constant(_IT, [-65536] * 16)), _VT)  # (0xFFFF0000)
        return f32x16(v), codegen
    typer.__name__ = typer.__qualname__ = "vbffirst" if first else "vbfsecond"
    return intrinsic(typer)


vbffirst, vbfsecond = _half(True), _half(False)
