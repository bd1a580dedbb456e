"""Prefill passes and the memory they need: the activation workspace of a pass of `chunk` tokens, the device
KV blocks it writes, how many sequences decode beside it, and how many prompt tokens a pass over a long
context may take. The planner sizes the workspace with these; the executor and the engine cut passes by them."""

from __future__ import annotations

import math

import torch

from offload.model.config import ModelConfig
from storage.units import blocks_for

#: keys per query the workspace holds attention for, as a multiple of the chunk; longer contexts get smaller passes.
ATTENTION_KEYS_PER_CHUNK = 4
#: an op-by-op layer's temporaries on a CPU (products' float32 outputs, RoPE, SiLU, what glibc's heap keeps between
#: them until `storage.heap.trim_heap`), as a multiple of a pass's flat activations; measured on the 1.7B
#: Llama shape over 1563 tokens of cold KV blocks, growth of the process at its peak: 77 / 113 / 185 MiB at chunks of
#: 128 / 256 / 512 tokens, against 58 / 104 / 196 reserved (the keys a pass of 128 / 256 tokens is sized for are
#: fewer than that context's: 512 / 1024)
CPU_LAYER_TEMPORARIES = 3.5


def workspace_bytes(cfg: ModelConfig, chunk: int, dtype: torch.dtype, keys: int = 0, scores: bool = True) -> int:
    """Activation memory of one prefill pass of `chunk` tokens attending over `keys` keys (an estimate, reserved).

    Flat activations (residual, norm output, fused qkv, gate/up, attention output) at the compute dtype; the keys'
    K/V gathered into token order (gathered, padded and split: three copies); float32 logits for a batch of up to
    64 last tokens; and the attention as `offload.model.functional.attend_group` materialises it: float32 scores,
    their masked copy and the probabilities plus the probabilities in the compute dtype (each [heads, chunk, keys])
    and the boolean mask expanded over the query groups.

    `scores=False`: attention by a kernel that makes no scores (`offload.model.cpu_attention`, each query row on its
    own): the op-by-op layer's temporaries take their place, `CPU_LAYER_TEMPORARIES` times the flat activations.
    """
    keys = max(keys, chunk)
    per_token = 3 * cfg.hidden_size + (cfg.q_size + 2 * cfg.kv_size) + 3 * cfg.intermediate_size + cfg.q_size
    flat = chunk * per_token * dtype.itemsize
    gathered = 3 * keys * 2 * cfg.kv_size * dtype.itemsize
    logits = min(chunk, 64) * cfg.vocab_size * 4
    if not scores:
        return int(CPU_LAYER_TEMPORARIES * flat) + gathered + logits
    scores_bytes = cfg.num_heads * chunk * keys * (3 * 4 + 2 * dtype.itemsize)
    mask = cfg.num_heads // cfg.num_kv_heads * chunk * keys
    return flat + scores_bytes + mask + gathered + logits


def pass_blocks(chunk: int, block_size: int) -> int:
    """Device KV blocks one prefill pass of `chunk` tokens may write: its blocks when it starts inside a partial
    block (every running sequence pins its newest block besides)."""
    return blocks_for(chunk, block_size) + 1


def batch_rows(kv_blocks: int, chunk: int, block_size: int, row_blocks: int = 1) -> int:
    """Sequences a device pool of `kv_blocks` keeps decoding together beside a prefill pass of `chunk` tokens:
    each running sequence pins `row_blocks` device blocks (its newest), the pass the rest (the engine's admission
    rule, `offload.runtime.engine`). At least one: a lone sequence always runs."""
    return max(1, (kv_blocks - pass_blocks(chunk, block_size)) // row_blocks)


def pool_blocks(blocks: int, outputs: list[int], chunk: int, block_size: int, row_blocks: int = 1) -> int:
    """A KV pool for requests reserving `blocks` in all (each with `outputs[i]` outputs) that the engine admits all at
    once: beside a prefill pass of `chunk` tokens every running output pins `row_blocks` device blocks (the admission
    rule, `batch_rows`); a first request is admitted without that room. (A pool of `blocks` alone ran a list of
    prompts one after the other.)"""
    if len(outputs) < 2:
        return blocks
    return max(blocks, sum(outputs) * row_blocks + pass_blocks(chunk, block_size))


def pass_tokens(chunk: int, context: int) -> int:
    """Prompt tokens a pass may take for a sequence with `context` tokens already cached.

    The workspace holds attention for `chunk` queries over `ATTENTION_KEYS_PER_CHUNK * chunk` keys;
    a pass over a longer context takes fewer tokens so that queries x keys stays within it (at least one).
    """
    budget = chunk * ATTENTION_KEYS_PER_CHUNK * chunk
    if context + chunk <= ATTENTION_KEYS_PER_CHUNK * chunk:
        return chunk
    t = int((math.sqrt(context * context + 4 * budget) - context) / 2)  # t * (context + t) <= budget
    return max(1, min(chunk, t))
