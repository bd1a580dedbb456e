"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): parity with transformers resident and streamed
from the disk tier, experts as their own store groups (dense and int8/int4), tokens grouped by expert, and a
checkpoint whose experts disagree with its config refused by name before anything is converted."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from offload.config import OffloadConfig
from offload.errors import CheckpointError
from offload.model import moe
from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig
from offload.plan.planner import Planner, resolve_capacities
from offload.runtime.runner import Runner
from offload.weights.convert import convert
from offload.weights.groups import WeightFormat, group_names, model_layouts
from storage.errors import CapacityError
from tests.conftest import run_config
from tests.test_parity import hf_logits, hf_model, prompts
from tests.test_quant import reference_rtn

transformers = pytest.importorskip("transformers")

TOL = 1e-3
NEW = 12

CASES = [
    pytest.param("mixtral", {}, id="mixtral-sliding-window"),  # window 32 < the 41-token prompt (+ 16 new)
    pytest.param("qwen2_moe", {}, id="qwen2_moe-shared-expert"),
    pytest.param("qwen3_moe", {}, id="qwen3_moe-norm-topk"),
    pytest.param("olmoe", {}, id="olmoe-whole-qk-norm"),
    pytest.param("qwen3_moe", {"overrides": {"decoder_sparse_step": 2, "mlp_only_layers": [3],
                                             "norm_topk_prob": False}}, id="qwen3_moe-sparse-step-mlp-only"),
    pytest.param("qwen2_moe", {"overrides": {"mlp_only_layers": [0, 2]}}, id="qwen2_moe-mlp-only"),
    pytest.param("olmoe", {"overrides": {"clip_qkv": 0.5}}, id="olmoe-clip-qkv"),
    pytest.param("mixtral", {"experts": "stacked"}, id="mixtral-stacked"),
    pytest.param("qwen2_moe", {"experts": "stacked"}, id="qwen2_moe-stacked"),
]


