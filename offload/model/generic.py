"""The shape of a model Offload has no math for, read from its checkpoint's tensor names and config.json.

For `model_impl: transformers` (or `auto` on a family `offload.model.config` does not know) transformers runs
the model and Offload only moves its weights, so Offload needs no more than: which tensors make up each
decoder block (`{prefix}layers.{i}.*`, GPT-style `h.{i}.*`, `blocks.{i}.*`), the token embeddings, and what is
left (the final norm and the LM head, run after the last block). Tensors go by the name of the parameter
transformers' module tree gives them, e.g. `model.layers.3.self_attn.q_proj.weight`, so the weights bind to the
modules as they are: the checkpoint's own name, or the one transformers 5 renames or stacks it into as it loads
(`loaded_names`, which asks transformers' conversion mapping where transformers is installed). The sizes a planner
estimates with (heads, widths) are read from config.json where present, else from the tensors; the KV cache of
this path is transformers' own, so they only size activation workspaces. This module knows names and shapes;
it knows nothing of tiers or files.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from offload.errors import CheckpointError
from offload.model.config import SUPPORTED, ModelConfig, quant_method

#: A decoder block's tensor: (prefix)(layers|h|blocks).(i).(rest)
_BLOCK = re.compile(r"^(?P<pre>(?:.*\.)?(?:layers|h|blocks))\.(?P<i>\d+)\.(?P<rest>.+)$")
#: Token-embedding tensors, by the names transformers' families give them.
_EMBED = re.compile(r"^(?:.*\.)?(?:embed_tokens|word_embeddings|wte|embed_in)\.weight$")
#: ... and where none of those is there, Mamba's (`backbone.embeddings`)
_EMBED_ELSE = re.compile(r"^(?:.*\.)?embeddings\.weight$")
#: The LM head's name in a causal LM (transformers' `get_output_embeddings()` of nearly every family), the name its
#: group keeps it under whatever the checkpoint calls it: HEADS, GPT-NeoX's (Pythia) `embed_out` too, a module
#: transformers 5 names lm_head (it renames the tensor as it loads)
LM_HEAD = "lm_head.weight"
HEADS = (LM_HEAD, "embed_out.weight")

Tensor = tuple[str, tuple[int, ...]]  # (full checkpoint name, shape)
#: The conversions transformers makes as it loads that binding follows (beside renames): experts stacked into one
#: [E, ...] parameter (`experts.{e}.down_proj`), and gate and up stacked then concatenated ([E, 2I, H])
STACKS = ((("MergeModulelist", 0),), (("MergeModulelist", 0), ("Concatenate", 1)))


@dataclass(frozen=True)
class GenericTensors:
    """Which checkpoint tensors make up each group of a model run by transformers (full names)."""

    embed: Tensor  # the token embeddings
    layers: tuple[tuple[Tensor, ...], ...]  # per decoder block, in the checkpoint's (sorted) order
    head: tuple[Tensor, ...]  # everything else but the LM head: the final norm(s)
    lm_head: Tensor | None  # None: tied to the embeddings (the head group reads them)
    #: the parameters transformers builds from checkpoint tensors of other names as it loads (`loaded_names`):
    #: (parameter name, (the tensors filling its rows, in order)); the rest are the checkpoint's own
    built: tuple[tuple[str, tuple[Tensor, ...]], ...] = ()
    #: experts' matrices as one tensor of their rows one after another (stacked by transformers, or dequantized
    #: from MXFP4): packed by an int8 / int4 format as one matrix
    stacked: frozenset[str] = frozenset()
    #: the routers' matrices ([E, H]): kept dense, as the native path keeps them (routing is sensitive to rounding)
    routers: frozenset[str] = frozenset()
    #: stacked experts their module holds transposed ([E, in, out]: gpt-oss), by the shapes (`transposed_experts`):
    #: packed as each expert's [out, in] rows, the orientation the packed kernels multiply
    transposed: frozenset[str] = frozenset()
    experts: int = 0  # routed experts a MoE layer has (config.json's count)

    @property
    def tied(self) -> bool:
        return self.lm_head is None

    @functools.cached_property
    def matrices(self) -> dict[str, int]:
        """The blocks' matrices an int8/int4 format packs: 2-D `.weight` tensors, and experts transformers stacks
        (their matrices' rows one after another: one matrix of E x the rows): name -> input dimension."""
        return {n: s[0] // self.experts if n in self.transposed else s[1] for layer in self.layers for n, s in layer
                if len(s) == 2 and (n.endswith(".weight") or n in self.stacked) and n not in self.routers}

    @functools.cached_property
    def sources(self) -> dict[str, tuple[Tensor, ...]]:
        """A tensor of a group -> the checkpoint tensors filling its rows (itself, for most)."""
        return dict(self.built)


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


#: A multimodal checkpoint's language model, as transformers 4 and 5 save it: prefix -> the causal LM's own
TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."), ("lm_head.", "lm_head."))


#: A multimodal checkpoint's other parts, by the names transformers' families give them
_TOWER = re.compile(r"(?:^|\.)(?:visual|vision_tower|vision_model|audio_tower|multi_modal_projector|mm_projector)\.")


def text_only(raw: Mapping[str, Any], names: Iterable[str]) -> tuple[dict[str, Any], dict[str, str]] | None:
    """A multimodal checkpoint (a config.json with a `text_config`: Gemma 3 4B+, Mistral 3, ...) run as its language
    model alone: (the text config, {the causal LM's tensor name: the checkpoint's}); None for a causal LM, or where
    no tensor is the language model's. The vision and audio towers' tensors are left out: a text prompt never runs
    them."""
    text = text_config(raw)
    if text is None:
        return None
    names = list(names)
    if not any(name.startswith(old) for name in names for old, _ in TEXT_PREFIXES[:-1]):
        # the language model under its own names (Qwen2.5-VL's `model.layers`), the towers beside (`visual.`)
        return text, {name: name for name in names if not _TOWER.search(name)}
    out = {}
    for name in names:
        new = next((new + name[len(old):] for old, new in TEXT_PREFIXES if name.startswith(old)), None)
        if new is not None:
            out[new] = name
    return (text, out) if out else None


def text_config(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """A multimodal model's language model's config.json (its `text_config`, with the dtype, quantization and
    special tokens of the whole where it does not say them); None for a causal LM."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return None
    keep = ("torch_dtype", "dtype", "quantization_config", "bos_token_id", "eos_token_id")
    return dict(text) | {k: raw[k] for k in keep if k in raw and k not in text}


#: experts a checkpoint keeps stacked as transformers' module holds them ([E, R, k]: gpt-oss, a model re-saved
#: unconverted), by the name of their parameter
_STACKED_EXPERTS = re.compile(r"\.experts\.[^.]+$")


#: a router's matrix, by its module's name (Mixtral's and DeepSeek's `mlp.gate`, gpt-oss's `mlp.router`, Hunyuan's
#: `mlp.gate.wg`, Granite-MoE's `router.layer`) and its rows (the experts')
_ROUTER = re.compile(r"\.(?:gate|router)\.(?:[a-z_]+\.)?weight$")
#: config.json's count of routed experts, by the names families give it
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


#: a GPTQ / AWQ linear's packed parts (`offload.weights.gptq`), which make the matrix `X.weight` a model binds
PREQUANT_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def prequant_matrices(raw: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """{`X.weight`: (N, K)} of a GPTQ / AWQ checkpoint's packed linears, by `X.qweight` (GPTQ [K / f, N], AWQ
    [K, N / f], f = 32 / bits values an int32); {} for another checkpoint (or bits its format parser refuses)."""
    method, qc = quant_method(raw), raw.get("quantization_config")
    bits = qc.get("bits", qc.get("w_bit")) if isinstance(qc, dict) else None
    if method not in ("gptq", "awq") or bits not in (4, 8):
        return {}
    f = 32 // bits
    return {n.removesuffix("qweight") + "weight": (s[1], s[0] * f) if method == "gptq" else (s[1] * f, s[0])
            for n, s in shapes.items() if n.endswith(".qweight") and len(s) == 2}


def stacked_matrices(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """The checkpoint's stacked experts [E, R, k] as the matrix of their rows one after another [E R, k] (its bytes
    as they lie): packed by an int8 / int4 format as one, as the experts transformers stacks are."""
    return {n: (s[0] * s[1], s[2]) for n, s in shapes.items() if len(s) == 3 and _STACKED_EXPERTS.search(n)}


def loaded_names(raw: Mapping[str, Any], names: Iterable[str], where: str) -> dict[str, list[str]]:
    """How transformers renames and stacks this architecture's checkpoint tensors as it loads them (its conversion
    mapping, transformers 5): {parameter: [the checkpoint tensors filling its rows, in order]} for each one it
    changes; {} where it changes none (transformers 4's modules carry the checkpoint's names). Renames (GPT-NeoX's
    embed_out -> lm_head, Phi-MoE's block_sparse_moe -> mlp) and experts stacked (`STACKS`: DeepSeek-V2, Jamba,
    Phi-MoE, the Qwen-MoE families) are followed; another conversion is refused, naming it."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return {}
    keys = [k for k in [*(raw.get("architectures") or [])[:1], raw.get("model_type")] if isinstance(k, str)]
    transforms = next((m for k in keys if (m := get_checkpoint_conversion_mapping(k))), None) or []
    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out: dict[str, list[str]] = {}
    stacks: dict[str, dict[tuple[int, int], str]] = {}
    for name in sorted(names):
        new = name
        for t in renames:
            new = t.rename_source_key(new)[0]
        for t in converters:
            target, pattern = t.rename_source_key(new)
            if pattern is None:
                continue
            ops = tuple((type(o).__name__, getattr(o, "dim", None)) for o in t.operations)
            if ops not in STACKS:
                raise CheckpointError(f"{where}: transformers converts tensor {name!r} as it loads it "
                                      f"({', '.join(op for op, _ in ops)}), which Offload's transformers path does "
                                      "not follow; such a model cannot run through it")
            expert = int(re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), new)[1])
            stacks.setdefault(target, {})[(expert, t.source_patterns.index(pattern))] = name
            break
        else:
            if new != name:
                out[new] = [name]
    for target, parts in stacks.items():
        experts, kinds = {e for e, _ in parts}, {k for _, k in parts}
        if experts != set(range(len(experts))) or len(parts) != len(experts) * len(kinds):
            raise CheckpointError(f"{where}: the experts transformers stacks into {target!r} are not numbered "
                                  f"0..{len(experts) - 1}, each with its {len(kinds)} tensors; the checkpoint is "
                                  "incomplete")
        out[target] = [parts[k] for k in sorted(parts)]  # (each expert's rows: gate's, then up's)
    return out


