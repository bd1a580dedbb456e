"""Group-wise int8/int4 weights: the codec against a reference written from the scheme's description,
the fused kernel against the dequantized matrix, a whole model against transformers running the
dequantized weights, and the store, planner and config around them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from offload.cli.main import main
from offload.config import OffloadConfig
from offload.errors import ConfigError, StoreError
from offload.model.checkpoint import Checkpoint
from offload.plan.planner import Planner
from offload.runtime.runner import Runner
from offload.weights import quant
from offload.weights.convert import convert
from offload.weights.groups import WeightFormat, model_layouts
from tests.conftest import run_config

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 9, 200, 17, 33, 2, 88, 41, 7], [1, 300, 12]]


def reference_rtn(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """FlexGen's asymmetric round-to-nearest, group by group along the input dim, in float32 as the scheme says:
    scale = (max - min) / (2^b - 1), q = clamp(round((w - min) / scale)), w' = min + q * scale."""
    out = np.empty(w.shape, dtype=np.float64)
    levels = 2**bits - 1
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], group):
            g = w[r, c : c + group].astype(np.float32)
            lo, hi = g.min(), g.max()
            s = np.float32((hi - lo) / np.float32(levels))
            q = np.clip(np.round((g - lo) / s), 0, levels) if s > 0 else np.zeros_like(g)
            out[r, c : c + group] = np.float64(lo) + q * np.float64(s)
    return out


@pytest.fixture(scope="module")
def model(model_factory):
    # intermediate 384 so that every input dim (128, 384) is a multiple of 64 and 128
    return model_factory("llama", overrides={"intermediate_size": 384})


def test_tile_order_round_trips_and_torch_kernel_reads_it_only_where_torch_packs_alike():
    """torch packs int4 in 64-row tiles with AVX-512 but 32-row tiles with AVX2: its kernel on our 64-row
    tiles gave wrong products on an AVX2 machine, so it is used only where its packing equals ours."""
    g = torch.Generator().manual_seed(0)
    nib = torch.randint(0, 16, (128, 96), generator=g, dtype=torch.int32)
    packed = quant.pack_tiles(nib)
    assert torch.equal(quant.unpack_tiles(packed), nib.to(torch.uint8))
    if hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        alike = torch.equal(packed, torch._convert_weight_to_int4pack_for_cpu(nib, 1))
        assert quant._torch_packs_like_us() == alike


