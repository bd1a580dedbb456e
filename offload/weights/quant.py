"""Group-wise int8 / int4 weight codecs: quantize once at conversion, multiply packed at compute time.

The scheme is FlexGen's: asymmetric round-to-nearest along the input dimension, one (scale, min)
per `group_size` consecutive input columns of each output row:

    q = clamp(round((w - min) / scale), 0, 2**bits - 1)      scale = (max - min) / (2**bits - 1)

Packed bytes are laid out the way torch's CPU int4 matmul (`_weight_int4pack_mm_for_cpu`) reads
them, so on a CPU device a packed matrix is multiplied as it lies in its slot, with no dequantized
copy. int8 is stored as two 4-bit *planes* (high and low nibble, `q = 16 hi + lo`): two such
matmuls whose sum is the int8 product. Each plane carries `(scale, zero)` pairs in the compute
dtype, with the kernel's meaning `w = (nibble - 8) * scale + zero`:

    int4:           scale = s,      zero = min + 8 s
    int8 high:      scale = 16 s,   zero = min + 128 s
    int8 low:       scale = s,      zero = 8 s

Tile order of one plane (torch's CPU int4 packing): output rows in blocks of 64; inside a block,
for each input column k, 32 bytes whose byte j holds row j (low nibble) and row j + 32 (high
nibble). Rows are padded with zeros to a multiple of 64. Where the kernel is missing (CUDA, other
group sizes) a matrix is dequantized into a reused scratch buffer and multiplied densely.

On a CPU a packed matrix multiplies through `offload.model.kernels` (row-invariant: torch's kernel above
with bf16 scales, a numba kernel on the same bytes otherwise). Knows nothing about models, groups or files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.model import kernels

#: Output rows per tile of the packed layout.
TILE_ROWS = 64
#: Group sizes torch's fused CPU kernel accepts.
FUSED_GROUPS = (32, 64, 128, 256)
_FUSED = getattr(torch, "_weight_int4pack_mm_for_cpu", None)


def _torch_packs_like_us() -> bool:
    """torch packs int4 for its CPU kernel by the vector width it was dispatched to (64-row tiles with AVX-512,
    32-row tiles with AVX2), while stores keep 64-row tiles on every machine: its kernel reads our bytes only
    where its packing of a probe equals ours."""
    convert = getattr(torch, "_convert_weight_to_int4pack_for_cpu", None)
    if _FUSED is None or convert is None:
        return False
    nib = torch.arange(64 * 64, dtype=torch.int32).view(64, 64).mul_(7).remainder_(16)
    return torch.equal(convert(nib, 1), pack_tiles(nib))


def planes(bits: int) -> int:
    return {4: 1, 8: 2}[bits]


def padded_rows(n: int) -> int:
    return -(-n // TILE_ROWS) * TILE_ROWS


def packed_shapes(n: int, k: int, bits: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the packed tensors of one [n, k] matrix: nibbles (uint8) and (scale, zero) pairs."""
    p, rows = planes(bits), padded_rows(n)
    return {"q": (p, rows, k // 2), "sz": (p, k // group_size, rows, 2)}


# ----------------------------------------------------------------------------- tile order
def pack_tiles(q: torch.Tensor) -> torch.Tensor:
    """Nibbles [rows, k] (values 0..15, rows a multiple of 64) -> bytes [rows, k / 2] in tile order."""
    rows, k = q.shape
    b = q.to(torch.uint8).view(rows // TILE_ROWS, 2, TILE_ROWS // 2, k)  # [blocks, half, j, k]
    return (b[:, 0] | (b[:, 1] << 4)).permute(0, 2, 1).reshape(rows, k // 2)


def unpack_tiles(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bytes [rows, k / 2] in tile order -> nibbles [rows, k] (uint8, or written into `out` of any dtype)."""
    rows, half = packed.shape
    k = 2 * half
    b = packed.view(rows // TILE_ROWS, k, TILE_ROWS // 2)  # [blocks, k, j]
    if out is None:
        out = torch.empty(rows, k, dtype=torch.uint8, device=packed.device)
    o = out.view(rows // TILE_ROWS, 2, TILE_ROWS // 2, k)  # [blocks, half, j, k]
    o[:, 0].copy_((b & 15).transpose(1, 2))
    o[:, 1].copy_((b >> 4).transpose(1, 2))
    return out


# ----------------------------------------------------------------------------- quantize
def quantize(w: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense [n, k] -> {"q": uint8 [planes, rows, k/2], "sz": dtype [planes, k/g, rows, 2]} (see module doc)."""
    n, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    rows, levels = padded_rows(n), 2**bits - 1
    w32 = torch.zeros(rows, k, dtype=torch.float32)
    w32[:n] = w.float()
    g = w32.view(rows, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)  # [rows, groups]
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((g - lo[..., None]) / safe[..., None]).round_().clamp_(0, levels).to(torch.int32).view(rows, k)
    if bits == 4:
        nibbles = [q]
        pairs = [(scale, lo + 8 * scale)]
    else:
        nibbles = [q >> 4, q & 15]
        pairs = [(16 * scale, lo + 128 * scale), (scale, 8 * scale)]
    packed = torch.stack([pack_tiles(x) for x in nibbles])
    sz = torch.stack([torch.stack([s.T, z.T], dim=-1) for s, z in pairs]).to(dtype)
    return {"q": packed, "sz": sz}


def dequantize(q: torch.Tensor, sz: torch.Tensor, out: torch.Tensor | None = None,
               tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Packed planes -> dense [rows, k] in sz's dtype (padded rows included), into `out` when given
    (`tmp`, another [rows, k], holds the second plane of int8)."""
    p, rows, half = q.shape
    k, groups = 2 * half, sz.shape[1]
    gs = k // groups
    if out is None:
        out = torch.empty(rows, k, dtype=sz.dtype, device=q.device)
    if p > 1 and tmp is None:
        tmp = torch.empty(rows, k, dtype=sz.dtype, device=q.device)
    for i in range(p):
        dest = out if i == 0 else tmp
        unpack_tiles(q[i], dest)
        d = dest.view(rows, groups, gs)
        scale, zero = sz[i, ..., 0].T[..., None], sz[i, ..., 1].T[..., None]  # [rows, groups, 1]
        d.sub_(8).mul_(scale).add_(zero)
        if i > 0:
            out.add_(tmp)
    return out


# ----------------------------------------------------------------------------- at compute time
class Scratch:
    """One reused buffer that packed matrices are dequantized into, grown to the largest; one per runner.

    Reuse is safe because a layer's matmuls run one after another on one stream: a matrix's
    dense copy is consumed before the next one overwrites it.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        b = self._buf
        if b is None or b.numel() < nbytes or b.device != device:
            self._buf = b = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return b[:nbytes].view(dtype)


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A packed [out_features, k] weight; `linear(x)` is `x @ W.T` (+ bias) without a resident dense W."""

    q: torch.Tensor  # uint8 [planes, rows, k / 2], tile order
    sz: torch.Tensor  # [planes, k / group, rows, 2] (scale, zero) in the compute dtype
    out_features: int  # rows before padding to a multiple of 64
    scratch: Scratch | None  # where to dequantize when no fused kernel applies

    @property
    def group_size(self) -> int:
        return 2 * self.q.shape[2] // self.sz.shape[1]

    @property
    def fused(self) -> bool:
        """torch's vectorised int4 kernel applies: a CPU, one of its group sizes, bf16 scales (other scale dtypes
        take its scalar loop, so they go to the numba kernel where there is one)."""
        return (_TORCH_LAYOUT and self.q.device.type == "cpu" and self.group_size in FUSED_GROUPS
                and (self.sz.dtype == torch.bfloat16 or not kernels.packed_supported(self.sz)))

    def row_invariant(self, x: torch.Tensor) -> bool:
        return self.fused or kernels.packed_supported(self.sz)

    def dense(self) -> torch.Tensor:
        """The dequantized weight [out_features, k] (in the scratch buffer when there is one)."""
        p, rows, k = self.q.shape[0], self.q.shape[1], 2 * self.q.shape[2]
        if self.scratch is None:
            return dequantize(self.q, self.sz)[: self.out_features]
        buf = self.scratch.take(p * rows * k, self.sz.dtype, self.q.device).view(p, rows, k)
        return dequantize(self.q, self.sz, buf[0], buf[1] if p > 1 else None)[: self.out_features]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., k] -> [..., out_features] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.fused:
            x2 = x2.to(self.sz.dtype).contiguous()
            y = _FUSED(x2, self.q[0], self.group_size, self.sz[0])
            for i in range(1, self.q.shape[0]):
                y = y + _FUSED(x2, self.q[i], self.group_size, self.sz[i])
        elif kernels.packed_supported(self.sz):
            y = kernels.packed_linear(x2, self.q, self.sz)
        else:
            return F.linear(x, self.dense().to(x.dtype), bias)
        y = y[:, : self.out_features].to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.out_features)


_TORCH_LAYOUT = _torch_packs_like_us()
