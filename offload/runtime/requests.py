"""What the engine works on: a request (one prompt, its sampling, its n outputs) and what it reserves.

    Sampling   how tokens are chosen and when an output stops (offload.runtime.sampling)
    Output     one sample: its sequence in the KV cache, its tokens, why it finished
    Kept       a finished conversation's sequence left in the cache, to be continued
    Request    a prompt and its outputs, as the engine moves it from waiting to finished
    Context    the longest sequence a request may reach (prompt + new tokens), and where that limit comes from

Plain data plus `blocks_needed`, the worst-case KV reservation admission checks, and
`Context.check`, the one context-length check every entry point (run, chat, the server, files,
`Runner.generate`, conversations) passes before any forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.errors import ContextLengthError
from offload.model.tokenizer import StreamDecoder
from offload.runtime.results import TokenCallback
from offload.runtime.sampling import Sampling
from offload.runtime.stops import StopMatcher
from storage.units import blocks_for


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the model (before temperature), and the likeliest alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), likeliest first


@dataclass
class Output:
    """One sample of a request: its sequence in the KV cache and what it generated."""

    index: int  # position among all outputs of the run (what `on_token` reports)
    generator: torch.Generator | None
    stream: StreamDecoder | None = None
    sid: int | None = None
    draft_sid: int | None = None  # its sequence in the speculative draft's KV cache
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "" while running; "eos" | "stop" (a stop string) | "length" | "abort"
    first_token_s: float | None = None  # seconds from submission to the first token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when sampling.logprobs is set
    stops: StopMatcher | None = None  # with stop strings: the text shown so far, stop string excluded


@dataclass(frozen=True)
class Kept:
    """A finished request's sequence left in the KV cache, to be continued (`Engine.continue_`) or dropped."""

    sid: int
    tokens: tuple[int, ...]  # the tokens whose K/V the cache holds, in order


@dataclass
class Request:
    prompt: list[int]
    sampling: Sampling = field(default_factory=Sampling)
    name: str = "request"  # how errors refer to it ("prompt 3")
    on_token: TokenCallback | None = None
    outputs: list[Output] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already in the KV cache
    submitted_s: float = 0.0
    keep: bool = False  # when finished, keep the sequence's KV (as `kept`) instead of freeing it
    context: list[int] = field(default_factory=list)  # tokens of a continued sequence already cached before `prompt`
    kept: Kept | None = None  # set when a `keep` request finishes
    cached: int | None = None  # prompt tokens the prefix cache supplied (None: not looked up yet)

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and all(o.finish_reason for o in self.outputs)

    @property
    def worst_case_tokens(self) -> int:
        """The most tokens one output's sequence can hold: the cached context, the prompt, every new token."""
        return len(self.context) + len(self.prompt) + self.sampling.max_new_tokens


def blocks_needed(prompt_len: int, s: Sampling, block_size: int) -> int:
    """Logical KV blocks a request reserves: prompt + max_new_tokens per output, full prompt blocks shared."""
    per_output = blocks_for(prompt_len + s.max_new_tokens, block_size)
    # with samples, a partial last prompt block is copied by every writer before the shared one goes
    copied = 1 if s.n > 1 and prompt_len % block_size else 0
    return per_output + (s.n - 1) * (per_output - prompt_len // block_size) + copied


#: an output to sample a token for and its logits: (request, output, a tensor, its row)
Pick = tuple["Request", Output, torch.Tensor, int]


def logit_rows(refs: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Rows (tensor, row) of logits as one [B, V] tensor: a slice where they are consecutive rows of one tensor (a
    decode step's: no torch call a row, each ~20-50 us with the caches cold after a step's weights)."""
    t, first = refs[0]
    if all(r is t and i == first + k for k, (r, i) in enumerate(refs)):
        return t if first == 0 and len(refs) == t.shape[0] else t[first:first + len(refs)]
    return torch.stack([r[i] for r, i in refs])


def record_logprobs(rows: torch.Tensor, tokens: list[int], outputs: list[Output], k: int) -> None:
    """Each output's chosen token's log-probability under `rows` [B, V] (before temperature) and its top `k`."""
    logp = torch.log_softmax(rows.float(), dim=-1).cpu()  # [B, V]
    chosen = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    top = torch.topk(logp, k) if k else None
    for b, o in enumerate(outputs):
        alts = tuple(zip(top.indices[b].tolist(), top.values[b].tolist())) if top is not None else ()
        o.logprobs.append(TokenLogprob(chosen[b], alts))


@dataclass
class DecodeRow:
    """A pass row of a decoding output: its last token (speculating: then the draft's chain to verify)."""

    req: Request
    output: Output
    tokens: list[int]

    @property
    def sid(self) -> int:
        assert self.output.sid is not None
        return self.output.sid


@dataclass
class PrefillRow:
    """A pass row of a prefilling request: a chunk of its prompt; the last chunk's logits give every output's
    first token."""

    req: Request
    tokens: list[int]
    last: bool

    @property
    def sid(self) -> int:
        sid = self.req.outputs[0].sid
        assert sid is not None
        return sid


@dataclass(frozen=True)
class Context:
    """The most tokens one sequence may hold (prompt and every new token), and where the limit comes from."""

    tokens: int
    source: str = "the model's context (max_position_embeddings in config.json)"

    def check(self, prompt_len: int, max_new_tokens: int, name: str = "the request",
              knob: str = "max_new_tokens") -> None:
        """ContextLengthError, naming both numbers and what to change, unless prompt + new tokens fit."""
        total = prompt_len + max_new_tokens
        if total <= self.tokens:
            return
        tokens = f"{prompt_len} prompt token" + ("" if prompt_len == 1 else "s")
        if prompt_len >= self.tokens:
            raise ContextLengthError(
                f"{name} has {tokens}, which leaves no room for a new token in {self.source} of "
                f"{self.tokens} tokens; shorten the prompt to fewer than {self.tokens} tokens",
                prompt_len, max_new_tokens, self.tokens)
        raise ContextLengthError(
            f"{name} has {tokens} and {knob} asks for {max_new_tokens} more, {total} in all, but "
            f"{self.source} is {self.tokens} tokens; lower {knob} to at most {self.tokens - prompt_len} or shorten "
            "the prompt", prompt_len, max_new_tokens, self.tokens)