def test_int8_is_one_byte_a_weight_in_64_row_tiles():
    """int8 is not two int4 planes (two products): one byte a weight in tiles of 64 rows, each unit of four columns a
    row's four codes side by side (the quads VNNI and AMX multiply as they lie; the kernel reads a tile as one
    stream), the last K % 4 columns 64 bytes each; the scales group-major as int4's."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 128, generator=g)
    packed = quant.quantize(w, 8, 64, torch.bfloat16)
    assert quant.packed_shapes(100, 128, 8, 64) == {"q": (2, 128, 64), "sz": (2, 128, 2)}
    assert packed["q"].shape == (2, 128, 64) and packed["sz"].shape == (2, 128, 2)
    lo = w.view(100, 2, 64).amin(-1)
    scale = (w.view(100, 2, 64).amax(-1) - lo) / 255
    codes = ((w.view(100, 2, 64) - lo[..., None]) / scale[..., None]).round().view(100, 128)
    quads = packed["q"].reshape(2, 32, 64, 4)  # tile b, unit p, row j, byte c: row 64 b + j, column 4 p + c
    assert torch.equal(quads.permute(0, 2, 1, 3).reshape(128, 128)[:100].float(), codes)
    for k in (6, 53, 130):  # a tail of K % 4 columns: column k at 64 k + j of its tile
        c = torch.randint(0, 256, (128, k), generator=g, dtype=torch.uint8)
        tiles = quant.int8_tiles(c)
        k4 = k - k % 4
        assert tiles.shape == (2, k, 64) and torch.equal(quant.int8_codes(tiles, torch.empty(128, k)), c.float())
        assert torch.equal(tiles.reshape(2, -1)[:, 64 * k4:].view(2, k - k4, 64).transpose(1, 2).reshape(128, -1),
                           c[:, k4:])
    assert torch.equal(packed["sz"][:, :100].float(), torch.stack([scale.T, lo.T], -1).bfloat16().float())


@pytest.mark.parametrize("bits,group,rows", [(4, 64, 128), (8, 64, 100), (4, 32, 70), (8, 8, 64), (4, 16, 3)])
def test_dequantized_weights_equal_the_reference(bits, group, rows):
    w = torch.randn(rows, 128, generator=torch.Generator().manual_seed(bits + group)) * 0.05
    w[0, :group] = 0.3  # a constant group: scale 0
    packed = quant.quantize(w, bits, group, torch.float32)
    dense = quant.dequantize(packed["q"], packed["sz"])[:rows].double()
    ref = torch.from_numpy(reference_rtn(w.numpy(), bits, group))
    span = float(w.max() - w.min())
    assert float((dense - ref).abs().max()) < 1e-6 * span
    # and the quantization error is what b bits buy: at most half a step per element
    step = span / (2**bits - 1)
    assert float((ref - w.double()).abs().max()) <= 0.5 * step + 1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 64), (4, 128), (8, 8)])
def test_packed_linear_equals_the_dense_product_and_rows_are_independent(bits, group, dtype):
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(200, 256, generator=g), torch.randn(9, 256, generator=g), torch.randn(200, generator=g)
    packed = quant.quantize(w, bits, group, dtype)
    lin = quant.PackedLinear(packed["q"], packed["sz"], 200, quant.Scratch())
    dense = lin.dense().float().clone()
    assert dense.shape == (200, 256)
    x, b = x.to(dtype), b.to(dtype)
    want = x.float() @ dense.T + b.float()
    tol = 1e-4 if dtype == torch.float32 else 1e-2 * float(want.abs().max())  # bf16: the product is rounded
    torch.testing.assert_close(lin.linear(x, b).float(), want, rtol=tol, atol=tol)
    if lin.row_invariant(x):  # each row alone, and in every slice of the batch, has the batch's bits
        full = lin.linear(x, b)
        for m in (1, 2, 3, 4, 5, 8):
            assert torch.equal(lin.linear(x[:m], b), full[:m])
        assert torch.equal(lin.linear(x[4:5], b), full[4:5])


def hf_with(path, fmt: WeightFormat):
    """transformers on the checkpoint, each packed matrix replaced by the reference dequantization."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cfg = Checkpoint(path).config
    packs = {t: fmt.packs(cfg, t) for t in ("qkv", "o", "gate_up", "down", "lm_head")}
    for layer in model.model.layers:
        mats = {"qkv": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                "o": [layer.self_attn.o_proj], "gate_up": [layer.mlp.gate_proj, layer.mlp.up_proj],
                "down": [layer.mlp.down_proj]}
        for name, mods in mats.items():
            if packs[name]:  # per row: fusing rows changes nothing for a row-wise scheme
                for m in mods:
                    m.weight.data = torch.from_numpy(reference_rtn(m.weight.data.numpy(), fmt.bits,
                                                                   fmt.group_size)).float()
    if packs["lm_head"]:  # at 8 bits in any format; a new parameter: a tied model's embedding rows stay dense
        model.lm_head.weight = torch.nn.Parameter(torch.from_numpy(
            reference_rtn(model.lm_head.weight.data.numpy(), fmt.tensor_bits("lm_head"), fmt.group_size)).float())
    return model


@pytest.mark.parametrize("quantization,group,keep,tied", [
    ("int8", 64, ["lm_head"], False), ("int4", 64, [], False), ("int4", 32, ["lm_head", "down"], False),
    ("int8", 8, [], False), ("int4", 64, [], True), ("int8", 32, ["lm_head"], True)])
