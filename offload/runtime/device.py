"""The device and dtypes a run's YAML names: `device: auto | cpu | cuda[:N]`, `dtype: auto | float32 | ...`."""

from __future__ import annotations

import torch

from offload.errors import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when there is one, else the CPU; a device that is not here is refused naming the fix."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {name!r} was asked for but CUDA is not available here; use device: cpu")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r} does not exist; this machine has {torch.cuda.device_count()} GPUs")
    return dev


def resolve_dtype(name: str, checkpoint_dtype: str | None) -> torch.dtype:
    """The dtype weights are kept in: `auto` is the checkpoint's (config.json torch_dtype), else bfloat16."""
    if name == "auto":
        return DTYPES.get(checkpoint_dtype or "", torch.bfloat16)
    return DTYPES[name]