@torch.no_grad()
def hf_greedy(path, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy generation, with its own KV cache (the MoE models are slow without one)."""
    out = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def disk_tiers(path, store, weights: dict | None = None, depth: int = 1, extra: int = 0) -> dict:
    """The smallest device tier the planner accepts (in steps of 64 KiB), plus `extra` KiB for a few homes, and no
    host tier: most groups stream from the disk tier through the ring."""
    cfg = run_config(path, weights=weights or {}, prefetch={"depth": depth}, kv_cache={"gpu_blocks": 8},
                     activations={"prefill_chunk": 16})
    for kib in range(512, 8192, 64):
        cfg["tiers"] = {"gpu": {"capacity": f"{kib}KiB"}, "cpu": {"capacity": 0}, "disk": {"path": str(store)}}
        config = OffloadConfig.load(cfg)
        try:
            Planner(config, Checkpoint(path).config, torch.float32, torch.device("cpu"),
                    resolve_capacities(config.tiers, torch.device("cpu"))).run_plan()
            cfg["tiers"]["gpu"]["capacity"] = f"{kib + extra}KiB"
            return cfg
        except CapacityError:
            continue
    raise AssertionError("no device capacity fits")


@pytest.mark.parametrize("family,kw", CASES)
def test_prefill_logits_match_transformers(model_factory, family, kw):
    path = model_factory(family, **kw)
    batch = prompts(Checkpoint(path).config.vocab_size)
    with Runner.from_config(run_config(path, activations={"prefill_chunk": 16})) as r:
        assert r.cfg.is_moe
        ours = r.prefill_logits(batch)
    worst = max((ours[b, : len(ids)] - hf_logits(path, ids)).abs().max().item() for b, ids in enumerate(batch))
    assert worst < TOL, f"max |logits - transformers| = {worst:.2e}"


@pytest.mark.parametrize("family,kw", CASES[:4])
def test_greedy_tokens_match_transformers_resident_and_streamed_from_disk(model_factory, tmp_path, family, kw):
    path = model_factory(family, **kw)
    batch = prompts(Checkpoint(path).config.vocab_size, seed=1)[:2]  # 41 and 7 tokens: ragged, past the window
    refs = [hf_greedy(path, ids, NEW) for ids in batch]
    with Runner.from_config(run_config(path)) as r:
        assert [x.token_ids for x in r.generate(batch, max_new_tokens=NEW, stop_on_eos=False)] == refs
    # mixtral (experts.cache 0): layers and experts all streamed through the ring in pass order; olmoe: layers
    # streamed, experts loaded on demand into the expert cache; qwen: layers resident, experts on demand
    mixed = family.startswith("qwen")
    cfg = disk_tiers(path, tmp_path / "store", extra=1600 if mixed else 0)
    if family == "mixtral":
        cfg["experts"] = {"cache": 0}
    with Runner.from_config(cfg) as r:
        got = r.generate(batch, max_new_tokens=NEW, stop_on_eos=False)
        experts = {r.plan.homes[g] for g in r.plan.order if ".expert." in g}
        assert experts == {"disk"}
        assert (r.plan.homes["layer.1"] == "gpu") == mixed
        assert bool(r.plan.on_demand) == (family != "mixtral")
    assert [x.token_ids for x in got] == refs


def test_experts_are_groups_after_their_layer_and_the_layer_group_holds_router_and_shared_expert(model_factory):
    cfg = Checkpoint(model_factory("qwen2_moe", overrides={"mlp_only_layers": [0]})).config
    names = group_names(cfg)
    assert names[:3] == ["embed", "layer.0", "layer.1"]  # layer 0 is dense: no experts
    assert names[3:11] == [f"layer.1.expert.{e}" for e in range(8)] and names[11] == "layer.2"
    layouts = model_layouts(cfg, torch.float32)
    sparse = {s.name for s in layouts["layer.1"].tensors}
    assert {"router", "shared_gate_up", "shared_down", "shared_gate"} <= sparse and "gate_up" not in sparse
    assert {s.name for s in layouts["layer.1.expert.3"].tensors} == {"gate_up", "down"}
    assert {"gate_up", "down"} <= {s.name for s in layouts["layer.0"].tensors}
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert layouts["layer.1.expert.3"].nbytes == 3 * H * I * 4


def test_stacked_experts_give_the_same_logits_as_one_tensor_per_expert(model_factory):
    hub, stacked = model_factory("mixtral"), model_factory("mixtral", experts="stacked")
    assert "model.layers.0.mlp.experts.gate_up_proj" in Checkpoint(stacked).entries
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in Checkpoint(hub).entries
    ids = prompts(Checkpoint(hub).config.vocab_size, seed=3)[1]
    outs = []
    for path in (hub, stacked):
        with Runner.from_config(run_config(path)) as r:
            outs.append(r.prefill_logits(ids))
    assert torch.equal(outs[0], outs[1])  # the same bytes in the same groups


# ----------------------------------------------------------------------------- grouped by expert
class Counted:
    """A dense weight that counts its products and the rows they multiply."""

    def __init__(self, w: torch.Tensor, log: list[int]) -> None:
        self.w, self.log = w, log

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.log.append(x.shape[0])
        return x @ self.w.T


class Source:
    """An ExpertSource over a list of expert weights that records what it was asked for."""

    def __init__(self, experts: list[moe.ExpertWeights]) -> None:
        self.experts, self.asked = experts, []

    def ahead(self, h):
        pass

    def routed(self, ids):
        self.asked.append(list(ids))
        for e in reversed(ids):  # any order is allowed
            yield e, self.experts[e]


def test_tokens_are_grouped_by_expert_one_product_per_routed_expert():
    g = torch.Generator().manual_seed(0)
    N, H, I, E, k = 64, 32, 48, 8, 2
    h = torch.randn(N, H, generator=g).abs()
    router = torch.randn(E, H, generator=g)
    router[5:] = -1  # against positive rows, experts 5, 6, 7 never win: a routed set smaller than E
    dense = [(torch.randn(2 * I, H, generator=g) / H**0.5, torch.randn(H, I, generator=g) / I**0.5) for _ in range(E)]
    log: list[int] = []
    source = Source([moe.ExpertWeights(Counted(gu, log), Counted(d, log)) for gu, d in dense])
    out = moe.moe_mlp(h, moe.MoEWeights(router), source, k, normalize=True)
    probs = torch.softmax(h @ router.T, dim=-1)
    top = probs.topk(k, dim=-1)
    routed = sorted(set(top.indices.flatten().tolist()))
    assert source.asked == [routed] and len(routed) <= 5
    assert len(log) == 2 * len(routed)  # gate_up and down once per routed expert, not once per token
    assert sum(log) == 2 * N * k  # every (token, choice) row multiplied exactly once
    ref = torch.zeros(N, H)  # token by token, as written in the papers
    for t in range(N):
        w = top.values[t] / top.values[t].sum()
        for j, e in enumerate(top.indices[t].tolist()):
            gate, up = (h[t] @ dense[e][0].T).chunk(2)
            ref[t] += w[j] * (torch.nn.functional.silu(gate) * up) @ dense[e][1].T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_pass_multiplies_each_routed_expert_once_per_layer(model_factory, monkeypatch):
    path = model_factory("mixtral")
    calls: list[int] = []
    real = moe.gated_mlp
    monkeypatch.setattr(moe, "gated_mlp", lambda x, gu, d: calls.append(x.shape[0]) or real(x, gu, d))
    ids = prompts(Checkpoint(path).config.vocab_size)[0]  # 41 tokens, top 2 of 8: 82 rows per layer
    with Runner.from_config(run_config(path)) as r:
        r.prefill_logits(ids)
        layers, k = r.cfg.num_layers, r.cfg.experts_per_token
    assert sum(calls) == layers * len(ids) * k
    assert layers <= len(calls) <= layers * r.cfg.num_experts  # at most E products per layer, not 41 * 2


# ----------------------------------------------------------------------------- packed experts
def hf_dequantized(path, fmt: WeightFormat):
    """transformers with every expert's (and shared expert's) matrices replaced by the reference dequantization."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def rtn(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(reference_rtn(t.numpy(), fmt.bits, fmt.group_size)).float()

    for layer in model.model.layers:
        ex = layer.mlp.experts
        for e in range(ex.gate_up_proj.shape[0]):
            ex.gate_up_proj.data[e] = rtn(ex.gate_up_proj.data[e])
            ex.down_proj.data[e] = rtn(ex.down_proj.data[e])
        shared = getattr(layer.mlp, "shared_expert", None)
        mats = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj]
        mats += [shared.gate_proj, shared.up_proj, shared.down_proj] if shared is not None else []
        for m in mats:
            m.weight.data = rtn(m.weight.data)
    return model