def test_quantized_model_matches_transformers_on_the_dequantized_weights(model, model_factory, quantization, group,
                                                                         keep, tied):
    """Packed matrices as the reference dequantizes them; the LM head at int8 in any format (a tied one too: its
    embedding rows stay dense)."""
    if tied:
        model = model_factory("llama", tie=True, overrides={"intermediate_size": 384})
    weights = {"quantization": quantization, "group_size": group, "keep": keep}
    hf = hf_with(model, WeightFormat(quantization, group, tuple(keep)))
    with Runner.from_config(run_config(model, weights=weights)) as r:
        ours = r.prefill_logits(PROMPTS)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = hf(torch.tensor([p])).logits[0]
            torch.testing.assert_close(ours[i, : len(p)], ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_tokens_are_the_same_in_every_placement(model, model_factory, tmp_path, tied):
    """Streamed from disk or resident, the same tokens; a tied model's packed head leaves its embedding rows in a
    dense group of their own, read by rows from wherever it lies."""
    if tied:
        model = model_factory("llama", tie=True, overrides={"intermediate_size": 384})
    weights = {"quantization": "int4", "group_size": 64, "keep": []}
    with Runner.from_config(run_config(model, weights=weights)) as r:
        want = r.generate(PROMPTS, max_new_tokens=8, stop_on_eos=False)
    gpu = "1.2MiB" if tied else "1.1MiB"  # (the tied tiny model's vocabulary is larger)
    streamed = run_config(model, weights=weights, tiers={"gpu": {"capacity": gpu}, "cpu": {"capacity": "128KiB"},
                                                         "disk": {"path": str(tmp_path / "s")}},
                          kv_cache={"gpu_blocks": 8}, prefetch={"depth": 1},
                          activations={"prefill_chunk": 16})
    with Runner.from_config(streamed) as r:
        got = r.generate(PROMPTS, max_new_tokens=8, stop_on_eos=False)
        assert "disk" in r.plan.homes.values() and "embed" in r.plan.homes  # tied too: its rows, dense
        read = r.timeline.bytes_on("disk-read", set(range(1000)))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    dense = model_layouts(Checkpoint(model).config, torch.float32)
    packed = model_layouts(Checkpoint(model).config, torch.float32, WeightFormat("int4", 64, ()))
    assert read > 0 and packed["layer.0"].nbytes < dense["layer.0"].nbytes / 3


def test_manifest_records_the_scheme_and_another_scheme_is_refused(model, tmp_path):
    ckpt = Checkpoint(model)
    store = convert(ckpt, tmp_path / "s", torch.float32, progress=False, fmt=WeightFormat("int8", 64, ("lm_head",)))
    store.close()
    meta = json.loads((tmp_path / "s" / "manifest.json").read_text())["meta"]["weights"]
    assert meta["quantization"] == "int8" and meta["tensors"]["qkv"] == "int8-g64-asym-rtn-quads"
    assert meta["tensors"]["lm_head"] == "dense" and meta["tensors"]["input_norm"] == "dense"
    cfg = run_config(model, tiers={"disk": {"path": str(tmp_path / "s")}}, weights={"quantization": "int4"})
    with pytest.raises(StoreError, match=r"holds weights stored as .*int8.* --weights int4 --group-size \d+ "
                                         r"--keep.* --force"):
        Runner.from_config(cfg)


def test_group_size_that_does_not_divide_an_input_dim_is_one_error_before_converting(model_factory, tmp_path):
    tiny = model_factory("llama")  # intermediate 344: 64 does not divide it
    cfg = run_config(tiny, tiers={"disk": {"path": str(tmp_path / "s")}}, weights={"quantization": "int4"})
    with pytest.raises(ConfigError, match=r"weights.group_size: 64 does not divide the input dimension 344 of 'down'"):
        Runner.from_config(cfg)
    assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match=r"weights.keep: 'mlp' is not supported"):
        OffloadConfig.load(run_config(tiny, weights={"keep": ["mlp"]}))


def test_planner_counts_packed_bytes(model):
    cfg = Checkpoint(model).config
    sizes = {}
    for q in ("none", "int8", "int4"):
        config = OffloadConfig.load(run_config(model, weights={"quantization": q, "keep": []}))
        sizes[q] = {g.name: g.nbytes for g in Planner(config, cfg, torch.float32, torch.device("cpu")).groups}
    for q, ratio in (("int8", 4), ("int4", 8)):  # float32 -> 1 or 0.5 bytes per weight, plus scales
        assert sizes["none"]["layer.1"] / ratio * 0.9 < sizes[q]["layer.1"] < sizes["none"]["layer.1"] / ratio * 1.4


