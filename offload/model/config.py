"""The shape of a Llama-family model, normalised from any supported `config.json` style.

Supported families: Llama (2, 3, 3.1-3.3 with llama3 / linear rope scaling, tied or not), Mistral
(sliding window, head_dim != hidden / heads), Qwen2 / Qwen2.5 (q/k/v bias, tied embeddings,
per-layer sliding windows) and Qwen3 (per-head RMSNorm of q and k before RoPE, no bias,
head_dim != hidden / heads); and the mixtures of experts Mixtral (sliding window, top-2 of 8), Qwen2-MoE
(a shared expert behind a sigmoid gate; dense layers by `decoder_sparse_step` / `mlp_only_layers`),
Qwen3-MoE (Qwen3 attention, `norm_topk_prob`) and OLMoE (q/k RMSNorm over the whole projection,
`clip_qkv`). Router settings that only matter to training (aux loss, jitter) are ignored. This module
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
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
#: Families whose MLPs are mixtures of experts, with transformers' defaults for keys a config.json leaves out.
MOE_DEFAULTS = {"mixtral": {"experts": 8, "top_k": 2}, "qwen2_moe": {"experts": 60, "top_k": 4, "width": 1408},
                "qwen3_moe": {"experts": 128, "top_k": 8, "width": 768}, "olmoe": {"experts": 64, "top_k": 8}}
MOE_FAMILIES = tuple(MOE_DEFAULTS)
ROPE_TYPES = ("default", "linear", "llama3")
#: Bounds on a config.json's sizes: several times the largest public models, so that a corrupt or hostile
#: config is refused here rather than by an allocation that cannot succeed.
LIMITS = {
    "hidden_size": 2**17, "intermediate_size": 2**19, "num_hidden_layers": 2**12, "num_attention_heads": 2**12,
    "num_key_value_heads": 2**12, "head_dim": 2**12, "vocab_size": 2**23, "max_position_embeddings": 2**25,
    "sliding_window": 2**25, "num_experts": 2**12, "num_local_experts": 2**12, "num_experts_per_tok": 2**12,
    "moe_intermediate_size": 2**19, "shared_expert_intermediate_size": 2**19, "decoder_sparse_step": 2**12,
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model, normalised from any of the supported config.json styles."""

    family: str  # llama | mistral | qwen2 | qwen3 | mixtral | qwen2_moe | qwen3_moe | olmoe
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
    qk_norm_whole: bool = False  # OLMoE: the q / k norm is over the whole projection ([Hq * D], [Hkv * D])
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] (after the norms)
    # mixtures of experts (num_experts 0: a dense model)
    num_experts: int = 0  # routed experts in each MoE layer
    experts_per_token: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # width of one routed expert's gated MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert, scaled by sigmoid(h @ gate)
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum 1 (Mixtral always does)
    moe_layers: tuple[bool, ...] = ()  # per layer: a mixture of experts (else the dense MLP); () when dense
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    impl: str = "native"  # native: Offload's math; transformers: transformers runs it (offload.model.generic)
    tensors: Any = field(default=None, repr=False)  # transformers: its GenericTensors (which tensors are a group)
    #: False: a compressed-tensors checkpoint leaves a decoder matrix float (its int codes are read dense then,
    #: not kept as Offload's int4 / int8: `offload.model.compressed.kept_format`)
    codes_kept: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (False,) * self.num_layers)
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

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    def layer_params(self) -> int:
        """Parameters of one decoder layer; of a MoE model, the largest layer with all its experts."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.is_moe:
            experts = self.num_experts * self.moe_intermediate_size + self.shared_expert_intermediate_size
            mlp = 3 * self.hidden_size * experts + (self.num_experts + 1) * self.hidden_size
        return attn + mlp + 2 * self.hidden_size

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
                    f"{where}: model_type {model_type!r} (architectures {archs}) is not supported natively; "
                    f"Offload runs {', '.join(SUPPORTED.values())} checkpoints with its own math, and other "
                    "causal LMs with transformers (model_impl: auto or transformers)"
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
        if model_type in ("llama", "qwen3", "qwen3_moe", "olmoe"):
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        elif model_type == "qwen2":
            qkv_bias, o_bias = True, False
        elif model_type == "qwen2_moe":
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        else:
            qkv_bias = o_bias = False
        windows = _sliding_windows(cfg, model_type, layers, where)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        bos = cfg.get("bos_token_id")
        if not all(_is_int(t) for t in eos_ids) or not (bos is None or _is_int(bos)):
            raise CheckpointError(f"{where}: bos_token_id / eos_token_id must be integers; fix config.json")
        del eps, theta  # checked above; _rope reads the same values
        moe = _moe(cfg, model_type, layers, where) if model_type in MOE_FAMILIES else {}
        clip = cfg.get("clip_qkv") if model_type == "olmoe" else None
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
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_whole=model_type == "olmoe",
            clip_qkv=None if clip is None else _positive(cfg, "clip_qkv", 1.0, where),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=dict(cfg),
            **moe,
        )


def quant_method(raw: Any) -> str:
    """A config.json's `quantization_config.quant_method`, lowercase ('' for a float checkpoint or no mapping)."""
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    return str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""


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


