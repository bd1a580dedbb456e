"""Choosing the next token from logits: greedy, temperature, top-k, top-p. Knows no model."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] float32 -> one token id per row; temperature 0 is greedy (argmax)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    out = []
    for row, gen in zip(logits, generators):
        scores = row.float().cpu() / temperature
        if 0 < top_k < scores.numel():
            kth = torch.topk(scores, top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
