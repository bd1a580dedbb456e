"""OpenAI request bodies in, loop jobs out; finished choices in, OpenAI JSON out. No HTTP, no tensors.

    served = ServedModel.from_runner(runner, name="tiny")
    prompts, sampling, stops = served.completion(CompletionBody(model="tiny", prompt="Hi", max_tokens=8))
    served.chat(ChatBody(model="tiny", messages=[{"role": "user", "content": "Hi"}]))

Defaults follow the checkpoint (generation_config.json: EOS ids, sampling) where the body is
silent, as vLLM does; `max_tokens` defaults to 16 for completions (the OpenAI default) and to
`default_max_tokens` for chat. A request the model cannot take (too long for its context, a
knob out of range, a feature not built) is a `BadRequest` naming the field. As OpenAI does, a
field the API does not know is refused ("Unrecognized request argument supplied"), and so is an
unknown message role; OpenAI fields that change nothing here (`user`, `metadata`, ...) are
accepted, and those that would change the answer but are not built (`tools`, `response_format`
other than text, ...) are refused by name, never ignored.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from offload.errors import ContextLengthError, OffloadError
from offload.model.chat import ChatTemplate, GenerationDefaults
from offload.model.tokenizer import TextTokenizer
from offload.runtime.requests import Context, TokenLogprob
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling, SamplingError, resolve_sampling

MAX_LOGPROBS = 20
MAX_N = 128  # samples per request
#: the message roles OpenAI's chat API takes, in the order its error message lists them
ROLES = ("system", "assistant", "user", "function", "tool", "developer")
#: OpenAI fields that would change the answer but are not built here: refused when set to anything but
#: the value that changes nothing (None, or the value given here)
UNSUPPORTED = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
               "response_format": {"type": "text"}, "modalities": ["text"], "audio": None, "prediction": None,
               "reasoning_effort": None, "web_search_options": None, "suffix": ""}


class BadRequest(OffloadError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as OpenAI: "Unrecognized request argument supplied: x"
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM has it too)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # OpenAI fields that change nothing here: accepted, ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check_supported(self) -> None:
        """BadRequest naming the first OpenAI field set that this server does not build."""
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and value != neutral:
                raise BadRequest(f"{name} is not supported by this server; leave it out", name,
                                 code="unsupported_parameter")


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None  # changes nothing without tools
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None


@dataclass
class Choice:
    """One finished (or finishing) output as the response builders see it."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str = ""


