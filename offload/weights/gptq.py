"""Pre-quantized checkpoints read as they are: GPTQ (4/8-bit, with or without act-order) and AWQ (GEMM packing).

The packed tensors are copied into the store byte for byte (no re-quantization, no float round
trip) and dequantized at compute time exactly as the formats' reference kernels do:

GPTQ (`quant_method: gptq`; AutoGPTQ / GPTQModel, `checkpoint_format` gptq or gptq_v2), per linear
with input dim K and output dim N, bits b, f = 32 / b values per int32:
    qweight int32 [K / f, N]   input row k of column n: (qweight[k // f, n] >> (b * (k % f))) & (2^b - 1)
    qzeros  int32 [G, N / f]   zero of group g, column n: (qzeros[g, n // f] >> (b * (n % f))) & (2^b - 1),
                               plus 1 in the v1 format (the packer stored zero - 1)
    scales  fp16  [G, N]
    g_idx   int32 [K]          group of input row k (k // group_size, or any map with act-order)
    W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])       (one fp16 rounding)

AWQ GEMM (`quant_method: awq`, `version: gemm`; AutoAWQ), 4-bit, packed along the output dim in the
interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i of an int32 holds column 8c + order[i]):
    qweight int32 [K, N / 8], qzeros int32 [K / group, N / 8], scales fp16 [K / group, N]
    W[n, k] = (q[k, n] - zero[k // group, n]) * scales[k // group, n]   (one fp16 rounding)

This module knows the formats and their config; the model's grouping of tensors is `groups`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.errors import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds column order[i] of its 8


@dataclass(frozen=True)
class PrequantFormat:
    """A checkpoint's `quantization_config`, validated."""

    method: str  # gptq | awq
    bits: int  # 4 or 8 (AWQ: 4)
    group_size: int  # input rows per group; 0 = the whole input dim (-1 in the config)
    act_order: bool  # GPTQ desc_act: g_idx is an arbitrary map from input row to group
    zero_offset: int  # added to stored zeros: 1 for GPTQ's v1 checkpoint format, else 0

    @property
    def per_int(self) -> int:
        return 32 // self.bits

    def groups(self, k: int) -> int:
        return 1 if self.group_size == 0 else k // self.group_size

    def tensors(self, n: int, k: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Checkpoint suffix -> (storage dtype name, shape) of one [n, k] linear."""
        f, g = self.per_int, self.groups(k)
        if self.method == "gptq":
            return {"qweight": ("int32", (k // f, n)), "qzeros": ("int32", (g, n // f)),
                    "scales": ("float16", (g, n)), "g_idx": ("int32", (k,))}
        return {"qweight": ("int32", (k, n // f)), "qzeros": ("int32", (g, n // f)), "scales": ("float16", (g, n))}

    def check_shape(self, where: str, n: int, k: int) -> None:
        if self.group_size and k % self.group_size:
            raise CheckpointError(f"{where}: quantization_config.group_size {self.group_size} does not divide the "
                                  f"input dimension {k}; the checkpoint and its config.json do not belong together")
        if k % self.per_int or n % self.per_int:
            raise CheckpointError(f"{where}: a {n}x{k} matrix cannot hold {self.bits}-bit values packed "
                                  f"{self.per_int} per int32; the checkpoint is not a {self.method} checkpoint")

    def to_json(self) -> dict:
        return {"quantization": self.method, "bits": self.bits, "group_size": self.group_size,
                "act_order": self.act_order, "zero_offset": self.zero_offset}


def parse_quantization_config(raw: dict | None, where: str) -> PrequantFormat | None:
    """The checkpoint's format, None for a float checkpoint; one clear error for anything unsupported."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: quantization_config must be a mapping")
    method = str(raw.get("quant_method", "")).lower()
    bits = raw.get("bits", raw.get("w_bit"))
    group = raw.get("group_size", raw.get("q_group_size", -1))
    if method == "gptq":
        if bits not in (4, 8):
            raise CheckpointError(f"{where}: quantization_config.bits {bits!r} is not supported for GPTQ; Offload "
                                  "reads 4- and 8-bit GPTQ checkpoints (use one, or dequantize to float first)")
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; use gptq or gptq_v2")
        zero_offset = 1 if fmt == "gptq" else 0
        act_order = bool(raw.get("desc_act", False))
    elif method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: AWQ packing {version!r} is not supported; Offload reads AWQ GEMM "
                                  "checkpoints (quantization_config.version: gemm)")
        if bits != 4:
            raise CheckpointError(f"{where}: quantization_config.bits {bits!r} is not supported for AWQ; only 4")
        if raw.get("zero_point", True) is False:
            raise CheckpointError(f"{where}: AWQ without zero points is not supported; use a zero_point: true model")
        zero_offset, act_order = 0, False
    else:
        raise CheckpointError(f"{where}: quantization_config.quant_method {method!r} is not supported; Offload "
                              "reads float, gptq and awq (gemm) checkpoints")
    if not isinstance(group, int) or (group != -1 and group < 1):
        raise CheckpointError(f"{where}: quantization_config.group_size {group!r} must be -1 or a positive integer")
    return PrequantFormat(method, bits, 0 if group == -1 else group, act_order, zero_offset)


