"""The YAML schema: sizes, defaults, and one clear ConfigError per kind of mistake."""

from __future__ import annotations

import pytest

from offload.config import OffloadConfig, format_size, parse_size
from offload.errors import ConfigError, OffloadError


@pytest.mark.parametrize("text,expected", [
    (4096, 4096), ("512MiB", 512 * 2**20), ("20GiB", 20 * 2**30), ("1.5GB", 1_500_000_000),
    ("10 KB", 10_000), ("2TiB", 2 * 2**40), ("0", 0), ("3G", 3 * 2**30),
])
def test_sizes_parse_to_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "-1GiB", "GiB", True, [1], "1.2.3MB"])
def test_bad_size_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"tiers\.gpu\.capacity"):
        parse_size(bad, "tiers.gpu.capacity")


def test_format_size_round_trips_readably():
    assert format_size(512 * 2**20) == "512.00 MiB"
    assert format_size(100) == "100 B"


def test_full_schema_loads_from_yaml(tmp_path, tiny_llama):
    path = tmp_path / "run.yaml"
    path.write_text(f"""
model: {tiny_llama}
device: cpu
dtype: float16
tiers:
  gpu:  {{capacity: 20GiB}}
  cpu:  {{capacity: 48GiB, pinned: false}}
  disk: {{path: store, capacity: 500GiB}}
kv_cache: {{block_size: 32}}
prefetch: {{depth: 3}}
activations: {{prefill_chunk: 128}}
""")
    cfg = OffloadConfig.load(path)
    assert cfg.model == tiny_llama.resolve()
    assert (cfg.device, cfg.dtype) == ("cpu", "float16")
    assert cfg.tiers.gpu.capacity == 20 * 2**30
    assert cfg.tiers.cpu.capacity == 48 * 2**30 and cfg.tiers.cpu.pinned is False
    assert cfg.tiers.disk.path == (tmp_path / "store").resolve()  # relative to the YAML file
    assert cfg.kv_cache.block_size == 32 and cfg.prefetch.depth == 3 and cfg.activations.prefill_chunk == 128


def test_defaults_from_a_minimal_dict(tiny_llama):
    cfg = OffloadConfig.load({"model": str(tiny_llama)})
    assert cfg.device == "auto" and cfg.dtype == "auto" and cfg.tiers is None
    assert cfg.kv_cache.block_size == 16 and cfg.prefetch.depth == 2 and cfg.activations.prefill_chunk is None
    assert cfg.kv_cache.gpu_blocks is cfg.kv_cache.cpu_blocks is cfg.kv_cache.disk_blocks is None  # auto: fit
    assert cfg.to_dict()["model"] == str(tiny_llama.resolve())


def test_relative_model_path_is_resolved_from_the_yaml_directory(tmp_path, tiny_llama):
    (tmp_path / "cfg").mkdir()
    link = tmp_path / "models"
    link.symlink_to(tiny_llama.parent)
    path = tmp_path / "cfg" / "run.yaml"
    path.write_text(f"model: ../models/{tiny_llama.name}\n")
    assert OffloadConfig.load(path).model == tiny_llama.resolve()


@pytest.mark.parametrize("patch,match", [
    ({"prefech": {"depth": 1}}, r"prefech: unknown key; did you mean 'prefetch'\?"),
    ({"tiers": {"gpu": {"capacty": "1GiB"}}}, r"tiers\.gpu\.capacty: unknown key; did you mean 'capacity'\?"),
    ({"tiers": {"gpu": {"capacity": "lots"}}}, r"tiers\.gpu\.capacity: 'lots' is not a size"),
    ({"dtype": "float8"}, r"dtype: 'float8' is not supported.*float32, float16, bfloat16"),
    ({"dtype": "bfloat"}, r"did you mean 'bfloat16'"),
    ({"device": "tpu"}, r"device: 'tpu' is not a device"),
    ({"prefetch": {"depth": -1}}, r"prefetch\.depth: expected 'auto' or an integer from 0 to 64"),
    ({"kv_cache": {"block_size": 0}}, r"kv_cache\.block_size: expected an integer from 1 to 65536"),
    ({"activations": {"prefill_chunk": "big"}}, r"activations\.prefill_chunk: expected 'auto' or an integer"),
    ({"tiers": {"disk": {"capacity": "1GiB"}}}, r"tiers\.disk\.path: missing required key"),
    ({"tiers": {"cpu": {"pinned": "yes"}}}, r"tiers\.cpu\.pinned: expected true or false"),
    ({"kv_cache": 16}, r"kv_cache: expected a mapping"),
])
def test_each_bad_key_raises_one_clear_sentence(tiny_llama, patch, match):
    with pytest.raises(ConfigError, match=match) as info:
        OffloadConfig.load({"model": str(tiny_llama), **patch})
    assert isinstance(info.value, OffloadError)
    assert "\n" not in str(info.value)


def test_missing_model_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"model: checkpoint directory .*nowhere.* does not exist"):
        OffloadConfig.load({"model": str(tmp_path / "nowhere")})


def test_missing_model_key():
    with pytest.raises(ConfigError, match=r"model: missing required key"):
        OffloadConfig.load({"device": "cpu"})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .* does not exist"):
        OffloadConfig.load(tmp_path / "nope.yaml")


def test_broken_yaml_syntax_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: x\ntiers:\n  gpu: {capacity: 1GiB\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        OffloadConfig.load(path)


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- device\n")
    with pytest.raises(ConfigError, match=r"expected a mapping"):
        OffloadConfig.load(path)


def test_a_tilde_naming_no_user_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match=r"calibration: .* starts with ~ but names no user here"):
        OffloadConfig.load({"model": str(tiny_llama), "calibration": "~no-such-user-here/cal.json"})
