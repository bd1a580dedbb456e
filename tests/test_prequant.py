"""GPTQ and AWQ checkpoints read as they are: dequantized weights equal, to the last bit, a reference written
from the format description; logits match transformers on a float model made of those weights; the packed
bytes go into the store unchanged; bad checkpoints are one clear error with nothing converted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.cli.auto import cpu_packing
from offload.cli.main import main
from offload.config import OffloadConfig
from offload.errors import CheckpointError
from offload.model.checkpoint import Checkpoint
from offload.runtime.runner import Runner
from offload.testing import prequant
from offload.testing.prequant import make_prequantized
from offload.weights import gptq, quant
from offload.weights.convert import convert
from offload.weights.groups import WeightFormat
from offload.weights.reading import matrix_rows
from tests.conftest import run_config

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 9, 200, 17, 33, 2, 88, 41, 7], [1, 300, 12]]
CASES = {  # id: (method, bits, group size, act order, checkpoint format)
    "gptq4-g32": ("gptq", 4, 32, False, "gptq"),
    "gptq4-g32-act-order": ("gptq", 4, 32, True, "gptq"),
    "gptq8-g64-v2": ("gptq", 8, 64, False, "gptq_v2"),
    "gptq8-act-order": ("gptq", 8, 32, True, "gptq"),
    "gptq4-per-channel": ("gptq", 4, -1, False, "gptq"),
    "awq4-g32": ("awq", 4, 32, False, None),
}


@pytest.fixture(scope="module")
def float_model(model_factory):
    return model_factory("llama", overrides={"intermediate_size": 384})


@pytest.fixture(scope="module")
def prequantized(float_model, tmp_path_factory):
    made: dict[str, Path] = {}

    def make(case: str) -> Path:
        if case not in made:
            method, bits, group, act, fmt = CASES[case]
            made[case] = make_prequantized(float_model, tmp_path_factory.mktemp(case), method, bits, group, act,
                                           fmt or "gptq")
        return made[case]
    return make


# ----------------------------------------------------------------------------- the reference
def reference_dequant(qc: dict, t: dict[str, torch.Tensor]) -> np.ndarray:
    """W [N, K] (float16) element by element from the published description of the format."""
    bits = qc["bits"]
    f, mask = 32 // bits, (1 << bits) - 1
    qw = t["qweight"].numpy().view(np.uint32).astype(np.int64)
    qz = t["qzeros"].numpy().view(np.uint32).astype(np.int64)
    scales = t["scales"].numpy()
    if qc["quant_method"] == "gptq":
        k_dim, n_dim = qw.shape[0] * f, qw.shape[1]
        k, n = np.meshgrid(np.arange(k_dim), np.arange(n_dim), indexing="ij")  # [K, N]
        g = t["g_idx"].numpy().astype(np.int64)[k]
        q = (qw[k // f, n] >> (bits * (k % f))) & mask
        z = ((qz[g, n // f] >> (bits * (n % f))) & mask) + (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)
        w = (scales[g, n].astype(np.float32) * (q - z).astype(np.float32)).astype(np.float16)
    else:
        inverse = [0, 4, 1, 5, 2, 6, 3, 7]  # column j of a word sits in nibble inverse[j]
        k_dim, n_dim = qw.shape[0], qw.shape[1] * 8
        k, n = np.meshgrid(np.arange(k_dim), np.arange(n_dim), indexing="ij")
        g = k // (k_dim // scales.shape[0])
        nib = np.array(inverse)[n % 8]
        q = (qw[k, n // 8] >> (4 * nib)) & 15
        z = (qz[g, n // 8] >> (4 * nib)) & 15
        w = ((q - z).astype(np.float32) * scales[g, n].astype(np.float32)).astype(np.float16)
    return w.T


def float_twin(path: Path, out: Path) -> Path:
    """A float checkpoint whose linears are the reference dequantization of `path`'s packed ones."""
    out.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    tensors = load_file(str(path / "model.safetensors"))
    dense = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            parts = {s: tensors[f"{base}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx") if
                     f"{base}.{s}" in tensors}
            dense[f"{base}.weight"] = torch.from_numpy(reference_dequant(qc, parts)).float().contiguous()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            dense[name] = t
    save_file(dense, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", list(CASES))
def test_dequantized_weights_equal_the_reference_to_the_last_bit(prequantized, case):
    path = prequantized(case)
    ckpt = Checkpoint(path)
    qc = ckpt.config.raw["quantization_config"]
    fmt = gptq.parse_quantization_config(qc, "config.json")
    tensors = load_file(str(path / "model.safetensors"))
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        base = f"model.layers.1.{proj}"
        part = {s: tensors[f"{base}.{s}"] for s in fmt.tensors(1, 1)}
        ours = gptq.dequantize(fmt, part)
        ref = torch.from_numpy(reference_dequant(qc, part))
        assert ours.dtype == torch.float16 and torch.equal(ours, ref), (case, proj)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_on_the_dequantized_float_model(prequantized, case, tmp_path):
    path = prequantized(case)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(float_twin(path, tmp_path / "twin")),
                                                           dtype=torch.float32).eval()
    with Runner.from_config(run_config(path)) as r:
        ours = r.prefill_logits(PROMPTS)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            torch.testing.assert_close(ours[i, : len(p)], hf(torch.tensor([p])).logits[0], rtol=1e-4, atol=1e-4)


