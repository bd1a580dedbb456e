"""Write a seeded, randomly initialised Llama-family or mixture-of-experts checkpoint in the Hugging Face layout.

    python scripts/make_model.py --family llama --size tiny --out /tmp/tiny-llama
    python scripts/make_model.py --family qwen3_moe --size medium --dtype bfloat16 --out /tmp/moe  # ~4 GiB
    from offload.testing.make_model import make_model; make_model("/tmp/m", family="qwen2", size="small")

The directory gets `config.json`, safetensors shards with `model.safetensors.index.json`
(or a single `model.safetensors`), and a `tokenizer.json`: a small byte-level BPE trained
with `tokenizers` on `offload/testing/corpus.txt`. Experts are written one tensor each, as the Hub
has them, or stacked (`experts="stacked"`: `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I], transformers' in-memory names) with the same values. Needs torch, safetensors and tokenizers, not
transformers. Weights are drawn tensor by tensor from a generator seeded by (seed, name),
so the same arguments always give the same bytes and memory stays at one shard.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

CORPUS = Path(__file__).with_name("corpus.txt")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES)
ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # the tokenizer is trained to min(vocab, what the corpus supports)
    shard_bytes: int  # largest safetensors shard
    window: int  # mistral's sliding window
    tie: bool | None = None  # tie embeddings (None: as the family does)
    exact_vocab: bool = False  # the config keeps `vocab` even where the tokenizer has fewer tokens (a real shape)


SIZES = {
    # a few MB: for tests
    "tiny": Size(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=344, vocab=512,
                 shard_bytes=1 << 20, window=32),
    # ~57M parameters (113 MB in bf16): the demo
    "small": Size(hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048, vocab=4096,
                  shard_bytes=64 << 20, window=4096),
    # TinyLlama-1.1B shape: the benchmark
    "medium": Size(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000,
                   shard_bytes=1 << 30, window=4096, exact_vocab=True),
    # SmolLM2-1.7B shape (1.71B parameters, 3.4 GB in bf16, tied embeddings): the CPU benchmark against llama.cpp
    "1.7b": Size(hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192, vocab=49152,
                 shard_bytes=1 << 30, window=4096, tie=True, exact_vocab=True),
}


@dataclass(frozen=True)
class MoeSize:
    """The experts of a MoE family at a size (attention, layers and vocabulary from the `Size`)."""

    experts: int
    top_k: int
    width: int  # one routed expert's intermediate size
    shared: int = 0  # qwen2_moe's shared expert
    dense: int = 0  # intermediate size of qwen's dense (mlp_only) layers; 0: the Size's


MOE_SIZES = {
    # tiny: 8 experts, top 2; every matrix's input dimension a multiple of 64 (int4 tests)
    "tiny": {"mixtral": MoeSize(8, 2, 128), "qwen2_moe": MoeSize(8, 2, 64, shared=192, dense=256),
             "qwen3_moe": MoeSize(8, 2, 64, dense=256), "olmoe": MoeSize(8, 2, 128)},
    "small": {"mixtral": MoeSize(8, 2, 1024), "qwen2_moe": MoeSize(16, 4, 256, shared=1024),
              "qwen3_moe": MoeSize(32, 4, 256), "olmoe": MoeSize(32, 4, 256)},
    # 1.9-2.2B parameters, 3.5-4.1 GiB in bf16: the MoE benchmark (Mixtral / Qwen3-30B-A3B shapes scaled down)
    "medium": {"mixtral": MoeSize(8, 2, 1408), "qwen2_moe": MoeSize(60, 4, 192, shared=1408),
               "qwen3_moe": MoeSize(64, 8, 192), "olmoe": MoeSize(64, 8, 192)},
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def train_tokenizer(vocab_size: int, corpus: Path = CORPUS):
    """A byte-level BPE (GPT-2 style) that prepends <s>; deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus.read_text(encoding="utf-8").split("\n\n"), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def moe_config(family: str, m: MoeSize, size: Size) -> dict[str, Any]:
    """The expert keys of a MoE family's config.json, named as that family's transformers config names them."""
    if family == "mixtral":
        return {"num_local_experts": m.experts, "num_experts_per_tok": m.top_k, "intermediate_size": m.width,
                "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "output_router_logits": False}
    cfg = {"num_experts": m.experts, "num_experts_per_tok": m.top_k, "router_aux_loss_coef": 0.001,
           "output_router_logits": False}
    if family == "olmoe":
        return cfg | {"intermediate_size": m.width, "norm_topk_prob": False, "clip_qkv": None}
    cfg |= {"moe_intermediate_size": m.width, "intermediate_size": m.dense or size.intermediate,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": family == "qwen3_moe"}
    if family == "qwen2_moe":
        cfg |= {"shared_expert_intermediate_size": m.shared, "qkv_bias": True}
    return cfg


def model_config(family: str, size: Size, vocab: int, dtype: str, rope_scaling: str | None,
                 tie: bool | None, head_dim: int | None = None, moe: MoeSize | None = None) -> dict[str, Any]:
    # Qwen3 checkpoints have head_dim != hidden / heads (128 with 1024 / 16 in Qwen3-0.6B): so do ours
    head_dim = head_dim or (2 if family in ("qwen3", "qwen3_moe") else 1) * size.hidden // size.heads
    cfg: dict[str, Any] = {
        "architectures": [ARCH[family]],
        "model_type": family,
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6 if family.startswith("qwen") else 1e-5,
        "rope_theta": 1000000.0 if family.startswith("qwen") or family == "mixtral" else 10000.0,
        "vocab_size": vocab,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": (family in ("qwen2", "qwen3")) if tie is None else tie,  # the MoE ones untied
        "torch_dtype": dtype,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if family in ("mistral", "mixtral"):
        cfg["sliding_window"] = size.window
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        cfg.update(use_sliding_window=False, sliding_window=size.window, max_window_layers=size.layers)
    if family in ("qwen3", "qwen3_moe", "olmoe"):
        cfg.update(attention_bias=False)
    if family in MOE_FAMILIES:
        cfg.update(moe_config(family, moe or MOE_SIZES["tiny"][family], size))
    if rope_scaling == "llama3":  # Llama 3.1: trained at 8192 tokens, scaled to 128K
        cfg["rope_theta"] = 500000.0
        cfg["max_position_embeddings"] = 131072
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    elif rope_scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    elif rope_scaling is not None:
        raise ValueError(f"rope_scaling must be llama3, linear or None, not {rope_scaling!r}")
    return cfg


def moe_layer(cfg: dict[str, Any], i: int) -> bool:
    """Is layer i a mixture of experts (the rule of transformers' decoder layers)?"""
    t = cfg["model_type"]
    if t not in MOE_FAMILIES:
        return False
    if t in ("mixtral", "olmoe"):
        return True
    return i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0


def mlp_specs(cfg: dict[str, Any], i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Layer i's feed-forward tensors: a dense gated MLP, or a router, routed experts (Hub names, one tensor
    each) and qwen2_moe's shared expert."""
    H, t, p = cfg["hidden_size"], cfg["model_type"], f"model.layers.{i}."
    if not moe_layer(cfg, i):
        I = cfg["intermediate_size"]
        return [(p + "mlp.gate_proj.weight", (I, H), "linear"), (p + "mlp.up_proj.weight", (I, H), "linear"),
                (p + "mlp.down_proj.weight", (H, I), "linear")]
    mlp = p + ("block_sparse_moe." if t == "mixtral" else "mlp.")
    E = cfg["num_local_experts"] if t == "mixtral" else cfg["num_experts"]
    I = cfg["intermediate_size"] if t in ("mixtral", "olmoe") else cfg["moe_intermediate_size"]
    names = ("w1", "w3", "w2") if t == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    specs = [(mlp + "gate.weight", (E, H), "linear")]
    for e in range(E):
        specs += [(f"{mlp}experts.{e}.{names[0]}.weight", (I, H), "linear"),
                  (f"{mlp}experts.{e}.{names[1]}.weight", (I, H), "linear"),
                  (f"{mlp}experts.{e}.{names[2]}.weight", (H, I), "linear")]
    if t == "qwen2_moe":
        S = cfg["shared_expert_intermediate_size"]
        specs += [(mlp + "shared_expert.gate_proj.weight", (S, H), "linear"),
                  (mlp + "shared_expert.up_proj.weight", (S, H), "linear"),
                  (mlp + "shared_expert.down_proj.weight", (H, S), "linear"),
                  (mlp + "shared_expert_gate.weight", (1, H), "linear")]
    return specs


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init kind) of every tensor, in Hugging Face naming and order."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    D = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    bias = cfg["model_type"] in ("qwen2", "qwen2_moe") or cfg.get("attention_bias", False)
    embed_kind = "head" if cfg["tie_word_embeddings"] else "embed"
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (V, H), embed_kind)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (H,), "norm")]
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            specs.append((p + f"self_attn.{name}.weight", (rows, H), "linear"))
            if bias:
                specs.append((p + f"self_attn.{name}.bias", (rows,), "bias"))
        specs.append((p + "self_attn.o_proj.weight", (H, q), "linear"))
        if cfg.get("attention_bias", False):
            specs.append((p + "self_attn.o_proj.bias", (H,), "bias"))
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            specs += [(p + "self_attn.q_norm.weight", (D,), "norm"), (p + "self_attn.k_norm.weight", (D,), "norm")]
        if cfg["model_type"] == "olmoe":  # over the whole q / k projection
            specs += [(p + "self_attn.q_norm.weight", (q,), "norm"), (p + "self_attn.k_norm.weight", (kv,), "norm")]
        specs.append((p + "post_attention_layernorm.weight", (H,), "norm"))
        specs += mlp_specs(cfg, i)
    specs.append(("model.norm.weight", (H,), "norm"))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, H), "head"))
    return specs


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
Spec = tuple[str, tuple[int, ...], str]


