"""What `Runner.generate` returns (one result per prompt, its n samples as `outputs`, the timing of the call)
and what `Runner.stream` yields (one event per token)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TokenCallback = Callable[[int, int, str], None]  # (output index, token id, text delta)


@dataclass
class RunStats:
    """Timing of one `generate` call (shared by its results)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache supplied (not computed)
    prefill_passes: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0  # tokens sampled by decode steps (the first token of each prompt comes from prefill)
    generated_tokens: int = 0
    step_ms: list[float] = field(default_factory=list)
    draft_tokens: int = 0  # speculative decoding: draft tokens the target checked
    accepted_tokens: int = 0  # ... and kept
    most_rows: int = 0  # the most sequences one pass computed (decoding outputs and prompts being prefilled)
    #: (timeline step, "prefill" | "decode" | "mixed", milliseconds) of every forward pass, in order
    passes: list[tuple[int, str, float]] = field(default_factory=list)
    #: a mixture of experts with an expert cache: its counts after the call (`TieredWeights.expert_stats`: hits,
    #: prefetched, misses, hit rates per layer, the next-layer prediction's recall and precision)
    experts: dict[str, Any] = field(default_factory=dict)

    def account(self, dt: float, step_id: int, decode_rows: int, prefill_rows: int, emitted: int) -> None:
        """One engine pass of `dt` seconds: decode rows (and the tokens they emitted) and prefill rows."""
        if decode_rows:
            self.decode_s += dt
            self.decode_steps += 1
            self.decode_tokens += emitted
            self.step_ms.append(1000 * dt)
        else:
            self.prefill_s += dt
        if prefill_rows:
            self.prefill_passes += 1
        self.most_rows = max(self.most_rows, decode_rows + prefill_rows)
        kind = "mixed" if decode_rows and prefill_rows else "decode" if decode_rows else "prefill"
        self.passes.append((step_id, kind, 1000 * dt))

    @property
    def decode_only_steps(self) -> list[int]:
        """Timeline steps of the passes that only decoded (the steady state benchmarks measure)."""
        return [step for step, kind, _ in self.passes if kind == "decode"]

    @property
    def decode_only_ms_per_step(self) -> float:
        ms = [t for _, kind, t in self.passes if kind == "decode"]
        return sum(ms) / len(ms) if ms else 0.0

    @property
    def decode_ms_per_step(self) -> float:
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def acceptance(self) -> float:
        """Share of draft tokens the target kept (0 without speculative decoding)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_decode_pass(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "prefill_passes": self.prefill_passes,
            "prefill_s": round(self.prefill_s, 6), "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "decode_steps": self.decode_steps, "decode_s": round(self.decode_s, 6),
            "decode_ms_per_step": round(self.decode_ms_per_step, 3), "decode_tokens": self.decode_tokens,
            "generated_tokens": self.generated_tokens,
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            **({"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance": round(self.acceptance, 4),
                "tokens_per_decode_pass": round(self.tokens_per_decode_pass, 3)} if self.draft_tokens else {}),
            **({"experts": self.experts} if self.experts else {}),
        }


@dataclass(frozen=True)
class Completion:
    """One sample of a prompt."""

    index: int  # 0..n-1 among the prompt's samples
    token_ids: list[int]  # generated tokens only (an EOS that ended it included)
    text: str  # decoded generated tokens, a stop string that ended it excluded ("" without a tokenizer)
    finish_reason: str  # "eos" | "stop" (a stop string) | "length"


@dataclass(frozen=True)
class GenerationResult:
    """A prompt's result: its samples (`outputs`, n of them) and the call's timing. With one sample,
    `token_ids`, `text` and `finish_reason` are that sample's."""

    prompt_ids: list[int]
    outputs: list[Completion]
    stats: RunStats

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


@dataclass(frozen=True)
class TokenEvent:
    """A token as `Runner.stream` yields it."""

    prompt: int  # index of the prompt in the call
    sample: int  # 0..n-1 among its samples
    token_id: int
    text: str  # the text this token adds (held back while it may start a stop string; may be "")
    finish_reason: str | None  # None while the sample runs; else why this token ended it
