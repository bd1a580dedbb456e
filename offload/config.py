"""The run configuration: a typed, validated view of the YAML file (or a dict).

```yaml
model: path/to/checkpoint-dir      # a Hugging Face style directory (relative to the YAML file),
                                    # or a Hub id: meta-llama/Llama-3.1-70B-Instruct[@revision]
model_impl: auto                    # native | transformers | auto (native when Offload knows the family)
device: cpu                         # cpu | cuda | cuda:N; default: cuda if available else cpu
dtype: bfloat16                     # float32 | float16 | bfloat16 | auto (the checkpoint's)
tiers:
  gpu:  {capacity: 20GiB}
  cpu:  {capacity: 48GiB, pinned: true}
  disk: {path: /nvme/offload, capacity: 500GiB}
kv_cache: {block_size: 16}
prefetch: {depth: 2}
activations: {prefill_chunk: auto}
weights: {quantization: int4, group_size: 64, keep: [lm_head]}
experts: {cache: auto, policy: lfu, prefetch: true, compute: auto}
```

Sizes are bytes as `int` everywhere inside; strings like "20GiB" exist only here. Every
error names the key path and says what is allowed. This module reads no weights.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offload.errors import ConfigError
from offload.fields import (
    MAX_INT,
    _bool,
    _bool_or_auto,
    _choice,
    _device,
    _int,
    _int_or_auto,
    _key_name,
    _names,
    _number,
    _opt,
    _short,
    _size_or_auto,
    _str,
    read_yaml,
)
from offload.fields import format_size as format_size  # re-exported: the config's sizes
from offload.fields import parse_size as parse_size
from offload.model import hub


# ----------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class GpuTierConfig:
    capacity: int | None = _opt(_size_or_auto, "bytes of device memory Offload may use; auto = free memory")


@dataclass(frozen=True)
class CpuTierConfig:
    capacity: int | None = _opt(_size_or_auto, "bytes of host RAM for weights homed on the host; auto = available")
    pinned: bool = _opt(_bool, "page-lock host slots so copies to CUDA are asynchronous (ignored on CPU)", True)


@dataclass(frozen=True)
class DiskTierConfig:
    path: Path | None = _opt(_str, "directory of the converted zarr store (created on first run)")
    capacity: int | None = _opt(_size_or_auto, "bytes the store may take on disk; auto = free space")
    page_cache: bool = _opt(_bool, "keep read pages in the OS page cache (only on machines with RAM to spare)",
                            False)
    verify: str = _opt(_choice("once", "always"), "check each chunk's crc32c on its first read in a run (once) or on "
                       "every read (always: one more pass over every streamed byte per step)", "once")
    direct_io: bool = _opt(_bool, "read with O_DIRECT into the page-aligned slots (no page-cache copy, no fadvise); "
                           "falls back to buffered reads where the file system refuses it", True)


@dataclass(frozen=True)
class TiersConfig:
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig, metadata={"section": GpuTierConfig})
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig, metadata={"section": CpuTierConfig})
    disk: DiskTierConfig | None = field(default=None, metadata={"section": DiskTierConfig})


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int = _opt(_int(1, 2**16), "tokens per KV block (all layers of those tokens live in one block)", 16)
    gpu_blocks: int | None = _opt(_int_or_auto(1), "blocks in the device pool; auto = sized from the request "
                                  "(no tiers), else 2048 tokens plus what the plan leaves free, shrunk to fit")
    cpu_blocks: int | None = _opt(_int_or_auto(0), "cold blocks kept in host RAM (counted in tiers.cpu.capacity); "
                                  "auto = what the cpu tier leaves free, at most 16384 tokens (0 without tiers)")
    disk_blocks: int | None = _opt(_int_or_auto(0), "cold blocks in a slot file under tiers.disk.path; auto = "
                                   "what the disk tier leaves free, at most 65536 tokens (0 without tiers.disk)")
    eviction: str = _opt(_choice("lru", "attention", "idle"), "which blocks leave the device first", "lru")
    idle_seconds: float = _opt(_number(0.0), "for eviction: idle, how long untouched makes a block idle", 30.0)
    quantization: str = _opt(_choice("none", "int8"), "cold blocks as int8 with per-block, per-head scales",
                             "none")
    cpu_attention: bool | None = _opt(_bool_or_auto, "attend host blocks on the CPU instead of moving them "
                                      "(auto: when the host's memory is faster than the link to the device)")
    prefix_cache: str = _opt(_choice("on", "off", "persist"), "full KV blocks found by their tokens and shared by "
                             "later requests with the same prompt prefix; persist: also kept on disk under "
                             "tiers.disk.path for later processes", "on")
    prefix_disk_blocks: int = _opt(_int(1, 2**31), "with prefix_cache: persist, the most blocks kept on disk "
                                   "(least recently used deleted first)", 4096)


@dataclass(frozen=True)
class PrefetchConfig:
    depth: int | None = _opt(_int_or_auto(0, 64), "layers in flight ahead of compute; 0 = load then compute; "
                             "auto = the depth the cost model predicts fastest", 2)


@dataclass(frozen=True)
class ActivationsConfig:
    prefill_chunk: int | None = _opt(_int_or_auto(1, 2**20), "prompt tokens per prefill forward pass (bounds "
                                     "activation memory); auto = prefill_chunk_max (512), fewer when the device tier "
                                     "cannot hold its workspace")
    prefill_chunk_max: int = _opt(_int(1, 2**20), "the largest chunk an automatic prefill_chunk tries (then "
                                  "256, 128, ... 16 below it, until its workspace fits); an explicit prefill_chunk "
                                  "is kept as given", 512)
    kv_restore: str = _opt(_choice("transfer", "recompute", "auto"), "cold KV blocks keep K/V (transfer) or the "
                           "layer inputs, rebuilt by one projection (recompute); auto: whichever is fewer bytes",
                           "transfer")


def _steps_or_all(value: Any, key: str) -> int | None:
    if value == "all":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
        raise ConfigError(f"{key}: expected 'all' or an integer from 1 to {MAX_INT}, got {_short(value)}")
    return value


def _layer_counts(value: Any, key: str) -> tuple[int, ...] | None:
    if value != "auto" and (not isinstance(value, (list, tuple)) or len(value) < 1 or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in value)):
        raise ConfigError(f"{key}: expected auto or a list of layer counts, one per rank (each at least 1, "
                          f"summing to the model's layers), got {_short(value)}")
    return None if value == "auto" else tuple(value)


@dataclass(frozen=True)
class DistributedConfig:  # read only under torchrun (WORLD_SIZE > 1): every rank runs the same command and YAML
    layers: tuple[int, ...] | None = _opt(_layer_counts, "layers per rank, in rank order (rank 0 embeds, the last "
                                          "rank holds the head); auto = balance the predicted stage times")
    backend: str = _opt(_choice("auto", "gloo", "nccl"), "torch.distributed backend; auto = nccl on CUDA, gloo on "
                        "CPU", "auto")
    micro_batches: int | None = _opt(_int_or_auto(1, 1024), "a pass's sequences split into this many micro-batches "
                                     "so that every rank computes at once; auto = one per rank for passes of at "
                                     "least 64 tokens a run when no rank streams weights, else the pass goes whole")
    timeout_s: float = _opt(_number(1.0), "a rank that has not answered a pass within this many seconds is taken "
                            "for dead or hung and every rank stops", 300.0)


#: drafts built from the target itself (the packed-weight path of `weights.quantization`)
SELF_DRAFTS = ("self-int4", "self-int8")


def _draft(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected none, self-int4, self-int8 or a draft checkpoint directory, got {value!r}")
    return value


@dataclass(frozen=True)
class TimelineConfig:
    keep_steps: int | None = _opt(_steps_or_all, "spans kept in memory: those of the last N steps (a long-lived "
                                  "process stays flat); all = every span (`run --trace` keeps all)", 512)


@dataclass(frozen=True)
class SpeculativeConfig:
    draft: str = _opt(_draft, "none | self-int4 | self-int8 | a draft checkpoint directory or Hub id (org/name"
                              "[@revision]) sharing the target's tokenizer", "none")
    tokens: int | None = _opt(_int_or_auto(1), "draft tokens proposed per pass; auto = the count the measured "
                              "acceptance and pass times predict fastest", 8)
    tree: bool = _opt(_bool, "greedy outputs branch on the draft's top 3 first tokens, each continued as a "
                             "chain and verified in a fork of the sequence in the same pass", False)
    #: the draft checkpoint directory (resolved); None for none and the self-* drafts
    path: Path | None = field(default=None, compare=False, metadata={"internal": True})
    #: a Hub draft's id: `path` is None until `OffloadConfig.fetched()` names its snapshot
    hub: str | None = field(default=None, compare=False, metadata={"internal": True})

    @property
    def enabled(self) -> bool:
        return self.draft != "none"


@dataclass(frozen=True)
class WeightsConfig:
    quantization: str = _opt(_choice("none", "int8", "int4"), "store and stream the weight matrices group-wise "
                             "quantized (asymmetric round-to-nearest along the input dimension)", "none")
    group_size: int = _opt(_int(2), "input columns sharing one scale and zero (must divide every input dim)", 64)
    keep: tuple[str, ...] = _opt(_names("qkv", "o", "gate_up", "down", "lm_head"),
                                 "matrices kept in the compute dtype (the LM head, when packed, is int8 even in an "
                                 "int4 format, as llama.cpp keeps its output matrix at 6-8 bits)", ())
    int4_activations: str = _opt(_choice("auto", "int8", "int16"), "on the CPU, bf16 activations meet int4 weights "
                                 "in int8 steps per group (llama.cpp's Q4_0 class: 1.3-1.5x faster products where "
                                 "the CPU has AVX-512 VNNI) or int16 steps (closer, and faster on a CPU without it); "
                                 "auto = int8 with AVX-512 VNNI, else int16 (one setting a process)", "auto")
    int8_activations: str = _opt(_choice("auto", "int8", "int16"), "on the CPU, bf16 activations meet int8 weights "
                                 "in int8 steps per group (llama.cpp's Q8_0 class: faster prefill and verify passes "
                                 "where the CPU has AVX-512 VNNI) or int16 steps (closer, and faster on a CPU without "
                                 "it); auto = int8 with AVX-512 VNNI, else int16 (one setting a process)", "auto")


@dataclass(frozen=True)
class ExpertsConfig:
    cache: int | None = _opt(_int_or_auto(0), "device slots of the expert cache that routed experts homed off the "
                             "device load into on demand (mixtures of experts); auto = what the device tier leaves "
                             "after the ring and KV; 0 = none (experts stream through the ring in pass order)")
    policy: str = _opt(_choice("lfu", "lru"), "which cached expert leaves first: lfu (decayed frequency, the recent "
                       "uses protected) or lru", "lfu")
    prefetch: bool = _opt(_bool, "load the next MoE layer's experts ahead, predicted by its router applied to the "
                          "current hidden state", True)
    compute: str = _opt(_choice("auto", "device", "host"), "where experts homed in host RAM are computed on CUDA: "
                        "moved to the device (device), computed on the host with their input moved (host), or "
                        "whichever the cost model predicts faster (auto); a CPU device reads them in place", "auto")


DTYPE_NAMES = ("float32", "float16", "bfloat16", "auto")


@dataclass(frozen=True)
class OffloadConfig:
    """Everything a run needs to know; build it with `OffloadConfig.load(path_or_dict)`."""

    model: Path = field(metadata={"parse": _str, "doc": "checkpoint directory (Hugging Face layout) or a Hub id "
                                                        "(org/name[@revision], fetched into the Hugging Face cache)"})
    model_impl: str = _opt(_choice("auto", "native", "transformers"),
                           "whose math runs the model: native (Offload's own, for the families it knows), "
                           "transformers (any causal LM, built by transformers with its weights streamed through "
                           "the tiers; needs the hf extra), auto = native when the family is supported", "auto")
    device: str = _opt(_device, "compute device: cpu, cuda, cuda:N or auto", "auto")
    dtype: str = _opt(_choice(*DTYPE_NAMES), "storage and transfer dtype of the weights (and compute dtype); "
                      "auto = the checkpoint's own, as `offload convert` stores by default", "auto")
    compute_dtype: str = _opt(_choice("auto", "float32", "float16", "bfloat16"),
                              "dtype of the math and the KV cache: auto = float32 on a CPU that multiplies "
                              "float32 1.5x faster than dtype (weights upcast after the transfer, every placement "
                              "alike; dtype where float32 cannot fit), else dtype",
                              "auto")
    tiers: TiersConfig | None = field(default=None, metadata={"section": TiersConfig})
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig, metadata={"section": KVCacheConfig})
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig, metadata={"section": PrefetchConfig})
    activations: ActivationsConfig = field(default_factory=ActivationsConfig,
                                           metadata={"section": ActivationsConfig})
    weights: WeightsConfig = field(default_factory=WeightsConfig, metadata={"section": WeightsConfig})
    timeline: TimelineConfig = field(default_factory=TimelineConfig, metadata={"section": TimelineConfig})
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig,
                                           metadata={"section": SpeculativeConfig})
    experts: ExpertsConfig = field(default_factory=ExpertsConfig, metadata={"section": ExpertsConfig})
    distributed: DistributedConfig = field(default_factory=DistributedConfig,
                                           metadata={"section": DistributedConfig})
    calibration: Path | None = _opt(_str, "calibration file from `offload calibrate` (default: the saved one, if any)")
    #: where a YAML file was loaded from (relative paths are resolved against its directory)
    source: Path | None = field(default=None, compare=False, metadata={"internal": True})
    #: the Hub id `model:` named (None: a local directory); `model` is then the id itself until `fetched()`
    #: names its snapshot in the Hugging Face cache (a runner fetches when it starts; loading never does)
    hub: str | None = field(default=None, metadata={"internal": True})

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any], model: str | None = None) -> OffloadConfig:
        """Load from a YAML file or a dict (`model` overrides its model:); ConfigError names the key on bad input."""
        if isinstance(source, Mapping):
            data = dict(source) | ({"model": model} if model else {})
            return _build(cls, data, "", base_dir=Path.cwd(), source=None)
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file")
        data = read_yaml(path)
        data = dict(data) | ({"model": model} if model else {})
        return _build(cls, data, "", base_dir=path.resolve().parent, source=path.resolve())

    def to_dict(self) -> dict[str, Any]:
        def conv(obj: Any) -> Any:
            if dataclasses.is_dataclass(obj):
                return {f.name: conv(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                        if not f.metadata.get("internal")}
            return str(obj) if isinstance(obj, Path) else obj
        return conv(self) | ({"model": self.hub} if self.hub else {})

    def replace(self, **changes: Any) -> OffloadConfig:
        return dataclasses.replace(self, **changes)

    def fetched(self, weights: bool = True) -> OffloadConfig:
        """This config with its Hub checkpoints (`model:` and a speculative draft given as org/name) in the local
        Hugging Face cache, downloading what is missing (`weights=False`: config and tokenizer files only, what
        a plan needs); `model` (and `speculative.path`) then name the snapshot directories. Loading a config
        never downloads: a runner calls this when it starts."""
        config = self
        if self.hub:
            config = config.replace(model=hub.fetch(self.hub, weights=weights))
        spec = config.speculative
        if spec.hub:
            path = hub.fetch(spec.hub, weights=weights, key="speculative.draft")
            config = config.replace(speculative=dataclasses.replace(spec, path=path))
        return config


def _build(cls: type, data: Mapping[str, Any], prefix: str, base_dir: Path, source: Path | None) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {_short(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in data:
        if key not in fields:
            hint = difflib.get_close_matches(_key_name(key), list(fields), n=1)
            did = f"did you mean {hint[0]!r}? " if hint else ""
            raise ConfigError(f"{prefix}{_key_name(key)}: unknown key; {did}allowed here: {', '.join(fields)}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{prefix}{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}: missing required key; {f.metadata.get('doc', '')}")
            continue
        value = data[name]
        if "section" in f.metadata:
            values[name] = _build(f.metadata["section"], value if value is not None else {}, key + ".",
                                  base_dir, source)
        else:
            values[name] = f.metadata["parse"](value, key)
    if cls is OffloadConfig:
        values["source"] = source
        if hub.is_hub_id(values["model"], base_dir):  # fetched when a runner starts (`fetched`), not now
            values["hub"] = values["model"]
            values["model"] = Path(values["model"])
        else:
            values["model"] = _model_dir(values["model"], base_dir)
        if values.get("calibration") is not None:
            values["calibration"] = _resolve(values["calibration"], base_dir, prefix + "calibration")
    if cls is DiskTierConfig:
        if "path" not in values:
            raise ConfigError(f"{prefix}path: missing required key; the disk tier needs a directory for its store")
        values["path"] = _resolve(values["path"], base_dir, prefix + "path")
    if cls is SpeculativeConfig and values.get("draft", "none") not in ("none", *SELF_DRAFTS):
        if hub.is_hub_id(values["draft"], base_dir):  # fetched with the model (`OffloadConfig.fetched`)
            values["hub"] = values["draft"]
        else:
            values["path"] = _draft_dir(values["draft"], base_dir, prefix + "draft")
    return cls(**values)


def _resolve(value: str, base_dir: Path, key: str) -> Path:
    """A path from the config, `~` expanded and relative to the config file's directory."""
    try:
        return (base_dir / Path(value).expanduser()).resolve()
    except RuntimeError:  # `~name` of a user this machine does not know
        raise ConfigError(f"{key}: {_short(value)} starts with ~ but names no user here; write the path out") from None


def _draft_dir(value: str, base_dir: Path, key: str) -> Path:
    path = _resolve(value, base_dir, key)
    if not path.is_dir():
        raise ConfigError(
            f"{key}: {value!r} is neither none, self-int4, self-int8 nor a checkpoint directory; give the path of a "
            "draft checkpoint (config.json, *.safetensors, the target's tokenizer) or a Hub id (org/name)"
        )
    return path


def _model_dir(value: str, base_dir: Path) -> Path:
    path = _resolve(value, base_dir, "model")
    if not path.is_dir():
        raise ConfigError(
            f"model: checkpoint directory {str(path)!r} does not exist; point it at a directory with "
            "config.json and *.safetensors (relative paths are resolved from the config file's directory), "
            "or give a Hub id like org/name"
        )
    return path


def cache_dir() -> Path:
    """Where Offload keeps what it makes for itself: the demo model, the saved calibration."""
    if os.environ.get("OFFLOAD_CACHE"):
        return Path(os.environ["OFFLOAD_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "offload"