def _moe(cfg: dict[str, Any], model_type: str, layers: int, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a MoE family's config (ModelConfig keyword arguments)."""
    # absent keys take transformers' defaults for the family, as its loader does
    d = MOE_DEFAULTS[model_type]
    # (transformers 5 saves Qwen3-MoE's count as num_local_experts, Mixtral's name: either is read)
    keys = ("num_local_experts", "num_experts") if model_type == "mixtral" else ("num_experts", "num_local_experts")
    experts_key = next((k for k in keys if k in cfg), keys[0])
    experts = _size(cfg, experts_key, where, d["experts"])
    top_k = _size(cfg, "num_experts_per_tok", where, d["top_k"])
    if top_k > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok ({top_k}) exceeds the {experts} experts "
                              f"({experts_key}); the checkpoint's config is inconsistent")
    if model_type in ("mixtral", "olmoe"):  # every layer sparse; the experts are intermediate_size wide
        width, shared = _size(cfg, "intermediate_size", where), 0
    else:
        width = _size(cfg, "moe_intermediate_size", where, d["width"])
        shared = _size(cfg, "shared_expert_intermediate_size", where, 5632) if model_type == "qwen2_moe" else 0
    if model_type == "mixtral":  # Mixtral always renormalises its top-k probabilities
        return {"num_experts": experts, "experts_per_token": top_k, "norm_topk_prob": True,
                "moe_intermediate_size": width, "moe_layers": (True,) * layers}
    sparse = (True,) * layers
    if model_type in ("qwen2_moe", "qwen3_moe"):  # dense MLPs where mlp_only_layers or decoder_sparse_step say
        step = _size(cfg, "decoder_sparse_step", where, 1)
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(_is_int(i) and 0 <= i < layers for i in dense):
            raise CheckpointError(f"{where}: mlp_only_layers must list layer indices from 0 to {layers - 1}; "
                                  "fix config.json")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    norm = cfg.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise CheckpointError(f"{where}: norm_topk_prob is {str(norm)[:40]}, expected true or false; fix config.json")
    return {"num_experts": experts, "experts_per_token": top_k, "norm_topk_prob": norm,
            "moe_intermediate_size": width, "shared_expert_intermediate_size": shared, "moe_layers": sparse}


def _sliding_windows(cfg: dict[str, Any], model_type: str, layers: int, where: str) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    # olmoe has no window; qwen2_moe writes sliding_window 0 when use_sliding_window is off
    if model_type in ("llama", "olmoe") or not window:
        return (None,) * layers
    window = _size(cfg, "sliding_window", where)
    if model_type in ("mistral", "mixtral"):
        return (window,) * layers
    if model_type == "qwen3_moe":  # one mask for every layer when use_sliding_window
        return ((window,) if cfg.get("use_sliding_window", False) else (None,)) * layers
    # qwen2, qwen3: explicit layer_types (transformers >= 4.53) or use_sliding_window + max_window_layers
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers:
            raise CheckpointError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if not cfg.get("use_sliding_window", False):
        return (None,) * layers
    first = int(cfg.get("max_window_layers", layers))
    if model_type == "qwen2_moe":  # its config's default layer_types: every other layer, below max_window_layers
        return tuple(window if (i + 1) % 2 and i < first else None for i in range(layers))
    return tuple(window if i >= first else None for i in range(layers))