# group size 16: the dequantize-into-scratch path (torch's fused CPU int4 kernel takes 32-256)
@pytest.mark.parametrize("family,quantization", [("qwen2_moe", "int4"), ("mixtral", "int8")])
def test_packed_experts_match_transformers_on_the_dequantized_weights_and_stream_the_same(
        model_factory, tmp_path, family, quantization):
    path = model_factory(family)
    weights = {"quantization": quantization, "group_size": 16, "keep": ["lm_head"]}
    fmt = WeightFormat(quantization, 16, ("lm_head",))
    layouts = model_layouts(Checkpoint(path).config, torch.float32, fmt)
    assert {s.name for s in layouts["layer.0.expert.0"].tensors} == {"gate_up.q", "gate_up.sz", "down.q", "down.sz"}
    assert "router" in {s.name for s in layouts["layer.0"].tensors}  # the router stays dense
    batch = prompts(Checkpoint(path).config.vocab_size, seed=4)[1:]
    hf = hf_dequantized(path, fmt)
    with Runner.from_config(run_config(path, weights=weights)) as r:
        ours = r.prefill_logits(batch)
        want = r.generate(batch, max_new_tokens=8, stop_on_eos=False)
    with torch.no_grad():
        for i, p in enumerate(batch):
            torch.testing.assert_close(ours[i, : len(p)], hf(torch.tensor([p])).logits[0], rtol=TOL, atol=TOL)
    with Runner.from_config(disk_tiers(path, tmp_path / "s", weights)) as r:
        got = r.generate(batch, max_new_tokens=8, stop_on_eos=False)
        assert any(".expert." in g and r.plan.homes[g] == "disk" for g in r.plan.on_demand)  # via the expert cache
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


