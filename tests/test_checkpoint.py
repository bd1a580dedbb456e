"""Checkpoint reading: supported layouts as other tools write them, and one clear error per bad checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.errors import CheckpointError
from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig
from offload.runtime.runner import Runner
from tests.conftest import run_config


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def greedy(path: Path, n: int = 8, **cfg) -> list[int]:
    with Runner.from_config(run_config(path, **cfg)) as r:
        return r.generate([[1, 5, 9, 13, 200]], max_new_tokens=n, stop_on_eos=False)[0].token_ids


def test_sharded_checkpoint_reads_config_and_every_tensor(tiny_llama):
    ck = Checkpoint(tiny_llama)
    cfg = ck.config
    assert isinstance(cfg, ModelConfig) and cfg.family == "llama"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 4, 2, 32)
    assert len(ck.files) > 1  # the tiny model is written in several shards with an index
    ref = all_tensors(tiny_llama)
    q = ck.read("layers.1.self_attn.q_proj.weight", (128, 128), torch.float32)
    assert torch.equal(q, ref["model.layers.1.self_attn.q_proj.weight"])


def test_single_file_without_prefix_gives_the_same_tokens(tmp_path, tiny_llama):
    """Exported by tools that save the bare decoder (no `model.` prefix) into one model.safetensors."""
    dst = tmp_path / "flat"
    dst.mkdir()
    shutil.copy(tiny_llama / "config.json", dst)
    tensors = {k.removeprefix("model."): v for k, v in all_tensors(tiny_llama).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    assert greedy(dst) == greedy(tiny_llama)


def test_sharded_without_index_and_with_stray_buffers(tmp_path, tiny_llama):
    """Shards without an index file, plus an old rotary `inv_freq` buffer, still load."""
    dst = copy_ckpt(tiny_llama, tmp_path / "noindex")
    (dst / "model.safetensors.index.json").unlink()
    save_file({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}, str(dst / "extra.safetensors"))
    assert greedy(dst) == greedy(tiny_llama)


def test_bfloat16_checkpoint_runs_in_float32(model_factory):
    path = model_factory("llama", dtype="bfloat16")
    ck = Checkpoint(path)
    assert ck.entries["model.norm.weight"].dtype == torch.bfloat16
    assert len(greedy(path)) == 8


def test_v5_style_rope_parameters_are_read(tmp_path, model_factory):
    src = model_factory("llama", rope_scaling="llama3")
    dst = copy_ckpt(src, tmp_path / "v5")
    cfg = json.loads((dst / "config.json").read_text())
    params = dict(cfg.pop("rope_scaling"), rope_theta=cfg.pop("rope_theta"))
    cfg["rope_parameters"] = params
    (dst / "config.json").write_text(json.dumps(cfg))
    assert Checkpoint(dst).config.rope_scaling == Checkpoint(src).config.rope_scaling
    assert Checkpoint(dst).config.rope_theta == 500000.0


def test_qwen2_sliding_window_layers():
    base = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
            "intermediate_size": 128, "vocab_size": 100, "sliding_window": 8}
    assert ModelConfig.from_dict(base).sliding_windows == (None,) * 4
    on = ModelConfig.from_dict(base | {"use_sliding_window": True, "max_window_layers": 2})
    assert on.sliding_windows == (None, None, 8, 8)
    types = ["full_attention", "sliding_attention"] * 2
    assert ModelConfig.from_dict(base | {"layer_types": types}).sliding_windows == (None, 8, None, 8)
    assert ModelConfig.from_dict(base | {"model_type": "mistral"}).sliding_windows == (8,) * 4


# ----------------------------------------------------------------------------- bad checkpoints
def _break(tmp_path: Path, src: Path, how: str) -> Path:
    dst = copy_ckpt(src, tmp_path / how)
    shards = sorted(dst.glob("model-*.safetensors"))
    if how == "unsupported_arch":
        rewrite_config(dst, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    elif how == "pickle_only":
        for f in dst.glob("*.safetensors"):
            f.unlink()
        (dst / "model.safetensors.index.json").unlink()
        (dst / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    elif how == "no_config":
        (dst / "config.json").unlink()
    elif how == "bad_json_config":
        (dst / "config.json").write_text("{ this is not json")
    elif how == "missing_shard":
        shards[-1].unlink()
    elif how == "truncated_shard":
        data = shards[0].read_bytes()
        shards[0].write_bytes(data[: len(data) // 2])
    elif how == "garbage_header":
        shards[0].write_bytes(b"\xff" * 64)
    elif how == "shape_mismatch":
        rewrite_config(dst, intermediate_size=999)
    elif how == "missing_tensor":
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        name = "model.layers.2.mlp.down_proj.weight"
        shard = dst / index["weight_map"][name]
        tensors = {k: v for k, v in load_file(shard).items() if k != name}
        save_file(tensors, str(shard))
    elif how == "rope_yarn":
        rewrite_config(dst, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    elif how == "gelu":
        rewrite_config(dst, hidden_act="gelu")
    elif how == "missing_key":
        rewrite_config(dst, num_hidden_layers=None)
    elif how == "bad_gqa":
        rewrite_config(dst, num_key_value_heads=3)
    elif how == "no_weights":
        for f in dst.glob("*.safetensors"):
            f.unlink()
        (dst / "model.safetensors.index.json").unlink()
    return dst


@pytest.mark.parametrize("how,match", [
    # not a native family: transformers builds GPT-NeoX, whose modules the Llama tensors do not name
    ("unsupported_arch", r"tensor 'model.layers.0.input_layernorm.weight' names no module of transformers' GPTNeoX"),
    ("pickle_only", r"only pickle weights \(pytorch_model.bin\).*never unpickles.*safetensors"),
    ("no_config", r"no config.json"),
    ("bad_json_config", r"config.json: not valid JSON"),
    ("missing_shard", r"the index lists shard .* which is missing"),
    ("truncated_shard", r"truncated|too short|header"),
    ("garbage_header", r"header length .* is invalid|not valid JSON"),
    ("shape_mismatch", r"has shape \[.*\] but config.json implies"),
    ("missing_tensor", r"tensor 'model.layers.2.mlp.down_proj.weight' is missing"),
    ("rope_yarn", r"rope scaling type 'yarn' is not supported"),
    ("gelu", r"hidden_act 'gelu' is not supported"),
    ("missing_key", r"missing key 'num_hidden_layers'"),
    ("bad_gqa", r"not a multiple of num_key_value_heads"),
    ("no_weights", r"no \*.safetensors weights found"),
])
def test_each_bad_checkpoint_raises_one_clear_sentence(tmp_path, tiny_llama, how, match):
    path = _break(tmp_path, tiny_llama, how)
    with pytest.raises(CheckpointError, match=match) as info:
        Runner.from_config(run_config(path))
    assert "\n" not in str(info.value)


def test_an_unsupported_family_forced_native_is_refused_naming_the_families(tmp_path, tiny_llama):
    path = _break(tmp_path, tiny_llama, "unsupported_arch")
    with pytest.raises(CheckpointError, match=r"'gpt_neox'.*not supported natively; Offload runs LlamaForCausalLM, "
                       r"MistralForCausalLM, Qwen2.*\(model_impl: auto or transformers\)"):
        Runner.from_config(run_config(path, model_impl="native"))


def test_fingerprint_tells_seeds_apart(model_factory, tmp_path, tiny_llama):
    a = Checkpoint(tiny_llama).fingerprint()
    assert a == Checkpoint(copy_ckpt(tiny_llama, tmp_path / "copy")).fingerprint()  # a copy is the same model
    assert a != Checkpoint(model_factory("llama", seed=1)).fingerprint()
