"""Speculative decoding: a small resident draft proposes a chain of tokens, the target checks them in one pass.

    spec = Speculator(draft_executor, tokens=8, timeline=runner.timeline, verify_cost=...)
    branches = spec.propose(rows, width)    # up to `tokens` draft passes: a chain (or a tree) per output
    ... the target runs [last token, *branch] of every branch in one pass, logits for each position ...
    kept = spec.accept(rows, logits)        # per output: the accepted drafts and one token of the target's,
                                            # and the branch they came from

The draft is a second executor (`offload.runtime.executor`) with its own KV pool (resident: its
passes read no streamed bytes).
Each output has a draft sequence that lags the committed tokens by at most two; a step first
feeds the draft what it has not seen, then one token per pass. Verification keeps the target's
result exactly:

    greedy     drafts are kept while they equal the target's argmax; then the target's argmax
    sampling   draft token d (drawn from q) is kept with probability min(1, p(d) / q(d)); the first
               rejected one is replaced by a draw from max(p - q, 0), normalised; if all are kept, one
               more is drawn from p (Leviathan et al. 2023; Chen et al. 2023), so every token is
               distributed as the target alone would draw it (p, q: after temperature, top-k, top-p)

A tree (`tree: true`, greedy outputs, while the pools have room) is TREE_WIDTH chains that share the
output's context and start with the draft's top first tokens: each extra branch is a fork of the
sequence (copy-on-write blocks), so the target verifies it with plain causal attention in the same
pass; the longest accepted branch wins and the other forks go (a tree attention mask over one
sequence would put a node's keys out of token order, and its bits would not be a plain step's).
Sampled outputs keep one chain: the rule above is for one candidate per position.

`offload.runtime.verify` rolls the target's KV back past the kept tokens (`PagedKVCache.truncate`);
this module rolls back the draft's. `tokens: auto` re-chooses the chain length each step from the measured
acceptance rate and pass times (`offload.plan.speculative`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from offload.config import SELF_DRAFTS, KVCacheConfig, OffloadConfig, SpeculativeConfig
from offload.errors import ConfigError
from offload.kv.cache import PagedKVCache
from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig
from offload.model.tokenizer import TextTokenizer
from offload.plan.calibrate import load_calibration
from offload.plan.planner import Planner
from offload.plan.speculative import MAX_AUTO_TOKENS, SpecGain, SpecPrediction, choose_tokens, gain, reserve_draft
from offload.runtime.executor import Executor, ForwardBatch
from offload.runtime.sampling import probs
from offload.weights.groups import WeightFormat
from schedulers.plan import Capacities
from schedulers.timeline import Timeline
from storage.units import blocks_for

#: acceptance rate assumed before any draft token was checked (and the weight of that prior, in tokens)
PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 8.0
#: with `tokens: auto` and drafting not paying, every PROBE_EVERY-th pass still drafts one token
PROBE_EVERY = 16
#: `tree: true`: the draft's top TREE_WIDTH first tokens, each continued greedily to the chain's length
TREE_WIDTH = 3


def draft_config(config: OffloadConfig) -> OffloadConfig:
    """The draft's run: its checkpoint, the target's device and dtype, every weight resident (no tiers).

    Its KV pool is sized by the caller once the target's is known (one draft block per target block)."""
    spec = config.speculative
    # no prefix cache: the draft is resident and feeds its whole prompt (only the target's blocks are shared)
    kv = KVCacheConfig(block_size=config.kv_cache.block_size, gpu_blocks=None, prefix_cache="off")
    off = dataclasses.replace(spec, draft="none", path=None, hub=None)
    if spec.draft in SELF_DRAFTS:  # the target itself, its matrices packed (in memory: every weight is resident)
        fmt = WeightFormat(spec.draft.removeprefix("self-"), config.weights.group_size, tuple(config.weights.keep))
        fmt = fmt.fitted(Checkpoint(config.model).config)  # a group size every packed matrix allows
        weights = dataclasses.replace(config.weights, quantization=fmt.quantization, group_size=fmt.group_size)
        return dataclasses.replace(config, tiers=None, kv_cache=kv, weights=weights, speculative=off)
    assert spec.path is not None
    # a Hub draft: the runner fetched it with the target (`OffloadConfig.fetched`)
    return dataclasses.replace(config, model=spec.path, hub=spec.hub, tiers=None, kv_cache=kv, speculative=off)


