"""The shape of a Llama-family model, normalised from any supported `config.json` style.

Supported families: Llama (2, 3, 3.1-3.3 with llama3 / linear rope scaling, tied or not), Mistral
(sliding window, head_dim != hidden / heads), Qwen2 / Qwen2.5 (q/k/v bias, tied embeddings,
per-layer sliding windows) and Qwen3 (per-head RMSNorm of q and k before RoPE, no bias,
head_dim != hidden / heads). This module
reads one dict; it knows nothing about weights, files or tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from offload.errors import CheckpointError

SUPPORTED = {
    # model_type -> architecture class name in config.json
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")
#: Bounds on a config.json's sizes: several times the largest public models, so that a corrupt or hostile
#: config is refused here rather than by an allocation that cannot succeed.
LIMITS = {
    "hidden_size": 2**17, "intermediate_size": 2**19, "num_hidden_layers": 2**12, "num_attention_heads": 2**12,
    "num_key_value_heads": 2**12, "head_dim": 2**12, "vocab_size": 2**23, "max_position_embeddings": 2**25,
    "sliding_window": 2**25,
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model, normalised from any of the supported config.json styles."""

    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # normalised, with "rope_type"; None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of every q and k head, before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}); the checkpoint's config is inconsistent"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Every key is checked for type and range; whatever else is malformed is still one CheckpointError."""
        try:
            return cls._from_dict(cfg, where)
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
            raise CheckpointError(f"{where}: malformed ({type(e).__name__}: {str(e)[:120]}); "
                                  "fix or re-download the checkpoint's config.json") from None

    @classmethod
    def _from_dict(cls, cfg: dict[str, Any], where: str) -> ModelConfig:
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED:
            by_arch = [t for t, a in SUPPORTED.items() if a in archs]
            if not by_arch:
                raise CheckpointError(
                    f"{where}: model_type {model_type!r} (architectures {archs}) is not supported; "
                    f"Offload runs {', '.join(SUPPORTED.values())} checkpoints"
                )
            model_type = by_arch[0]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{where}: hidden_act {act!r} is not supported; Llama-family models use 'silu'")

        def need(key: str) -> int:
            if key not in cfg:
                raise CheckpointError(f"{where}: missing key {key!r}; the checkpoint's config.json is incomplete")
            return _size(cfg, key, where)

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        layers = need("num_hidden_layers")
        if cfg.get("head_dim") is None and hidden % heads:
            raise CheckpointError(f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                                  f"({heads}) and no head_dim is given; the checkpoint's config is inconsistent")
        head_dim = _size(cfg, "head_dim", where) if cfg.get("head_dim") is not None else hidden // heads
        kv_heads = _size(cfg, "num_key_value_heads", where) if cfg.get("num_key_value_heads") else heads
        eps, theta = _positive(cfg, "rms_norm_eps", 1e-6, where), _positive(cfg, "rope_theta", 10000.0, where)
        rope_theta, scaling = _rope(cfg, where)
        if model_type in ("llama", "qwen3"):
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        elif model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = False
        windows = _sliding_windows(cfg, model_type, layers, where)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        bos = cfg.get("bos_token_id")
        if not all(_is_int(t) for t in eos_ids) or not (bos is None or _is_int(bos)):
            raise CheckpointError(f"{where}: bos_token_id / eos_token_id must be integers; fix config.json")
        del eps, theta  # checked above; _rope reads the same values
        return cls(
            family=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=_size(cfg, "max_position_embeddings", where, 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            sliding_windows=windows,
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=dict(cfg),
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _size(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    """cfg[key] as a positive integer within LIMITS[key] (or `default` when absent)."""
    v = cfg.get(key, default)
    if not _is_int(v) or not 1 <= v <= LIMITS[key]:
        raise CheckpointError(f"{where}: {key} is {str(v)[:40]}, expected an integer from 1 to {LIMITS[key]}; "
                              "the checkpoint's config.json is corrupt")
    return v


def _positive(cfg: dict[str, Any], key: str, default: float, where: str) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e30:
        raise CheckpointError(f"{where}: {key} is {str(v)[:40]}, expected a positive number; fix config.json")
    return float(v)


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling dict, from the v4 (`rope_theta` + `rope_scaling`) or v5 (`rope_parameters`) style."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = float(params["rope_theta"]), dict(params)
    else:
        theta, scaling = float(cfg.get("rope_theta", 10000.0)), dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"{where}: rope scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = rope_type
    if "factor" not in scaling:
        raise CheckpointError(f"{where}: rope scaling of type {rope_type!r} needs a 'factor'")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise CheckpointError(f"{where}: llama3 rope scaling needs {key!r}")
    return theta, scaling


def _sliding_windows(cfg: dict[str, Any], model_type: str, layers: int, where: str) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None:
        return (None,) * layers
    window = _size(cfg, "sliding_window", where)
    if model_type == "mistral":
        return (window,) * layers
    # qwen2, qwen3: explicit layer_types (transformers >= 4.53) or use_sliding_window + max_window_layers
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers:
            raise CheckpointError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if not cfg.get("use_sliding_window", False):
        return (None,) * layers
    first = int(cfg.get("max_window_layers", layers))
    return tuple(window if i >= first else None for i in range(layers))