def test_the_store_keeps_the_packed_bytes_and_streams_the_same_tokens(prequantized, tmp_path):
    path = prequantized("gptq4-g32-act-order")
    fmt = WeightFormat.from_config(OffloadConfig.load(run_config(path)).weights, Checkpoint(path).config)
    store = convert(Checkpoint(path), tmp_path / "s", torch.float32, progress=False, fmt=fmt)
    layout = store.groups["layer.2"].layout
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    store.tier.read_into("layer.2", buf)
    store.close()
    views = layout.views(buf)
    raw = load_file(str(path / "model.safetensors"))
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):  # q_proj is part 0 of qkv, v_proj part 2
        assert torch.equal(views[f"qkv.0.{suffix}"], raw[f"model.layers.2.self_attn.q_proj.{suffix}"])
        assert torch.equal(views[f"qkv.2.{suffix}"], raw[f"model.layers.2.self_attn.v_proj.{suffix}"])
    meta = json.loads((tmp_path / "s" / "manifest.json").read_text())["meta"]["weights"]
    assert meta["quantization"] == "gptq" and meta["tensors"]["qkv"] == "gptq-4bit-g32-act-order"
    with Runner.from_config(run_config(path)) as r:
        want = [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)]
    streamed = run_config(path, tiers={"gpu": {"capacity": "1100KiB"}, "cpu": {"capacity": "256KiB"},
                                       "disk": {"path": str(tmp_path / "s")}},
                          kv_cache={"gpu_blocks": 8}, activations={"prefill_chunk": 16}, prefetch={"depth": 1})
    with Runner.from_config(streamed) as r:
        assert "disk" in r.plan.homes.values()
        assert [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)] == want



