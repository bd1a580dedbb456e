"""A CPU decoder layer in one compiled call (its elementwise formulas: `offload.model.cpu_elementwise`).

A Llama-family layer is ~40 tensor ops and numba calls op by op (`functional.decoder_layer`); on a CPU each costs
microseconds, which at batch 1 is as much as the products themselves (SmolLM2-135M, 30 layers). `decoder_layer`
runs the whole layer as one call: RMSNorm, the row-invariant products of `offload.model.kernels`, RoPE, the K/V
write into the paged pool, attention over it, SwiGLU and the residuals, each op rounded to the activations' dtype
as torch rounds it (bf16: to nearest even after every op). `rms_norm` and `silu_mul` (`cpu_elementwise`) are the
same formulas for the op-by-op layer (its RoPE is torch's, whose roundings the layer repeats), so a layer gives the
same bits either way
(tests/test_batch_invariance.py). Knows nothing about models, tiers or files.
"""

from __future__ import annotations

import numpy as np
import torch

from offload.model.cpu_attention import ColdBlocks, cold_rows
from offload.model.cpu_elementwise import _raw, elementwise_supported
from offload.model.kernels import (
    NO_SCALES,
    _threads,
    dense_kind,
    numba,
    packed_args,
    packed_kind,
    packed_supported,
)

