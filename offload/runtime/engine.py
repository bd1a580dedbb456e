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
    finished    EOS, a stop string, max_new_tokens, or aborted; its KV blocks go back to the pool
                (or, with `keep=True`, stay as a `Kept` sequence for `Engine.continue_`)

A conversation keeps its KV between turns: `Request(..., keep=True)` leaves the finished
sequence in the cache (its unused reservation given back), and `engine.continue_(kept, ids)`
submits the next turn's whole prompt; only the tokens after the longest prefix the cache
already holds are prefilled.

A pass holds a token for every decoding output plus up to `activations.prefill_chunk` prompt
tokens of prefilling requests (oldest first; fewer once a prompt's context outgrows the attention
workspace, see `offload.plan.passes.pass_tokens`), so a request
that arrives while others decode joins at the next pass: the weights are read once for all
of them. The n outputs of a request share its prompt's blocks copy-on-write. The engine
knows requests, sequences and tokens; the model is the executor's business.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence

import torch

from offload.errors import CapacityError, ConfigError
from offload.plan.passes import batch_rows, pass_blocks, pass_tokens
from offload.runtime.executor import ForwardBatch
from offload.runtime.requests import (
    Context,
    DecodeRow,
    Kept,
    Output,
    Pick,
    PrefillRow,
    Request,
    Sampling,
    blocks_needed,
    logit_rows,
    record_logprobs,
)
from offload.runtime.results import RunStats, TokenCallback
from offload.runtime.sampling import sample
from offload.runtime.speculative import TREE_WIDTH
from offload.runtime.stops import StopMatcher
from offload.runtime.verify import Verification, tree_room
from storage import interrupts
from storage.block_pool import Admission

log = logging.getLogger(__name__)