def test_plan_on_paper_for_llama3_70b_int4_fits_gpu_and_ram_and_is_bound_by_pcie(capsys):
    root = Path(__file__).resolve().parent.parent / "scripts"
    cal = str(root / "calibrations" / "rtx4090-pcie4-nvme.json")
    assert main(["plan", "--config", str(root / "examples" / "llama3-70b-24gb-int4.yaml"), "--calibration", cal,
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prediction"]["bottleneck"] == "host->device"
    assert all(home != "disk" for g, home in data["homes"].items() if g != "embed")  # embed is read by rows
    rows = {r["quantization"]: r for r in data["weights"]}
    assert rows["none"]["bottleneck"] == "disk read" and "disk read" not in rows["int4"]["bytes_per_token"]
    assert rows["int4"]["step_ms"] < rows["int8"]["step_ms"] < rows["none"]["step_ms"] / 3
    assert rows["int4"]["layer_bytes"] < rows["none"]["layer_bytes"] / 3.4
    assert main(["plan", "--config", str(root / "examples" / "llama3-70b-24gb-int4.yaml"), "--calibration", cal]) == 0
    out = capsys.readouterr().out
    assert "stored int4 g64 keeping lm_head" in out and "bottleneck: host->device" in out


def test_convert_command_writes_a_quantized_store_the_run_uses(model, tmp_path, capsys):
    store = tmp_path / "s"
    assert main(["convert", str(model), str(store), "--dtype", "float32", "--weights", "int4"]) == 0
    assert "weights int4 g64" in capsys.readouterr().out
    cfg = run_config(model, tiers={"disk": {"path": str(store)}}, weights={"quantization": "int4"})
    with Runner.from_config(cfg) as r:
        got = r.generate(PROMPTS, max_new_tokens=4, stop_on_eos=False)
    with Runner.from_config(run_config(model, weights={"quantization": "int4"})) as r:
        want = r.generate(PROMPTS, max_new_tokens=4, stop_on_eos=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


@pytest.mark.cuda
def test_on_cuda_packed_matrices_dequantize_into_the_scratch_and_give_the_cpu_tokens(model):
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(192, 256, generator=g), torch.randn(4, 256, generator=g)
    for bits in (4, 8):
        packed = {k: v.cuda() for k, v in quant.quantize(w, bits, 64, torch.float32).items()}
        lin = quant.PackedLinear(packed["q"], packed["sz"], 192, quant.Scratch())
        assert not lin.fused
        cpu = quant.PackedLinear(*[v.cpu() for v in (packed["q"], packed["sz"])], 192, None)
        torch.testing.assert_close(lin.linear(x.cuda()).cpu(), cpu.linear(x), rtol=1e-4, atol=1e-4)
    weights = {"quantization": "int8", "group_size": 64, "keep": []}
    out = {}
    for device in ("cpu", "cuda"):
        with Runner.from_config(run_config(model, device=device, weights=weights)) as r:
            out[device] = [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=8, stop_on_eos=False)]
    assert out["cpu"] == out["cuda"]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantizing_into_the_store_a_block_of_rows_at_a_time_gives_the_whole_matrix_bytes(bits, monkeypatch):
    """Conversion quantizes a large matrix (an LM head) a few tiles of rows at a time, to bound its temporaries:
    the bytes are those of quantizing it whole, the last block's padded rows included."""
    w = torch.randn(200, 128, generator=torch.Generator().manual_seed(bits))
    whole = quant.quantize(w, bits, 32, torch.bfloat16)
    q, sz = torch.full_like(whole["q"], 7), torch.full_like(whole["sz"], 3.0)
    monkeypatch.setattr(quant, "QUANTIZE_BLOCK_BYTES", 64 * 4 * 128)  # one tile of rows a block: four blocks
    quant.quantize_into(w, bits, 32, q, sz)
    assert torch.equal(q, whole["q"]) and torch.equal(sz, whole["sz"])


def test_a_conversion_reads_a_packed_matrix_a_block_of_rows_at_a_time(model_factory, tmp_path, monkeypatch):
    """Converting packs each matrix from blocks of its rows read from the checkpoint, so a large one (SmolLM2's
    tied head: 113 MB in float32) never lies whole in memory (a 400 MiB machine was killed converting it to
    int4); the fused gate/up rows that straddle two checkpoint tensors are read from both. Same bytes."""
    path = model_factory("llama", tie=True, overrides={"intermediate_size": 352})  # 5.5 tiles of 64 rows
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    fmt = WeightFormat(quantization="int4", group_size=32)
    monkeypatch.setattr(quant, "QUANTIZE_BLOCK_BYTES", 64 * 4 * cfg.hidden_size)  # one tile of rows a block
    reads = []
    read_rows = Checkpoint.read_rows_into
    monkeypatch.setattr(Checkpoint, "read_rows_into",
                        lambda self, short, shape, row, dest: reads.append((short, dest.shape[0])) or
                        read_rows(self, short, shape, row, dest))
    store = convert(ckpt, tmp_path / "store", torch.float32, fmt=fmt)
    try:
        assert max(n for short, n in reads if short.endswith("proj.weight")) <= 64
        # the head packs the tied embeddings a tile at a time (the dense embed group is one read of its own)
        head = [n for short, n in reads if short == "embed_tokens.weight" and n <= 64]
        assert sum(head) == cfg.vocab_size and len(head) == cfg.vocab_size // 64
        assert {s for s, n in reads if n == 32} >= {"layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"}
        for group, tensor, sources in [("head", "lm_head", ["embed_tokens.weight"]),
                                       ("layer.0", "gate_up", ["layers.0.mlp.gate_proj.weight",
                                                               "layers.0.mlp.up_proj.weight"])]:
            whole = torch.cat([ckpt.read(s, ckpt.entries[ckpt.name(s)].shape, torch.float32) for s in sources])
            want = quant.quantize(whole, fmt.tensor_bits(tensor), 32, torch.float32)
            layout = store.groups[group].layout
            buf = torch.empty(layout.nbytes, dtype=torch.uint8)
            store.tier.read_into(group, buf)
            got = layout.views(buf)
            assert torch.equal(got[f"{tensor}.q"], want["q"]) and torch.equal(got[f"{tensor}.sz"], want["sz"])
    finally:
        store.close()
