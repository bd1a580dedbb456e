"""int8 / int4 blocks of a model transformers runs (model_impl: transformers) are multiplied as they lie
(`offload.hf.packed`): a Linear's weight and the routed experts of transformers' experts modules go through the
packed kernels, never dequantized, and give the logits transformers' own modules give on the same (dequantized)
weights; experts a checkpoint keeps stacked [E, ...] are packed too, and where they cannot be multiplied packed
(gpt-oss's transposed ones) only the routed experts' rows are dequantized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload import Runner
from offload.hf import packed as packing
from offload.model import kernels
from offload.model.generic import transposed_experts
from offload.weights import quant
from tests.conftest import run_config

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, pad_token_id=0)
PROMPT = [5, 17, 33, 2, 9, 100, 41, 7]
NEW = 8


def save(path: Path, model: torch.nn.Module) -> Path:
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def phimoe(tmp_path_factory) -> Path:
    """Phi-MoE: 8 experts of 2 routed, stored one by one (transformers stacks them [E, 2I, H] as it loads)."""
    torch.manual_seed(0)
    config = transformers.PhimoeConfig(**SIZES, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    return save(tmp_path_factory.mktemp("phimoe"), transformers.PhimoeForCausalLM(config))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, list[int]]:
    """gpt-oss in float: its experts stacked in the checkpoint, transposed ([E, H, 2I]), with biases; and
    transformers' greedy tokens."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**SIZES, head_dim=16, intermediate_size=64, num_local_experts=8,
                                       num_experts_per_tok=2, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention"])
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        ref = model.eval().generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW,
                                    do_sample=False)[0, len(PROMPT):].tolist()
    return save(tmp_path_factory.mktemp("gpt_oss"), model), ref


def run(raw: dict) -> tuple[torch.Tensor, list[int]]:
    with Runner(raw) as r:
        assert r.cfg.impl == "transformers"
        logits = r.prefill_logits([PROMPT])[0]
        tokens = r.generate([PROMPT], max_new_tokens=NEW, temperature=0, stop_on_eos=False)[0].outputs[0].token_ids
    return logits, tokens


def streamed(raw: dict, gpu: str, store: Path) -> list[int]:
    """The greedy tokens with the blocks streamed from a disk store through `gpu` of device memory."""
    raw = raw | {"prefetch": {"depth": 1}, "tiers": {"gpu": {"capacity": gpu}, "cpu": {"capacity": "60KiB"},
                                                       "disk": {"path": str(store)}}}
    with Runner(raw) as r:
        assert "disk" in r.plan.homes.values()
        return r.generate([PROMPT], max_new_tokens=NEW, temperature=0, stop_on_eos=False)[0].outputs[0].token_ids