class Engine:
    """Runs requests on a runner's target executor (`runner.target`: forward passes and the KV pool), with
    its speculator when it has one; the runner's tokenizer streams text, its EOS ids end outputs."""

    def __init__(self, runner, stats: RunStats | None = None) -> None:
        self.executor = runner.target  # offload.runtime.executor.Executor
        self.speculator = runner.speculator  # offload.runtime.speculative.Speculator, or None
        self.tokenizer = runner.tokenizer
        self.model_name = runner.config.model
        self.tree = runner.config.speculative.tree
        self.eos = frozenset(runner.generation.eos_token_ids)  # what Sampling(stop_token_ids=None) stops at
        assert self.executor.kv is not None, "size the KV pool first (Runner.ensure_kv)"
        self.kv = self.executor.kv
        self.budget = self.executor.prefill_chunk  # activations.prefill_chunk, `auto` resolved by the planner
        self.context = Context(self.executor.cfg.max_position_embeddings)  # a conversation may set a smaller one
        self.stats = stats or RunStats()
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self._next_output = 0
        # sequences of finished `keep` requests, still holding their blocks, oldest first; when a waiting
        # request cannot be admitted and nothing runs, they give their blocks back (a cache, not a promise)
        self._kept: dict[int, None] = {}
        bs = self.kv.block_size
        # device blocks one prefill pass may write: every running sequence pins its newest block besides
        self._pass_blocks = pass_blocks(self.budget, bs)
        self._row_blocks = runner.row_blocks  # device blocks each running sequence may hold in a pass

    @property
    def batch(self) -> int:
        """Sequences the device KV pool keeps decoding together (the admission rule of `_reserve`)."""
        return batch_rows(self.kv.pool.num_blocks, self.budget, self.kv.block_size, self._row_blocks)

    # -- requests -----------------------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        """ContextLengthError if prompt + max_new_tokens exceed the context, CapacityError if the request's
        worst-case KV could never fit (reads only the pool's fixed size)."""
        self._refuse_never(len(req.context) + len(req.prompt), req.sampling, req.name)

    def submit(self, req: Request, continues: Kept | None = None) -> Request:
        """Queue a request; one whose KV could never fit is refused now (CapacityError) and costs nothing."""
        if req.keep and req.sampling.n != 1:
            raise ConfigError(f"{req.name}: a kept (conversation) request has one output, not n={req.sampling.n}")
        self.check_fits(req)
        if req.sampling.stop_token_ids is None:  # the model's EOS ids
            req.sampling = dataclasses.replace(req.sampling, stop_token_ids=self.eos)
        seed = req.sampling.seed
        for s in range(req.sampling.n):
            o = self._next_output
            self._next_output += 1
            gen = None if seed is None else torch.Generator().manual_seed(seed + s)
            tok = self.tokenizer
            stops = StopMatcher(req.sampling.stop_strings) if req.sampling.stop_strings else None
            if stops is not None and tok is None:
                raise ConfigError(f"{self.model_name} has no tokenizer.json, so stop strings cannot be "
                                  "matched; use stop token ids instead")
            stream = tok.stream() if tok and (req.on_token or stops) else None
            req.outputs.append(Output(o, gen, stream, stops=stops))
        if continues is not None:
            self._kept.pop(continues.sid, None)
            req.outputs[0].sid = continues.sid
        req.submitted_s = time.perf_counter()
        self.waiting.append(req)
        return req

    def _refuse_never(self, prompt_len: int, s: Sampling, name: str) -> None:
        self.context.check(prompt_len, s.max_new_tokens, name)
        need = blocks_needed(prompt_len, s, self.kv.block_size)
        if need > self.kv.logical.num_blocks:  # NEVER; reads only the pool's fixed size: safe from any thread
            raise CapacityError(
                f"{name} needs {need} KV blocks ({prompt_len} + {s.max_new_tokens} tokens"
                + (f", {s.n} samples" if s.n > 1 else "") + f") but the KV cache holds {self.kv.logical.num_blocks} "
                "in all tiers; raise kv_cache.gpu_blocks (or cpu_blocks / disk_blocks) or lower max_new_tokens"
            )

    def abort(self, req: Request) -> None:
        """Stop a request now (a client went away): its blocks are freed, its outputs end with "abort"."""
        for o in req.outputs:
            if not o.finish_reason:
                o.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)
            sid = req.outputs[0].sid if req.outputs else None
            if sid is not None:  # a continued sequence not admitted yet: it stays kept as it was
                req.outputs[0].sid = None
                req.kept = Kept(sid, tuple(req.context[: self.kv.length(sid)]))
                self._kept[sid] = None
        self._retire()

    def continue_(self, kept: Kept, prompt: Sequence[int], sampling: Sampling, name: str = "request",
                  on_token: TokenCallback | None = None, keep: bool = True) -> Request:
        """Continue a kept sequence with `prompt`, the whole token list of the next turn (context included).

        The cache keeps the longest prefix it shares with `prompt` (at least one token is left to
        compute the next logits); only the rest is prefilled. Returns the queued request. A kept
        sequence the engine has dropped since (to admit others) is computed again from the start.
        """
        prompt = [int(t) for t in prompt]
        if kept.sid not in self._kept:
            return self.submit(Request(prompt, sampling, name, on_token, keep=keep))
        common = 0
        for a, b in zip(kept.tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        self._refuse_never(len(prompt), sampling, name)  # before touching the kept sequence
        common = self.kv.truncate(kept.sid, common)
        req = Request(prompt[common:], sampling, name, on_token, keep=keep, context=prompt[:common])
        return self.submit(req, continues=kept)

    def drop(self, kept: Kept) -> None:
        """Free a kept sequence (the conversation is over)."""
        if kept.sid in self._kept:
            del self._kept[kept.sid]
            self.kv.free_sequence(kept.sid)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    # -- one pass -----------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            if not self._reserve(req):
                if self.prefilling or self.decoding or not self._kept:
                    return  # wait for running requests to finish
                oldest = next(iter(self._kept))  # nothing runs: kept conversations make room, oldest first
                log.info("dropping a kept sequence (%d tokens) to admit %s", self.kv.length(oldest), req.name)
                self.drop(Kept(oldest, ()))
                continue
            self.waiting.popleft()
            self.prefilling.append(req)

    def _reserve(self, req: Request) -> bool:
        """Admit `req` if its worst case fits: its sequence, with blocks reserved for every future token."""
        # every running and kept sequence pins its newest device block (and, speculating, its chain's)
        running = sum(len(r.outputs) for r in self.prefilling + self.decoding) + len(self._kept)
        if running and (running + req.sampling.n) * self._row_blocks + self._pass_blocks > self.kv.pool.num_blocks:
            return False  # the device could not hold every running sequence's newest block and a prefill pass
        total = req.worst_case_tokens
        if req.outputs[0].sid is not None:  # a continued sequence: reserve what it will grow by
            return self.kv.reserve(req.outputs[0].sid, total) is Admission.OK
        sid = self.kv.add_sequence()
        # its cached prefix first (the blocks held, so making room cannot take them): that much less to reserve
        cached = self.kv.prefix.pin(sid, req.prompt) if self.kv.prefix is not None else 0
        need = blocks_needed(len(req.prompt), req.sampling, self.kv.block_size) - cached
        if self.kv.can_allocate(need) is not Admission.OK or self.kv.reserve(sid, total) is not Admission.OK:
            self.kv.free_sequence(sid)
            return False
        req.outputs[0].sid = sid
        return True

    def step(self) -> None:
        """One forward pass: a token for every decoding output, then prompt chunks within the budget.

        With a speculator, each decoding output's row is its last token and the draft's chain; the
        pass verifies them all (`offload.runtime.verify`) and an output gains one to `tokens + 1` tokens.
        """
        interrupts.check()  # a Ctrl-C that a callback from C swallowed (`storage.interrupts`)
        self._admit()
        t0, step_id = time.perf_counter(), self.executor.timeline.step
        decode = [DecodeRow(req, o, [o.token_ids[-1]]) for req in self.decoding for o in req.outputs
                  if not o.finish_reason]
        verify = self._propose(decode) if decode and self.speculator is not None else None
        prefill = self._prefill_rows()
        if not decode and not prefill:
            if self.waiting and not self.prefilling and not self.decoding:
                raise AssertionError("nothing running and nothing admissible")  # NEVER was refused at submit
            return
        logits, timing = self._forward(self._batch(decode, prefill, verify), verify)
        for row in prefill:  # the chunks are in: their full blocks can serve other requests from now on
            self._register(row.sid, row.req.context + row.req.prompt)
        if verify is None:  # a row per sequence: each decoding output samples from its own (its row, by index)
            emitted, picks = len(decode), [(row.req, row.output, logits, i) for i, row in enumerate(decode)]
            prompt_rows = [(logits, emitted + i) for i in range(len(prefill))]
        else:  # decoding outputs keep the tokens verification gave them
            emitted, prompt_logits = self._verified(verify, logits, len(prefill), step_id, timing)
            prompt_rows, picks = [(lg[None], 0) for lg in prompt_logits], []
        self._sample(picks + self._prompts_done(prefill, prompt_rows))
        self.stats.account(time.perf_counter() - t0, step_id, len(decode), len(prefill), emitted)
        self._retire()

    def _forward(self, batch: ForwardBatch, verify: Verification | None
                 ) -> tuple[torch.Tensor, tuple[float, float]]:
        """The pass's logits, and when it started and ended (perf_counter seconds)."""
        start = time.perf_counter()
        try:
            logits = self.executor.forward(batch)
        except BaseException:  # a failed pass leaves no fork behind (the draft's go with `release`)
            if verify is not None:
                verify.abort()
            raise
        return logits, (start, time.perf_counter())

    def _verified(self, verify: Verification, logits: torch.Tensor, prefill_rows: int, step_id: int,
                  timing: tuple[float, float]) -> tuple[int, list[torch.Tensor]]:
        """Accept each decoding output's drafts (emitting them); (tokens emitted, the prompt rows' logits)."""
        done, prompt_logits = verify.accept(logits, prefill_rows, self._emit)
        verify.record(self.executor.timeline, step_id, *timing, done)
        self.stats.draft_tokens += done.drafted
        self.stats.accepted_tokens += done.accepted
        return done.emitted, prompt_logits

    def _propose(self, decode: list[DecodeRow]) -> Verification:
        """The draft's chains (a tree, greedy outputs, while the pools have room) appended to the decode rows."""
        assert self.speculator is not None
        prefill_blocks = self._pass_blocks if self.prefilling else 0
        tree = self.tree and tree_room(self.kv, len(decode), self._row_blocks, prefill_blocks)
        return Verification(self.speculator, self.kv, decode, TREE_WIDTH if tree else 1)

    def _prefill_rows(self) -> list[PrefillRow]:
        """Prompt chunks of prefilling requests, oldest first, within the pass's token budget."""
        rows, left = [], self.budget  # decode rows ride along (a row each)
        for req in self.prefilling:
            if left <= 0:
                break
            if req.cached is None:  # its first chunk: the longest cached prefix instead of computing it
                self._attach(req)
            take = min(left, len(req.prompt) - req.prefilled, pass_tokens(self.budget, req.prefilled))
            chunk = req.prompt[req.prefilled : req.prefilled + take]
            req.prefilled += take
            left -= take
            rows.append(PrefillRow(req, chunk, req.prefilled == len(req.prompt)))
        return rows

    def _attach(self, req: Request) -> None:
        sid = req.outputs[0].sid
        assert sid is not None
        req.cached = 0
        if self.kv.prefix is not None and not req.context:  # a continued sequence keeps its own prefix
            req.cached = req.prefilled = self.kv.prefix.attach(sid, req.prompt)
            self.stats.cached_tokens += req.cached

    def _register(self, sid: int, tokens: list[int]) -> None:
        """The full blocks of `sid` (whose K/V hold `tokens`, every one written) join the prefix cache."""
        if self.kv.prefix is not None:
            self.kv.prefix.register(sid, tokens)

    def _prompts_done(self, prefill: list[PrefillRow], logits: list[tuple[torch.Tensor, int]]
                      ) -> list[Pick]:
        """Requests whose whole prompt is in: their samples fork the prompt's sequence and decode from now on;
        each samples its first token from the last chunk's logits (a tensor's row)."""
        picks = []
        for row, lg in zip(prefill, logits):
            if row.last:
                req, outs = row.req, row.req.outputs
                for o in outs[1:]:
                    o.sid = self.kv.fork(row.sid, req.worst_case_tokens)
                self.prefilling.remove(req)
                self.decoding.append(req)
                picks += [(req, o, *lg) for o in outs]
        return picks

    def _batch(self, decode: list[DecodeRow], prefill: list[PrefillRow], verify: Verification | None
               ) -> ForwardBatch:
        rows: list[DecodeRow | PrefillRow] = [*decode, *prefill]
        sids, tokens = [r.sid for r in rows], [r.tokens for r in rows]
        if verify is None:
            return ForwardBatch.last(sids, tokens)
        forks = verify.forks
        return ForwardBatch.verify(sids + [f.sid for f in forks], tokens + [f.tokens for f in forks],
                                   keep=verify.keep + [1] * len(prefill) + [len(f.tokens) for f in forks],
                                   lanes=[0] * len(decode) + [-1] * len(prefill) + [f.branch for f in forks])

    def _sample(self, picks: list[Pick]) -> None:
        by_params: dict[Sampling, list[Pick]] = {}
        for p in picks:
            by_params.setdefault(p[0].sampling, []).append(p)
        for s, group in by_params.items():
            rows = logit_rows([(t, i) for _, _, t, i in group])  # [B, V]
            tokens = sample(rows, s.temperature, s.top_p, s.top_k, [o.generator for _, o, _, _ in group])
            if s.logprobs is not None:
                record_logprobs(rows, tokens, [o for _, o, _, _ in group], s.logprobs)
            for (req, o, _, _), tok in zip(group, tokens):
                self._emit(req, o, tok)

    def _emit(self, req: Request, o: Output, token: int) -> None:
        if not o.token_ids:
            o.first_token_s = time.perf_counter() - req.submitted_s
        o.token_ids.append(token)
        if token in req.sampling.stop_token_ids:
            o.finish_reason = "eos"
        elif len(o.token_ids) >= req.sampling.max_new_tokens:
            o.finish_reason = "length"
        text = ""
        if o.stream is not None:
            text = o.stream.push(token) + (o.stream.flush() if o.finish_reason else "")
            if o.stops is not None:
                text, stopped = o.stops.push(text)
                if stopped:
                    o.finish_reason = "stop"
                elif o.finish_reason:
                    text += o.stops.flush()
        if req.on_token is not None:
            req.on_token(o.index, token, text)

    def _retire(self) -> None:
        """Free the sequences of finished outputs; requests whose outputs all finished leave."""
        for group in (self.prefilling, self.decoding):
            for req in list(group):
                if req.keep and req.finished and req.outputs[0].sid is not None:
                    sid, req.outputs[0].sid = req.outputs[0].sid, None
                    self.kv.release_reservation(sid)
                    history = req.context + req.prompt + req.outputs[0].token_ids
                    req.kept = Kept(sid, tuple(history[: self.kv.length(sid)]))
                    self._kept[sid] = None
                for o in req.outputs:
                    if o.finish_reason and o.sid is not None and (group is self.decoding or o is req.outputs[0]):
                        if o.finish_reason != "abort":  # every token of it went through a whole pass
                            self._register(o.sid, req.context + req.prompt + o.token_ids)
                        self.kv.free_sequence(o.sid)
                        o.sid = None
                        if self.speculator is not None:
                            self.speculator.release(o)
                if req.finished:
                    group.remove(req)

    def run(self, requests: Sequence[Request]) -> list[Request]:
        """Submit every request (refusing any that could never fit before running one), then step until done."""
        try:
            for req in requests:
                self.submit(req)
            while self.busy:
                self.step()
        except BaseException:  # Ctrl-C, a full disk, a refusal: free every block, so the runner stays usable
            self.abort_all()
            raise
        return list(requests)

    def abort_all(self) -> None:
        for req in list(self.waiting) + self.prefilling + self.decoding:
            self.abort(req)