def generic_tensors(entries: Mapping[str, tuple[int, ...]], where: str,
                    loaded: Mapping[str, list[str]] | None = None, stacked: Iterable[str] = (),
                    raw: Mapping[str, Any] | None = None) -> GenericTensors:
    """Group a checkpoint's tensors (name -> shape) into embeddings, decoder blocks and the rest, under the names
    transformers gives them as it loads (`loaded`: `loaded_names`); `stacked`: other experts' matrices stored as
    their rows one after another (MXFP4's, read dense; stacked in the checkpoint: `stacked_matrices`), by their
    checkpoint names; `raw`: config.json, whose expert count tells the routers' matrices."""
    built = {target: tuple((n, tuple(entries[n])) for n in names) for target, names in (loaded or {}).items()}
    taken = {n for parts in built.values() for n, _ in parts}
    entries = {n: s for n, s in entries.items() if n not in taken} | {
        target: (sum(s[0] for _, s in parts), *parts[0][1][1:]) for target, parts in built.items()}
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
        elif name not in HEADS:
            rest.append((name, shape))
    if not embed:
        embed = [t for t in rest if _EMBED_ELSE.match(t[0]) and len(t[1]) == 2]
        rest = [t for t in rest if t not in embed]
    if len(embed) != 1 or not blocks or len(prefixes) != 1:
        found = [n for n, _ in embed] or "none"
        raise CheckpointError(f"{where}: cannot tell the token embeddings ({found}) and decoder blocks "
                              f"(layers.N.*: {len(blocks)} found under {len(prefixes)} prefixes) apart in the "
                              "checkpoint's tensor names; Offload streams causal LMs named as transformers saves them")
    if sorted(blocks) != list(range(len(blocks))):
        raise CheckpointError(f"{where}: decoder blocks {sorted(blocks)[:8]} are not numbered 0..{len(blocks) - 1}; "
                              "the checkpoint is incomplete")
    head = next(((name, tuple(entries[name])) for name in HEADS if name in entries), None)
    stacked = set(stacked)
    stacked |= {n for n, parts in built.items() if (len(parts) > 1 and all(len(s) == 2 for _, s in parts))
                or (len(parts) == 1 and parts[0][0] in stacked)}  # (stacked by transformers; renamed)
    experts = _int(raw or {}, EXPERT_COUNTS, 0)
    routers = {n for b in blocks.values() for n, s in b if len(s) == 2 and s[0] == experts and _ROUTER.search(n)}
    shapes = {n: s for b in blocks.values() for n, s in b if n in stacked and len(built.get(n, ())) <= 1}
    return GenericTensors(embed[0], tuple(tuple(blocks[i]) for i in range(len(blocks))), tuple(rest), head,
                          tuple(sorted(built.items())), frozenset(stacked), frozenset(routers),
                          transposed_experts(shapes, experts, embed[0][1][1]), experts)


