"""Chat like the ecosystem does it: the checkpoint's chat template and its generation defaults.

    template = ChatTemplate.from_checkpoint(dir)        # tokenizer_config.json: chat_template + special tokens
    text = template.render(messages, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)   # as transformers' apply_chat_template(tokenize=True)
    gen = GenerationDefaults.from_checkpoint(dir)      # generation_config.json: every EOS id, default sampling

Templates are untrusted code from the Hub: they are rendered in jinja2's immutable sandbox with
the same environment transformers gives them (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML), so the rendered prompt
is the one the model was trained on. This module reads two JSON files; it knows no weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from offload.errors import CheckpointError, ConfigError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _environment() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the Jinja text
    special: dict[str, str]  # bos_token, eos_token, ... as the template sees them
    where: str = "tokenizer_config.json"

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of tokenizer_config.json (or a chat_template.jinja beside it); None without one."""
        directory = Path(directory)
        cfg = _read_json(directory / "tokenizer_config.json") or {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if not isinstance(template, str) or not template.strip():
            return None
        special = {k: t for k in SPECIAL_KEYS if (t := _token_text(cfg.get(k))) is not None}
        return cls(template, special, str(directory / "tokenizer_config.json"))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The conversation as the model's prompt text (special tokens included, as the template writes them)."""
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ConfigError(f"message {i} must be an object with a 'role' (and 'content'), got {m!r}")
        try:
            compiled = _environment().from_string(self.source)
            return compiled.render(messages=[dict(m) for m in messages], tools=tools,
                                   add_generation_prompt=add_generation_prompt, **self.special, **extra)
        except jinja2.TemplateError as e:
            raise ConfigError(f"{self.where}: the chat template refused the conversation: {e}") from None


@dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json (and config.json) say a reply ends with and how to sample by default."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0  # 0: greedy (also when do_sample is false)
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None

    @classmethod
    def from_checkpoint(cls, directory: str | Path, config_eos: Sequence[int] = ()) -> GenerationDefaults:
        path = Path(directory) / "generation_config.json"
        data = _read_json(path) or {}
        eos = data.get("eos_token_id", list(config_eos))
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        eos_ids = tuple(dict.fromkeys(eos_ids + tuple(config_eos)))  # every EOS either file names, once
        sample = bool(data.get("do_sample", False))
        try:
            return cls(eos_ids, float(data.get("temperature", 1.0)) if sample else 0.0,
                       float(data.get("top_p", 1.0)) if sample else 1.0,
                       int(data.get("top_k", 0) or 0) if sample else 0,
                       int(data["max_new_tokens"]) if data.get("max_new_tokens") else None)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: a sampling default is not a number ({e}); fix or remove it") from None
