"""The engine loop: requests join and leave at pass boundaries; each pass computes every running sequence.

    engine = Engine(runner)
    req = engine.submit(Request(prompt_ids, Sampling(max_new_tokens=32)))   # can never fit: CapacityError
    while engine.busy:
        engine.step()                                # one forward pass over the weights
    req.outputs[0].token_ids, req.outputs[0].finish_reason

A request is one prompt and its `n` outputs (samples). Its life:

    waiting     admission said LATER (its worst-case KV does not fit next to the running ones)
    prefilling  its prompt goes through in chunks, within the pass's token budget
    decoding    one new token per output per pass
    finished    EOS, max_new_tokens, or aborted; its KV blocks go back to the pool

A pass holds a token for every decoding output plus up to `activations.prefill_chunk` prompt
tokens of prefilling requests (oldest first), so a request
that arrives while others decode joins at the next pass: the weights are read once for all
of them. The n outputs of a request share its prompt's blocks copy-on-write. The engine
knows requests, sequences and tokens; the model is the runner's business.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from offload.errors import CapacityError
from offload.model.tokenizer import StreamDecoder
from offload.runtime.results import RunStats, TokenCallback
from offload.runtime.sampling import sample
from storage.block_pool import Admission


@dataclass(frozen=True)
class Sampling:
    """How one request's tokens are chosen and when its outputs stop."""

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # output s of the request samples from a generator seeded `seed + s`
    n: int = 1  # outputs (samples) sharing the prompt's KV blocks
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class Output:
    """One sample of a request: its sequence in the KV cache and what it generated."""

    index: int  # position among all outputs of the run (what `on_token` reports)
    generator: torch.Generator | None
    stream: StreamDecoder | None = None
    sid: int | None = None
    draft_sid: int | None = None  # its sequence in the speculative draft's KV cache
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "" while running; "eos" | "length" | "abort"
    first_token_s: float | None = None  # seconds from submission to the first token


@dataclass
class Request:
    prompt: list[int]
    sampling: Sampling = field(default_factory=Sampling)
    name: str = "request"  # how errors refer to it ("prompt 3")
    on_token: TokenCallback | None = None
    outputs: list[Output] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already in the KV cache
    submitted_s: float = 0.0

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and all(o.finish_reason for o in self.outputs)


