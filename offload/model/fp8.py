"""FP8 checkpoints with block scales (`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`:
DeepSeek-V3 / R1, the Qwen3 -FP8 releases): a matrix W [R, C] is stored as float8 e4m3 codes `X.weight` with one
float32 scale a block of rows and columns, `X.weight_scale_inv` [ceil(R / 128), ceil(C / 128)], and read dense as
transformers dequantizes it (`transformers.integrations.finegrained_fp8`):

    W[r, c] = float32(code[r, c]) * scale_inv[r // 128, c // 128]      (then rounded once, to the run's dtype)

The checkpoint (`offload.model.checkpoint`) reads the bytes; this module knows the format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from offload.errors import CheckpointError
from offload.model.config import quant_method

CODES = torch.float8_e4m3fn


def pairs(raw: Mapping[str, Any], dtypes: Mapping[str, torch.dtype]) -> dict[str, str]:
    """{an FP8 matrix: its scales} of a checkpoint whose config.json says fp8; {} for any other."""
    if quant_method(raw) != "fp8":
        return {}
    return {n: f"{n}_scale_inv" for n, dt in dtypes.items() if dt == CODES and f"{n}_scale_inv" in dtypes}


def block(raw: Mapping[str, Any], where: str) -> tuple[int, int]:
    """The rows and columns a scale covers (`weight_block_size`, 128 x 128 where it is not given)."""
    size = raw["quantization_config"].get("weight_block_size") or (128, 128)
    if not (isinstance(size, list | tuple) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size {size!r} is not two positive block "
                              "sizes (rows, columns); fix config.json")
    return size[0], size[1]


def grid(shape: tuple[int, ...], size: tuple[int, int]) -> tuple[int, int]:
    """The scales' shape for a matrix of `shape`."""
    return -(-shape[0] // size[0]), -(-shape[1] // size[1])


def dequantize(codes: torch.Tensor, scales: torch.Tensor, offset: int, size: tuple[int, int]) -> torch.Tensor:
    """Rows [n, C] float32 of the codes [n, C], whose first row is row `offset` of the first row of blocks that
    `scales` [blocks, ceil(C / size[1])] (float32) holds."""
    n, c = codes.shape
    s = scales.repeat_interleave(size[0], 0)[offset : offset + n].repeat_interleave(size[1], 1)[:, :c]
    return codes.float() * s
