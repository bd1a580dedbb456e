"""The runner: the Python API. It assembles the executors a config describes and runs prompts on them.

    with Runner(model="org/name", device="cuda", tiers={"gpu": "20GiB", "cpu": "60GiB"}) as runner:
        [result] = runner.generate(["Once upon a time"], max_new_tokens=32)
        print(result.text, result.stats.decode_ms_per_step)
        for ev in runner.stream(["Hello"]):                     # token by token
            print(ev.text, end="")
        reply = runner.chat(system="Be brief.").say("Where is the kettle?")

`Runner(...)` takes the YAML's keys as keywords, a YAML path, a dict or an `OffloadConfig`. A run
is `target`, an `Executor` (`offload.runtime.executor`: one model's forward pass over its weight
source and KV pool), and with speculative decoding a second one, `draft`, with the `speculator`
that drives it; requests run on `offload.runtime.engine.Engine`. The runner holds the tokenizer
and the checkpoint's generation defaults, and no forward pass of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from offload.config import OffloadConfig, SpeculativeConfig
from offload.errors import ConfigError
from offload.kv.cache import PagedKVCache
from offload.model.chat import GenerationDefaults
from offload.model.checkpoint import Checkpoint
from offload.model.tokenizer import TextTokenizer
from offload.plan.calibrate import load_calibration
from offload.plan.passes import pool_blocks
from offload.plan.planner import run_capacities
from offload.plan.speculative import reserve_draft, streaming_note, verify_cost, without_draft
from offload.runtime.conversation import Conversation
from offload.runtime.engine import Engine
from offload.runtime.executor import DTYPES, Executor, WeightSource, resolve_device, resolve_dtype
from offload.runtime.pipeline import make_target
from offload.runtime.requests import Context, Output, Request, blocks_needed
from offload.runtime.results import Completion, GenerationResult, RunStats, TokenCallback, TokenEvent
from offload.runtime.sampling import Sampling, resolve_sampling
from offload.runtime.speculative import Speculator, auto_gain, check_draft, draft_config
from offload.runtime.verify import row_blocks, tree_blocks
from schedulers.plan import Capacities
from schedulers.timeline import Timeline

__all__ = ["Runner", "GenerationResult", "DTYPES", "WeightSource", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)

Prompts = str | Sequence[int] | Sequence[str | Sequence[int]]


def _target(name: str) -> property:
    return property(lambda self: getattr(self.target, name), doc=f"The target executor's `{name}`.")


def _close(executors: list[Executor]) -> None:
    for ex in executors:
        ex.close()


def load_config(source: OffloadConfig | str | Path | Mapping[str, Any] | None, keys: Mapping[str, Any]
                ) -> OffloadConfig:
    """A run's config from an `OffloadConfig`, a YAML path, a dict, or the YAML's keys as keywords (never both)."""
    if source is not None and keys:
        raise ConfigError(f"give a config (a YAML path, a dict or an OffloadConfig) or its keys as keywords "
                          f"({', '.join(sorted(keys))}), not both")
    if isinstance(source, OffloadConfig):
        return source
    if source is None:
        if not keys:
            raise ConfigError("Runner needs a model: Runner(model=DIR_OR_HUB_ID, ...), a YAML path or a dict")
        return OffloadConfig.load(dict(keys))
    return OffloadConfig.load(source)


class Runner:
    """Everything it starts is released by `close()` (or `with`), else when it is garbage-collected, else at
    interpreter exit, so a script that never calls `close()` still exits cleanly.

    `timeline`: a `Timeline` records the run's spans (the runner makes one otherwise); a mapping is the
    YAML's `timeline:` section (keep_steps). `concurrency`: the sequences you mean to decode together (a server's
    batch); an automatic KV pool (`kv_cache.gpu_blocks: auto` with tiers) keeps that many running on the device,
    trading prefill chunk for KV blocks (`offload.plan.planner.Planner`); `batch` says what it holds. `context`: the
    most tokens a sequence will hold (prompt and new tokens), where you know it: an automatic pool holds that many,
    not 2048, and what it leaves homes weights (`offload run` passes its prompts')."""

    def __init__(self, config: OffloadConfig | str | Path | Mapping[str, Any] | None = None, *,
                 timeline: Timeline | Mapping[str, Any] | None = None, concurrency: int = 1, context: int | None = None,
                 **keys: Any) -> None:
        if timeline is not None and not isinstance(timeline, Timeline):
            keys["timeline"], timeline = timeline, None
        config = load_config(config, keys).fetched()  # a Hub checkpoint comes now (resumed if interrupted)
        self.tokenizer = TextTokenizer.from_checkpoint(config.model)
        self.last_stats: RunStats | None = None
        self.draft: Executor | None = None  # speculative decoding: the draft, every weight resident
        self.speculator: Speculator | None = None
        executors: list[Executor] = []
        self._finalizer = weakref.finalize(self, _close, executors)
        caps = run_capacities(config, resolve_device(config.device))
        #: why `speculative.tokens: auto` runs plain decoding (the plan predicts the draft would not pay), or None
        self.speculation_note: str | None = None
        if config.speculative.enabled and config.speculative.tokens is None:
            config = self._auto_speculation(config, caps)
        try:
            if config.speculative.enabled:  # the draft is placed first; the target plans around it
                self.draft = Executor(draft_config(config), Timeline(enabled=False))
                executors.append(self.draft)
                check_draft(config.model, Checkpoint(config.model).config, self.tokenizer, self.draft)
                caps = reserve_draft(config, caps, self.draft.plan.used("gpu"), self.draft.kv_block_bytes)
            # model_impl's executor; under torchrun rank 0's stage
            self.target = make_target(config, timeline, caps, concurrency, context)
            executors.append(self.target)
        except BaseException:
            self.close()
            raise
        self.config = self.target.config
        # generation_config.json: every EOS id (with config.json's) and the default sampling
        self.generation = GenerationDefaults.from_checkpoint(config.model, self.cfg.eos_token_ids)
        if self.draft is not None:
            self._start_speculating(self.draft)

    def _auto_speculation(self, config: OffloadConfig, caps: Capacities) -> OffloadConfig:
        """`tokens: auto`: the config as given when the plan predicts its draft pays, else without a draft."""
        cfg = Checkpoint(config.model).config
        gain = auto_gain(config, cfg, resolve_dtype(config.dtype, cfg.torch_dtype),
                         resolve_device(config.device), caps)
        self.speculation_note = gain.plain_note()
        if self.speculation_note is None:
            return config
        log.warning("%s", self.speculation_note)
        return config.replace(speculative=SpeculativeConfig())

    def _start_speculating(self, draft: Executor) -> None:
        if self.plan.streamed:  # what the draft's memory costs the target
            note = streaming_note(self.plan, without_draft(self.config, self.cfg, self.dtype, self.device).plan)
            if note:
                log.warning("%s", note)
        if self.target.kv is not None:  # one draft block for every target block: what is admitted fits both
            draft.fix_kv(self.target.kv.logical.num_blocks)
        cost = verify_cost(self.plan, self.cfg, load_calibration(self.config.calibration), self.device.type,
                           self.dtype.itemsize)
        self.speculator = Speculator(draft, self.config.speculative.tokens, self.timeline, cost)

    @classmethod
    def from_config(cls, source: str | Path | Mapping[str, Any] | OffloadConfig) -> Runner:
        return cls(source)

    def close(self) -> None:
        """Stop and join every thread, close files and release memory (the draft's too); safe to call twice."""
        self._finalizer()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the target's plan, shape and pools, as the runner's own (what scripts and the CLI read)
    cfg = _target("cfg")
    checkpoint = _target("checkpoint")
    device = _target("device")
    dtype = _target("dtype")  # the weights move as this
    compute_dtype = _target("compute_dtype")  # the math and the KV cache
    plan = _target("plan")
    weights = _target("weights")
    kv_settings = _target("kv_settings")
    kv_block_bytes = _target("kv_block_bytes")
    prefill_chunk = _target("prefill_chunk")
    batch = _target("batch")  # sequences the planned device KV pool keeps decoding together (None: per request)
    rope = _target("rope")
    traffic = _target("traffic")
    timeline = _target("timeline")

    @property
    def kv(self) -> PagedKVCache | None:
        return self.target.kv

    # -- KV pools -------------------------------------------------------------------------------
    def ensure_kv(self, blocks: int) -> PagedKVCache:
        """The target's KV pool with room for `blocks` (unless fixed), and the draft's beside it."""
        kv = self.target.ensure_kv(blocks)
        if self.draft is not None:
            self.draft.ensure_kv(blocks)
        return kv

    @property
    def row_blocks(self) -> int:
        """Device blocks a running output may hold in a pass: its newest, and a speculative chain's."""
        return row_blocks(self.speculator.most_tokens + 1 if self.speculator is not None else 0,
                          self.kv_settings.block_size)

    def pool_blocks(self, blocks: int, outputs: list[int]) -> int:
        """A KV pool for requests reserving `blocks` (`outputs[i]` outputs each) that the engine runs all together:
        with room for its admission rule beside their blocks (`offload.plan.passes.pool_blocks`)."""
        return pool_blocks(blocks, outputs, self.target.prefill_chunk, self.kv_settings.block_size, self.row_blocks)

    def fix_kv_pool(self, gpu_blocks: int) -> PagedKVCache:
        """Keep one device KV pool for a long-lived engine (a server): a fixed pool stays as planned,
        a per-request one is made with `gpu_blocks` blocks now and no longer resized."""
        kv = self.target.fix_kv(gpu_blocks)
        if self.draft is not None:
            self.draft.fix_kv(kv.logical.num_blocks)
        return kv

    # -- prompts and sampling -------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(
                    f"{self.config.model} has no tokenizer.json, so prompts must be lists of token ids"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("a prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the model's vocabulary (0..{self.cfg.vocab_size - 1})")
        return ids

    def sampling(self, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int | None = None, n: int = 1,
                 stop: Sequence[str] | str = (), stop_on_eos: bool = True, logprobs: int | None = None,
                 fallback_max_new_tokens: int = 32) -> Sampling:
        """A `Sampling` whose unset knobs are the checkpoint's generation_config.json defaults (as the CLI and the
        server apply them), stopping at every EOS id unless `stop_on_eos=False`."""
        return resolve_sampling(self.generation, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, n=n, stop=stop, stop_on_eos=stop_on_eos,
                                logprobs=logprobs, fallback_max_new_tokens=fallback_max_new_tokens)

    @torch.inference_mode()
    def prefill_logits(self, token_ids: Sequence[Sequence[int]] | Sequence[int]) -> torch.Tensor:
        """Logits for every prompt position: [batch, max_len, vocab] float32; past a prompt's end, zeros."""
        return self.target.prefill_logits([self.encode(p) for p in _prompt_list(token_ids)])

    def output_text(self, o: Output) -> str:
        """An output's text: decoded, and cut before the stop string when one ended it."""
        if o.stops is not None:
            return o.stops.text
        return self.tokenizer.decode(o.token_ids) if self.tokenizer else ""

    # -- generation -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Prompts, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                 stop_on_eos: bool = True, on_token: TokenCallback | None = None, num_samples: int = 1,
                 stop: Sequence[str] = (), sampling: Sampling | None = None) -> list[GenerationResult]:
        """Generate for each prompt (a string or a token-id list); one result per prompt, its samples in `outputs`.

        Knobs left None take the checkpoint's generation_config.json defaults (`sampling()`); or pass one
        `sampling=Sampling(...)`, used as it is. Prompts are admitted while their worst-case KV (prompt +
        max_new_tokens, for every sample) fits the KV cache; the rest wait and join the running batch at a
        pass boundary; each prompt's tokens are the same as if it ran alone. With `num_samples=n` a prompt is
        prefilled once and its n samples share its KV blocks copy-on-write; sample s of prompt i draws from
        its own generator, seeded `seed + i * n + s`. An output ends at any EOS id (`stop_on_eos`) or when its
        text contains a `stop` string (its text then ends before it). `on_token(i * n + s, token id, text
        delta)` is called for every token.
        """
        s = self._sampling(sampling, max_new_tokens, temperature, top_p, top_k, seed, stop_on_eos, num_samples, stop)
        requests, stats = self._requests(prompts, s)
        run = self._run(requests, stats, deque() if on_token is not None else None)
        try:
            for ev in run:
                if on_token is not None:
                    on_token(ev.prompt * s.n + ev.sample, ev.token_id, ev.text)
        finally:
            run.close()  # a callback that raised: the engine's blocks come back now
        return [GenerationResult(r.prompt, [Completion(k, o.token_ids, self.output_text(o), o.finish_reason)
                                            for k, o in enumerate(r.outputs)], stats) for r in requests]

    @torch.inference_mode()
    def stream(self, prompts: Prompts, max_new_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
               stop_on_eos: bool = True, num_samples: int = 1, stop: Sequence[str] = (),
               sampling: Sampling | None = None) -> Iterator[TokenEvent]:
        """`generate`, token by token: a `TokenEvent` (prompt, sample, token id, text delta, finish reason) for
        every token, in the order the engine makes them. Leaving the loop early frees every KV block."""
        s = self._sampling(sampling, max_new_tokens, temperature, top_p, top_k, seed, stop_on_eos, num_samples, stop)
        requests, stats = self._requests(prompts, s)
        yield from self._run(requests, stats, deque())

    def chat(self, system: str | None = None, context: int | None = None, sampling: Sampling | None = None,
             **knobs: Any) -> Conversation:
        """A multi-turn `Conversation` (its KV kept between turns). Its replies stop at every EOS id; `knobs`
        (max_new_tokens, temperature, ...) override generation_config.json's defaults, as `sampling()` does."""
        if sampling is not None and knobs:
            raise ConfigError("give sampling=Sampling(...) or sampling knobs, not both")
        sampling = sampling or self.sampling(**({"fallback_max_new_tokens": 512} | knobs))
        return Conversation(self, sampling, system=system, context=context)

    def _sampling(self, sampling: Sampling | None, max_new_tokens: int | None, temperature: float | None,
                  top_p: float | None, top_k: int | None, seed: int | None, stop_on_eos: bool, n: int,
                  stop: Sequence[str]) -> Sampling:
        if sampling is None:
            return self.sampling(max_new_tokens, temperature, top_p, top_k, seed, n, stop, stop_on_eos)
        if (max_new_tokens, temperature, top_p, top_k, seed) != (None,) * 5 or n != 1 or stop or not stop_on_eos:
            raise ConfigError("give sampling=Sampling(...) or sampling knobs, not both")
        return sampling

    def _requests(self, prompts: Prompts, s: Sampling) -> tuple[list[Request], RunStats]:
        encoded = [self.encode(p) for p in _prompt_list(prompts)]
        requests = [Request(p, s if s.seed is None else dataclasses.replace(s, seed=s.seed + i * s.n),
                            name=f"prompt {i}") for i, p in enumerate(encoded)]
        for r in requests:  # before the KV pool is sized for them and before any pass
            Context(self.cfg.max_position_embeddings).check(len(r.prompt), s.max_new_tokens, r.name)
        return requests, RunStats(prompt_tokens=sum(map(len, encoded)))

    def _run(self, requests: list[Request], stats: RunStats, events: deque[TokenEvent] | None
             ) -> Iterator[TokenEvent]:
        """Run the requests on an engine to the end, yielding their tokens (when `events` collects them)."""
        if not requests:
            self.last_stats = stats
            return
        bs = self.kv_settings.block_size
        need = sum(blocks_needed(len(r.prompt), r.sampling, bs) for r in requests)
        if self.speculator is not None and self.config.speculative.tree:  # room for every output's branches
            need += tree_blocks(sum(r.sampling.n for r in requests), self.row_blocks)
        self.ensure_kv(self.pool_blocks(need, [r.sampling.n for r in requests]))  # unless fixed
        engine = Engine(self, stats)
        if events is not None:
            for i, req in enumerate(requests):
                req.on_token = _collector(events, i, req)
        try:
            for req in requests:  # one that could never fit is refused before any runs
                engine.submit(req)
            while engine.busy:
                engine.step()
                while events:
                    yield events.popleft()
        except BaseException:  # Ctrl-C, a full disk, a refusal, a stream left early: every block comes back
            engine.abort_all()
            raise
        stats.generated_tokens = sum(len(o.token_ids) for r in requests for o in r.outputs)
        stats.experts = self.target.weights.expert_stats()
        self.last_stats = stats


def _prompt_list(prompts: Prompts) -> list[str | Sequence[int]]:
    """One prompt (a string, or a list of token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _collector(events: deque[TokenEvent], prompt: int, req: Request) -> Callable[[int, int, str], None]:
    def on_token(index: int, token: int, text: str) -> None:
        sample = index - req.outputs[0].index
        events.append(TokenEvent(prompt, sample, token, text, req.outputs[sample].finish_reason or None))
    return on_token
