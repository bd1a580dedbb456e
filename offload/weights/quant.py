"""Group-wise int8 / int4 weight codecs: quantize once at conversion, multiply packed at compute time.

The scheme is FlexGen's: asymmetric round-to-nearest along the input dimension, one (scale, min)
per `group_size` consecutive input columns of each output row:

    q = clamp(round((w - min) / scale), 0, 2**bits - 1)      scale = (max - min) / (2**bits - 1)

int4 bytes are laid out the way torch's CPU int4 matmul (`_weight_int4pack_mm_for_cpu`) reads
them, so on a CPU device a packed matrix is multiplied as it lies in its slot, with no dequantized
copy: one *plane* q [1, rows, k/2] with `(scale, zero)` pairs sz [1, k/g, rows, 2] in the compute
dtype, with the kernel's meaning `w = (nibble - 8) * scale + zero` (scale = s, zero = min + 8 s).
Tile order of the plane (torch's CPU int4 packing): output rows in blocks of 64; inside a block,
for each input column k, 32 bytes whose byte j holds row j (low nibble) and row j + 32 (high
nibble). int8 is one byte a weight in the same blocks of 64 rows, q [rows / 64, k, 64], in lane units of
four columns: a unit's 256 bytes hold each row's four codes side by side (`int8_tiles`: the byte quads
that AVX-512 VNNI and AMX tiles multiply as they lie), with sz [k/g, rows, 2] = (scale, min) and
`w = q * scale + min` (its CPU kernel reads a block as one stream, across the rows, as int4's does:
`offload.model.cpu_packed`). The scales' shape tells
the formats apart: int4's has the plane's leading 1. Rows are padded with zeros to a multiple of 64.
Where the kernel is missing (CUDA, numba absent) a matrix is dequantized into a reused scratch
buffer and multiplied densely.

On a CPU a packed matrix multiplies through `offload.model.kernels` (row-invariant numba kernels on these
bytes; torch's kernel above where numba is missing). Knows nothing about models, groups or files.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.model import kernels
from offload.model.cpu_elementwise import round_values

#: Output rows per tile of the packed layout.
TILE_ROWS = 64
#: Group sizes torch's fused CPU kernel accepts.
FUSED_GROUPS = (32, 64, 128, 256)
_FUSED = getattr(torch, "_weight_int4pack_mm_for_cpu", None)


@functools.cache
def _torch_packs_like_us() -> bool:
    """Asked at the first packed matmul, not at import: a process that forks right after importing us (a
    forkserver, a DataLoader) must not inherit an OpenMP pool, whose first parallel region hangs in the child.

    torch packs int4 for its CPU kernel by the vector width it was dispatched to (64-row tiles with AVX-512,
    32-row tiles with AVX2), while stores keep 64-row tiles on every machine: its kernel reads our bytes only
    where its packing of a probe equals ours."""
    convert = getattr(torch, "_convert_weight_to_int4pack_for_cpu", None)
    if _FUSED is None or convert is None:
        return False
    nib = torch.arange(64 * 64, dtype=torch.int32).view(64, 64).mul_(7).remainder_(16)
    return torch.equal(convert(nib, 1), pack_tiles(nib))


def padded_rows(n: int) -> int:
    return -(-n // TILE_ROWS) * TILE_ROWS


def packed_shapes(n: int, k: int, bits: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the packed tensors of one [n, k] matrix: codes (uint8) and (scale, zero) pairs."""
    rows = padded_rows(n)
    if bits == 8:
        return {"q": (rows // TILE_ROWS, k, TILE_ROWS), "sz": (k // group_size, rows, 2)}
    return {"q": (1, rows, k // 2), "sz": (1, k // group_size, rows, 2)}


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


def int8_tiles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [rows, K] (uint8, rows a multiple of 64) -> tiles [rows / 64, K, 64]: a block of 64 rows in lane
    units of four columns, each unit's 256 bytes the rows' four codes side by side (row r's columns 4p .. 4p + 3 at
    256 p + 4 r), the last K % 4 columns 64 bytes each (row r at 64 k + r). The quads are what AVX-512 VNNI's
    byte products and AMX tiles take as they lie (`simd_int.vquads8`), so no product rearranges the codes."""
    rows, k = codes.shape
    nb, k4 = rows // TILE_ROWS, k - k % 4
    b = codes.to(torch.uint8).view(nb, TILE_ROWS, k)
    out = torch.empty(nb, k * TILE_ROWS, dtype=torch.uint8, device=codes.device)
    out[:, : k4 * TILE_ROWS].view(nb, k4 // 4, TILE_ROWS, 4).copy_(b[:, :, :k4].reshape(nb, TILE_ROWS, k4 // 4, 4)
                                                                  .transpose(1, 2))
    out[:, k4 * TILE_ROWS :].view(nb, k - k4, TILE_ROWS).copy_(b[:, :, k4:].transpose(1, 2))
    return out.view(nb, k, TILE_ROWS)


def int8_codes(tiles: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`int8_tiles` undone: tiles [rows / 64, K, 64] -> out [rows, K] (any dtype: the codes as its values)."""
    nb, k, _ = tiles.shape
    k4 = k - k % 4
    flat, o = tiles.reshape(nb, k * TILE_ROWS), out.view(nb, TILE_ROWS, k)
    o[:, :, :k4].view(nb, TILE_ROWS, k4 // 4, 4).copy_(flat[:, : k4 * TILE_ROWS].view(nb, k4 // 4, TILE_ROWS, 4)
                                                       .transpose(1, 2))
    o[:, :, k4:].copy_(flat[:, k4 * TILE_ROWS :].view(nb, k - k4, TILE_ROWS).transpose(1, 2))
    return out


# ----------------------------------------------------------------------------- quantize
def quantize(w: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype,
             grid: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Dense [n, k] -> {"q": uint8 codes, "sz": dtype (scale, zero) pairs} as `packed_shapes` (see module doc).
    `grid`: (step, bottom) [n, k / group_size] of groups whose values already lie on bottom + step * (0 .. at most
    2^bits - 1) (an int4 / int8 checkpoint's own codes), NaN for the others: those keep their values (the codes are
    their integers, the scale the step), the others are quantized as above."""
    n, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    rows, levels = padded_rows(n), 2**bits - 1
    w32 = torch.zeros(rows, k, dtype=torch.float32)
    w32[:n] = w.float()
    g = w32.view(rows, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)  # [rows, groups]
    scale = (hi - lo) / levels
    if grid is not None:
        on = torch.zeros_like(scale, dtype=torch.bool)
        on[:n] = ~grid[0].isnan()
        scale[on], lo[on] = grid[0][on[:n]], grid[1][on[:n]]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((g - lo[..., None]) / safe[..., None]).round_().clamp_(0, levels).to(torch.int32).view(rows, k)
    if bits == 8:
        return {"q": int8_tiles(q), "sz": torch.stack([scale.T, lo.T], dim=-1).to(dtype)}
    sz = torch.stack([scale.T, (lo + 8 * scale).T], dim=-1).to(dtype)
    return {"q": pack_tiles(q)[None], "sz": sz[None]}


def group_grid(step: torch.Tensor, bottom: torch.Tensor, cols: int, group: int, k: int) \
        -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's integer grid by runs of `cols` columns (one scale column; 1: each column its own), (step,
    bottom) [n, ceil(k / cols)], as the grid of `quantize`'s groups of `group` columns, [n, k / group]: a group's
    where all its columns lie on one, NaN where they do not."""
    if group % cols and cols % group:  # runs that straddle groups: each column's own
        step, bottom = (t.repeat_interleave(cols, 1)[:, :k] for t in (step, bottom))
        cols = 1
    if cols > group:  # a run over several groups: one for each
        step, bottom = (t.repeat_interleave(cols // group, 1)[:, : k // group] for t in (step, bottom))
        cols = group
    shape = (step.shape[0], k // group, group // cols)
    step, bottom = step.reshape(shape), bottom.reshape(shape)
    one = (step == step[..., :1]).all(-1) & (bottom == bottom[..., :1]).all(-1)
    nan = torch.tensor(float("nan"))
    return torch.where(one, step[..., 0], nan), torch.where(one, bottom[..., 0], nan)


#: float32 bytes of a matrix `quantize_into` quantizes at a time (quantize's temporaries are a few times its input)
QUANTIZE_BLOCK_BYTES = 8 << 20


def quantize_into(w: torch.Tensor, bits: int, group_size: int, q: torch.Tensor, sz: torch.Tensor) -> None:
    """`quantize(w)` written into the packed tensors q, sz (`packed_shapes`), whole tiles of 64 rows at a time: a
    large matrix (an LM head: 49152 x 576 float32 is 113 MB) costs its blocks' temporaries, not five copies of it
    (a 600 MiB machine was killed converting SmolLM2's). The same bytes: the scheme is row by row. `w`: a tensor,
    or anything with a `shape` whose row slices are float tensors (`reading.CheckpointRows` reads them from disk)."""
    block = max(TILE_ROWS, QUANTIZE_BLOCK_BYTES // (4 * w.shape[1]) // TILE_ROWS * TILE_ROWS)
    for r0 in range(0, w.shape[0], block):
        grid = w.grid(r0, min(r0 + block, w.shape[0]), group_size, bits) if hasattr(w, "grid") else None
        part = quantize(w[r0 : r0 + block], bits, group_size, sz.dtype, grid)
        r1 = r0 + part["sz"].shape[-2]  # (the last block's padded rows are the matrix's)
        if bits == 8:
            q[r0 // TILE_ROWS : r1 // TILE_ROWS].copy_(part["q"])
            sz[:, r0:r1].copy_(part["sz"])
        else:
            q[0, r0:r1].copy_(part["q"][0])
            sz[0, :, r0:r1].copy_(part["sz"][0])


def dequantize(q: torch.Tensor, sz: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed codes -> dense [rows, k] in sz's dtype (padded rows included), into `out` when given."""
    int8 = kernels.is_int8(sz)
    rows, k = kernels.packed_rows_cols(q, sz)
    pairs = (sz if int8 else sz[0]).transpose(0, 1)  # [rows, groups, 2]
    groups = pairs.shape[1]
    if out is None:
        out = torch.empty(rows, k, dtype=sz.dtype, device=q.device)
    if int8:
        int8_codes(q, out)
    else:
        unpack_tiles(q[0], out)
    d = out.view(rows, groups, k // groups)
    scale, zero = pairs[..., 0, None], pairs[..., 1, None]  # [rows, groups, 1]
    if not int8:
        d.sub_(8)
    d.mul_(scale).add_(zero)
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

    q: torch.Tensor  # int4: uint8 [1, rows, k / 2], tile order; int8: uint8 [rows / 64, k, 64] tiles
    sz: torch.Tensor  # int4: [1, k / group, rows, 2] (scale, zero); int8: [k / group, rows, 2] (scale, min)
    out_features: int  # rows before padding to a multiple of 64
    scratch: Scratch | None  # where to dequantize when no fused kernel applies

    @property
    def bits(self) -> int:
        return 8 if kernels.is_int8(self.sz) else 4

    @property
    def group_size(self) -> int:
        return kernels.packed_rows_cols(self.q, self.sz)[1] // self.sz.shape[-3]

    @property
    def fused(self) -> bool:
        """torch's vectorised int4 kernel applies: a CPU, one of its group sizes, bf16 scales (other scale dtypes
        take its scalar loop, so they go to the numba kernel where there is one)."""
        return (self.bits == 4 and self.q.device.type == "cpu" and self.group_size in FUSED_GROUPS
                and (self.sz.dtype == torch.bfloat16 or not kernels.packed_supported(self.sz))
                and _torch_packs_like_us())

    def row_invariant(self, x: torch.Tensor) -> bool:
        return self.fused or kernels.packed_supported(self.sz)

    def dense(self, scratch: bool = True) -> torch.Tensor:
        """The dequantized weight [out_features, k] (in the scratch buffer when there is one and `scratch`)."""
        rows, k = kernels.packed_rows_cols(self.q, self.sz)
        if self.scratch is None or not scratch:
            return dequantize(self.q, self.sz)[: self.out_features]
        buf = self.scratch.take(rows * k, self.sz.dtype, self.q.device).view(rows, k)
        return dequantize(self.q, self.sz, buf)[: self.out_features]

    def dense_parts(self, parts: int, wanted: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out_features, k] in `dtype` with only the wanted of its `parts` equal ranges of rows
        written (ascending ids), the others' values undefined: a mixture of experts' stacked matrix, its routed
        experts only (an expert's rows dequantized with the whole tiles of 64 rows they lie in)."""
        k, n = kernels.packed_rows_cols(self.q, self.sz)[1], self.out_features // parts
        out = torch.empty(self.out_features, k, dtype=dtype, device=self.q.device)
        runs: list[list[int]] = []  # consecutive parts, dequantized together
        for p in wanted:
            if runs and runs[-1][1] == p:
                runs[-1][1] = p + 1
            else:
                runs.append([p, p + 1])
        for first, end in runs:
            r0, r1 = first * n, end * n
            a = r0 // TILE_ROWS * TILE_ROWS
            part = self.tile_rows(a, r1)
            out[r0:r1] = dequantize(part.q, part.sz)[r0 - a : r1 - a]
        return out

    def tile_rows(self, a: int, b: int) -> PackedLinear:
        """Rows a .. b as a matrix of their own (a on a tile of 64 rows; b on one, or the last row): views of the
        codes and scales of the whole tiles they lie in."""
        t = padded_rows(b)
        if self.bits == 8:
            return PackedLinear(self.q[a // TILE_ROWS : t // TILE_ROWS], self.sz[:, a:t], b - a, self.scratch)
        return PackedLinear(self.q[:, a:t], self.sz[:, :, a:t], b - a, self.scratch)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, float32: bool = False) -> torch.Tensor:
        """x [..., k] -> [..., out_features] in x's dtype (`float32`: in float32, the values x's dtype gives)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if kernels.packed_supported(self.sz):
            y = kernels.packed_linear(x2, self.q, self.sz)
        elif self.fused:
            y = _FUSED(x2.to(self.sz.dtype).contiguous(), self.q[0], self.group_size, self.sz[0])
        else:
            y = F.linear(x, self.dense().to(x.dtype), bias)
            return y.float() if float32 else y
        y = y[:, : self.out_features]
        if float32 and bias is None and y.dtype == torch.float32:  # (no copy in x's dtype)
            return round_values(y.contiguous(), x.dtype).reshape(*lead, self.out_features)
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        y = y.reshape(*lead, self.out_features)
        return y.float() if float32 else y