def stack_experts(specs: list[Spec]) -> tuple[list[Spec], dict[str, list[Spec]]]:
    """Per-expert specs -> transformers' stacked tensors (kind "stack"): `mlp.experts.gate_up_proj` [E, 2I, H]
    (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I]; Mixtral's
    `block_sparse_moe.` becomes `mlp.` as transformers names it. Every value is drawn from its per-expert
    (Hub) name's seed, so both layouts hold the same weights. Returns the specs and, for each stacked or
    renamed tensor, the Hub specs it is made of, in order."""
    out: list[Spec] = []
    parts: dict[str, list[Spec]] = {}
    experts: dict[str, set[str]] = {}
    for name, shape, kind in specs:
        m = _EXPERT.match(name)
        if m is None:
            new = name.replace(".block_sparse_moe.", ".mlp.")
            if new != name:
                parts[new] = [(name, shape, kind)]
            out.append((new, shape, "stack" if new != name else kind))
            continue
        layer, e, proj = m.groups()
        key = f"model.layers.{layer}.mlp.experts." + ("down_proj" if proj in ("down_proj", "w2") else "gate_up_proj")
        if key not in parts:
            parts[key], experts[key] = [], set()
            out.append((key, (), "stack"))
        parts[key].append((name, shape, kind))
        experts[key].add(e)
    shapes = {k: (len(experts[k]), sum(s[0] for _, s, _ in v) // len(experts[k]), v[0][1][1])
              for k, v in parts.items() if k in experts}
    return [(n, shapes.get(n, shape), kind) for n, shape, kind in out], parts


def init_tensor(name: str, shape: tuple[int, ...], kind: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Variance-preserving random init (logits get a spread of a few units, so greedy ties are rare)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if kind == "embed":
        pass  # std 1 (a tied embedding is initialised as a head: see tensor_specs)
    elif kind == "norm":
        x = 1.0 + 0.1 * x
    elif kind == "bias":
        x = 0.1 * x
    elif kind == "head":
        x = x * (2.0 / shape[1] ** 0.5)
    else:  # linear: std 1 / sqrt(fan_in)
        x = x / shape[1] ** 0.5
    return x.to(dtype)


def make_model(out: str | os.PathLike, family: str = "llama", size: str = "tiny", dtype: str = "float32",
               seed: int = 0, rope_scaling: str | None = None, tie: bool | None = None,
               shard_bytes: int | None = None, overrides: dict[str, Any] | None = None,
               progress: bool = False, head_dim: int | None = None, experts: str = "hub") -> Path:
    """Write the checkpoint into `out` (created; existing files of the same names are replaced).

    `experts` (MoE families): "hub" writes one tensor per expert matrix, "stacked" transformers' stacked ones.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, not {family!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, not {size!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = SIZES[size]
    tok = train_tokenizer(spec.vocab)
    vocab = spec.vocab if spec.exact_vocab else tok.get_vocab_size()
    cfg = model_config(family, spec, vocab, dtype, rope_scaling, spec.tie if tie is None else tie, head_dim,
                       MOE_SIZES.get(size, {}).get(family))
    cfg.update(overrides or {})
    torch_dtype = DTYPES[dtype]
    limit = shard_bytes or spec.shard_bytes

    specs, stacks = tensor_specs(cfg), {}
    if experts == "stacked":
        specs, stacks = stack_experts(specs)
    elif experts != "hub":
        raise ValueError(f"experts must be 'hub' or 'stacked', not {experts!r}")
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    used = 0
    for s in specs:
        nbytes = torch.Size(s[1]).numel() * torch_dtype.itemsize
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(s)
        used += nbytes
    for stale in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    bar = tqdm(total=sum(torch.Size(s[1]).numel() for s in specs) * torch_dtype.itemsize, unit="B",
               unit_scale=True, desc=f"writing {size} {family}", disable=not progress)
    for fname, shard in zip(names, shards):
        tensors = {}
        for name, shape, kind in shard:
            if kind == "stack":
                parts = [init_tensor(n, s, k, seed, torch_dtype) for n, s, k in stacks[name]]
                tensors[name] = torch.cat(parts).view(shape)
            else:
                tensors[name] = init_tensor(name, shape, kind, seed, torch_dtype)
            weight_map[name] = fname
            total += tensors[name].nbytes
            bar.update(tensors[name].nbytes)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save(str(out / "tokenizer.json"))
    # as real checkpoints ship it: without it transformers picks the family's tokenizer class, which may add its own
    # special tokens (Qwen2's <|endoftext|>) beyond the vocabulary (llama.cpp's converter then refuses the model)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": SPECIAL[0], "bos_token": SPECIAL[1],
         "eos_token": SPECIAL[2], "model_max_length": cfg["max_position_embeddings"]}, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--family", choices=FAMILIES, default="llama")
    ap.add_argument("--size", choices=tuple(SIZES), default="tiny")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rope-scaling", choices=("llama3", "linear"), default=None)
    ap.add_argument("--tie", choices=("yes", "no"), default=None, help="tie embeddings (default: per family)")
    ap.add_argument("--shard-mib", type=int, default=None, help="largest shard in MiB")
    ap.add_argument("--head-dim", type=int, default=None, help="head_dim (default: hidden / heads; qwen3: twice)")
    ap.add_argument("--experts", choices=("hub", "stacked"), default="hub",
                    help="MoE families: one tensor per expert matrix (hub) or transformers' stacked tensors")
    args = ap.parse_args(argv)
    path = make_model(args.out, args.family, args.size, args.dtype, args.seed, args.rope_scaling,
                      None if args.tie is None else args.tie == "yes",
                      args.shard_mib << 20 if args.shard_mib else None, progress=True, head_dim=args.head_dim,
                      experts=args.experts)
    print(path)


if __name__ == "__main__":
    main()