if numba is not None:
    from numba import njit, typed

    from offload.model.cpu_attention import _attend
    from offload.model.cpu_elementwise import (
        _add_row,
        _bias_row,
        _copy_row,
        _load,
        _norm_row,
        _put_kv,
        _rnd,
        _rope_row,
        _round_rows,
        _rows_f32,
        _silu_mul_act,
        _store_rows,
    )
    from offload.model.kernels import _product
    from offload.model.simd import LANES, cycles

    @njit(inline="always")
    def _width(w):  # pragma: no cover - compiled
        """A matrix's output rows (padded): int8 / int4 tiles [rows / 64, K, 64 / 32], else [rows, K]."""
        return w.shape[0] * 64 if w.ndim == 3 else w.shape[0]

    @njit(nogil=True, cache=True)
    def _layer(x, in_norm, qkv, qkv_b, o, o_b, post_norm, gate_up, gu_b, down, down_b, scales, inter, eps,
               cos, sin, kv, rows, slot_blocks, slot_offsets, table, mask, pad_index, unpad, hq, scale, kind, bf16,
               out):  # pragma: no cover - compiled
        """One decoder layer of a Llama-family model on flat rows x [N, H] (raw bits), every op as
        `functional.decoder_layer` does it on a CPU (the same kernels and roundings: the same bits), in one
        call: norms, products (parallel), RoPE, the K/V write into the paged pool kv, attention over it (and the
        step's cold blocks at the addresses rows: `cpu_attention_rows._attend_rows`), the
        SwiGLU MLP, the residuals -> out [N, H] raw bits. Matrices: raw bits, or int8 or int4 tiles
        (`kernels._product`; kind: `kernels._dense`'s, or `kernels.packed_kind`'s for tiles; scales: packed
        matrices' (scale, min / zero) pairs as `kernels.scale_bits` gives them, each padded to whole tiles of rows:
        only the first features count, inter for gate_up's halves). Biases: [1, n] raw bits, or [1, 0] for none."""
        N, H = x.shape
        B, Tq = pad_index.shape
        hkv, D = kv.shape[3], kv.shape[4]
        qs, ks = hq * D, hkv * D
        shift = 16 if bf16 else 0
        x32 = _rows_f32(x, bf16)
        h = np.empty((N, H), np.float32)
        for n in range(N):
            _norm_row(x32, n, in_norm, eps, bf16, h, n)
        y = np.empty((N, _width(qkv)), np.float32)
        _product(h, qkv, scales[0], y, kind)
        for n in range(N):
            _bias_row(y[n], qs + 2 * ks, qkv_b, bf16)
        # RoPE on q and k, from y into qk (no fused multiply-add: torch's x * cos + rotate_half(x) * sin)
        qk = np.empty((N, qs + ks), np.float32)
        half = D // 2
        for n in range(N):
            if half % LANES == 0:  # 16 dimensions at a time, the same operations
                _rope_row(y[n], qk[n], cos.ctypes.data + n * cos.strides[0], sin.ctypes.data + n * sin.strides[0],
                          hq + hkv, D, bf16)
                continue
            for hh in range(hq + hkv):
                base = hh * D
                for d in range(D):
                    rot = -y[n, base + d + half] if d < half else y[n, base + d - half]
                    a = _rnd(y[n, base + d] * _load(cos, n, d, bf16), bf16)
                    b = _rnd(rot * _load(sin, n, d, bf16), bf16)
                    qk[n, base + d] = _rnd(a + b, bf16)
        for n in range(N):  # this step's K and V into their slots
            blk, off = slot_blocks[n], slot_offsets[n]
            for kh in range(hkv):
                _put_kv(qk[n], qs + kh * D, kv, blk, 0, off, kh, bf16)
                _put_kv(y[n], qs + ks + kh * D, kv, blk, 1, off, kh, bf16)
        qp = np.empty((B, Tq, hq, D), np.float32)
        qf = qp.reshape(B * Tq, qs)
        for b in range(B):
            for t in range(Tq):
                _copy_row(qk[pad_index[b, t]], qf[b * Tq + t], qs, False)
        att = np.empty((B, Tq, hq, D), np.float32)
        lse = np.empty((B, Tq, hq), np.float32)
        _attend(qp, kv, rows, table, mask, scale, shift, att, lse)
        a2 = np.empty((N, qs), np.float32)
        flat = att.reshape(B * Tq, qs)
        for n in range(N):
            _copy_row(flat[unpad[n]], a2[n], qs, bf16)
        y = np.empty((N, H), np.float32)
        _product(a2, o, scales[1], y, kind)
        for n in range(N):
            _add_row(x32[n], y[n], o_b, bf16)
        for n in range(N):
            _norm_row(x32, n, post_norm, eps, bf16, h, n)
        g = np.empty((N, _width(gate_up)), np.float32)
        _product(h, gate_up, scales[2], g, kind)
        act = np.empty((N, inter), np.float32)
        _silu_mul_act(g, gu_b, inter, bf16, act)
        y = np.empty((N, H), np.float32)
        _product(act, down, scales[3], y, kind)
        for n in range(N):
            _add_row(x32[n], y[n], down_b, bf16)
        _store_rows(x32, bf16, out)

    @njit(nogil=True, cache=True)
    def _layers(x, layers, kv, rows, eps, cos, sin, slot_blocks, slot_offsets, table, mask, pad_index, unpad, hq,
                scale, kind, bf16, tmp, out, stamps):  # pragma: no cover - compiled
        """Decoder layers back to back, each `_layer` with its weight arguments layers[i] (`_weights`) and plane i
        of the pool kv [layers, slots, 2, block_size, Hkv, D] and the addresses of its cold blocks rows[i] (rows
        [layers, n], n 0 for none): x -> out, through tmp.
        stamps[0] = the cycle counter at the start, stamps[i + 1] when layer i is done (`simd.cycles`)."""
        n = len(layers)
        stamps[0] = cycles()
        src = x
        for i in range(n):
            dst = out if (n - 1 - i) % 2 == 0 else tmp  # the last layer writes out
            _layer(src, *layers[i], eps, cos, sin, kv[i], rows[i], slot_blocks, slot_offsets, table, mask, pad_index,
                   unpad, hq, scale, kind, bf16, dst)
            src = dst
            stamps[i + 1] = cycles()

    @njit(cache=True)
    def _weight_list(first):  # pragma: no cover - compiled
        """A typed list holding `_weights`' tuple first (`LayerRun`: made here, cached with the kernels, not by
        typed.List from Python, which compiles its methods for the tuple's type in every process: ~1.8 s of a run's
        first pass)."""
        out = typed.List()
        out.append(first)
        return out

    @njit(cache=True)
    def _push(items, item):  # pragma: no cover - compiled
        items.append(item)

    @njit(nogil=True, cache=True)
    def _head(x, norm, eps, bf16, w, scales, kind, out, stamps):  # pragma: no cover - compiled
        """The model's last RMSNorm and the head's product in one call: rows x [N, H] (raw bits), norm [1, H] bits
        -> out [N, V] float32 logits holding the activations' dtype's values (`functional.head`'s bits: `_norm_row`,
        `kernels._product`, rounded as `cpu_elementwise.round_values`). stamps[-1] = the cycle counter when done."""
        xf = _rows_f32(x, bf16)
        h = np.empty(xf.shape, np.float32)
        for n in range(xf.shape[0]):
            _norm_row(xf, n, norm, eps, bf16, h, n)
        _product(h, w, scales, out, kind)
        if bf16:
            _round_rows(out)
        stamps[stamps.shape[0] - 1] = cycles()

