"""The checkpoint generator: deterministic, Hugging Face layout, no transformers needed."""

from __future__ import annotations

import json
import subprocess
import sys

from safetensors.torch import load_file

from offload.testing.make_model import SIZES, make_model, tensor_specs


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = make_model(tmp_path / "a", "mistral", "tiny", seed=5)
    b = make_model(tmp_path / "b", "mistral", "tiny", seed=5)
    c = make_model(tmp_path / "c", "mistral", "tiny", seed=6)
    for f in sorted(a.glob("*.safetensors")):
        assert f.read_bytes() == (b / f.name).read_bytes()
    first = "model-00001-of-00004.safetensors"
    assert (a / first).read_bytes() != (c / first).read_bytes()


def test_layout_index_and_tokenizer(tmp_path):
    path = make_model(tmp_path / "q", "qwen2", "tiny")
    cfg = json.loads((path / "config.json").read_text())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    names = {n for n, _, _ in tensor_specs(cfg)}
    assert set(index["weight_map"]) == names
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.bias" in names  # qwen2 has q/k/v bias
    loaded = {}
    for f in set(index["weight_map"].values()):
        loaded.update(load_file(path / f))
    assert set(loaded) == names
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert tok.encode("café 東京").ids[0] == 1 and tok.decode(tok.encode("café 東京").ids) == "café 東京"


def test_small_size_is_about_55m_parameters():
    s = SIZES["small"]
    cfg = {"hidden_size": s.hidden, "intermediate_size": s.intermediate, "vocab_size": s.vocab, "head_dim": 64,
           "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "num_hidden_layers": s.layers,
           "model_type": "llama", "tie_word_embeddings": False}
    import math
    params = sum(math.prod(shape) for _, shape, _ in tensor_specs(cfg))
    assert 50e6 < params < 60e6


def test_runs_without_transformers(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from offload.testing.make_model import main\n"
            f"main(['--out', r'{tmp_path / 'm'}', '--family', 'llama', '--size', 'tiny', '--rope-scaling', 'llama3'])")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