@pytest.mark.parametrize("method, act_order", [("gptq", True), ("awq", False)])
def test_a_family_transformers_runs_reads_them_too(tmp_path, method, act_order):
    """Gemma 2 (no native math): the packed bytes stored as they are, dequantized as each Linear runs; the greedy
    tokens are transformers' on the float model of the reference dequantization, resident and streamed from disk."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0)
    transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**sizes)).save_pretrained(tmp_path / "float")
    path = make_prequantized(tmp_path / "float", tmp_path / "q", method, 4, 32, act_order)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(float_twin(path, tmp_path / "twin")),
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p):].tolist()
               for p in PROMPTS]
    streamed = {"tiers": {"gpu": {"capacity": "420KiB"}, "cpu": {"capacity": "40KiB"},
                          "disk": {"path": str(tmp_path / "store")}}, "prefetch": {"depth": 1}}
    for extra in ({}, streamed):
        with Runner.from_config(run_config(path, **extra)) as r:
            assert r.cfg.impl == "transformers" and ("disk" in r.plan.homes.values()) == bool(extra)
            assert [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)] == ref


def edit_config(path: Path, **qc) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(qc)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage,match,error", [
    ("bits3", r"bits 3 is not supported for GPTQ; Offload reads 4- and 8-bit", CheckpointError),
    ("awq_gemv", r"AWQ packing 'gemv' is not supported", CheckpointError),
    ("marlin", r"checkpoint_format 'marlin' is not supported", CheckpointError),
    ("no_qzeros", r"model.layers.3.mlp.up_proj.qzeros' is missing", CheckpointError),
    ("group48", r"group_size 48 does not divide the input dimension 128", CheckpointError),
])
def test_bad_prequantized_checkpoint_is_one_clear_error_and_nothing_is_converted(prequantized, tmp_path, damage,
                                                                                 match, error):
    src = prequantized("awq4-g32" if damage == "awq_gemv" else "gptq4-g32")
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    if damage == "bits3":
        edit_config(path, bits=3)
    elif damage == "awq_gemv":
        edit_config(path, version="gemv")
    elif damage == "marlin":
        edit_config(path, checkpoint_format="marlin")
    elif damage == "group48":
        edit_config(path, group_size=48)
    elif damage == "no_qzeros":
        tensors = load_file(str(path / "model.safetensors"))
        del tensors["model.layers.3.mlp.up_proj.qzeros"]
        save_file(tensors, str(path / "model.safetensors"))
    store = tmp_path / "store"
    with pytest.raises(error, match=match) as info:
        Runner.from_config(run_config(path, tiers={"disk": {"path": str(store)}}))
    assert "\n" not in str(info.value)
    assert not store.exists()


def test_a_gptq_mixture_of_experts_on_the_transformers_path_is_one_sentence(tmp_path, monkeypatch):
    """Its experts packed one by one, which transformers stacks into one parameter: refused before anything loads,
    naming the releases that run (the native path reads it)."""
    sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, num_local_experts=4)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**sizes)).save_pretrained(tmp_path / "float")
    monkeypatch.setattr(prequant, "LINEAR", re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|w1|w2|w3)\.weight$"))
    path = make_prequantized(tmp_path / "float", tmp_path / "q", "gptq", 4, 32)
    with pytest.raises(CheckpointError, match="a GPTQ mixture of experts is read by Offload's native families only"):
        Runner.from_config(run_config(path, model_impl="transformers"))


@pytest.mark.parametrize("case", ["gptq4-g32", "awq4-g32", "gptq4-g32-act-order", "gptq8-g64-v2"])
def test_int4_of_a_gptq_checkpoint_keeps_its_codes_and_scales(prequantized, case, tmp_path):
    """`weights.quantization: int4 | int8` of a GPTQ/AWQ checkpoint (its packed layout is dequantized every pass: on
    a CPU SmolLM2 decoded 1.3 tok/s so, 153 as int4): each group of columns with one (scale, zero) keeps the
    checkpoint's codes and scale ((q - zero) * scale, before the reference's fp16 rounding); an act-order map's
    groups, and 8-bit codes in int4, are quantized anew from the dequantized matrix. The run's tokens, resident and
    streamed, are the same."""
    path = prequantized(case)
    ckpt = Checkpoint(path)
    method, bits, group, act_order, _ = CASES[case]
    target = 8 if bits == 8 else 4
    fmt = WeightFormat.from_config(OffloadConfig.load(run_config(path, weights={"quantization": f"int{target}"})
                                                      ).weights, ckpt.config)
    assert (fmt.quantization, fmt.group_size) == (f"int{target}", min(group, 64))
    tensors = load_file(str(path / "model.safetensors"))
    base = "model.layers.1.mlp.down_proj"
    part = {s: tensors[f"{base}.{s}"] for s in fmt.source.tensors(1, 1)}
    scale, zero = gptq.scales_zeros(fmt.source, part)
    exact = gptq.dequantize(fmt.source, part).float()  # (fp16 products)
    rows = matrix_rows(ckpt, [("layers.1.mlp.down_proj.weight", tuple(exact.shape))], fmt)
    shapes = quant.packed_shapes(*exact.shape, target, fmt.group_size)
    q, sz = torch.empty(shapes["q"], dtype=torch.uint8), torch.empty(shapes["sz"])
    quant.quantize_into(rows, target, fmt.group_size, q, sz)
    got = quant.dequantize(q, sz)[: exact.shape[0]]
    codes = _unpack_codes(fmt.source, part)
    if not act_order:
        assert torch.equal(got, (codes - zero) * scale)
        torch.testing.assert_close(got, exact, rtol=2**-10, atol=0)
    else:
        anew = quant.quantize(exact, target, fmt.group_size, torch.float32)
        assert torch.equal(got, quant.dequantize(anew["q"], anew["sz"])[: exact.shape[0]])
    config = run_config(path, weights={"quantization": f"int{target}"})
    with Runner.from_config(config) as r:
        want = [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)]
    gpu = f"{1100 if target == 4 else 1500}KiB"
    streamed = config | {"tiers": {"gpu": {"capacity": gpu}, "cpu": {"capacity": "100KiB"},
                                   "disk": {"path": str(tmp_path / "s")}}, "prefetch": {"depth": 1},
                         "kv_cache": {"gpu_blocks": 8}, "activations": {"prefill_chunk": 16}}
    with Runner.from_config(streamed) as r:
        assert "disk" in r.plan.homes.values()
        assert [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)] == want


def _unpack_codes(fmt: gptq.PrequantFormat, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each weight's code q [N, K], float32, from the published layouts."""
    qw = t["qweight"].numpy().view(np.uint32)
    f, mask = 32 // fmt.bits, (1 << fmt.bits) - 1
    if fmt.method == "gptq":  # along K: row k of column n at bits b (k % f) of qweight[k // f, n]
        q = np.stack([(qw >> (fmt.bits * j)) & mask for j in range(f)], axis=1).reshape(-1, qw.shape[1]).T
    else:  # AWQ: along N, nibble i of an int32 holds column 8 c + order[i]
        nib = np.stack([(qw >> (4 * i)) & mask for i in range(f)], axis=-1)  # [K, N / 8, 8] by nibble
        q = np.empty_like(nib)
        q[..., list(gptq.AWQ_ORDER)] = nib
        q = q.reshape(qw.shape[0], -1).T
    return torch.from_numpy(q.astype(np.float32))


