"""The shape of a model Offload has no math for, read from its checkpoint's tensor names and config.json.

For `model_impl: transformers` (or `auto` on a family `offload.model.config` does not know) transformers runs
the model and Offload only moves its weights, so Offload needs no more than: which tensors make up each
decoder block (`{prefix}layers.{i}.*`, GPT-style `h.{i}.*`, `blocks.{i}.*`), the token embeddings, and what is
left (the final norm and the LM head, run after the last block). Tensor names are kept whole: a block's
group holds e.g. `model.layers.3.self_attn.q_proj.weight`, the name of the parameter transformers' module
tree gives it, so the weights bind to the module without a mapping. The sizes a planner estimates with
(heads, widths) are read from config.json where present, else from the tensors; the KV cache of this path is
transformers' own, so they only size activation workspaces. This module knows names and shapes; it
knows nothing of transformers, tiers or files.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from offload.errors import CheckpointError
from offload.model.config import SUPPORTED, ModelConfig

#: A decoder block's tensor: (prefix)(layers|h|blocks).(i).(rest)
_BLOCK = re.compile(r"^(?P<pre>(?:.*\.)?(?:layers|h|blocks))\.(?P<i>\d+)\.(?P<rest>.+)$")
#: Token-embedding tensors, by the names transformers' families give them.
_EMBED = re.compile(r"^(?:.*\.)?(?:embed_tokens|word_embeddings|wte|embed_in)\.weight$")
#: The LM head's name in a causal LM (transformers' `get_output_embeddings()` of nearly every family).
LM_HEAD = "lm_head.weight"

Tensor = tuple[str, tuple[int, ...]]  # (full checkpoint name, shape)


@dataclass(frozen=True)
class GenericTensors:
    """Which checkpoint tensors make up each group of a model run by transformers (full names)."""

    embed: Tensor  # the token embeddings
    layers: tuple[tuple[Tensor, ...], ...]  # per decoder block, in the checkpoint's (sorted) order
    head: tuple[Tensor, ...]  # everything else but the LM head: the final norm(s)
    lm_head: Tensor | None  # None: tied to the embeddings (the head group reads them)

    @property
    def tied(self) -> bool:
        return self.lm_head is None

    @functools.cached_property
    def matrices(self) -> dict[str, int]:
        """The blocks' matrices (2-D `.weight` tensors) an int8/int4 format packs: name -> input dimension."""
        return {n: s[1] for layer in self.layers for n, s in layer if len(s) == 2 and n.endswith(".weight")}


def block_module(name: str) -> str:
    """The decoder block a block tensor belongs to: `model.layers.3.mlp.up_proj.weight` -> `model.layers.3`."""
    m = _BLOCK.match(name)
    assert m is not None, name
    return f"{m['pre']}.{m['i']}"


def resolve_impl(impl: str, raw: Mapping[str, Any]) -> str:
    """`native` or `transformers` for a config's `model_impl` (auto: native when Offload knows the family)."""
    if impl != "auto":
        return impl
    archs = raw.get("architectures") or []
    known = raw.get("model_type") in SUPPORTED or any(a in SUPPORTED.values() for a in archs)
    return "native" if known else "transformers"


def generic_tensors(entries: Mapping[str, tuple[int, ...]], where: str) -> GenericTensors:
    """Group a checkpoint's tensors (name -> shape) into embeddings, decoder blocks and the rest."""
    blocks: dict[int, list[Tensor]] = {}
    prefixes: set[str] = set()
    embed: list[Tensor] = []
    rest: list[Tensor] = []
    for name in sorted(entries):
        shape = tuple(entries[name])
        m = _BLOCK.match(name)
        if m:
            blocks.setdefault(int(m["i"]), []).append((name, shape))
            prefixes.add(m["pre"])
        elif _EMBED.match(name) and len(shape) == 2:
            embed.append((name, shape))
        elif name != LM_HEAD:
            rest.append((name, shape))
    if len(embed) != 1 or not blocks or len(prefixes) != 1:
        found = [n for n, _ in embed] or "none"
        raise CheckpointError(f"{where}: cannot tell the token embeddings ({found}) and decoder blocks "
                              f"(layers.N.*: {len(blocks)} found under {len(prefixes)} prefixes) apart in the "
                              "checkpoint's tensor names; Offload streams causal LMs named as transformers saves them")
    if sorted(blocks) != list(range(len(blocks))):
        raise CheckpointError(f"{where}: decoder blocks {sorted(blocks)[:8]} are not numbered 0..{len(blocks) - 1}; "
                              "the checkpoint is incomplete")
    head = (LM_HEAD, tuple(entries[LM_HEAD])) if LM_HEAD in entries else None
    return GenericTensors(embed[0], tuple(tuple(blocks[i]) for i in range(len(blocks))), tuple(rest), head)


def generic_config(raw: dict[str, Any], tensors: GenericTensors | None, where: str) -> ModelConfig:
    """A ModelConfig for a model transformers runs: the sizes from the tensors, the rest from config.json.
    Without `tensors` (config.json alone: checks before the weights load) the sizes are config.json's, and
    the config cannot plan (it names no groups)."""
    if tensors is not None:
        (vocab, hidden), layers, tied = tensors.embed[1], len(tensors.layers), tensors.tied
    else:
        vocab, hidden = _int(raw, ("vocab_size",), 1), _int(raw, ("hidden_size", "n_embd", "d_model"), 1)
        layers, tied = _int(raw, ("num_hidden_layers", "n_layer", "num_layers"), 1), False
    heads = _int(raw, ("num_attention_heads", "n_head", "num_heads"), max(hidden // 128, 1))
    kv_heads = _int(raw, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), heads)
    if heads % kv_heads:
        kv_heads = heads
    head_dim = _int(raw, ("head_dim",), hidden // heads if hidden % heads == 0 else 128)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(t for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int))
    bos = raw.get("bos_token_id")
    return ModelConfig(
        family=str(raw.get("model_type") or "unknown"),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_int(raw, ("intermediate_size", "ffn_hidden_size", "n_inner"), 4 * hidden),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,  # Offload's RoPE is not used on this path: transformers applies its own
        rope_scaling=None,
        max_position_embeddings=_int(raw, ("max_position_embeddings", "n_positions", "seq_length"), 2048),
        tie_word_embeddings=tied,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        sliding_windows=(None,) * layers,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=eos_ids,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        raw=dict(raw),
        impl="transformers",
        tensors=tensors,
    )


def _int(raw: Mapping[str, Any], keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        v = raw.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**31:
            return v
    return default
