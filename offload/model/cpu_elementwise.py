"""The elementwise steps of a CPU decoder layer, each op rounded to the activations' dtype as torch rounds it (bf16:
to nearest even after every op): RMSNorm, SiLU x up, RoPE, a product's bias and rounding. The fused layer
(`offload.model.fused`) calls the compiled row functions; `rms_norm` and `silu_mul` are the same formulas for the
op-by-op layer, so both give the same bits. Written in 16-lane vectors where a row allows (`simd`, `simd_math`):
every value goes through the same operations whatever its neighbours, so a row's bits are its own. Knows nothing
about models, tiers or files.
"""

from __future__ import annotations

import numpy as np
import torch

from offload.model.kernels import _as_numpy, numba

#: Columns of SiLU x up a parallel work item computes (a whole number of 16-lane vectors).
_SILU_RUN = 512

if numba is not None:
    from numba import njit, prange

    from offload.model.kernels import _bits_f32, _f32_bits
    from offload.model.simd import LANES, fma, vfma, vload, vsplat, vstore, vsum, vzero
    from offload.model.simd_math import vadd, vdiv, vexp, vmul, vput, vraw, vround

    @njit(inline="always")
    def _bf16_bits(f):  # pragma: no cover - compiled
        """float32 -> bf16 bits (uint16 value), rounded to nearest even as torch rounds (NaN stays a quiet NaN)."""
        b = _f32_bits(f)
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            return np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
        return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @njit(inline="always")
    def _load(a, i, j, bf16):  # pragma: no cover - compiled
        return _bits_f32(np.uint32(a[i, j]) << np.uint32(16)) if bf16 else _bits_f32(a[i, j])

    @njit(inline="always")
    def _store(a, i, j, f, bf16):  # pragma: no cover - compiled
        """a[i, j] = f rounded to the tensor's dtype; returns the stored value as float32."""
        if bf16:
            bits = _bf16_bits(f)
            a[i, j] = bits
            return _bits_f32(np.uint32(bits) << np.uint32(16))
        a[i, j] = _f32_bits(f)
        return f

    @njit(inline="always")
    def _rnd(f, bf16):  # pragma: no cover - compiled
        """f rounded to the activations' dtype (bf16: to nearest even, as torch rounds an op's float result)."""
        return _bits_f32(np.uint32(_bf16_bits(f)) << np.uint32(16)) if bf16 else f

    @njit(inline="always")
    def _biased(y, b, j, bf16):  # pragma: no cover - compiled
        """A product's float32 output y (feature j) plus bias bits b [1, n] ([1, 0]: none), rounded to the dtype: what
        `kernels.dense_linear` returns."""
        return _rnd(y + _load(b, 0, j, bf16) if b.shape[1] else y, bf16)

    @njit(inline="always")
    def _norm_row(x, n, w, eps, bf16, out, m):  # pragma: no cover - compiled
        """out[m] = transformers' RMSNorm of the float32 row x[n] (values of the dtype) with weight bits w [1, H]:
        `w * (x * rsqrt(mean(x ** 2) + eps)).to(dtype)`, each op rounded to the dtype; the sum of squares in 16
        lanes of fused multiply-adds summed by `vsum`'s tree (then the columns past the last 16, in order), the
        rest 16 columns at a time (a scalar sum of squares is a chain of dependent adds as long as the row)."""
        H = x.shape[1]
        H16 = H - H % LANES
        xr, orow, wa = x[n], out[m], w.ctypes.data
        a = vzero()
        for h in range(0, H16, LANES):
            v = vload(xr, h)
            a = vfma(v, v, a)
        total = vsum(a)
        for h in range(H16, H):
            total = fma(xr[h], xr[h], total)
        r = np.float32(1.0) / np.sqrt(total / np.float32(H) + np.float32(eps))
        rv = vsplat(r)
        for h in range(0, H16, LANES):
            vstore(orow, h, vround(vmul(vraw(wa, h, bf16), vround(vmul(vload(xr, h), rv), bf16)), bf16))
        for h in range(H16, H):
            orow[h] = _rnd(_load(w, 0, h, bf16) * _rnd(xr[h] * r, bf16), bf16)

    @njit(inline="always")
    def _rope_row(y, out, cos, sin, heads, D, bf16):  # pragma: no cover - compiled
        """RoPE of one row's `heads` heads of y into out, 16 dimensions at a time (D / 2 a whole number of 16s; cos,
        sin: addresses of the row's raw bits): torch's `x * cos + rotate_half(x) * sin`, each op rounded to the dtype
        (the op-by-op layer's RoPE is torch's: the same bits)."""
        half, minus = D // 2, vsplat(np.float32(-1.0))
        for hh in range(heads):
            base = hh * D
            for d in range(0, D, LANES):
                v = vload(y, base + d)
                rot = vmul(vload(y, base + d + half), minus) if d < half else vload(y, base + d - half)
                a = vround(vmul(v, vraw(cos, d, bf16)), bf16)
                b = vround(vmul(rot, vraw(sin, d, bf16)), bf16)
                vstore(out, base + d, vround(vadd(a, b), bf16))

    @njit(inline="always")
    def _vbiased(y, j, bias, bf16):  # pragma: no cover - compiled
        """`_biased` of y[j : j + 16]; bias: the bias bits' address, 0 for none (`_bias_at`)."""
        v = vload(y, j)
        if bias:
            v = vadd(v, vraw(bias, j, bf16))
        return vround(v, bf16)

    @njit(inline="always")
    def _bias_at(b):  # pragma: no cover - compiled
        """The address of bias bits b [1, n], 0 for none ([1, 0]): taken once, before a row's loop (`b.ctypes` in the
        loop of `_add_row`, beside its scalar tail, made 9 rows of 576 columns 0.87 -> 5.4 us)."""
        at = b.ctypes.data
        return at if b.shape[1] else at - at  # (an unsigned address either way)

    @njit(inline="always")
    def _add_row(x, y, b, bf16):  # pragma: no cover - compiled
        """x[:] = x + `_biased`(y) for float32 rows x, y of the dtype's values (b: bias bits [1, n], [1, 0] none), each
        op rounded to the dtype: a residual after a product. 16 columns at a time, the rest one by one."""
        H = x.shape[0]
        H16, bias = H - H % LANES, _bias_at(b)
        for j in range(0, H16, LANES):
            vstore(x, j, vround(vadd(vload(x, j), _vbiased(y, j, bias, bf16)), bf16))
        for j in range(H16, H):
            x[j] = _rnd(x[j] + _biased(y[j], b, j, bf16), bf16)

    @njit(nogil=True, cache=True)
    def _rows_f32(x, bf16):  # pragma: no cover - compiled
        """Rows of raw bits x [N, M] (bf16 / float32) as float32, 16 columns at a time."""
        out = np.empty(x.shape, np.float32)
        M = x.shape[1]
        M16 = M - M % LANES
        for i in range(x.shape[0]):
            at, row = x.ctypes.data + i * x.strides[0], out[i]
            for j in range(0, M16, LANES):
                vstore(row, j, vraw(at, j, bf16))
            for j in range(M16, M):
                row[j] = _load(x, i, j, bf16)
        return out

    @njit(nogil=True, cache=True)
    def _round_rows(y):  # pragma: no cover - compiled
        """y [N, M] float32 rounded in place to bf16's values (`_rnd`), 16 lanes at a time."""
        for n in range(y.shape[0]):
            row = y[n]
            tail = row.shape[0] - row.shape[0] % LANES
            for k in range(0, tail, LANES):
                vstore(row, k, vround(vload(row, k), True))
            for k in range(tail, row.shape[0]):
                row[k] = _rnd(row[k], True)

    @njit(nogil=True, cache=True)
    def _store_rows(v, bf16, out):  # pragma: no cover - compiled
        """out [N, M] raw bits = float32 rows v rounded to the dtype (`_store`), 16 columns at a time."""
        M = v.shape[1]
        M16 = M - M % LANES
        for i in range(v.shape[0]):
            at, row = out.ctypes.data + i * out.strides[0], v[i]
            for j in range(0, M16, LANES):
                vput(at, j, vload(row, j), bf16)
            for j in range(M16, M):
                _store(out, i, j, v[i, j], bf16)

    @njit(inline="always")
    def _bias_row(y, n, b, bf16):  # pragma: no cover - compiled
        """y[:n] = `_biased`(y[:n]) of a float32 row (b: bias bits [1, >= n], [1, 0] none), 16 columns at a time."""
        if bf16 or b.shape[1]:  # (else nothing changes)
            n16, bias = n - n % LANES, _bias_at(b)
            for j in range(0, n16, LANES):
                vstore(y, j, _vbiased(y, j, bias, bf16))
            for j in range(n16, n):
                y[j] = _biased(y[j], b, j, bf16)

    @njit(inline="always")
    def _copy_row(src, dst, n, bf16):  # pragma: no cover - compiled
        """dst[:n] = src[:n] (float32 rows; with bf16 rounded to its values, `_rnd`), 16 at a time."""
        n16 = n - n % LANES
        for j in range(0, n16, LANES):
            vstore(dst, j, vround(vload(src, j), bf16))
        for j in range(n16, n):
            dst[j] = _rnd(src[j], bf16)

    @njit(inline="always")
    def _put_kv(src, s0, kv, blk, kind, off, kh, bf16):  # pragma: no cover - compiled
        """kv[blk, kind, off, kh] (a paged pool's raw bits [slots, 2, bs, Hkv, D]) = the float32 row src's D values
        from s0 rounded to the dtype (`_store`'s), 16 at a time."""
        D = kv.shape[4]
        D16 = D - D % LANES
        at = kv.ctypes.data + blk * kv.strides[0] + kind * kv.strides[1] + off * kv.strides[2] + kh * kv.strides[3]
        for d in range(0, D16, LANES):
            vput(at, d, vload(src, s0 + d), bf16)
        for d in range(D16, D):
            kv[blk, kind, off, kh, d] = _bf16_bits(src[s0 + d]) if bf16 else _f32_bits(src[s0 + d])

    @njit(nogil=True, cache=True)
    def _rms_norm(x, w, eps, bf16, out):  # pragma: no cover - compiled
        """x [N, H], w [1, H] raw bits (uint16 bf16 / uint32 float32) -> out [N, H], the same bits: `_norm_row`."""
        xf = _rows_f32(x, bf16)
        o = np.empty(xf.shape, np.float32)
        for n in range(xf.shape[0]):
            _norm_row(xf, n, w, eps, bf16, o, n)
        _store_rows(o, bf16, out)

    @njit(nogil=True, cache=True)
    def _silu_mul_rows(gu, bf16, out):  # pragma: no cover - compiled
        """gu [N, 2I] raw bits (gate | up) -> out [N, I]: `_silu_mul_act` on the rows widened (the values are the
        dtype's already: no bias, the roundings change nothing), stored back in the dtype."""
        act = np.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
        _silu_mul_act(_rows_f32(gu, bf16), np.zeros((1, 0), gu.dtype), act.shape[1], bf16, act)
        _store_rows(act, bf16, out)

    @njit(inline="always")
    def _silu_vec(gate, up, bf16):  # pragma: no cover - compiled
        """`F.silu(gate) * up` of 16 columns, each op rounded as torch's (`simd_math.vround`; e^-gate by `vexp`)."""
        one, neg, z = vsplat(np.float32(1.0)), vsplat(np.float32(-1.0)), vzero()
        x = vround(gate, bf16)  # (a value of the dtype already: rounding twice is rounding once)
        s = vround(vdiv(x, vadd(one, vexp(vfma(x, neg, z)))), bf16)
        return vround(vmul(s, vround(up, bf16)), bf16)

    @njit(parallel=True, nogil=True, cache=True)
    def _silu_mul_act(g, b, inter, bf16, act):  # pragma: no cover - compiled
        """act [N, inter] = `F.silu(gate) * up` of the gate_up product's float32 rows g [N, >= 2 inter] plus bias
        bits b (`_biased`: each rounded to the dtype), in parallel runs of `_SILU_RUN` columns, 16 at a time, read
        and written in place (the columns past the last 16 through a buffer): every column the same operations
        (`_silu_vec`). (One libm exp and scalar roundings a column cost ~9 ns; each run copied through two buffers
        before, 1536 columns 1 / 9 rows 4.3 / 18.2 -> 2.8 / 8.0 us, 8192: 14.4 / 113 -> 5.8 / 36.9, the same bits.)"""
        N = g.shape[0]
        runs = (inter + _SILU_RUN - 1) // _SILU_RUN
        bias, at = b.shape[1] != 0, b.ctypes.data
        for c in prange(N * runs):
            n, i0 = c // runs, (c % runs) * _SILU_RUN
            end = min(inter, i0 + _SILU_RUN)
            full = end - (end - i0) % LANES
            gr, ar = g[n], act[n]
            for k in range(i0, full, LANES):
                gate, up = vload(gr, k), vload(gr, inter + k)
                if bias:  # (rounded in `_silu_vec`)
                    gate, up = vadd(gate, vraw(at, k, bf16)), vadd(up, vraw(at, inter + k, bf16))
                vstore(ar, k, _silu_vec(gate, up, bf16))
            if full < end:
                gate, up = np.zeros(LANES, np.float32), np.zeros(LANES, np.float32)
                for i in range(full, end):
                    gate[i - full] = _biased(g[n, i], b, i, bf16)
                    up[i - full] = _biased(g[n, inter + i], b, inter + i, bf16)
                vstore(gate, 0, _silu_vec(vload(gate, 0), vload(up, 0), bf16))
                for i in range(full, end):
                    act[n, i] = gate[i - full]


