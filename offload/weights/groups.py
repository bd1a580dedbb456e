"""Which checkpoint tensors make up each group, and how a group is packed.

A model is cut into groups that move as units: `embed` (token embeddings, absent when they
are tied to the LM head), `layer.0` ... `layer.{L-1}`, and `head` (final norm + LM head).
In a mixture of experts each routed expert of each MoE layer is a group of its own,
`layer.{i}.expert.{e}` (its `gate_up` and `down`), right after its layer in pass order; the
layer's group keeps attention, norms, the `router` and Qwen2-MoE's shared expert. Experts are
read from the Hub's per-expert tensors (`experts.{e}.gate_proj` ..., Mixtral's `w1/w3/w2`) or,
when a checkpoint stores them stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I], transformers' in-memory layout), from expert e's slab of those.
Inside a layer, q/k/v are fused into one `qkv` matrix and gate/up into one `gate_up`, so a
decoder layer is two fewer kernel launches and every tensor is one contiguous row range
that can be read straight from the checkpoint. Storage gets only the resulting
`GroupLayout`s: it never learns what the names mean.

With a quantized `WeightFormat`, each packed matrix `t` becomes two tensors of the same group,
`t.q` (nibbles in tile order) and `t.sz` (scale/zero pairs), so a layer is still one read and one
copy; norms, biases and the embeddings stay in the compute dtype (`offload.weights.quant`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from offload.config import WeightsConfig
from offload.errors import ConfigError
from offload.model import compressed
from offload.model.checkpoint import TRANSPOSED, Checkpoint
from offload.model.config import ModelConfig, quant_method
from offload.model.generic import LM_HEAD, GenericTensors
from offload.weights import gptq, quant
from storage.layout import GroupLayout, dtype_name

#: A fused tensor is the row-wise concatenation of these checkpoint tensors: (short name, shape).
Sources = list[tuple[str, tuple[int, ...]]]


#: Tensors that are matrices multiplied by activations: the ones a quantized format packs (the MoE router is
#: not: it is small, and routing decisions flip with its rounding).
LINEARS = ("qkv", "o", "gate_up", "down", "lm_head", "shared_gate_up", "shared_down")
HEAD_BITS = 8  # the fewest bits an LM head is packed at (`WeightFormat.tensor_bits`)


@dataclass(frozen=True)
class WeightFormat:
    """How the matrices of a model are stored: dense, group-wise int8/int4 (config `weights:`), or the
    checkpoint's own GPTQ/AWQ packing (its config.json's `quantization_config`)."""

    quantization: str = "none"  # none | int8 | int4 | gptq | awq
    group_size: int = 64  # input columns per (scale, zero); must divide every packed matrix's input dim
    keep: tuple[str, ...] = ()  # matrices kept dense (names of LINEARS)
    prequant: gptq.PrequantFormat | None = None  # a GPTQ/AWQ checkpoint's format: its bytes are kept as they are
    #: a GPTQ/AWQ checkpoint's format its matrices are read from (dequantized), to be packed anew in this one
    source: gptq.PrequantFormat | None = field(default=None, compare=False)

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4}[self.quantization]

    def tensor_bits(self, tensor: str) -> int:
        """A packed tensor's bits: the format's, but the LM head never below 8 (the logits are what sampling reads;
        llama.cpp's 4-bit files keep their output matrix at 6 or 8 bits too)."""
        return max(self.bits, HEAD_BITS) if tensor == "lm_head" else self.bits

    def packs(self, cfg: ModelConfig, tensor: str) -> bool:
        """Is this group tensor stored packed? (A tied LM head packed leaves the embedding rows a dense `embed`
        group of their own: `separate_embed`.)"""
        if cfg.impl == "transformers":  # the blocks' matrices, by their checkpoint names (keep: not theirs)
            return tensor in cfg.tensors.matrices and (self.quantization in ("int8", "int4") or bool(self.prequant))
        if self.prequant is not None:  # GPTQ/AWQ checkpoints quantize the decoder layers' linears
            return tensor in LINEARS and tensor != "lm_head"
        return self.quantization != "none" and tensor in LINEARS and tensor not in self.keep

    def separate_embed(self, cfg: ModelConfig) -> bool:
        """Are the token embeddings a group of their own (`embed`)? Untied: always; tied: when the head is packed
        (the rows stay dense; the head's matrix is the same checkpoint tensor, quantized)."""
        return not cfg.tie_word_embeddings or (cfg.impl != "transformers" and self.packs(cfg, "lm_head"))

    def scheme(self, cfg: ModelConfig, tensor: str) -> str:
        """What the manifest records for a tensor: `dense`, e.g. `int4-g64-asym-rtn`, or e.g. `gptq-4bit-g128`."""
        if not self.packs(cfg, tensor):
            return "dense"
        if self.prequant is not None:
            p = self.prequant
            return f"{p.method}-{p.bits}bit-g{p.group_size or 'all'}" + ("-act-order" if p.act_order else "")
        bits = self.tensor_bits(tensor)  # (int8 codes in quads, `quant.int8_tiles`: a store holding them column by
        # column is of another scheme, converted again)
        return f"int{bits}-g{self.group_size}-asym-rtn" + ("-quads" if bits == 8 else "")

    @classmethod
    def from_config(cls, w: WeightsConfig, cfg: ModelConfig) -> WeightFormat:
        """The run's format: the config's `weights:`, or the checkpoint's own quantization (weights: none; a GPTQ /
        AWQ one packed anew by int8 / int4, from its dequantized matrices: `reading.PrequantRows`)."""
        raw, method = cfg.raw.get("quantization_config"), quant_method(cfg.raw)
        if method in ("fp8", "compressed-tensors") or (method == "mxfp4" and cfg.impl == "transformers"):
            raw = None  # (read dense, `offload.model.fp8` / `compressed` / `mxfp4`: as a float checkpoint)
        pre = gptq.parse_quantization_config(raw, "config.json")
        kept = compressed.kept_format(cfg.raw) if cfg.codes_kept else None
        if kept is not None and w.quantization == "none":  # an int4 / int8 compressed-tensors checkpoint stays
            return cls(f"int{kept[0]}", kept[1], ("lm_head",))  # int4 / int8, the same values
        if kept is not None and kept[0] <= cls(w.quantization).bits:  # its codes kept: groups at most its own
            return cls(w.quantization, kept_group(w.group_size, kept[1]), tuple(w.keep))
        if pre is None:
            return cls(w.quantization, w.group_size, tuple(w.keep))
        if w.quantization != "none":  # its codes and scales kept where a group has one scale (at most its groups)
            return cls(w.quantization, kept_group(w.group_size, pre.group_size), tuple(w.keep), source=pre)
        return cls(pre.method, pre.group_size, (), pre)

    def to_json(self) -> dict:
        if self.prequant is not None:
            return self.prequant.to_json()
        return {"quantization": self.quantization, "group_size": self.group_size, "keep": sorted(self.keep)}

    def stored_as(self, stored: dict) -> bool:
        """Does a store whose manifest records `stored` (a `to_json` of the format it was converted with) hold this
        format's bytes? Dense weights are the same whatever group size or keep list they were converted with."""
        if self.quantization == "none" and self.prequant is None:
            return stored.get("quantization") == "none"
        return stored == self.to_json()

    def check(self, cfg: ModelConfig) -> None:
        """Refuse, before anything is converted, a group size that does not divide a packed matrix's input dim."""
        if self.quantization == "none" or self.prequant is not None:
            return
        for tensor, k in self.inputs(cfg).items():
            if self.group_size % 2 or k % self.group_size:
                fits = [g for g in GROUP_SIZES if k % g == 0][:3] or [2]
                raise ConfigError(
                    f"weights.group_size: {self.group_size} does not divide the input dimension {k} of {tensor!r}; "
                    f"choose an even group size that divides {k} (e.g. {', '.join(map(str, fits))}) or add "
                    f"{tensor.split()[-1]} to weights.keep"
                )

    def inputs(self, cfg: ModelConfig) -> dict[str, int]:
        """The input dimension of every matrix this format packs (a routed expert's as `expert down`)."""
        if cfg.impl == "transformers":
            return {t: k for t, k in cfg.tensors.matrices.items() if self.packs(cfg, t)}
        dims = {"qkv": cfg.hidden_size, "o": cfg.q_size, "lm_head": cfg.hidden_size}
        if not all(cfg.moe_layers):
            dims |= {"gate_up": cfg.hidden_size, "down": cfg.intermediate_size}
        if cfg.is_moe:
            dims |= {"expert gate_up": cfg.hidden_size, "expert down": cfg.moe_intermediate_size}
        if cfg.shared_expert_intermediate_size:
            dims |= {"shared_gate_up": cfg.hidden_size, "shared_down": cfg.shared_expert_intermediate_size}
        return {t: k for t, k in dims.items() if self.packs(cfg, t.split()[-1])}

    def fitted(self, cfg: ModelConfig) -> WeightFormat:
        """This format with the largest group size (up to its own) that divides every packed input dimension."""
        dims = self.inputs(cfg).values()
        g = next((g for g in GROUP_SIZES if g <= self.group_size and all(k % g == 0 for k in dims)), 2)
        return dataclasses.replace(self, group_size=g)


DENSE = WeightFormat()
#: group sizes tried, largest first, when one must be chosen to fit
GROUP_SIZES = (256, 128, 64, 32, 16, 8, 4, 2)


def kept_group(asked: int, checkpoint: int) -> int:
    """The group size that keeps a quantized checkpoint's codes and scales (groups of `checkpoint` columns; 0: one
    over a whole row): `asked` where it divides them, else the checkpoint's own."""
    return asked if not checkpoint or checkpoint % asked == 0 else checkpoint


def expert_groups(cfg: ModelConfig, layer: int) -> list[str]:
    """The groups of layer `layer`'s routed experts, by expert id (none in a dense layer)."""
    return [f"layer.{layer}.expert.{e}" for e in range(cfg.num_experts)] if cfg.moe_layers[layer] else []


def group_names(cfg: ModelConfig, fmt: WeightFormat | None = None) -> list[str]:
    """Groups in the order a forward pass uses them (a MoE layer's experts right after the layer)."""
    embed = ["embed"] if (fmt or DENSE).separate_embed(cfg) else []
    layers = [g for i in range(cfg.num_layers) for g in (f"layer.{i}", *expert_groups(cfg, i))]
    return embed + layers + ["head"]


def stage_groups(cfg: ModelConfig, layers: range, fmt: WeightFormat | None = None) -> list[str]:
    """The groups a pipeline stage over `layers` reads, in pass order: the first stage the token embeddings
    (read by rows; with tied embeddings the `head` group), its layers (and their experts), the last the head."""
    first, last = layers.start == 0, layers.stop == cfg.num_layers
    embed, _ = embedding_source(cfg, fmt)
    keep = {f"layer.{i}" for i in layers} | {g for i in layers for g in expert_groups(cfg, i)}
    keep |= {embed} if first else set()
    keep |= {"head"} if last else set()
    return [g for g in group_names(cfg, fmt) if g in keep]


def stacked_experts(ckpt: Checkpoint) -> bool:
    """Does the checkpoint store each layer's experts stacked (`experts.gate_up_proj`) rather than one by one?"""
    sparse = [i for i, moe in enumerate(ckpt.config.moe_layers) if moe]
    return bool(sparse) and ckpt.name(f"layers.{sparse[0]}.mlp.experts.gate_up_proj") in ckpt.entries


def mlp_prefix(cfg: ModelConfig, layer: int, stacked: bool) -> str:
    """Mixtral's Hub checkpoints say `block_sparse_moe.`; transformers' own names (and stacked experts) `mlp.`."""
    return f"layers.{layer}." + ("block_sparse_moe." if cfg.family == "mixtral" and not stacked else "mlp.")


def expert_sources(cfg: ModelConfig, layer: int, e: int, stacked: bool = False) -> list[tuple[str, Sources]]:
    """Routed expert e of a layer: its gated MLP, per-expert tensors or expert e's slab of the stacked ones."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    if stacked:  # transformers' names: `mlp.` for every family
        p = f"layers.{layer}.mlp.experts."
        return [("gate_up", [(f"{p}gate_up_proj[{e}]", (2 * I, H))]), ("down", [(f"{p}down_proj[{e}]", (H, I))])]
    p = f"{mlp_prefix(cfg, layer, stacked)}experts.{e}."
    gate, up, down = ("w1", "w3", "w2") if cfg.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    return [("gate_up", [(f"{p}{gate}.weight", (I, H)), (f"{p}{up}.weight", (I, H))]),
            ("down", [(f"{p}{down}.weight", (H, I))])]


def stacked_sources(cfg: ModelConfig, layer: int) -> Sources:
    """The stacked expert tensors of a MoE layer, whole: (name, shape)."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    p = f"layers.{layer}.mlp.experts."
    return [(p + "gate_up_proj", (E, 2 * I, H)), (p + "down_proj", (E, H, I))]


def embedding_source(cfg: ModelConfig, fmt: WeightFormat | None = None) -> tuple[str, str]:
    """(group, tensor) whose rows are the token embeddings."""
    if cfg.impl == "transformers":
        return ("head", LM_HEAD) if cfg.tie_word_embeddings else ("embed", cfg.tensors.embed[0])
    return ("embed", "embed_tokens") if (fmt or DENSE).separate_embed(cfg) else ("head", "lm_head")


def generic_sources(tensors: GenericTensors, group: str) -> list[tuple[str, Sources]]:
    """A model transformers runs: each tensor under its parameter's name, read from the checkpoint tensors of that
    name or those transformers renames or stacks into it (`offload.model.generic.loaded_names`)."""
    if group == "embed":
        named = [tensors.embed]
    elif group == "head":  # the final norm(s), then the LM head (the embeddings when tied)
        named = [*tensors.head]
        return [(n, _read_from(tensors, (n, s))) for n, s in named] + [
            (LM_HEAD, _read_from(tensors, tensors.lm_head or tensors.embed))]
    elif group.startswith("layer.") and group.count(".") == 1:
        named = list(tensors.layers[int(group.split(".")[1])])
    else:
        raise KeyError(group)
    return [(n, _read_from(tensors, (n, s))) for n, s in named]


def _read_from(tensors: GenericTensors, tensor: tuple[str, tuple[int, ...]]) -> Sources:
    """The checkpoint tensors a group's tensor is read from: those transformers builds it of, else itself."""
    return list(tensors.sources.get(tensor[0], [tensor]))


def group_sources(cfg: ModelConfig, group: str, stacked: bool = False) -> list[tuple[str, Sources]]:
    """[(tensor name in the group, [(checkpoint tensor, shape), ...])] for one group; `stacked`: where the
    checkpoint keeps its experts stacked (`stacked_experts`)."""
    if cfg.impl == "transformers":
        return generic_sources(cfg.tensors, group)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.q_size, cfg.kv_size
    if group == "embed":
        return [("embed_tokens", [("embed_tokens.weight", (V, H))])]
    if group == "head":
        head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        return [("norm", [("norm.weight", (H,))]), ("lm_head", [(head, (V, H))])]
    if not group.startswith("layer."):
        raise KeyError(group)
    parts = group.split(".")
    layer = int(parts[1])
    if len(parts) == 4:  # layer.{i}.expert.{e}
        return expert_sources(cfg, layer, int(parts[3]), stacked)
    p = f"layers.{layer}."
    attn, mlp = p + "self_attn.", mlp_prefix(cfg, layer, stacked)
    out: list[tuple[str, Sources]] = [
        ("input_norm", [(p + "input_layernorm.weight", (H,))]),
        ("qkv", [(attn + "q_proj.weight", (q, H)), (attn + "k_proj.weight", (kv, H)),
                 (attn + "v_proj.weight", (kv, H))]),
    ]
    if cfg.qk_norm:  # per head; OLMoE: over the whole projection
        qn, kn = (q, kv) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
        out += [("q_norm", [(attn + "q_norm.weight", (qn,))]), ("k_norm", [(attn + "k_norm.weight", (kn,))])]
    if cfg.qkv_bias:
        out.append(("qkv_bias", [(attn + "q_proj.bias", (q,)), (attn + "k_proj.bias", (kv,)),
                                 (attn + "v_proj.bias", (kv,))]))
    out.append(("o", [(attn + "o_proj.weight", (H, q))]))
    if cfg.o_bias:
        out.append(("o_bias", [(attn + "o_proj.bias", (H,))]))
    out.append(("post_norm", [(p + "post_attention_layernorm.weight", (H,))]))
    if cfg.moe_layers[layer]:
        out.append(("router", [(mlp + "gate.weight", (cfg.num_experts, H))]))
        S = cfg.shared_expert_intermediate_size
        if S:
            se = mlp + "shared_expert."
            out += [("shared_gate_up", [(se + "gate_proj.weight", (S, H)), (se + "up_proj.weight", (S, H))]),
                    ("shared_down", [(se + "down_proj.weight", (H, S))]),
                    ("shared_gate", [(mlp + "shared_expert_gate.weight", (1, H))])]
        return out
    out.append(("gate_up", [(mlp + "gate_proj.weight", (I, H)), (mlp + "up_proj.weight", (I, H))]))
    if cfg.mlp_bias:
        out.append(("gate_up_bias", [(mlp + "gate_proj.bias", (I,)), (mlp + "up_proj.bias", (I,))]))
    out.append(("down", [(mlp + "down_proj.weight", (H, I))]))
    if cfg.mlp_bias:
        out.append(("down_bias", [(mlp + "down_proj.bias", (H,))]))
    return out


def dense_shape(sources: Sources) -> tuple[int, ...]:
    """A fused tensor's shape: its sources' rows one after another (one source: its shape, a scalar's () too)."""
    if len(sources) == 1:
        return tuple(sources[0][1])
    return (sum(shape[0] for _, shape in sources), *sources[0][1][1:])


def prequant_sources(sources: Sources, pre: gptq.PrequantFormat) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """(part suffix in the group, checkpoint tensor, dtype name, shape) of each packed tensor of a fused matrix."""
    out = []
    for i, (short, (n, k)) in enumerate(sources):
        base = short.removesuffix(".weight")
        for suffix, (dtype, shape) in pre.tensors(n, k).items():
            out.append((f"{i}.{suffix}", f"{base}.{suffix}", dtype, shape))
    return out


def packed_sources(cfg: ModelConfig, tensor: str, sources: Sources) -> Sources:
    """Where a packed matrix's rows are read: its sources, or for stacked experts their module holds transposed
    ([E in, out]: `GenericTensors.transposed`) each expert's transpose, [E out, in] (the orientation the kernels
    multiply)."""
    if cfg.impl != "transformers" or tensor not in cfg.tensors.transposed:
        return sources
    ((name, (rows, cols)),), experts = sources, cfg.tensors.experts
    return [(name + TRANSPOSED, (experts * cols, rows // experts))]


def group_layout(cfg: ModelConfig, group: str, dtype: torch.dtype, fmt: WeightFormat = DENSE) -> GroupLayout:
    entries = []
    for tensor, sources in group_sources(cfg, group):
        shape = dense_shape(sources)
        if fmt.prequant is not None and fmt.packs(cfg, tensor):
            entries += [(f"{tensor}.{part}", dt, shp) for part, _, dt, shp in prequant_sources(sources, fmt.prequant)]
        elif fmt.packs(cfg, tensor):
            shape = dense_shape(packed_sources(cfg, tensor, sources))
            shapes = quant.packed_shapes(shape[0], shape[1], fmt.tensor_bits(tensor), fmt.group_size)
            entries += [(f"{tensor}.q", "uint8", shapes["q"]), (f"{tensor}.sz", dtype_name(dtype), shapes["sz"])]
        else:
            entries.append((tensor, dtype_name(dtype), shape))
    return GroupLayout.build(group, entries)


def model_layouts(cfg: ModelConfig, dtype: torch.dtype, fmt: WeightFormat = DENSE,
                  layers: range | None = None) -> dict[str, GroupLayout]:
    """Every group's layout, or (`layers`) those of one pipeline stage (`stage_groups`)."""
    names = group_names(cfg, fmt) if layers is None else stage_groups(cfg, layers, fmt)
    return {g: group_layout(cfg, g, dtype, fmt) for g in names}


def weight_views(cfg: ModelConfig, group: str, views: dict[str, torch.Tensor], scratch: quant.Scratch | None,
                 fmt: WeightFormat = DENSE, dtype: torch.dtype | None = None) -> dict:
    """A group's views with each packed matrix turned into one weight object named as the dense one:
    (`t.q`, `t.sz`) into a `quant.PackedLinear`, a GPTQ/AWQ matrix's parts into a `gptq.PrequantLinear` (dense in
    `dtype`: the store's; by default the layer's norm's)."""
    if not any(name.endswith((".q", ".qweight")) for name in views):
        return views
    out: dict = {}
    for tensor, sources in group_sources(cfg, group):
        if fmt.prequant is not None and f"{tensor}.0.qweight" in views:
            parts = tuple({suffix: views[f"{tensor}.{i}.{suffix}"] for suffix in fmt.prequant.tensors(1, 1)}
                          for i in range(len(sources)))
            n, k = dense_shape(sources)
            out[tensor] = gptq.PrequantLinear(fmt.prequant, parts, n, k, dtype or views["input_norm"].dtype, scratch)
        elif f"{tensor}.q" in views:
            rows = dense_shape(packed_sources(cfg, tensor, sources))[0]
            out[tensor] = quant.PackedLinear(views[f"{tensor}.q"], views[f"{tensor}.sz"], rows, scratch)
        else:
            out[tensor] = views[tensor]
    return out