# ----------------------------------------------------------------------------- dequantization
def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R * f, C]: value j of row r is (packed[r] >> (bits * j)) & mask (GPTQ, along K)."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    vals = (packed[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)  # [R, f, C]
    return vals.reshape(-1, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> [R, C * f]: nibble i of packed[r, c] is column c * f + order[i] (identity order for GPTQ)."""
    f = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    vals = (packed[:, :, None] >> shifts) & (2**bits - 1)  # [R, C, f], nibble order
    if order is not None:
        vals = vals[:, :, torch.tensor(sorted(range(f), key=lambda i: order[i]), device=packed.device)]
    return vals.reshape(packed.shape[0], -1)


def dequantize(fmt: PrequantFormat, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One linear's packed tensors -> W [N, K] in the scales' dtype, as the format's reference kernel computes it."""
    scales, zeros = t["scales"], _zeros(fmt, t)  # [G, N]
    if fmt.method == "gptq":
        q = _unpack_rows(t["qweight"], fmt.bits)  # [K, N]
        g = t["g_idx"].long()
        w = (q - zeros[g]).float() * scales[g].float()  # exact in float32; one rounding to the scales' dtype
    else:
        q = _unpack_cols(t["qweight"], fmt.bits, AWQ_ORDER)  # [K, N]
        rows = q.shape[0] // zeros.shape[0]
        w = (q - zeros.repeat_interleave(rows, 0)).float() * scales.repeat_interleave(rows, 0).float()
    return w.to(scales.dtype).T


def _zeros(fmt: PrequantFormat, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One linear's zero points, int32 [G, N] (GPTQ's stored ones less its offset, in AWQ's nibble order)."""
    if fmt.method == "gptq":
        return _unpack_cols(t["qzeros"], fmt.bits) + fmt.zero_offset
    return _unpack_cols(t["qzeros"], fmt.bits, AWQ_ORDER)


def _column_groups(fmt: PrequantFormat, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each input column's group, long [K] (GPTQ's `g_idx`; AWQ's groups are consecutive columns)."""
    if fmt.method == "gptq":
        return t["g_idx"].long()
    k, groups = t["qweight"].shape[0], t["scales"].shape[0]
    return torch.arange(k) // (k // groups)


def scales_zeros(fmt: PrequantFormat, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's scale and zero of one linear's packed tensors, float32 [N, K]: W = (q - zero) * scale."""
    g = _column_groups(fmt, t)
    return t["scales"][g].float().T, _zeros(fmt, t)[g].float().T


def group_scales(fmt: PrequantFormat, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Each group's scale and zero of one linear's packed tensors, float32 [N, G], and the input columns a group
    covers, where its groups are consecutive columns (None for an act-order map: `scales_zeros` spreads them)."""
    g = _column_groups(fmt, t)
    k, groups = len(g), t["scales"].shape[0]
    if k % groups or not torch.equal(g, torch.arange(k) // (k // groups)):
        return None
    return t["scales"].float().T, _zeros(fmt, t).float().T, k // groups


@dataclass(frozen=True, slots=True)
class PrequantLinear:
    """A fused matrix made of one or more GPTQ/AWQ linears (rows stacked: q, k, v), dequantized per use."""

    fmt: PrequantFormat
    parts: tuple[dict[str, torch.Tensor], ...]  # each: the checkpoint's packed tensors of one linear
    out_features: int  # rows of all parts
    in_features: int
    dtype: torch.dtype  # the compute dtype
    scratch: object | None  # a `quant.Scratch`: the dense copy's reused buffer

    def dense(self, scratch: bool = True) -> torch.Tensor:
        """W [N, K] in the compute dtype, in the scratch buffer (`scratch`: a module holding two at once asks for
        fresh ones, as `quant.PackedLinear.dense` is asked)."""
        dev = self.parts[0]["scales"].device
        n, k = self.out_features, self.in_features
        out = (torch.empty(n, k, dtype=self.dtype, device=dev) if self.scratch is None or not scratch
               else self.scratch.take(n * k, self.dtype, dev).view(n, k))
        row = 0
        for part in self.parts:
            w = dequantize(self.fmt, part)
            out[row : row + w.shape[0]].copy_(w)
            row += w.shape[0]
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, float32: bool = False) -> torch.Tensor:
        y = F.linear(x, self.dense(), bias)
        return y.float() if float32 else y