#: (activation dtype, matrix dtype) pairs the layer takes (a bf16 model computing in float32 widens as it multiplies)
LAYER_DTYPES = {(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)} \
    if numba is not None else set()


def layers_compiled(packed: bool | None = None, dtype: torch.dtype | None = None) -> bool | None:
    """Does numba's cache hold a compiled decoder layer (`_layer`, which every fused pass calls: a streamed layer on
    its own, resident ones through `_layers`, whose compiling around a cached `_layer` held 57 MiB) of these kernel
    files: for packed matrices (int8, int4: `packed` True), dense ones (False) or any, with activations of `dtype`
    (bf16, float32: each its own layer and products) or any? False on a fresh install, whose first run compiles
    every kernel it uses (~1 min, and memory: `COMPILING`); None where numba is not there or its cache's (private)
    layout differs."""
    try:
        signatures = [str(key[0]) for key in _layer._cache._cache_file._load_index()]
    except Exception:  # noqa: BLE001 - numba's internals: where they differ, only this answer is lost
        return None
    rows = None if dtype is None else f"(Array({_raw(torch.empty(0, dtype=dtype), True).dtype}, "  # x: raw bits
    return any((packed is None or ("uint8" in s) == packed) and (rows is None or s.startswith(rows))
               for s in signatures)  # packed codes are the uint8 arrays



#: what a first run's compiling holds beyond a later run's, for the process's life (numba keeps the code and its
#: compiler's state; SmolLM2-135M's calibration, numba 0.68, a 2-core Xeon): dense kernels ~300 MiB, with the
#: packed ones ~650 MiB (a run of the int4 store alone: 546 MiB)
COMPILING = {False: 300 * 2**20, True: 650 * 2**20}


def compile_reserve(packed: bool) -> int:
    """RAM a CPU run computing with dense or packed (int8, int4) matrices still needs for compiling its kernels in
    this install: `COMPILING` where numba's cache does not hold them yet, else 0 (also where it cannot tell)."""
    return COMPILING[packed] if layers_compiled(packed) is False else 0


def _packed(m) -> bool:
    """Is m a packed int8 or int4 matrix the CPU kernels multiply (`quant.PackedLinear`: codes and their scales)?"""
    return getattr(m, "bits", None) in (4, 8) and m.q.device.type == "cpu" and packed_supported(m.sz)


def layer_supported(x: torch.Tensor, mats: tuple) -> bool:
    """Does `decoder_layer` take this layer: a CPU, numba, its four matrices dense tensors of one dtype that goes with
    x's (`LAYER_DTYPES`) or all packed (int8, int4), its biases (where it has them) in x's dtype on the CPU?"""
    if not elementwise_supported(x):
        return False
    matrices, biases = mats[0::2], [b for b in mats[1::2] if b is not None]
    if not all(b.dtype == x.dtype and b.device.type == "cpu" for b in biases):
        return False
    if all(_packed(m) for m in matrices):
        return True
    kind = getattr(matrices[0], "dtype", None)
    return (x.dtype, kind) in LAYER_DTYPES and all(isinstance(m, torch.Tensor) and m.dtype == kind and m.dim() == 2
                                                    and m.device.type == "cpu" for m in matrices)


