"""Reading Hugging Face checkpoints: `config.json` plus safetensors shards. Never unpickles.

Supported families: Llama (2, 3, 3.1 with llama3 / linear rope scaling), Mistral (sliding
window) and Qwen2 (q/k/v bias, tied embeddings, per-layer sliding windows). Tensors are read
by parsing the safetensors header ourselves and `preadv`-ing the bytes straight into the
destination buffer, so loading touches each byte once and maps no files (which keeps RSS
honest). This module knows checkpoint names and model shapes; it knows nothing about tiers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.errors import CheckpointError
from storage.io import preadv_into

log = logging.getLogger(__name__)

SUPPORTED = {
    # model_type -> architecture class name in config.json
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model, normalised from any of the supported config.json styles."""

    family: str  # llama | mistral | qwen2
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

    def layer_params(self) -> int:
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        return attn + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
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

        def need(key: str) -> Any:
            if key not in cfg:
                raise CheckpointError(f"{where}: missing key {key!r}; the checkpoint's config.json is incomplete")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_theta, scaling = _rope(cfg, where)
        if model_type == "llama":
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        elif model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = False
        windows = _sliding_windows(cfg, model_type, layers, where)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            family=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            sliding_windows=windows,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=dict(cfg),
        )


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
    if model_type == "mistral":
        return (int(window),) * layers
    # qwen2: explicit layer_types (transformers >= 4.53) or use_sliding_window + max_window_layers
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers:
            raise CheckpointError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if not cfg.get("use_sliding_window", False):
        return (None,) * layers
    first = int(cfg.get("max_window_layers", layers))
    return tuple(int(window) if i >= first else None for i in range(layers))


# ----------------------------------------------------------------------------- safetensors
@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes are inside a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorEntry], bytes]:
    """Parse a safetensors header (8-byte little-endian length + JSON); validate offsets against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: file too short to be safetensors; re-download or re-save the shard")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(size - 8, 100 * 2**20):
            raise CheckpointError(f"{path}: safetensors header length {hlen} is invalid; the file is corrupt")
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: safetensors header is not valid JSON; the file is corrupt") from None
    base = 8 + hlen
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _ST_DTYPES.get(info["dtype"])
        shape = tuple(int(s) for s in info["shape"])
        if base + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {base + end} but the file has {size}; "
                "the shard is truncated, re-download or re-save it"
            )
        if dtype is not None and math.prod(shape) * dtype.itemsize != end - start:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - start} bytes for shape {shape}; corrupt header")
        # a non-float tensor we never read is harmless; `Checkpoint.entry` refuses to read one
        entries[name] = TensorEntry(path, dtype if dtype is not None else torch.uint8, shape, base + start, end - start)
    return entries, raw


class Checkpoint:
    """A Hugging Face checkpoint directory: its `ModelConfig` and where every tensor's bytes are."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {str(self.path)!r} does not exist")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json; a Hugging Face checkpoint directory needs one")
        try:
            self.config_bytes = cfg_path.read_bytes()
            raw = json.loads(self.config_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e}); fix or re-download it") from None
        self.config = ModelConfig.from_dict(raw, str(cfg_path))
        self.files = self._find_files()
        self.entries: dict[str, TensorEntry] = {}
        self._headers: dict[Path, bytes] = {}
        for f in self.files:
            entries, raw_header = read_safetensors_header(f)
            self.entries.update(entries)
            self._headers[f] = raw_header
        self._prefix = self._detect_prefix()

    def _find_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index}: not a valid safetensors index (no weight_map)") from None
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(
                    f"{self.path}: the index lists shard {missing[0]!r} which is missing; download every shard"
                )
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        pickles = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt*")]
        if pickles:
            raise CheckpointError(
                f"{self.path}: only pickle weights ({pickles[0]}) found; Offload never unpickles files, "
                "convert them to safetensors (e.g. save_pretrained(..., safe_serialization=True))"
            )
        raise CheckpointError(f"{self.path}: no *.safetensors weights found; the checkpoint is incomplete")

    def _detect_prefix(self) -> str:
        for prefix in ("model.", "", "language_model.model."):
            if f"{prefix}embed_tokens.weight" in self.entries:
                return prefix
        raise CheckpointError(
            f"{self.path}: no embed_tokens.weight tensor; this is not a Llama-family checkpoint in Hugging Face naming"
        )

    # -- names --------------------------------------------------------------------------------
    def name(self, short: str) -> str:
        """Full checkpoint name of a short one (`layers.3.mlp.up_proj.weight`, `norm.weight`, `lm_head.weight`)."""
        if short == "lm_head.weight":
            if "lm_head.weight" in self.entries:
                return "lm_head.weight"
            # a few exporters keep the prefix on the head too
            return f"{self._prefix}lm_head.weight"
        return f"{self._prefix}{short}"

    def entry(self, short: str, shape: tuple[int, ...]) -> TensorEntry:
        full = self.name(short)
        e = self.entries.get(full)
        if e is None:
            raise CheckpointError(f"{self.path}: tensor {full!r} is missing; the checkpoint does not match its config")
        if e.shape != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {full!r} has shape {list(e.shape)} but config.json implies {list(shape)}; "
                "the weights and config.json do not belong together"
            )
        if e.dtype not in _ST_DTYPES.values():
            raise CheckpointError(
                f"{self.path}: tensor {full!r} is not a float tensor; quantized checkpoints are not supported"
            )
        return e

    def read_into(self, short: str, dest: torch.Tensor) -> None:
        """Copy a tensor into `dest` (any dtype/device, same shape), reading its bytes once."""
        e = self.entry(short, tuple(dest.shape))
        fd = os.open(e.file, os.O_RDONLY)
        try:
            if e.dtype == dest.dtype and dest.device.type == "cpu" and dest.is_contiguous():
                preadv_into(fd, dest, e.start, e.file)
            else:
                tmp = torch.empty(e.shape, dtype=e.dtype)
                preadv_into(fd, tmp, e.start, e.file)
                dest.copy_(tmp)
        finally:
            os.close(fd)

    def read(self, short: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.read_into(short, out)
        return out

    # -- identity -----------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A content hash that tells checkpoints apart without reading every byte.

        sha256 over config.json, each shard's size and header, and 16 sampled 4 KiB windows
        of each shard's data: different seeds, fine-tunes or truncations change it.
        """
        h = hashlib.sha256(self.config_bytes)
        for f in self.files:
            size = f.stat().st_size
            h.update(f.name.encode() + struct.pack("<Q", size) + self._headers[f])
            with open(f, "rb") as fh:
                for off in np.linspace(0, max(size - 4096, 0), 16).astype(np.int64):
                    fh.seek(int(off))
                    h.update(fh.read(4096))
        return h.hexdigest()