# ----------------------------------------------------------------------------- refused checkpoints
def edited(src, dst, **config):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text()) | config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("family,kw,change,tensor", [
    ("mixtral", {}, {"num_local_experts": 6}, r"model\.layers\.0\.block_sparse_moe\.gate\.weight' has shape \[8, 128\]"
                                              r" but config\.json implies \[6, 128\]"),
    ("qwen3_moe", {"experts": "stacked"}, {"num_experts": 10},
     r"model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \[8, 128, 128\] but config\.json implies \[10, "),
    ("qwen2_moe", {}, {"mlp_only_layers": [1]}, r"model\.layers\.1\.mlp\.gate\.weight' is a router but config\.json "
                                                r"makes layer 1 dense"),
    ("olmoe", {}, {"intermediate_size": 96}, r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' has shape"),
])
def test_a_checkpoint_whose_experts_disagree_with_its_config_is_refused_naming_the_tensor(
        model_factory, tmp_path, family, kw, change, tensor):
    path = edited(model_factory(family, **kw), tmp_path / "ckpt", **change)
    with pytest.raises(CheckpointError, match=tensor):
        Runner.from_config(run_config(path, tiers={"disk": {"path": str(tmp_path / "store")}}))
    with pytest.raises(CheckpointError, match=tensor):
        convert(Checkpoint(path), tmp_path / "store", torch.float32, progress=False)
    assert not (tmp_path / "store").exists()  # nothing converted half-way


def test_routing_config_that_cannot_be_is_refused(model_factory, tmp_path):
    path = edited(model_factory("qwen3_moe"), tmp_path / "ckpt", num_experts_per_tok=9)
    with pytest.raises(CheckpointError, match=r"num_experts_per_tok \(9\) exceeds the 8 experts \(num_experts\)"):
        Checkpoint(path)


def test_config_reads_each_family_routing():
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 100,
            "intermediate_size": 128}
    mix = ModelConfig.from_dict(base | {"model_type": "mixtral", "num_local_experts": 8, "sliding_window": 16})
    assert (mix.num_experts, mix.experts_per_token, mix.moe_intermediate_size, mix.norm_topk_prob) == (8, 2, 128, True)
    assert mix.sliding_windows == (16,) * 4 and mix.moe_layers == (True,) * 4
    q2 = ModelConfig.from_dict(base | {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                       "decoder_sparse_step": 2, "mlp_only_layers": [3], "sliding_window": 0})
    assert q2.moe_layers == (False, True, False, False) and q2.shared_expert_intermediate_size == 48
    assert q2.sliding_windows == (None,) * 4 and q2.qkv_bias and not q2.norm_topk_prob
    ol = ModelConfig.from_dict(base | {"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2,
                                       "clip_qkv": 8.0})
    assert ol.qk_norm and ol.qk_norm_whole and ol.clip_qkv == 8.0 and ol.moe_intermediate_size == 128
    assert np.isclose(ol.layer_params(), 4 * 64 * 64 + 3 * 64 * 4 * 128 + 5 * 64 + 2 * 64)


def test_a_qwen3_moe_saved_by_transformers_5_runs_with_its_own_expert_count(tmp_path):
    """transformers 5 saves Qwen3-MoE's expert count as num_local_experts (Mixtral's name); read as num_experts
    only, a 4-expert model was taken for the family's default 128 and refused its own tensors. Saved by
    transformers itself, greedy tokens equal its own."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, pad_token_id=0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_dict(raw).num_experts == 4
    with torch.no_grad():
        want = model.generate(torch.tensor([[5, 17, 33, 2]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with Runner(run_config(tmp_path)) as r:
        got = r.generate([[5, 17, 33, 2]], max_new_tokens=6, temperature=0, stop_on_eos=False)[0].outputs[0].token_ids
    assert got == want[0, 4:].tolist()