def head_supported(x: torch.Tensor, w) -> bool:
    """Does `head_logits` take rows x and the head's matrix w (as `layer_supported` takes a layer's)?"""
    if not elementwise_supported(x) or x.dim() != 2:
        return False
    return _packed(w) or (isinstance(w, torch.Tensor) and (x.dtype, w.dtype) in LAYER_DTYPES and w.dim() == 2
                          and w.device.type == "cpu")


def head_logits(x: torch.Tensor, norm: torch.Tensor, eps: float, w) -> torch.Tensor | None:
    """x [N, H] -> float32 logits [N, V] of `norm`'s RMSNorm and the head's product in one compiled call (`_head`),
    or None where it does not take them (`head_supported`): the same bits as `functional.head`'s ops one by one
    (~0.4 ms less of a step's Python, run with its caches cold after the weights went through them)."""
    got = head_args(x, norm, w)
    if got is None:
        return None
    out, bits = _logits_buffer(x.shape[0], got)
    _head_into(_raw(x.contiguous()), float(eps), got, bits, _NO_STAMPS)
    return out


def head_args(x: torch.Tensor, norm: torch.Tensor, w) -> tuple | None:
    """What `_head` takes of the head (matrix, scales, norm bits, kind, the vocabulary's rows, bf16?) for rows like x,
    or None where it does not take them (`head_supported`). Made once and kept on the matrix (for norm and x's
    dtype)."""
    got = getattr(w, "q", w).__dict__.get("_offload_head")
    if got is None or got[0] is not norm or got[1] is not x.dtype:
        if not head_supported(x, w):
            return None
        wm, scales = _matrix(w)
        got = (norm, x.dtype, wm, scales, _raw(norm.to(x.dtype).contiguous()),
               packed_kind(x.dtype) if _packed(w) else dense_kind(w.dtype, x.dtype),
               w.out_features if _packed(w) else w.shape[0], x.dtype == torch.bfloat16)
        getattr(w, "q", w).__dict__["_offload_head"] = got
    return got[2:]


def _head_into(x: np.ndarray, eps: float, head: tuple, bits: np.ndarray, stamps: np.ndarray) -> None:
    """`_head` of `head_args`' head on rows x (raw bits) into `_logits_buffer`'s bits (stamps[-1]: when done)."""
    if bits.size:
        wm, scales, nm, kind, vocab, bf16 = head
        _threads(x.shape[0] * x.shape[1] * vocab)
        _head(x, nm, eps, bf16, wm, scales, kind, bits, stamps)


def _logits_buffer(n: int, head: tuple) -> tuple[torch.Tensor, np.ndarray]:
    """(float32 logits [n, V] of `head_args`' head, the padded buffer `_head` writes them into)."""
    wm, rows = head[0], head[4]
    out = torch.empty(n, wm.shape[0] * 64 if wm.ndim == 3 else rows, dtype=torch.float32)
    return out[:, :rows] if out.shape[1] != rows else out, out.numpy()


_NO_STAMPS = np.zeros(1, np.int64)  # `_head`'s stamp where no one reads it


def _bias(b: torch.Tensor | None, dtype: torch.dtype) -> np.ndarray:
    if b is not None:
        return _raw(b.contiguous())
    return np.zeros((1, 0), np.uint16 if dtype == torch.bfloat16 else np.uint32)


def _matrix(m) -> tuple[np.ndarray, np.ndarray]:
    """A matrix as the product kernels take it (`kernels._product`): (raw bits, or int8 / int4 tiles [rows / 64, K,
    64 / 32]; their scales' bits or none)."""
    if isinstance(m, torch.Tensor):
        return _raw(m.contiguous()), NO_SCALES
    return packed_args(m.q, m.sz)


