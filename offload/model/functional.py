"""Model math for the Llama family, as pure functions of (activations, weights, KV view).

The model never owns parameters: every function takes its weights as an argument (a small
dataclass of tensor views into a packed slot), so weights can stream through without hooks
and the same code runs on CPU in tests and on CUDA. Activations are *flat*: all tokens of
all sequences in a step are rows of one `[N, hidden]` matrix, and attention pads them per
sequence using the step's `BatchLayout`. This module knows nothing about tiers or files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from offload.model import cpu_attention, cpu_elementwise, fused, kernels, moe
from offload.model.config import ModelConfig
from offload.model.layout import BatchLayout
from offload.model.rope import Rope, apply_rope, rope_inv_freq  # noqa: F401 (the model math's names)
from offload.model.sdpa import sdpa_with_lse


# ----------------------------------------------------------------------------- weights
class PackedWeight(Protocol):
    """A matrix [out, in] stored packed (e.g. group-wise int4); it multiplies without a resident dense copy."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, float32: bool = False) -> torch.Tensor:
        """x [..., in] -> x @ W.T + bias, [..., out] in x's dtype (`float32`: in float32, the same values)."""

    def row_invariant(self, x: torch.Tensor) -> bool:
        """Is each row of `linear(x)` independent of x's other rows (`offload.model.kernels`)?"""


#: A weight matrix: a dense tensor [out, in], or a packed one.
Weight = torch.Tensor | PackedWeight


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
           groups: list[torch.Tensor] | None = None, float32: bool = False) -> torch.Tensor:
    """x [N, in] -> [N, out] in x's dtype (`float32`: in float32, the same values); `groups` (flat rows; a verify
    pass's j-th tokens) must get a plain step's bits.

    CPU products are row-invariant (`offload.model.kernels`): groups need no product of their own. cuBLAS
    splits its reduction by the number of rows, so there each group is its own product, a plain step's shape.
    """
    if isinstance(w, torch.Tensor) and kernels.dense_supported(x, w):
        y = kernels.dense_linear(x, w, bias)
    elif groups is not None and len(groups) > 1 and not (not isinstance(w, torch.Tensor) and w.row_invariant(x)):
        parts = [linear(x[g], w, bias, float32=float32) for g in groups]
        y = parts[0].new_empty(x.shape[0], parts[0].shape[-1])
        for g, part in zip(groups, parts):
            y[g] = part
    else:
        y = F.linear(x, w, bias) if isinstance(w, torch.Tensor) else w.linear(x, bias, float32=float32)
    return y.float() if float32 else y


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Weight  # [(Hq + 2 Hkv) * D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) * D]
    o: Weight  # [H, Hq * D]
    o_bias: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    gate_up: Weight | None  # [2 I, H] (None in a mixture-of-experts layer)
    gate_up_bias: torch.Tensor | None  # [2 I]
    down: Weight | None  # [H, I]
    down_bias: torch.Tensor | None  # [H]
    q_norm: torch.Tensor | None = None  # [D] (Qwen3: per-head RMSNorm of q before RoPE); OLMoE: [Hq * D]
    k_norm: torch.Tensor | None = None  # [D]; OLMoE: [Hkv * D]
    moe: moe.MoEWeights | None = None  # router (+ shared expert) of a mixture-of-experts layer

    @classmethod
    def from_views(cls, v: dict[str, torch.Tensor]) -> LayerWeights:
        return cls(v["input_norm"], v["qkv"], v.get("qkv_bias"), v["o"], v.get("o_bias"), v["post_norm"],
                   v.get("gate_up"), v.get("gate_up_bias"), v.get("down"), v.get("down_bias"), v.get("q_norm"),
                   v.get("k_norm"), moe.MoEWeights.from_views(v))


@dataclass(frozen=True, slots=True)
class HeadWeights:
    norm: torch.Tensor  # [H]
    lm_head: Weight  # [V, H]

    @classmethod
    def from_views(cls, v: dict[str, torch.Tensor]) -> HeadWeights:
        return cls(v["norm"], v["lm_head"])


