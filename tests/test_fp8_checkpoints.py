"""Block-FP8 checkpoints (`quantization_config: {quant_method: fp8, weight_block_size: [..]}`, as DeepSeek-V3 and
the Qwen3 -FP8 releases ship): float8 e4m3 matrices with a float32 scale a block, read dense as transformers
dequantizes them; the greedy tokens equal transformers' own on the native path (Llama) and the transformers path
(Phi-3), resident and streamed from disk; packed int8 from them the same tokens in every placement; scales of
another shape refused in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from offload import Runner
from offload.errors import CheckpointError
from tests.conftest import run_config

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
PROMPTS = [[5, 17, 33, 2, 9, 100, 41, 7, 8, 12, 13], [3, 4, 200]]
NEW = 8
BLOCK = (32, 32)


def fp8_checkpoint(path: Path, family: str, bad_scales: bool = False) -> None:
    """A tiny checkpoint whose decoder matrices are float8 e4m3 codes with one float32 scale a 32 x 32 block
    (the block's largest value at 448, e4m3's largest), the rest float."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "phi3": ("Phi3Config", "Phi3ForCausalLM")}[family]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SIZES))
    model.save_pretrained(path)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [k for k, w in tensors.items() if ".layers." in k and k.endswith(".weight") and w.dim() == 2]:
        w = tensors[name]
        (r, c), (br, bc) = w.shape, BLOCK
        blocks = torch.nn.functional.pad(w, (0, -c % bc, 0, -r % br)).reshape(-(-r // br), br, -(-c // bc), bc)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448
        tensors[name] = (w / scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:r, :c]).to(torch.float8_e4m3fn)
        tensors[f"{name}_scale_inv"] = scale[:, :-1].contiguous() if bad_scales else scale
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (path / "config.json").write_text(json.dumps(raw))


def greedy(raw: dict) -> tuple[list[list[int]], str, set[str]]:
    with Runner(raw) as r:
        tokens = [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                             stop_on_eos=False)]
        return tokens, r.cfg.impl, set(r.plan.homes.values())


@pytest.mark.parametrize("family, impl", [("llama", "native"), ("phi3", "transformers")])
def test_an_fp8_checkpoint_gives_transformers_tokens_in_every_placement(tmp_path, family, impl):
    fp8_checkpoint(tmp_path / "model", family)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    with torch.no_grad():  # (on a CPU transformers dequantizes an FP8 checkpoint as it loads it)
        ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
                              )[0, len(p):].tolist() for p in PROMPTS]
    assert greedy(run_config(tmp_path / "model"))[:2] == (ref, impl)
    for weights, gpu in (({}, "700KiB"), ({"weights": {"quantization": "int8", "group_size": 32}}, "420KiB")):
        streamed = run_config(tmp_path / "model", **weights, prefetch={"depth": 1},
                              tiers={"gpu": {"capacity": gpu}, "cpu": {"capacity": "60KiB"},
                                     "disk": {"path": str(tmp_path / f"store{len(weights)}")}})
        tokens, _, homes = greedy(streamed)
        assert "disk" in homes and tokens == (ref if not weights else
                                              greedy(run_config(tmp_path / "model", **weights))[0])


def test_fp8_scales_of_another_shape_are_refused(tmp_path):
    fp8_checkpoint(tmp_path / "model", "llama", bad_scales=True)
    with pytest.raises(CheckpointError, match=r"is not the float32 scales \[\d+, \d+\] of 'model.layers.0.*' in "
                                              r"blocks of \[32, 32\]; the checkpoint does not match"):
        Runner(run_config(tmp_path / "model"))


def test_a_malformed_quantization_config_is_one_sentence_not_a_crash(tmp_path, tiny_llama):
    """Any checkpoint is asked whether it is FP8 as it opens: a quantization_config that is not a mapping still
    gets the format parser's sentence (the first FP8 reader took .get of it: AttributeError), and an FP8 one's
    block size that is not two positive sizes is named."""
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "plain")
    raw = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps(raw | {"quantization_config": "gptq"}))
    with pytest.raises(CheckpointError, match="quantization_config must be a mapping"):
        Runner(run_config(tmp_path / "plain"))
    fp8_checkpoint(tmp_path / "model", "llama")
    raw = json.loads((tmp_path / "model" / "config.json").read_text())
    raw["quantization_config"]["weight_block_size"] = [0, 32]
    (tmp_path / "model" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"weight_block_size \[0, 32\] is not two positive block sizes"):
        Runner(run_config(tmp_path / "model"))
