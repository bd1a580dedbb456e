"""MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`, gpt-oss): each expert matrix is stored as 4-bit
E2M1 codes in blocks of 32 inputs with one power-of-two scale a block, and read as the dense matrix transformers'
model multiplies by, the values transformers' own dequantization gives (`transformers.integrations.mxfp4`):

    X_blocks  uint8 [E, N, G, 16]   two codes a byte, the low nibble first: N outputs, G blocks of 32 inputs
    X_scales  uint8 [E, N, G]       the block's exponent + 127
    X[e, k, n] = FP4[code of (e, n, k)] * 2^(scale of (e, n, k // 32) - 127)     X: [E, K = 32 G, N], exact

The checkpoint (`offload.model.checkpoint`) reads the bytes; this module knows the format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from offload.model.config import quant_method

#: The 16 E2M1 values a code stands for
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def pairs(raw: Mapping[str, Any], names: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """{the parameter: (its blocks, its scales)} of a checkpoint whose config.json says mxfp4; {} for any other."""
    if quant_method(raw) != "mxfp4":
        return {}
    return {n.removesuffix("_blocks"): (n, n.removesuffix("_blocks") + "_scales") for n in names
            if n.endswith("_blocks") and n.removesuffix("_blocks") + "_scales" in names}


def dense_shape(blocks: tuple[int, ...]) -> tuple[int, int]:
    """The dense matrix's rows (E experts' K inputs, one expert after another) and columns (N) from the blocks'
    shape [E, N, G, 16]."""
    e, n, g, b = blocks
    return (e * g * 2 * b, n)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One expert's [K, N] float32 from its blocks [N, G, 16] and scales [N, G] (uint8)."""
    n, g, b = blocks.shape
    codes = torch.stack((FP4[(blocks & 15).long()], FP4[(blocks >> 4).long()]), dim=-1).reshape(n, g, 2 * b)
    return (codes * torch.exp2(scales.float() - 127)[..., None]).reshape(n, g * 2 * b).T