class KVView(Protocol):
    """What a layer needs of the KV cache: write this step's K/V, then attend over every block."""

    needs_inputs: bool  # keep the layer inputs too (cold blocks restored by recomputation)

    def write(self, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | None = None) -> None:
        """k, v: [N, Hkv, D] for the flat new tokens of the step; h: [N, hidden] their layer inputs."""

    def attend(self, q: torch.Tensor, scale: float, window: int | None,
               restore: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Padded queries q [B, Tq, Hq, D] -> [(out [B, Tq, Hq, D], lse [B, Tq, Hq])], one per group of blocks."""

    def paged(self, window: int | None) -> tuple[torch.Tensor | None, ...] | None:
        """(pool [slots, 2, block_size, Hkv, D], the step's cold blocks (`cpu_attention.ColdBlocks`) or None,
        slot_blocks, slot_offsets, table [B, cols], mask) for a layer that writes and reads the blocks where they
        lie (`fused.decoder_layer`; -1 - i in the table: cold block i); None where it cannot."""

    def planes(self, n: int) -> torch.Tensor:
        """The pool's planes of n layers from this one, [n, slots, 2, block_size, Hkv, D] (`run_layers`)."""

    def cold_planes(self, n: int) -> list[cpu_attention.ColdBlocks]:
        """The step's cold blocks of n layers from this one, each as `paged` gives them (`run_layers`)."""


# ----------------------------------------------------------------------------- math
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if cpu_elementwise.elementwise_supported(x):  # one call, the fused layer's formula (the same bits either way)
        return cpu_elementwise.rms_norm(x, weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_heads(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Flat rows [N, heads * D] RMS-normed over each run of weight.numel() values: a head, or the whole row."""
    return rms_norm(t.unflatten(-1, (-1, weight.shape[0])), weight, eps).flatten(-2)


def attend_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 block: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Exact attention of padded queries over one group of keys, with its log-sum-exp.

    q [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; mask [B, Tq, Tk] -> out [B, Tq, Hq, D] (float32),
    lse [B, Tq, Hq] (float32, -inf where a query sees no key of this group), and with `block`
    the log-sum-exp of each run of `block` keys, [B, Tq, Hq, Tk / block] (None otherwise).
    Grouped-query heads share K/V without copying it: queries are reshaped to [B, Hkv, G*Tq, D].
    """
    if block is None and q.device.type == "cuda":  # fused kernel: no [heads, Tq, Tk] float32 scores
        return (*sdpa_with_lse(q, k, v, mask, scale), None)
    if block is None and cpu_attention.attention_supported(q, k):  # each query row on its own: batch-invariant
        return (*cpu_attention.attend(q, k, v, mask, scale), None)
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    qg = q.view(B, Tq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Tq, D)
    kt = k.permute(0, 2, 3, 1)  # [B, Hkv, D, Tk]
    scores = torch.matmul(qg, kt).float() * scale  # [B, Hkv, G*Tq, Tk]
    m = mask[:, None, None, :, :].expand(B, 1, G, Tq, mask.shape[-1]).reshape(B, 1, G * Tq, -1)
    scores = scores.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, Hkv, G*Tq, 1]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    out = torch.matmul(probs.to(v.dtype), v.permute(0, 2, 1, 3)).float()  # [B, Hkv, G*Tq, D]
    out = out.view(B, Hkv, G, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, D)
    block_lse = None
    if block is not None:
        per = torch.logsumexp(scores.view(B, Hkv, G * Tq, -1, block), dim=-1)  # [B, Hkv, G*Tq, blocks]
        block_lse = per.view(B, Hkv, G, Tq, -1).permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, -1)
    lse = lse.view(B, Hkv, G, Tq).permute(0, 3, 1, 2).reshape(B, Tq, Hq)
    return out, lse, block_lse


def attend_pool(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, mask: torch.Tensor, scale: float,
                cold: cpu_attention.ColdBlocks = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`attend_group` (and `attend_columns`: each query row on its own) over K/V read where they lie in a paged
    pool, kv [slots, 2, block_size, Hkv, D], table [B, cols] the slot of each sequence's blocks in token order (-1 - i:
    the i-th of the `cold` blocks, `cpu_attention.ColdBlocks`); None where no kernel reads a pool in place (the caller
    gathers the blocks in token order)."""
    if reads_pool(q, kv):
        return cpu_attention.attend_paged(q, kv, table, mask, scale, cold)
    return None


def reads_pool(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Does `attend_pool` read a pool like kv for queries like q (else it returns None)?"""
    return cpu_attention.attention_supported(q, kv)


def attend_columns(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_group` one query column at a time, column j over its first `keys[j]` key slots: the shapes a
    plain decode step at those positions has (a verify pass of speculative decoding; the kernels reduce
    over keys and query rows in an order that depends on both counts). `keys` comes from the host-side
    layout (`BatchLayout.column_keys`): no device sync. The CPU kernel attends each row on its own: one call."""
    if cpu_attention.attention_supported(q, k):
        return cpu_attention.attend(q, k, v, mask, scale)
    outs, lses = [], []
    for j, n in enumerate(keys):
        out, lse, _ = attend_group(q[:, j : j + 1], k[:, :n], v[:, :n], mask[:, j : j + 1, :n], scale)
        outs.append(out)
        lses.append(lse)
    if q.shape[1] > len(keys):  # the rest of a prompt chunk in the same pass: one call
        out, lse, _ = attend_group(q[:, len(keys) :], k, v, mask[:, len(keys) :], scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine per-group (out, lse) exactly: softmax over the union of the groups' keys."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])  # [P, B, Tq, Hq]
    total = torch.logsumexp(lses, dim=0)
    total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    out = 0
    for o, lse in parts:
        out = out + o * torch.exp(lse - total)[..., None]
    return out


def attention(q: torch.Tensor, kv: KVView, layout: BatchLayout, window: int | None, scale: float,
              restore: Callable | None = None) -> torch.Tensor:
    """q [N, Hq, D] flat -> [N, Hq * D] flat, attending over every group of blocks the KV view holds."""
    N, Hq, D = q.shape
    B, Tq = layout.pad_index.shape
    q_pad = q.view(B, Tq, Hq, D) if layout.uniform else q[layout.pad_index]  # [B, Tq, Hq, D]
    out = merge_attention(kv.attend(q_pad, scale, window, restore)).to(q.dtype)  # [B, Tq, Hq, D]
    out = out.reshape(B * Tq, Hq * D)
    return out if layout.uniform else out[layout.unpad_index]


def restore_kv(h: torch.Tensor, positions: torch.Tensor, w: LayerWeights, rope: Rope,
               cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of tokens from their layer inputs h [n, hidden] (after the input norm): one projection + RoPE."""
    q_size, n = cfg.q_size, h.shape[0]
    if isinstance(w.qkv, torch.Tensor):  # project onto K and V only
        bias = None if w.qkv_bias is None else w.qkv_bias[q_size:]
        kv = linear(h, w.qkv[q_size:], bias)
    else:  # a packed matrix is multiplied whole
        kv = linear(h, w.qkv, w.qkv_bias)[:, q_size:]
    k, v = kv.split([cfg.kv_size, cfg.kv_size], dim=-1)
    if w.k_norm is not None:
        k = norm_heads(k, w.k_norm, cfg.rms_norm_eps)
    if cfg.clip_qkv is not None:
        k, v = k.clamp(-cfg.clip_qkv, cfg.clip_qkv), v.clamp(-cfg.clip_qkv, cfg.clip_qkv)
    k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    cos, sin = rope(positions)
    return apply_rope(k, cos, sin), v.reshape(n, cfg.num_kv_heads, cfg.head_dim)


def decoder_layer(x: torch.Tensor, w: LayerWeights, kv: KVView, layout: BatchLayout,
                  rope: tuple[torch.Tensor, torch.Tensor], cfg: ModelConfig, window: int | None,
                  rope_table: Rope | None = None, experts: moe.ExpertSource | None = None) -> torch.Tensor:
    """One decoder layer on flat tokens x [N, H]; writes this step's K/V into `kv`.

    `rope_table` is needed only when the KV cache rebuilds cold blocks from their layer inputs;
    `experts` only in a mixture-of-experts layer (`w.moe`): its routed experts' weights.
    """
    N = x.shape[0]
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mats = (w.qkv, w.qkv_bias, w.o, w.o_bias, w.gate_up, w.gate_up_bias, w.down, w.down_bias)
    if w.moe is None and w.q_norm is None and cfg.clip_qkv is None and fused.layer_supported(x, mats) \
            and (paged := paged_pool(kv, window, x)) is not None:
        pool, cold, slot_blocks, slot_offsets, table, mask = paged  # one compiled call: ~40 fewer ops a layer
        return fused.decoder_layer(x, mats, (w.input_norm, w.post_norm), cfg.rms_norm_eps, *rope, pool, cold,
                                     (slot_blocks, slot_offsets, table, mask, layout.pad_index, layout.unpad_index),
                                     Hq, D**-0.5)
    h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)
    groups = layout.row_groups
    qkv = linear(h, w.qkv, w.qkv_bias, groups)  # [N, (Hq + 2 Hkv) * D]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    if w.q_norm is not None:  # before RoPE; Qwen3: each head over D, OLMoE: the whole projection
        q, k = norm_heads(q, w.q_norm, cfg.rms_norm_eps), norm_heads(k, w.k_norm, cfg.rms_norm_eps)
    if cfg.clip_qkv is not None:
        q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    q, k = q.reshape(N, Hq, D), k.reshape(N, Hkv, D)
    cos, sin = rope
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    kv.write(k, v.reshape(N, Hkv, D), h if kv.needs_inputs else None)
    restore = None
    if rope_table is not None:
        restore = lambda hs, pos: restore_kv(hs, pos, w, rope_table, cfg)  # noqa: E731
    a = attention(q, kv, layout, window, D**-0.5, restore)
    x = x + linear(a, w.o, w.o_bias, groups)
    h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)
    if w.moe is not None:
        return x + moe.moe_mlp(h, w.moe, experts, cfg.experts_per_token, cfg.norm_topk_prob)
    gate_up = linear(h, w.gate_up, w.gate_up_bias, groups)
    if cpu_elementwise.elementwise_supported(gate_up):  # the fused layer's formula
        return x + linear(cpu_elementwise.silu_mul(gate_up), w.down, w.down_bias, groups)
    gate, up = gate_up.chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w.down, w.down_bias, groups)


def layer_run(x: torch.Tensor, ws: Sequence[LayerWeights], cfg: ModelConfig,
              head: HeadWeights | None = None) -> fused.LayerRun | None:
    """Decoder layers with weights ws, run back to back in one compiled call (`fused.LayerRun`: called with the
    pass's cos / sin, the layers' pool planes and the step's indices, the same bits as `decoder_layer` on each), or
    None where one of them does not take the fused layer. With `head`, the model's head after them (the same bits
    as `head`), or None where it does not take that."""
    if cfg.clip_qkv is not None or any(w.moe is not None or w.q_norm is not None for w in ws):
        return None
    head_args = None if head is None else fused.head_args(x, head.norm, head.lm_head)
    if head is not None and (head_args is None or not kernels.ROW_INVARIANT):
        return None
    layers = [((w.qkv, w.qkv_bias, w.o, w.o_bias, w.gate_up, w.gate_up_bias, w.down, w.down_bias),
               (w.input_norm, w.post_norm)) for w in ws]
    if not fused.LayerRun.supported(x, layers):
        return None
    try:
        return fused.LayerRun(layers, x.dtype, head_args)
    except TypeError:  # arguments of more than one numba type (one list holds them): layer by layer
        return None


def paged_pool(kv: KVView, window: int | None, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """`kv.paged(window)` where its pool holds x's dtype (what a fused layer reads and writes in place), else None
    (then op by op)."""
    paged = kv.paged(window)
    return paged if paged is not None and paged[0].dtype == x.dtype else None


def run_layers(run: fused.LayerRun, x: torch.Tensor, kv: KVView, paged: tuple[torch.Tensor, ...],
               layout: BatchLayout, rope: tuple[torch.Tensor, torch.Tensor], cfg: ModelConfig,
               ) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """x through the layers of a `layer_run` (kv: the first one's view, paged its `paged_pool`; the others' are the
    pool's next planes, and their cold blocks: read where they lie): (out, the cycle counter at the start and after
    each layer and the head, the head's logits: None where the run has no head)."""
    _, cold, slot_blocks, slot_offsets, table, mask = paged
    return run(x, cfg.rms_norm_eps, *rope, kv.planes(run.size), None if cold is None else kv.cold_planes(run.size),
               (slot_blocks, slot_offsets, table, mask, layout.pad_index, layout.unpad_index), cfg.num_heads,
               cfg.head_dim**-0.5)


def head(x: torch.Tensor, w: HeadWeights, cfg: ModelConfig,
         groups: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x [N, H] -> logits [N, V] in float32 (on a CPU in one compiled call: row-invariant, no groups needed)."""
    if kernels.ROW_INVARIANT and (y := fused.head_logits(x, w.norm, cfg.rms_norm_eps, w.lm_head)) is not None:
        return y
    return linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head, None, groups, float32=True)
