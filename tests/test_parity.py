"""Parity with Hugging Face transformers on the same checkpoint (float32): logits and greedy tokens.

transformers is the oracle and a test-only dependency. Its reference is computed one prompt
at a time with full recomputation (no cache), so nothing of ours leaks into the reference.
"""

from __future__ import annotations

import pytest
import torch

from offload.runtime.runner import Runner
from tests.conftest import run_config

transformers = pytest.importorskip("transformers")

TOL = 1e-4
NEW_TOKENS = 32
PROMPT_LENS = (41, 7, 23)  # a ragged batch of 3; 41 + 32 > the tiny Mistral window of 32


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


_HF: dict = {}


def hf_model(path):
    if path not in _HF:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        _HF[path] = model.eval()
    return _HF[path]


@torch.no_grad()
def hf_logits(path, ids: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(path, ids: list[int], n: int) -> list[int]:
    model, seq = hf_model(path), list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


CASES = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("llama", {"rope_scaling": "llama3"}, id="llama3-rope"),
    pytest.param("llama", {"rope_scaling": "linear"}, id="linear-rope"),
    pytest.param("mistral", {}, id="mistral-sliding-window"),
    pytest.param("qwen2", {}, id="qwen2-bias-tied"),
    pytest.param("llama", {"overrides": {"attention_bias": True}}, id="llama-attention-bias"),  # o_proj's bias too
    pytest.param("llama", {"rope_scaling": "llama3", "tie": True}, id="llama3.2-rope-tied"),
    pytest.param("mistral", {"head_dim": 48}, id="mistral-window-head-dim"),  # Mistral Nemo: 128 != 5120 / 32
    pytest.param("qwen2", {"tie": False}, id="qwen2.5-bias-untied"),
    pytest.param("qwen3", {}, id="qwen3-qk-norm-head-dim-tied"),
    pytest.param("qwen3", {"tie": False}, id="qwen3-untied"),
]


@pytest.mark.parametrize("family,kw", CASES)
@pytest.mark.parametrize("chunk", [512, 5], ids=["unchunked", "chunk5"])
def test_prefill_logits_match_transformers(model_factory, family, kw, chunk):
    path = model_factory(family, **kw)
    batch = prompts(Runner.from_config(run_config(path)).cfg.vocab_size)
    with Runner.from_config(run_config(path, activations={"prefill_chunk": chunk})) as r:
        ours = r.prefill_logits(batch)  # ragged batch of 3
        alone = r.prefill_logits(batch[1])
    worst = 0.0
    for b, ids in enumerate(batch):
        ref = hf_logits(path, ids)
        worst = max(worst, (ours[b, : len(ids)] - ref).abs().max().item())
        assert torch.all(ours[b, len(ids):] == 0)
    assert worst < TOL, f"max |logits - transformers| = {worst:.2e}"
    assert (alone[0] - ours[1, : len(batch[1])]).abs().max() < 1e-5


@pytest.mark.parametrize("family,kw", CASES)
@pytest.mark.parametrize("chunk", [512, 5], ids=["unchunked", "chunk5"])
def test_greedy_tokens_match_transformers(model_factory, family, kw, chunk):
    path = model_factory(family, **kw)
    batch = prompts(Runner.from_config(run_config(path)).cfg.vocab_size, seed=1)
    refs = [hf_greedy(path, ids, NEW_TOKENS) for ids in batch]
    with Runner.from_config(run_config(path, activations={"prefill_chunk": chunk})) as r:
        single = r.generate([batch[0]], max_new_tokens=NEW_TOKENS, stop_on_eos=False)
        ragged = r.generate(batch, max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    assert single[0].token_ids == refs[0]
    assert [res.token_ids for res in ragged] == refs


def test_qwen3_cold_kv_rebuilt_from_layer_inputs_matches_transformers(model_factory, tmp_path):
    """Recompute restore applies Qwen3's k norm before RoPE when it rebuilds K from the layer inputs."""
    path = model_factory("qwen3")
    ids = prompts(Runner.from_config(run_config(path)).cfg.vocab_size, seed=2)[0]
    ref = hf_greedy(path, ids, 16)
    cfg = run_config(path, tiers={"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": "64MiB"},
                                  "disk": {"path": str(tmp_path / "store")}},
                     kv_cache={"block_size": 4, "gpu_blocks": 6, "cpu_blocks": 32},
                     activations={"prefill_chunk": 8, "kv_restore": "recompute"})
    with Runner.from_config(cfg) as r:
        cold = []
        res = r.generate([ids], max_new_tokens=16, stop_on_eos=False,
                         on_token=lambda *_: cold.append(r.kv.count("cpu")))
        assert res[0].token_ids == ref
        assert max(cold) > 0 and r.kv.cold_fmt.name == "hidden"  # blocks were cold, kept as layer inputs