@dataclass(frozen=True)
class ServedModel:
    name: str  # what /v1/models lists and requests must name
    runner: Runner  # encode() only: the loop's thread alone runs it
    tokenizer: TextTokenizer | None
    template: ChatTemplate | None
    defaults: GenerationDefaults
    context: int  # max_position_embeddings
    default_max_tokens: int = 256  # chat replies without max_tokens
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_runner(cls, runner: Runner, name: str | None = None, default_max_tokens: int = 256) -> ServedModel:
        model_dir = runner.config.model
        return cls(name or model_dir.name, runner, runner.tokenizer, ChatTemplate.from_checkpoint(model_dir),
                   runner.generation, runner.cfg.max_position_embeddings, default_max_tokens)

    # -- requests -----------------------------------------------------------------------------
    def check_model(self, body: _Body) -> None:
        body.check_supported()
        if body.model != self.name:
            raise BadRequest(f"the model `{body.model}` does not exist; this server serves `{self.name}` "
                             "(GET /v1/models)", "model", 404, "model_not_found")

    def completion(self, body: CompletionBody) -> tuple[list[list[int]], Sampling, tuple[str, ...]]:
        self.check_model(body)
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]  # type: ignore[list-item]
        if not p:
            raise BadRequest("prompt is empty; give a string, a list of strings or a list of token ids", "prompt")
        if body.echo:
            raise BadRequest("echo is not supported; send it as false", "echo")
        if body.best_of not in (None, body.n):
            raise BadRequest("best_of is not supported; use n", "best_of")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
        prompts = [self._encode(x, "prompt") for x in p]
        return prompts, self._sampling(body, max(map(len, prompts)), 16, body.logprobs, "prompt"), _stops(body.stop)

    def chat(self, body: ChatBody) -> tuple[list[int], Sampling, tuple[str, ...]]:
        self.check_model(body)
        if self.template is None:
            raise BadRequest(f"{self.runner.config.model} has no chat template (tokenizer_config.json "
                             "chat_template); use /v1/completions with a prompt", "messages")
        if not body.messages:
            raise BadRequest("messages is empty; give at least one message", "messages")
        messages = [_flatten(_check_role(m, i), i) for i, m in enumerate(body.messages)]
        try:
            text = self.template.render(messages, add_generation_prompt=True)
        except OffloadError as e:
            raise BadRequest(str(e), "messages") from None
        ids = self._encode(text, "messages", special=False)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        return ids, self._sampling(body, len(ids), self.default_max_tokens, logprobs, "messages", fit=True), \
            _stops(body.stop)

    def _encode(self, prompt: str | list[int], param: str, special: bool = True) -> list[int]:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise BadRequest(f"{self.runner.config.model} has no tokenizer.json: send prompts as token ids", param)
        try:
            ids = self.tokenizer.encode(prompt, add_special_tokens=special) if isinstance(prompt, str) else prompt
            return self.runner.encode(ids)  # checks: not empty, every id inside the vocabulary
        except OffloadError as e:
            raise BadRequest(str(e), param) from None

    def _sampling(self, body: _Body, prompt_len: int, default_max: int, logprobs: int | None,
                  prompt_param: str, fit: bool = False) -> Sampling:
        """The body's knobs over the checkpoint's defaults (`resolve_sampling`, as Python and the CLI do); `fit`:
        a reply whose length the body leaves out stops where the context ends."""
        checks = [(1 <= body.n <= MAX_N, "n", f"n must be between 1 and {MAX_N}"),
                  (not body.presence_penalty and not body.frequency_penalty and not body.logit_bias,
                   "presence_penalty", "presence_penalty, frequency_penalty and logit_bias are not supported")]
        for ok, param, message in checks:
            if not ok:
                raise BadRequest(message, param)
        try:
            sampling = resolve_sampling(self.defaults, max_new_tokens=body.max_tokens, temperature=body.temperature,
                                        top_p=body.top_p, top_k=body.top_k, seed=body.seed, n=body.n,
                                        logprobs=logprobs, fallback_max_new_tokens=default_max)
        except SamplingError as e:  # named as the body names it
            param = {"max_new_tokens": "max_tokens"}.get(e.field, e.field)
            raise BadRequest(str(e).replace("max_new_tokens", "max_tokens"), param) from None
        if fit and body.max_tokens is None:
            sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens,
                                                                        max(self.context - prompt_len, 1)))
        try:
            Context(self.context).check(prompt_len, sampling.max_new_tokens, "this request", knob="max_tokens")
        except ContextLengthError as e:  # the same check as every other entry point; param: what to change
            raise BadRequest(str(e), prompt_param if e.prompt_too_long else "max_tokens",
                             code="context_length_exceeded") from None
        return sampling

    # -- responses ----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)

    def completion_logprobs(self, lps: list[TokenLogprob], ids: list[int]) -> dict[str, Any]:
        tokens = [self.token_text(t) for t in ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}

    def chat_logprobs(self, lps: list[TokenLogprob], ids: list[int]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            s = self.token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}
        return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(a, v) for a, v in lp.top]}
                            for t, lp in zip(ids, lps)]}

    def completion_response(self, rid: str, choices: list[Choice], prompt_tokens: int, logprobs: bool,
                            created: int | None = None, cached_tokens: int = 0) -> dict[str, Any]:
        """`created`: when the request arrived (OpenAI's meaning), else now."""
        created = int(time.time()) if created is None else created
        return {"id": rid, "object": "text_completion", "created": created, "model": self.name,
                "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish,
                             "logprobs": self.completion_logprobs(c.logprobs, c.token_ids) if logprobs else None}
                            for c in choices],
                "usage": usage(prompt_tokens, choices, cached_tokens)}

    def chat_response(self, rid: str, choices: list[Choice], prompt_tokens: int, logprobs: bool,
                      created: int | None = None, cached_tokens: int = 0) -> dict[str, Any]:
        created = int(time.time()) if created is None else created
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish,
                             "logprobs": self.chat_logprobs(c.logprobs, c.token_ids) if logprobs else None}
                            for c in choices],
                "usage": usage(prompt_tokens, choices, cached_tokens)}


def usage(prompt_tokens: int, choices: list[Choice], cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the prefix cache supplied (not computed)."""
    done = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop must be a string or a list of up to 4 strings", "stop")
    return stops


def _check_role(message: Mapping[str, Any], i: int) -> Mapping[str, Any]:
    """OpenAI's answers to a message without a role, or with one it does not know."""
    param = f"messages.[{i}].role"
    if "role" not in message:
        raise BadRequest(f"Missing required parameter: '{param}'.", param, code="missing_required_parameter")
    if message["role"] not in ROLES:
        listed = ", ".join(f"'{r}'" for r in ROLES[:-1]) + f", and '{ROLES[-1]}'"
        raise BadRequest(f"Invalid value: {str(message['role'])[:64]!r}. Supported values are: {listed}.", param,
                         code="invalid_value")
    return message


def _flatten(message: Mapping[str, Any], i: int) -> dict[str, Any]:
    """A message whose content is a list of parts becomes one string (text parts only)."""
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
            raise BadRequest(f"message {i}: only text content parts are supported", "messages")
        content = "".join(str(p.get("text", "")) for p in content)
    return {**message, "content": "" if content is None else content}