def _weights(mats: tuple, norms: tuple[torch.Tensor, torch.Tensor], dt: torch.dtype) -> tuple:
    """The layer's weight arguments of `_layer` (numpy views of the weights' bytes, norms in the activations'
    dtype), made once for a set of weight tensors and kept on the first matrix's bytes: ~30 numpy views a layer
    cost ~0.1 ms, a third of a SmolLM2-135M layer's compute. (The weights' tensors are the same objects step
    after step: `TieredWeights.views`; a streamed group's slot is refilled with the same bytes.)"""
    qkv, qkv_b, o, o_b, gu, gu_b, down, down_b = mats
    anchor = qkv.q if _packed(qkv) else qkv
    key = (dt, *map(id, mats), *map(id, norms))  # (a group's weight objects are the same step after step:
    got = anchor.__dict__.get("_offload_layer")  # `TieredWeights.views`)
    if got is not None and got[0] == key:
        return got[1]
    kept = (mats, norms)  # the objects whose ids make the key: theirs while the entry lives
    norms = tuple(n.to(dt).contiguous() for n in norms)
    (wq, sq), (wo, so), (wg, sg), (wd, sd) = (_matrix(m) for m in (qkv, o, gu, down))
    inter = (gu.out_features if _packed(gu) else gu.shape[0]) // 2
    args = (_raw(norms[0]), wq, _bias(qkv_b, dt), wo, _bias(o_b, dt), _raw(norms[1]), wg, _bias(gu_b, dt), wd,
            _bias(down_b, dt), (sq, so, sg, sd), inter)
    # the value holds views of these tensors' memory: kept only while `anchor` lives (a new set of weight objects
    # makes a new entry)
    anchor.__dict__["_offload_layer"] = (key, args, kept, norms)
    return args


def _index(t: torch.Tensor, raw: bool = False) -> np.ndarray:
    """A step's tensor (built once a step, read by every layer: indices, the mask, cos / sin) as numpy (its raw
    bits with `raw`), over its memory, made once and kept on it."""
    if not t.is_contiguous():
        return _raw(t.contiguous()) if raw else t.contiguous().numpy()
    got = t.__dict__.get("_offload_numpy")
    if got is None:
        got = t.__dict__["_offload_numpy"] = _raw(t) if raw else t.numpy()
    return got


def decoder_layer(x: torch.Tensor, mats: tuple, norms: tuple[torch.Tensor, torch.Tensor], eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, cold: ColdBlocks | None,
                  index: tuple[torch.Tensor, ...], heads: int, scale: float) -> torch.Tensor:
    """A Llama-family decoder layer on flat rows x [N, H] in one compiled call (`_layer`): mats (qkv, qkv bias,
    o, o bias, gate_up, its bias, down, its bias: `layer_supported`), norms (input, post), the rows' cos / sin
    [N, D], the paged pool kv [slots, 2, block_size, Hkv, D] (this step's K/V are written into it), the step's
    blocks in the cold tiers (`cpu_attention.ColdBlocks`, read where they lie; -1 - i in the table: block i), index
    (slot_blocks, slot_offsets, table, mask, pad_index, unpad_index: `offload.kv` and `BatchLayout`). The same bits
    as the op-by-op layer."""
    qkv = mats[0]
    _threads(x.numel() * (qkv.out_features if _packed(qkv) else qkv.shape[0]))
    x = x.contiguous()
    out = torch.empty_like(x)
    dt = x.dtype
    kind = packed_kind(dt) if _packed(qkv) else dense_kind(qkv.dtype, dt)
    _layer(_raw(x), *_weights(mats, norms, dt), float(eps), _index(cos, raw=True), _index(sin, raw=True),
           _raw(kv, keep=True), cold_rows(kv, cold or ()),
           *(_index(t) for t in index), heads, float(scale), kind, dt == torch.bfloat16, _raw(out))
    return out


