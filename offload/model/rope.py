"""Rotary position embeddings as Hugging Face computes them: inverse frequencies (plain, linear or llama3
scaling), cos/sin tables by absolute position, and their application to flat per-head rows. Pure torch;
knows nothing about tiers or files.
"""

from __future__ import annotations

import math

import torch

from offload.model.config import ModelConfig


class Rope:
    """cos/sin tables by absolute position, computed as Hugging Face does (float32, then cast)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.dtype = dtype
        self.device = device
        self._cos = self._sin = torch.empty(0, cfg.head_dim, device=device, dtype=dtype)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self._cos.shape[0], 256)
        pos = torch.arange(n, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def __call__(self, positions: torch.Tensor, need: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, D]. need: more than the largest position, where the caller knows it (a
        step's longest sequence: no reduction over the positions, which costs a decode step ~20 us)."""
        if need is None:
            need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            self._grow(need)
        return self._cos[positions], self._sin[positions]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3 (Llama 3.1): low frequencies divided by `factor`, high ones kept, smooth in between
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos/sin [N, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
