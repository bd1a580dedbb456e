"""How tokens are chosen: the `Sampling` settings (checked when made), the checkpoint's defaults, the draw.

    s = Sampling(max_new_tokens=64, temperature=0.7, top_p=0.9)     # a bad value: SamplingError, one sentence
    s = resolve_sampling(runner.generation, temperature=None, ...)   # unset knobs: generation_config.json's
    sample(logits, s.temperature, s.top_p, s.top_k, generators)      # greedy, temperature, top-k, top-p

`resolve_sampling` is the one place where generation_config.json's defaults meet a caller's
knobs: Python's `generate`, `offload run` / `chat` and the server all call it, so a model
gives the same default output from every entry point. Knows no model and no tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from offload.errors import ConfigError
from offload.model.chat import GenerationDefaults


class SamplingError(ConfigError):
    """A sampling setting out of range; `field` names it (as `Sampling` spells it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Sampling:
    """How one request's tokens are chosen and when its outputs stop. Every value is checked when it is made.

    A hand-made `Sampling` is used as it is (temperature 0: greedy), except `stop_token_ids=None`, which the
    engine reads as the model's EOS ids; `Runner.sampling(...)` fills what a caller leaves out from the
    checkpoint's generation_config.json."""

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: the smallest set of likeliest tokens whose probability reaches top_p
    top_k: int = 0  # 0: off
    seed: int | None = None  # output s of the request samples from a generator seeded `seed + s`
    n: int = 1  # outputs (samples) sharing the prompt's KV blocks
    #: the token ends the output (and is kept in it); None: the model's EOS ids; frozenset(): none
    stop_token_ids: frozenset[int] | None = None
    stop_strings: tuple[str, ...] = ()  # the decoded text containing one ends the output; the text excludes it
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest alternatives

    def __post_init__(self) -> None:
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, Iterable) or not all(_whole(t) for t in ids):
                raise SamplingError("stop_token_ids", f"stop_token_ids must be token ids (whole numbers), got {ids!r}")
            object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in ids))
        strings = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings or ())
        object.__setattr__(self, "stop_strings", strings)
        checks = [
            ("max_new_tokens", _whole(self.max_new_tokens) and self.max_new_tokens >= 1,
             "must be at least 1 (a whole number)"),
            ("temperature", _number(self.temperature) and self.temperature >= 0, "must be 0 (greedy) or more"),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _whole(self.top_k) and self.top_k >= 0, "must be 0 (off) or more (a whole number)"),
            ("seed", self.seed is None or _whole(self.seed), "must be a whole number (or None: unseeded)"),
            ("n", _whole(self.n) and self.n >= 1, "must be at least 1 (a whole number)"),
            ("stop_strings", all(isinstance(s, str) for s in strings), "must be strings"),
            ("logprobs", self.logprobs is None or (_whole(self.logprobs) and self.logprobs >= 0),
             "must be None or 0 or more (a whole number)"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise SamplingError(name, f"{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def resolve_sampling(defaults: GenerationDefaults, *, max_new_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     seed: int | None = None, n: int = 1, stop: Iterable[str] | str = (), stop_on_eos: bool = True,
                     logprobs: int | None = None, fallback_max_new_tokens: int = 32) -> Sampling:
    """A `Sampling` from a caller's knobs; each one left None takes the checkpoint's generation_config.json value
    (temperature, top_p, top_k: greedy when it does not sample; max_new_tokens: else `fallback_max_new_tokens`,
    the entry point's own). Every EOS id of generation_config.json and config.json ends an output (`stop_on_eos`)."""
    return Sampling(
        max_new_tokens=max_new_tokens if max_new_tokens is not None else defaults.max_new_tokens
        or fallback_max_new_tokens,
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        seed=seed, n=n, stop_token_ids=frozenset(defaults.eos_token_ids) if stop_on_eos else frozenset(),
        stop_strings=stop, logprobs=logprobs)


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
    if temperature <= 0:  # (numpy's argmax on the CPU: the same first maximum or NaN, 49152 logits 87 -> 6 us)
        cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
        return (logits.numpy().argmax(-1) if cpu else logits.argmax(dim=-1)).tolist()
    return [int(torch.multinomial(probs(row, temperature, top_p, top_k), 1, generator=gen))
            for row, gen in zip(logits, generators)]