def transposed_experts(stacked: Mapping[str, tuple[int, ...]], experts: int, hidden: int) -> frozenset[str]:
    """The stacked experts [E x rows, cols] whose module holds them [E, in, out], told by the hidden size: `up` (gate_up
    or up: in = hidden) and `down` (out = hidden) of one module, each [E, hidden, n] / [E, n, hidden] where the module
    is transposed, the other way round where not; one of them is always unambiguous (n = hidden for one only)."""
    out: set[str] = set()
    modules: dict[str, dict[str, tuple[int, int]]] = {}
    for n, (rows, cols) in ((n, s) for n, s in stacked.items() if len(s) == 2 and experts and s[0] % experts == 0):
        prefix, _, leaf = n.rpartition(".")
        modules.setdefault(prefix, {})[leaf] = (rows // experts, cols)
    for prefix, leaves in modules.items():
        votes = set()
        for leaf, (a, b) in leaves.items():
            if leaf in ("gate_up_proj", "up_proj") and (a == hidden) != (b == hidden):
                votes.add(a == hidden)
            elif leaf == "down_proj" and (a == hidden) != (b == hidden):
                votes.add(b == hidden)
        if votes == {True}:
            out |= {f"{prefix}.{leaf}" for leaf in leaves if leaf in ("gate_up_proj", "up_proj", "down_proj")}
    return frozenset(out)


def generic_config(raw: dict[str, Any], tensors: GenericTensors | None, where: str) -> ModelConfig:
    """A ModelConfig for a model transformers runs: the sizes from the tensors, the rest from config.json.
    Without `tensors` (config.json alone: checks before the weights load) the sizes are config.json's, and
    the config cannot plan (it names no groups)."""
    if tensors is None and (text := text_config(raw)) is not None:  # (a multimodal model's language model)
        raw = text
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
