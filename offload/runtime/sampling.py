"""Choosing the next token from logits: greedy, temperature, top-k, top-p. Knows no model."""

from __future__ import annotations

import torch


def probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """logits [..., V] -> the distribution sampling draws from [..., V] float32 (CPU); temperature > 0."""
    scores = logits.float().cpu() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        p = torch.zeros_like(p).scatter_(-1, order, sorted_p * keep)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] float32 -> one token id per row; temperature 0 is greedy (argmax)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    return [int(torch.multinomial(probs(row, temperature, top_p, top_k), 1, generator=gen))
            for row, gen in zip(logits, generators)]