def test_chat_auto_on_a_machine_without_a_gpu_runs_gptq_as_int4(prequantized, float_model):
    """`offload chat --auto`'s first start on a CPU: a GPTQ / AWQ checkpoint's YAML says int4 (int8 for act-order
    groups or 8-bit codes), where its own packing ran at 1.3 tokens/s; a float checkpoint's says nothing."""
    got = {case: cpu_packing(str(prequantized(case))) for case in ("gptq4-g32", "awq4-g32", "gptq4-g32-act-order",
                                                                    "gptq8-g64-v2")}
    assert got == {"gptq4-g32": "int4", "awq4-g32": "int4", "gptq4-g32-act-order": "int8", "gptq8-g64-v2": "int8"}
    assert cpu_packing(str(float_model)) is None


@pytest.mark.parametrize("weights", ["none", "int4"])
def test_offload_convert_writes_the_store_a_run_reads(prequantized, tmp_path, weights):
    """`offload convert` of a GPTQ checkpoint (refused before: "tensor ...q_proj.weight is missing", while stale-store
    errors told users to run it): its own packing, or int4 of its codes; a run on that store streams the tokens of
    the resident run."""
    path, store = prequantized("gptq4-g32"), tmp_path / "store"
    assert main(["convert", str(path), str(store), "--dtype", "float32", "--weights", weights]) == 0
    meta = json.loads((store / "manifest.json").read_text())["meta"]["weights"]
    assert meta["quantization"] == {"none": "gptq", "int4": "int4"}[weights]
    config = run_config(path, weights={"quantization": weights})
    with Runner.from_config(config) as r:
        want = [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)]
    streamed = config | {"tiers": {"gpu": {"capacity": "1500KiB"}, "cpu": {"capacity": "100KiB"},
                                   "disk": {"path": str(store)}}, "prefetch": {"depth": 1},
                         "kv_cache": {"gpu_blocks": 8}, "activations": {"prefill_chunk": 16}}
    with Runner.from_config(streamed) as r:
        assert "disk" in r.plan.homes.values() and r.target.weights.store.built is False
        assert [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)] == want