class LayerRun:
    """Decoder layers back to back in one compiled call (`_layers`), for a run of layers whose weights stay where
    they are (resident): per layer, the Python of a call (~0.1 ms: arguments, checks, numba's dispatch of ~30 of
    them) is as much as a small model's products. Made once for a set of weight objects (`_weights` of each
    layer: mats, norms as `decoder_layer` takes them); the same bits as calling `decoder_layer` layer by layer.
    With `head` (`head_args`; the run ends at the model's last layer and the pass keeps every row) the model's head
    follows in the same call from Python (`_head`: the logits): between the two, a decode step's Python had been
    ~0.4 ms of a ~11 ms SmolLM2-135M step (acquiring the head, its views, checks, spans, all with cold caches; now
    ~0.07; one process alternating, 2-core Zen 4: bf16 / int4 steps 4.3 / 4.5% shorter, the same tokens)."""

    def __init__(self, layers: list[tuple[tuple, tuple]], dt: torch.dtype, head: tuple | None = None) -> None:
        self.dt, self.size, self.head = dt, len(layers), head
        self.no_cold = np.zeros((self.size, 0), np.int64)  # the cold blocks' addresses of a step without any
        weights = [_weights(mats, norms, dt) for mats, norms in layers]
        if len({numba.typeof(w) for w in weights}) != 1:  # (one list holds them: a list of another type raises
            raise TypeError("the layers' weights are not of one numba type")  # AssertionError or numba's own)
        self.args = _weight_list(weights[0])
        for w in weights[1:]:
            _push(self.args, w)
        qkv = layers[0][0][0]
        self.width = qkv.out_features if _packed(qkv) else qkv.shape[0]
        self.kind = packed_kind(self.dt) if _packed(qkv) else dense_kind(qkv.dtype, self.dt)

    @staticmethod
    def supported(x: torch.Tensor, layers: list[tuple[tuple, tuple]]) -> bool:
        """Does every layer take `decoder_layer`, all with matrices of one kind (one compiled loop)?"""
        kinds = {(type(m[0]), getattr(m[0], "bits", None), getattr(m[0], "dtype", None)) for m, _ in layers}
        return bool(layers) and len(kinds) == 1 and all(layer_supported(x, m) for m, _ in layers)

    def __call__(self, x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                 cold: list[ColdBlocks] | None, index: tuple[torch.Tensor, ...], heads: int, scale: float,
                 ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor | None]:
        """x [N, H] through the layers (kv: the pool's planes of these layers, [layers, slots, 2, block_size, Hkv,
        D]; cold: each layer's cold blocks, the same blocks of the table in each, or None; the rest as
        `decoder_layer`'s) -> (out [N, H], the cycle counter at the start and after each layer (and the head), the
        head's float32 logits [N, V] or None without one)."""
        _threads(x.numel() * self.width)
        x = x.contiguous()
        out, tmp = torch.empty_like(x), torch.empty_like(x)
        stamps = np.zeros(self.size + 1 + (self.head is not None), np.int64)
        # (the logits' buffer made here, beside the others: torch's code is in the caches now, not after the layers)
        logits, bits = (None, None) if self.head is None else _logits_buffer(x.shape[0], self.head)
        rows = self.no_cold if cold is None else np.stack([cold_rows(kv[i], c) for i, c in enumerate(cold)])
        y = _raw(out)
        _layers(_raw(x), self.args, _raw(kv, keep=True), rows, float(eps), _index(cos, raw=True),
                _index(sin, raw=True), *(_index(t) for t in index), heads, float(scale), self.kind,
                self.dt == torch.bfloat16, _raw(tmp), y, stamps)
        if self.head is not None and bits is not None:  # (bits: the head's buffer, made with it)
            _head_into(y, float(eps), self.head, bits, stamps)
        return out, stamps, logits
