"""A draft model for speculative-decoding tests: the target's checkpoint with seeded noise on every weight.

    perturbed_copy(target_dir, out_dir, noise=0.3)   # agrees with the target often, not always

Noise is `noise` times each tensor's standard deviation, drawn from a generator seeded by
(seed, tensor name), so the same arguments give the same bytes. config.json and the tokenizer
are copied unchanged (a draft must share the target's tokenizer).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def perturbed_copy(src: str | os.PathLike, out: str | os.PathLike, noise: float, seed: int = 0) -> Path:
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            x = t.float()
            scale = float(x.std()) if x.numel() > 1 else 0.0
            tensors[name] = (x + noise * scale * torch.randn(x.shape, generator=gen)).to(t.dtype)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    return out