def blocks_needed(prompt_len: int, s: Sampling, block_size: int) -> int:
    """Logical KV blocks a request reserves: prompt + max_new_tokens per output, full prompt blocks shared."""
    per_output = -(-(prompt_len + s.max_new_tokens) // block_size)
    # with samples, a partial last prompt block is copied by every writer before the shared one goes
    copied = 1 if s.n > 1 and prompt_len % block_size else 0
    return per_output + (s.n - 1) * (per_output - prompt_len // block_size) + copied


class Engine:
    def __init__(self, runner, stats: RunStats | None = None) -> None:
        self.runner = runner
        self.speculator = getattr(runner, "speculator", None)  # runtime.speculative.Speculator when configured
        self.kv = runner._kv()
        self.budget = runner.config.activations.prefill_chunk
        self.stats = stats or RunStats()
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self._next_output = 0
        bs = self.kv.block_size
        # device blocks one prefill pass may write: every running sequence pins its newest block besides
        self._pass_blocks = -(-self.budget // bs) + 1
        # device blocks each running sequence may hold in a pass: its newest, plus a speculative chain's
        chain = self.speculator.most_tokens + 1 if self.speculator is not None else 0
        self._row_blocks = 1 + -(-chain // bs)

    # -- requests -----------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request; one whose KV could never fit is refused now (CapacityError) and costs nothing."""
        need = blocks_needed(len(req.prompt), req.sampling, self.kv.block_size)
        if self.kv.logical.can_allocate(need) is Admission.NEVER:
            s = req.sampling
            raise CapacityError(
                f"{req.name} needs {need} KV blocks ({len(req.prompt)} + {s.max_new_tokens} tokens"
                + (f", {s.n} samples" if s.n > 1 else "") + f") but the KV cache holds {self.kv.logical.num_blocks} "
                "in all tiers; raise kv_cache.gpu_blocks (or cpu_blocks / disk_blocks) or lower max_new_tokens"
            )
        seed = req.sampling.seed
        for s in range(req.sampling.n):
            o = self._next_output
            self._next_output += 1
            gen = None if seed is None else torch.Generator().manual_seed(seed + s)
            stream = self.runner.tokenizer.stream() if self.runner.tokenizer and req.on_token else None
            req.outputs.append(Output(o, gen, stream))
        req.submitted_s = time.perf_counter()
        self.waiting.append(req)
        return req

    def abort(self, req: Request) -> None:
        """Stop a request now (a client went away): its blocks are freed, its outputs end with "abort"."""
        for o in req.outputs:
            if not o.finish_reason:
                o.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)
        self._retire()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    # -- one pass -----------------------------------------------------------------------------
    def _admit(self) -> None:
        running = sum(len(r.outputs) for r in self.prefilling + self.decoding)
        while self.waiting:
            req = self.waiting[0]
            need = blocks_needed(len(req.prompt), req.sampling, self.kv.block_size)
            if self.kv.logical.can_allocate(need) is not Admission.OK:
                return
            if running and (running + req.sampling.n) * self._row_blocks + self._pass_blocks > self.kv.pool.num_blocks:
                return  # the device could not hold every running sequence's newest block and a prefill pass
            self.waiting.popleft()
            req.outputs[0].sid = self.kv.add_sequence(reserve_tokens=len(req.prompt) + req.sampling.max_new_tokens)
            self.prefilling.append(req)
            running += req.sampling.n

    def step(self) -> None:
        """One forward pass: a token for every decoding output, then prompt chunks within the budget.

        With a speculator, each decoding output's row is its last token and the draft's chain; the
        pass verifies them all, the target's KV is rolled back past the rejected ones, and an output
        gains one to `tokens + 1` tokens.
        """
        self._admit()
        t0, step_id = time.perf_counter(), self.runner.timeline.step
        rows: list[tuple[Request, list[Output], list[int], bool]] = []  # (request, outputs, tokens, samples?)
        for req in self.decoding:
            for o in req.outputs:
                if not o.finish_reason:
                    rows.append((req, [o], [o.token_ids[-1]], True))
        decode_rows = len(rows)
        spec = self.speculator if decode_rows else None
        drafts = spec.propose([(req, outs[0]) for req, outs, _, _ in rows]) if spec else []
        for i, chain in enumerate(drafts):
            rows[i][2].extend(chain)
        left = self.budget  # prompt tokens per pass; decode rows ride along (a row each)
        for req in self.prefilling:
            if left <= 0:
                break
            take = min(left, len(req.prompt) - req.prefilled)
            chunk = req.prompt[req.prefilled : req.prefilled + take]
            req.prefilled += take
            left -= take
            rows.append((req, req.outputs, chunk, req.prefilled == len(req.prompt)))
        if not rows:
            if self.waiting and not self.prefilling and not self.decoding:
                raise AssertionError("nothing running and nothing admissible")  # NEVER was refused at submit
            return
        keep = [len(toks) for _, _, toks, _ in rows[:decode_rows]] + [1] * (len(rows) - decode_rows) if spec else None
        t_pass = time.perf_counter()
        logits = self.runner._forward([outs[0].sid for _, outs, _, _ in rows], [toks for _, _, toks, _ in rows],
                                      keep=keep)
        verify_end = time.perf_counter()
        if spec:
            logits, emitted = self._verify(rows[:decode_rows], drafts, logits, keep)
            spec.timed_verify(verify_end - t_pass, max(map(len, drafts)))
            self.runner.timeline.add("speculative", "verify", t_pass - self.runner.timeline.origin,
                                     verify_end - self.runner.timeline.origin, step=step_id,
                                     proposed=sum(map(len, drafts)), accepted=emitted - decode_rows, rows=decode_rows)
        else:
            emitted = decode_rows
        picks: list[tuple[Request, Output, torch.Tensor]] = []
        for i, ((req, outs, _, samples), row) in enumerate(zip(rows, logits)):
            if not samples or (spec and i < decode_rows):
                continue
            if outs is req.outputs and req in self.prefilling:  # the prompt is in: fork the samples, decode next
                for o in outs[1:]:
                    o.sid = self.kv.fork(outs[0].sid, len(req.prompt) + req.sampling.max_new_tokens)
                self.prefilling.remove(req)
                self.decoding.append(req)
                picks += [(req, o, row) for o in outs]
            else:
                picks.append((req, outs[0], row))
        self._sample(picks)
        dt = time.perf_counter() - t0
        if decode_rows:
            self.stats.decode_s += dt
            self.stats.decode_steps += 1
            self.stats.decode_tokens += emitted
            self.stats.step_ms.append(1000 * dt)
        else:
            self.stats.prefill_s += dt
        if len(rows) > decode_rows:
            self.stats.prefill_passes += 1
        kind = "mixed" if decode_rows and len(rows) > decode_rows else "decode" if decode_rows else "prefill"
        self.stats.passes.append((step_id, kind, 1000 * dt))
        self._retire()

    def _verify(self, rows, drafts: list[list[int]], logits: torch.Tensor, keep: list[int]
                ) -> tuple[list[torch.Tensor], int]:
        """Accept or reject each decoding output's drafts; roll its KV back; emit what it keeps.

        Returns one logits row per pass row (the last of each decoding row's) and the tokens emitted."""
        per_row = list(torch.split(logits, keep))
        emitted = 0
        kept = self.speculator.accept([(req, outs[0]) for req, outs, _, _ in rows], per_row[: len(rows)])
        for (req, outs, _, _), chain, tokens in zip(rows, drafts, kept):
            o = outs[0]
            self.kv.truncate(o.sid, self.kv.length(o.sid) - (len(chain) + 1 - len(tokens)))
            self.stats.draft_tokens += len(chain)
            self.stats.accepted_tokens += len(tokens) - 1
            for tok in tokens:
                if o.finish_reason:
                    break
                self._emit(req, o, tok)
                emitted += 1
        return [r[-1] for r in per_row], emitted

    def _sample(self, picks: list[tuple[Request, Output, torch.Tensor]]) -> None:
        by_params: dict[Sampling, list[tuple[Request, Output, torch.Tensor]]] = {}
        for p in picks:
            by_params.setdefault(p[0].sampling, []).append(p)
        for s, group in by_params.items():
            tokens = sample(torch.stack([row for _, _, row in group]), s.temperature, s.top_p, s.top_k,
                            [o.generator for _, o, _ in group])
            for (req, o, _), tok in zip(group, tokens):
                self._emit(req, o, tok)

    def _emit(self, req: Request, o: Output, token: int) -> None:
        if not o.token_ids:
            o.first_token_s = time.perf_counter() - req.submitted_s
        o.token_ids.append(token)
        if token in req.sampling.stop_token_ids:
            o.finish_reason = "eos"
        elif len(o.token_ids) >= req.sampling.max_new_tokens:
            o.finish_reason = "length"
        if req.on_token is not None:
            text = ""
            if o.stream is not None:
                text = o.stream.push(token) + (o.stream.flush() if o.finish_reason else "")
            req.on_token(o.index, token, text)

    def _retire(self) -> None:
        """Free the sequences of finished outputs; requests whose outputs all finished leave."""
        for group in (self.prefilling, self.decoding):
            for req in list(group):
                for o in req.outputs:
                    if o.finish_reason and o.sid is not None and (group is self.decoding or o is req.outputs[0]):
                        self.kv.free_sequence(o.sid)
                        o.sid = None
                        if self.speculator is not None:
                            self.speculator.release(o)
                if req.finished:
                    group.remove(req)

    def run(self, requests: Sequence[Request]) -> list[Request]:
        """Submit every request (refusing any that could never fit before running one), then step until done."""
        for req in requests:
            self.submit(req)
        while self.busy:
            self.step()
        return list(requests)