def draft_model_config(config: OffloadConfig, target_cfg: ModelConfig) -> ModelConfig:
    """The draft's model shape (`draft_config(config)`'s), from its config.json alone (no weights read)."""
    if config.speculative.draft in SELF_DRAFTS:
        return target_cfg
    path = draft_config(config).model
    return ModelConfig.from_dict(json.loads((path / "config.json").read_text()), str(path))


def auto_gain(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
              caps: Capacities) -> SpecGain:
    """What the config's draft buys against plain decoding, planned (no weights read): the draft placed first,
    the target around it, and the target alone with all of `caps`."""
    dconf = draft_config(config)
    draft = Planner(dconf, draft_model_config(config, cfg), dtype, device)
    drp = draft.run_plan()
    target = Planner(config, cfg, dtype, device, reserve_draft(config, caps, drp.plan.used("gpu"),
                                                                 drp.kv_block_bytes))
    alone = Planner(config.replace(speculative=SpeculativeConfig()), cfg, dtype, device, caps)
    return gain(target, alone, draft, load_calibration(config.calibration))


def check_draft(target_model: Path, target_cfg: ModelConfig, target_tokenizer: TextTokenizer | None,
                draft: Executor) -> None:
    """A draft must speak the target's tokens: the same vocabulary size and the same tokenizer."""
    where = f"speculative.draft: {draft.config.model}"
    if draft.cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"{where} has a vocabulary of {draft.cfg.vocab_size} tokens but the target has "
                          f"{target_cfg.vocab_size}; a draft must share the target's tokenizer")
    tokenizer = TextTokenizer.from_checkpoint(draft.config.model)
    if (tokenizer is None) != (target_tokenizer is None) or (
            tokenizer is not None and tokenizer.vocab() != target_tokenizer.vocab()):
        raise ConfigError(f"{where} has another tokenizer than the target ({target_model}); a draft must "
                          "share the target's tokenizer.json (the same tokens with the same ids)")


