"""A multi-turn conversation on the engine: the chat template renders it, the KV cache keeps it.

    conv = runner.chat(system="Be brief.")                      # or Conversation(runner, sampling, system=...)
    reply = conv.say("Where is the kettle?", on_text=print)   # reply.text, reply.token_ids, reply.finish_reason
    reply.cached, reply.prefilled                              # prompt tokens reused from the cache / computed

Every turn renders the whole conversation with the checkpoint's template (as transformers'
`apply_chat_template` does) and hands the ids to `Engine.continue_`, which prefills only the
tokens after the prefix the kept sequence already holds. So the prompt is exactly what the
model would see from scratch, and a turn costs its new tokens, not the history. This module
knows messages and ids; the template is `offload.model.chat`, the tensors the executor's. Replies stop
at every EOS id of generation_config.json / config.json unless the `Sampling` given says otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from offload.errors import ConfigError
from offload.model.chat import ChatTemplate
from offload.runtime.engine import Engine, Kept, Request, Sampling
from offload.runtime.requests import Context
from offload.runtime.results import RunStats

DEFAULT_CONTEXT = 4096  # tokens a conversation may reach when the KV pool is sized here (no tiers)


@dataclass(frozen=True)
class Reply:
    text: str  # the assistant's message (a stop string that ended it excluded)
    token_ids: list[int]  # generated tokens (an EOS that ended it included)
    finish_reason: str  # "eos" | "stop" | "length" | "abort"
    cached: int  # prompt tokens whose KV was kept from earlier turns
    prefilled: int  # prompt tokens computed this turn
    seconds: float
    stats: RunStats


class Conversation:
    """`sampling`: None takes the checkpoint's defaults (`runner.sampling`, up to 512 new tokens a reply); a
    `Sampling` is used as it is (its `stop_token_ids=None`, the default, stops at the model's EOS ids)."""

    def __init__(self, runner, sampling: Sampling | None = None, system: str | None = None,
                 context: int | None = None) -> None:
        model = runner.config.model
        self.template = ChatTemplate.from_checkpoint(model)
        if self.template is None:
            raise ConfigError(f"{model} has no chat template (tokenizer_config.json: chat_template); use "
                              "`offload run` for plain completion, or add the template of the model's family")
        if runner.tokenizer is None:
            raise ConfigError(f"{model} has no tokenizer.json; a chat needs the model's tokenizer")
        sampling = sampling or runner.sampling(fallback_max_new_tokens=512)
        if sampling.n != 1:
            raise ConfigError("a conversation has one reply per turn; use n=1")
        self.runner, self.sampling, self.system = runner, sampling, system
        limit = runner.cfg.max_position_embeddings
        tokens = min(context or min(limit, DEFAULT_CONTEXT), limit)
        runner.ensure_kv(runner.target.blocks_for(tokens))  # a fixed pool (tiers) is used as it is
        self.engine = Engine(runner)
        if context is not None and context < limit:  # every turn (history, message, reply) must fit it
            self.engine.context = Context(context, "the conversation's context (chat --context)")
        self.messages: list[dict[str, str]] = []
        self.kept: Kept | None = None
        self.reset()

    def reset(self) -> None:
        """Start over: the system message only, and the kept KV freed."""
        if self.kept is not None:
            self.engine.drop(self.kept)
            self.kept = None
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def close(self) -> None:
        self.reset()

    def prompt_ids(self, messages: list[dict[str, str]] | None = None) -> list[int]:
        """The conversation (with the assistant's turn opened) as token ids, as `apply_chat_template` gives them."""
        text = self.template.render(self.messages if messages is None else messages, add_generation_prompt=True)
        return self.runner.tokenizer.encode(text, add_special_tokens=False)

    def say(self, text: str, on_text: Callable[[str], None] | None = None,
            sampling: Sampling | None = None) -> Reply:
        """Add a user message, generate the reply (streamed to `on_text`), and add it to the conversation."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.prompt_ids(messages)
        s = sampling or self.sampling
        callback = None if on_text is None else (lambda i, tok, delta: delta and on_text(delta))
        t0 = time.perf_counter()
        self.engine.stats = stats = RunStats(prompt_tokens=len(ids))
        if self.kept is None:
            req = self.engine.submit(Request(ids, s, "the conversation", callback, keep=True))
        else:
            req = self.engine.continue_(self.kept, ids, s, "the conversation", callback)
        self.kept = None
        try:
            while self.engine.busy:
                self.engine.step()
        except BaseException:  # an interrupted pass may have left the cache half written: start it afresh
            self.engine.abort(req)
            if req.kept is not None:
                self.engine.drop(req.kept)
            raise
        self.kept = req.kept
        out = req.outputs[0]
        stats.generated_tokens = len(out.token_ids)
        cached = req.cached or 0
        reply = Reply(self.runner.output_text(out), list(out.token_ids), out.finish_reason, len(req.context) + cached,
                      len(req.prompt) - cached, time.perf_counter() - t0, stats)
        self.messages = messages + [{"role": "assistant", "content": reply.text}]
        return reply