def _raw(t: torch.Tensor, keep: bool = False) -> np.ndarray:
    """A bf16 or float32 tensor's bits as a numpy array (uint16 / uint32) over the same memory: 2-D rows of its last
    dimension (a 1-D tensor is one row), or its own shape with `keep`."""
    return _as_numpy(t if keep else t.reshape(-1, t.shape[-1]))


def elementwise_supported(x: torch.Tensor) -> bool:
    """Do `rms_norm` and `silu_mul` take x (CPU, bf16 or float32, numba present)?"""
    return numba is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of each run of weight.numel() values of x, with its roundings (the fused layer's
    formula, so a layer gives the same bits fused or op by op). The sum of squares is this loop's own order
    (torch's `mean` reduces in another: the last bit of a row's scale can differ from torch's)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _rms_norm(_raw(x.view(-1, weight.shape[-1])), _raw(weight.to(x.dtype).contiguous()), float(eps),
                  x.dtype == torch.bfloat16, _raw(out.view(-1, weight.shape[-1])))
    return out


def round_values(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 y with its values rounded to dtype's, as `y.to(dtype).float()` gives them: in place for bf16 on the
    CPU (one pass, no copy in bf16: a head's 49152 logits), else that."""
    if dtype == torch.float32:
        return y
    if dtype == torch.bfloat16 and elementwise_supported(y) and y.dtype == torch.float32 and y.is_contiguous():
        if y.numel():
            _round_rows(y.view(-1, y.shape[-1]).numpy())
        return y
    return y.to(dtype).float()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> `F.silu(gate) * up` [N, I] with torch's roundings (the fused layer's formula)."""
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    if out.numel():
        _silu_mul_rows(_raw(gate_up), gate_up.dtype == torch.bfloat16, _raw(out))
    return out
