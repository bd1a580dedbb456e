"""Which checkpoint tensors make up each group, and how a group is packed.

A model is cut into groups that move as units: `embed` (token embeddings, absent when they
are tied to the LM head), `layer.0` ... `layer.{L-1}`, and `head` (final norm + LM head).
Inside a layer, q/k/v are fused into one `qkv` matrix and gate/up into one `gate_up`, so a
decoder layer is two fewer kernel launches and every tensor is one contiguous row range
that can be read straight from the checkpoint. Storage gets only the resulting
`GroupLayout`s: it never learns what the names mean.
"""

from __future__ import annotations

import torch

from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig
from storage.layout import GroupLayout, dtype_name

#: A fused tensor is the row-wise concatenation of these checkpoint tensors: (short name, shape).
Sources = list[tuple[str, tuple[int, ...]]]


def group_names(cfg: ModelConfig) -> list[str]:
    """Groups in the order a forward pass uses them."""
    embed = [] if cfg.tie_word_embeddings else ["embed"]
    return embed + [f"layer.{i}" for i in range(cfg.num_layers)] + ["head"]


def embedding_source(cfg: ModelConfig) -> tuple[str, str]:
    """(group, tensor) whose rows are the token embeddings."""
    return ("head", "lm_head") if cfg.tie_word_embeddings else ("embed", "embed_tokens")


def group_sources(cfg: ModelConfig, group: str) -> list[tuple[str, Sources]]:
    """[(tensor name in the group, [(checkpoint tensor, shape), ...])] for one group."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.q_size, cfg.kv_size
    if group == "embed":
        return [("embed_tokens", [("embed_tokens.weight", (V, H))])]
    if group == "head":
        head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        return [("norm", [("norm.weight", (H,))]), ("lm_head", [(head, (V, H))])]
    if not group.startswith("layer."):
        raise KeyError(group)
    p = f"layers.{int(group.split('.')[1])}."
    attn, mlp = p + "self_attn.", p + "mlp."
    out: list[tuple[str, Sources]] = [
        ("input_norm", [(p + "input_layernorm.weight", (H,))]),
        ("qkv", [(attn + "q_proj.weight", (q, H)), (attn + "k_proj.weight", (kv, H)),
                 (attn + "v_proj.weight", (kv, H))]),
    ]
    if cfg.qk_norm:
        out += [("q_norm", [(attn + "q_norm.weight", (cfg.head_dim,))]),
                ("k_norm", [(attn + "k_norm.weight", (cfg.head_dim,))])]
    if cfg.qkv_bias:
        out.append(("qkv_bias", [(attn + "q_proj.bias", (q,)), (attn + "k_proj.bias", (kv,)),
                                 (attn + "v_proj.bias", (kv,))]))
    out.append(("o", [(attn + "o_proj.weight", (H, q))]))
    if cfg.o_bias:
        out.append(("o_bias", [(attn + "o_proj.bias", (H,))]))
    out.append(("post_norm", [(p + "post_attention_layernorm.weight", (H,))]))
    out.append(("gate_up", [(mlp + "gate_proj.weight", (I, H)), (mlp + "up_proj.weight", (I, H))]))
    if cfg.mlp_bias:
        out.append(("gate_up_bias", [(mlp + "gate_proj.bias", (I,)), (mlp + "up_proj.bias", (I,))]))
    out.append(("down", [(mlp + "down_proj.weight", (H, I))]))
    if cfg.mlp_bias:
        out.append(("down_bias", [(mlp + "down_proj.bias", (H,))]))
    return out


def group_layout(cfg: ModelConfig, group: str, dtype: torch.dtype) -> GroupLayout:
    entries = []
    for tensor, sources in group_sources(cfg, group):
        rows = sum(shape[0] for _, shape in sources)
        entries.append((tensor, dtype_name(dtype), (rows, *sources[0][1][1:])))
    return GroupLayout.build(group, entries)


def model_layouts(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, GroupLayout]:
    return {g: group_layout(cfg, g, dtype) for g in group_names(cfg)}


def check_checkpoint(ckpt: Checkpoint) -> None:
    """Every tensor config.json implies is in the checkpoint with its shape (CheckpointError otherwise): checked
    from the headers alone, before a byte is allocated for it, so an absurd config costs nothing."""
    for group in group_names(ckpt.config):
        for _, sources in group_sources(ckpt.config, group):
            for short, shape in sources:
                ckpt.entry(short, shape)


def fill_group(ckpt: Checkpoint, layout: GroupLayout, buf: torch.Tensor) -> None:
    """Read a group's tensors from the checkpoint into `buf` (1-D uint8, CPU), converting dtype."""
    buf[: layout.nbytes].zero_()
    views = layout.views(buf)
    for tensor, sources in group_sources(ckpt.config, layout.name):
        row = 0
        for short, shape in sources:
            ckpt.read_into(short, views[tensor][row : row + shape[0]])
            row += shape[0]