def counting(monkeypatch) -> list[int]:
    """The rows every dequantization produces, in order."""
    rows, real = [], quant.dequantize

    def spy(q, sz, out=None):
        d = real(q, sz, out)
        rows.append(d.shape[0])
        return d

    monkeypatch.setattr(quant, "dequantize", spy)
    return rows


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_packed_linears_and_experts_are_multiplied_as_they_lie_giving_transformers_logits(phimoe, scheme,
                                                                                          monkeypatch, tmp_path):
    """Nothing is dequantized (before: every Linear's and all 8 experts' matrices, each pass), the logits are those
    of transformers' own modules on the dequantized weights, and streaming from disk gives the same tokens."""
    raw = run_config(phimoe, weights={"quantization": scheme, "group_size": 32})
    dequantized = counting(monkeypatch)
    logits, tokens = run(raw)
    assert dequantized == []
    assert streamed(raw, "400KiB", tmp_path / "store") == tokens
    monkeypatch.setattr(packing, "multipliable", lambda *_: False)  # transformers' modules, dequantized
    want, _ = run(raw)
    assert dequantized
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_experts_stacked_transposed_in_the_checkpoint_pack_as_each_experts_transpose(gpt_oss, monkeypatch, tmp_path):
    """gpt-oss's float checkpoint keeps its experts stacked as its module holds them, transposed [E, H, 2I]: they ran
    dense whatever weights.quantization said (the bulk of the model); now packed as each expert's transpose and
    multiplied as they lie, nothing dequantized, the logits those of transformers' modules on the same weights."""
    path, ref = gpt_oss
    dense, tokens = run(run_config(path))
    assert tokens == ref  # (float: transformers' own tokens, the experts read as their rows one after another)
    raw = run_config(path, weights={"quantization": "int8", "group_size": 32})
    with Runner(run_config(path)) as d, Runner(raw) as p:
        assert p.plan.sizes["layer.0"] < d.plan.sizes["layer.0"] / 1.8
    dequantized = counting(monkeypatch)
    logits, tokens = run(raw)
    assert dequantized == []
    assert ((logits - dense).norm() / dense.norm()).item() < 0.02
    assert streamed(raw, "600KiB", tmp_path / "store") == tokens
    monkeypatch.setattr(packing, "multipliable", lambda *_: False)  # transformers' experts loop, dequantized
    want, _ = run(raw)
    assert dequantized
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_experts_that_cannot_be_multiplied_packed_dequantize_only_the_routed_ones(tmp_path, monkeypatch):
    """Experts whose rows do not fill whole tiles of 64 (2I = 32 here) are dequantized for transformers' own loop:
    a step of one token dequantizes the rows of the 2 experts routed to (before: all 8), and the logits are those
    of every expert dequantized."""
    torch.manual_seed(0)
    config = transformers.PhimoeConfig(**SIZES, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
    raw = run_config(save(tmp_path / "m", transformers.PhimoeForCausalLM(config)),
                     weights={"quantization": "int8", "group_size": 16})
    dequantized = counting(monkeypatch)
    with Runner(raw) as r:
        dequantized.clear()  # (a one-token prompt: every pass routes one row to 2 experts of 8)
        r.generate([PROMPT[:1]], max_new_tokens=4, temperature=0, stop_on_eos=False)
    # (dequantized in whole tiles of 64 rows: an expert's 32 of gate_up's 256, its 64 of down_proj's 512)
    assert dequantized and max(dequantized) <= 2 * 64 < 256
    logits, tokens = run(raw)
    monkeypatch.setattr(packing, "routed", lambda *_: None)  # every expert dequantized
    want, every = run(raw)
    assert torch.equal(logits, want) and every == tokens


def test_dense_linears_multiply_through_offloads_kernels_and_keep_transformers_tokens(phimoe, monkeypatch):
    """A dense Linear (the LM head, attention's projections) and a routed expert multiply by the kernels the native
    path's dense products use (torch's bf16 product of one row read an LM head at a fraction of the memory's speed:
    a Gemma 3 of 211 M decoded at 14.8 tok/s, 27.9 now); bf16 greedy tokens stay transformers' own."""
    model = transformers.AutoModelForCausalLM.from_pretrained(phimoe, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False)[0, len(PROMPT):].tolist()
    shapes, real = [], kernels.dense_linear
    monkeypatch.setattr(kernels, "dense_linear", lambda x, w, bias=None: shapes.append(tuple(w.shape)) or
                        real(x, w, bias))
    with Runner(run_config(phimoe, dtype="bfloat16")) as r:
        tokens = r.generate([PROMPT], max_new_tokens=NEW, temperature=0, stop_on_eos=False)[0].outputs[0].token_ids
    assert (256, 64) in shapes and (64, 32) in shapes and tokens == ref  # (the LM head; an expert's down_proj)


@pytest.mark.parametrize(("hidden", "gate_up", "down", "transposed"), [
    (2880, (2880, 5760), (2880, 2880), True),  # gpt-oss-20b: down is square (I = H), gate_up tells
    (2048, (2048, 2048), (2048, 1024), False),  # OLMoE's shape: gate_up is square (2I = H), down tells
    (4096, (28672, 4096), (4096, 14336), False),  # Mixtral's
    (64, (64, 128), (64, 64), True),
])
def test_the_orientation_of_stacked_experts_is_told_by_the_hidden_size(hidden, gate_up, down, transposed):
    """Which stacked experts their module holds [E, in, out]: one of gate_up and down is never square."""
    E, p = 8, "model.layers.0.mlp.experts."
    stacked = {p + "gate_up_proj": (E * gate_up[0], gate_up[1]), p + "down_proj": (E * down[0], down[1])}
    assert transposed_experts(stacked, E, hidden) == (set(stacked) if transposed else set())