class Speculator:
    def __init__(self, draft: Executor, tokens: int | None, timeline: Timeline,
                 verify_cost: Callable[[int], float] = lambda k: 1.0) -> None:
        self.draft = draft  # an Executor whose weights are all resident; its KV pool is its own
        self.fixed = tokens  # draft tokens per step; None: auto
        self.timeline = timeline  # the target's: "speculative" spans (draft passes, verify passes)
        self.verify_cost = verify_cost  # target pass over k+1 tokens / over 1 token (from the cost model)
        self.proposed = 0  # draft tokens checked by the target
        self.accepted = 0  # of those, kept
        self.cut = 0  # chains the target cut short (a draft token rejected)
        self.draft_s = 0.0  # seconds in draft passes
        self.draft_passes = 0
        self.verify_s = 0.0  # seconds in target passes that verified drafts (normalised to a plain pass)
        self.verify_passes = 0
        self.choice: SpecPrediction | None = None  # the last automatic choice
        self.warm: set[str] = set()  # the passes timed once already (`_warm`)
        self.tree_wins = 0  # tree mode: steps whose longest accepted branch was not the draft's first choice
        # output -> (branches of drafts, their draft sequences, q of a sampled chain, context length)
        self._step: dict[int, tuple[list[list[int]], list[int], torch.Tensor | None, int]] = {}

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def most_tokens(self) -> int:
        """The longest chain a step may propose."""
        return self.fixed if self.fixed is not None else MAX_AUTO_TOKENS

    @property
    def alpha(self) -> float:
        """Measured chance the target keeps a draft token given it kept the ones before (with a weak prior
        while few were checked): kept tokens over kept tokens plus rejections. Tokens after a rejection
        were never judged; counting them as rejected (kept / proposed) understates it: SmolLM2 with a
        self-int4 draft, 4 per chain, kept 43% of its drafts yet made 2.50 tokens per pass, which needs 0.62."""
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.accepted + self.cut + PRIOR_WEIGHT)

    def tokens(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if not self.draft_passes or not self.verify_passes:
            return 1  # one cheap step measures both pass times; then the measured choice
        t_draft = self.draft_s / self.draft_passes
        t_plain = self.verify_s / self.verify_passes
        self.choice = choose_tokens(self.alpha, t_draft, lambda k: t_plain * self.verify_cost(k), t_plain,
                                    MAX_AUTO_TOKENS)
        if self.choice.tokens == 0 and self.verify_passes % PROBE_EVERY == 0 and choose_tokens(
                1.0, t_draft, lambda k: t_plain * self.verify_cost(k), t_plain, MAX_AUTO_TOKENS).tokens:
            return 1  # drafting does not pay: plain passes, with a probe now and then to re-measure acceptance
            # (none when even a draft the target always agreed with could not pay: its passes are too slow)
        return self.choice.tokens

    def _kv(self) -> PagedKVCache:
        kv = self.draft.kv
        assert kv is not None, "the draft's KV pool is sized with the target's (Runner.ensure_kv)"
        return kv

    def release(self, output: Any) -> None:
        """An output finished: its draft sequence goes."""
        if output.draft_sid is not None:
            self._kv().free_sequence(output.draft_sid)
            output.draft_sid = None
        step = self._step.pop(output.index, None)
        for sid in step[1][1:] if step else ():
            self._kv().free_sequence(sid)

    def timed_verify(self, seconds: float, k: int) -> None:
        """The target's verify pass took `seconds` with chains of up to `k` drafts."""
        if self._warm("verify"):
            self.verify_s += seconds / self.verify_cost(k)
            self.verify_passes += 1

    # -- proposing ----------------------------------------------------------------------------
    def propose(self, rows: list[tuple[Any, Any]], width: int = 1) -> list[list[list[int]]]:
        """Draft branches for each (request, output): at most `tokens` each, never past max_new_tokens.

        A chain is one branch. With `width` > 1 (tree mode, greedy outputs, room in the draft's pool) the
        draft's top `width` first tokens each start a branch continued greedily: the target verifies
        every branch in the same pass and keeps the longest accepted one."""
        k_max = self.tokens()
        ks = [min(k_max, req.sampling.max_new_tokens - len(o.token_ids) - 1) for req, o in rows]
        lanes: list[list[int]] = [[o.draft_sid] for _, o in rows]  # draft sequence of each branch
        branches: list[list[list[int]]] = [[[]] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = [i for i, k in enumerate(ks) if k > 0]
        try:
            self._draft_branches(rows, ks, active, lanes, branches, qs, width)
        except BaseException:  # a failed draft pass leaves no forked draft sequence behind
            for sids in lanes:
                for sid in sids[1:]:
                    self._kv().free_sequence(sid)
            raise
        for i, (req, o) in enumerate(rows):
            q = torch.stack(qs[i]) if qs[i] and qs[i][0] is not None else None
            self._step[o.index] = (branches[i], lanes[i], q, len(req.prompt) + len(o.token_ids))
        return branches

    def _draft_branches(self, rows, ks, active, lanes, branches, qs, width: int) -> None:
        """The draft passes of a step: fills `branches` (tokens), `lanes` (draft sequences), `qs` (q per token)."""
        if active:
            with self.timeline.span("speculative", "draft", tokens=max(ks)):
                self._start([rows[i] for i in active])
                lanes[:] = [[o.draft_sid] for _, o in rows]
                feed = {(i, 0): self._unseen(*rows[i]) for i in active}
                for j in range(max(ks)):
                    live = [(i, b) for i in active if ks[i] > j for b in range(len(lanes[i]))]
                    logits = self._draft_pass([lanes[i][b] for i, b in live], [feed[i, b] for i, b in live],
                                              all(len(feed[i, b]) <= 2 for i, b in live))
                    if j == 0 and width > 1:
                        self._widen(rows, live, logits, lanes, branches, qs, feed, width, ks)
                        continue
                    picks = self._pick([rows[i] for i, _ in live], logits)
                    for (i, b), (tok, q) in zip(live, picks):
                        branches[i][b].append(tok)
                        if b == 0:
                            qs[i].append(q)
                        feed[i, b] = [tok]

    def _widen(self, rows, live, logits, lanes, branches, qs, feed, width: int, ks: list[int]) -> None:
        """The first draft pass of a tree: greedy outputs branch on the draft's top tokens (forked draft
        sequences, while the draft's pool has room); sampled ones keep their single drawn chain."""
        kv = self._kv()
        room = min(kv.pools["gpu"].num_free, kv.logical.num_free)  # blocks the extra branches may take
        for (i, _), row, (tok, q) in zip(live, logits, self._pick([rows[i] for i, _ in live], logits)):
            req, o = rows[i]
            tops = [tok]
            qs[i].append(q)
            if q is None:  # greedy: the top `width` (the first is the argmax)
                extra = blocks_for(ks[i] + 1, kv.block_size) + 1  # blocks a branch may write, copy-on-write included
                tops = row.topk(min(width, row.shape[-1], 1 + room // extra)).indices.tolist()
                room -= (len(tops) - 1) * extra
            for b, t in enumerate(tops):
                if b:
                    context = kv.length(o.draft_sid)
                    lanes[i].append(kv.fork(o.draft_sid, context + ks[i] + 1))
                    branches[i].append([])
                branches[i][b].append(t)
                feed[i, b] = [t]

    def _start(self, rows: list[tuple[Any, Any]]) -> None:
        """Draft sequences for outputs that have none: the prompt goes in once, the samples of a prompt fork it."""
        kv = self._kv()
        new = {}
        for req, o in rows:
            if o.draft_sid is None:
                new.setdefault(id(req), (req, []))[1].append(o)
        if not new:
            return
        firsts = []
        for req, outs in new.values():
            outs[0].draft_sid = kv.add_sequence(reserve_tokens=draft_tokens(req))
            firsts.append((outs[0].draft_sid, req.prompt[:-1]))
        firsts = [(sid, p) for sid, p in firsts if p]
        if firsts:
            for chunk in self.draft.prefill_chunks([s for s, _ in firsts], [p for _, p in firsts]):
                self._draft_pass([s for s, _, _ in chunk], [t for _, t, _ in chunk], timed=False)
        for req, outs in new.values():
            for o in outs[1:]:
                o.draft_sid = kv.fork(outs[0].draft_sid, draft_tokens(req))

    def _unseen(self, req: Any, o: Any) -> list[int]:
        """Committed tokens the draft's KV does not hold yet (the last one at least)."""
        context = req.prompt + o.token_ids
        return context[self._kv().length(o.draft_sid) :]

    def _draft_pass(self, sids: list[int], tokens: list[list[int]], timed: bool = True) -> torch.Tensor:
        """The draft's pass; `timed`: counted as a draft token's, but for the first (its kernels' first use). Not
        timed: a prompt's prefill, and a catching up on more than a step's own two tokens (its last draft's and
        the target's) after plain steps: SmolLM2-135M, a 64-token prompt's pass took 270-560 ms, 30-60 draft
        passes' worth, and 16 tokens' 40 ms; `tokens: auto` took drafting for hopeless from them and stayed plain."""
        t0 = time.perf_counter()
        logits = self.draft.forward(ForwardBatch.last(sids, tokens))
        if timed and self._warm("draft"):
            self.draft_s += time.perf_counter() - t0
            self.draft_passes += 1
        return logits

    def _warm(self, passes: str) -> bool:
        """Were `passes` ("draft", "verify") timed before? The first of each is left out of their means."""
        if passes in self.warm:
            return True
        self.warm.add(passes)
        return False

    @staticmethod
    def _pick(rows: list[tuple[Any, Any]], logits: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """A draft token per row (logits [rows, V]), and the distribution q it was drawn from (None: greedy)."""
        dists = distributions(rows, logits)
        out = []
        for (_, o), row, q in zip(rows, logits, dists):
            tok = int(row.argmax()) if q is None else int(torch.multinomial(q, 1, generator=o.generator))
            out.append((tok, q))
        return out

    # -- verifying ----------------------------------------------------------------------------
    def accept(self, rows: list[tuple[Any, Any]], logits: list[list[torch.Tensor]]) -> list[tuple[list[int], int]]:
        """The tokens this step commits for each (request, output) and the branch they come from.

        logits[i][b]: [k + 1, V], the target's at the output's last token and each draft of branch b. Keeps
        the chosen branch's draft sequence (rolled back to the kept tokens) and frees the others; the caller
        does the same for the target's sequences.
        """
        firsts = [lanes[0] for lanes in logits]
        ps = distributions([r for r, lg in zip(rows, firsts) for _ in range(len(lg))], torch.cat(firsts))
        out, at = [], 0
        for (req, o), lanes in zip(rows, logits):
            p, at = ps[at : at + len(lanes[0])], at + len(lanes[0])
            out.append(self._accept_one(req, o, lanes, None if p[0] is None else torch.stack(p)))
        return out

    def _accept_one(self, req: Any, o: Any, lanes: list[torch.Tensor], p: torch.Tensor | None
                    ) -> tuple[list[int], int]:
        branches, sids, q, context = self._step.pop(o.index)
        best = 0
        if p is None:  # greedy: the branch whose drafts equal the target's argmax the longest
            found = []
            for drafts, logits in zip(branches, lanes):
                target = logits.argmax(dim=-1).tolist()
                a = 0
                while a < len(drafts) and drafts[a] == target[a]:
                    a += 1
                found.append(drafts[:a] + [target[a]])
            best = max(range(len(found)), key=lambda b: (len(found[b]), -b))
            out = found[best]
        else:  # one chain: p [k+1, V], q [k, V]
            out = []
            for j, d in enumerate(branches[0]):
                u = float(torch.rand(1, generator=o.generator))
                if u * float(q[j, d]) < float(p[j, d]):  # kept with probability min(1, p/q)
                    out.append(d)
                    continue
                residual = (p[j] - q[j]).clamp(min=0)
                total = float(residual.sum())
                out.append(int(torch.multinomial(residual / total if total > 0 else p[j], 1, generator=o.generator)))
                break
            else:
                out.append(int(torch.multinomial(p[len(branches[0])], 1, generator=o.generator)))
        k, kept = len(branches[best]), len(out) - 1
        self.proposed += k
        self.accepted += kept
        self.cut += kept < k
        self.tree_wins += best > 0
        kv = self._kv()
        for b, sid in enumerate(sids):
            if b != best:
                kv.free_sequence(sid)
        if best:  # the chosen branch's draft sequence becomes the output's, with its worst case reserved
            o.draft_sid = sids[best]
            kv.reserve(o.draft_sid, draft_tokens(req))
        if k and o.draft_sid is not None:  # the draft saw the context and drafts[:-1]; keep what was accepted
            kv.truncate(o.draft_sid, min(kv.length(o.draft_sid), context + kept), reserve=True)
        return out, best


def draft_tokens(req: Any) -> int:
    """The most tokens an output's draft sequence holds: the prompt and every new token (a continued
    conversation's cached context is not fed to the draft)."""
    return len(req.prompt) + req.sampling.max_new_tokens


def distributions(rows: list[tuple[Any, Any]], logits: torch.Tensor) -> list[torch.Tensor | None]:
    """The sampling distribution of each logits row [V] under its request's settings (None where greedy)."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    groups: dict[Any, list[int]] = {}
    for i, (req, _) in enumerate(rows):
        if req.sampling.temperature > 0:
            groups.setdefault(req.sampling, []).append(i)
    for s, idx in groups.items():
        for i, p in zip(idx, probs(logits[idx], s.temperature, s.top_p, s.top_k)):
            out[i] = p
    return out
