"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's output for vLLM), written here
by `compressed_tensors`' own compressors: every quantized matrix reads back as `compressed_tensors` decompresses it,
bit for bit, in each format and strategy Offload reads (int4 / int8 packed, symmetric and asymmetric, by group; FP8
by channel, tensor and block; int8 by channel); the greedy tokens equal transformers' own on the checkpoint, on the
native path (Llama) and the transformers path (Phi-3), resident and streamed from disk; other formats and damaged
parts are refused in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload import Runner
from offload.cli.auto import packed
from offload.cli.main import main
from offload.errors import CheckpointError
from offload.model.checkpoint import Checkpoint
from offload.weights import quant
from offload.weights.reading import CheckpointRows
from tests.conftest import run_config

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
PROMPTS = [[5, 17, 33, 2, 9, 100, 41, 7, 8, 12, 13], [3, 4, 200]]
NEW = 8
#: case: (llm-compressor's preset, group size, block) -> its format and strategy
CASES = {"w4a16-g32": ("W4A16", 32, None), "w4a16-asym-g32": ("W4A16_ASYM", 32, None), "w8a16-g64": ("W8A16", 64, None),
         "fp8-channel": ("FP8_DYNAMIC", None, None), "fp8-tensor": ("FP8", None, None),
         "fp8-block-32x16": ("FP8_BLOCK", None, (32, 16)), "int8-channel": ("W8A8", None, None)}


def _scales(w: torch.Tensor, args, asym: bool) -> dict[str, torch.Tensor]:
    """A weight's scales (bf16, as llm-compressor saves them) and zero points by its strategy."""
    n, k = w.shape
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "block":
        b0, b1 = args.block_structure
        t = torch.nn.functional.pad(w, (0, -k % b1, 0, -n % b0)).reshape(-(-n // b0), b0, -(-k // b1), b1)
        lo, hi = t.amin(dim=(1, 3)), t.amax(dim=(1, 3))
    else:
        t = {"tensor": w.reshape(1, 1, -1), "channel": w.reshape(n, 1, k),
             "group": w.reshape(n, -1, args.group_size or 1)}[strategy]
        lo, hi = t.amin(-1), t.amax(-1)
        lo, hi = (lo.reshape(1), hi.reshape(1)) if strategy == "tensor" else (lo, hi)
    if str(getattr(args.type, "value", args.type)) == "float":
        return {"weight_scale": (torch.maximum(-lo, hi).clamp(min=1e-6) / 448).to(torch.bfloat16)}
    levels = 2 ** args.num_bits
    if not asym:
        return {"weight_scale": (torch.maximum(-lo, hi).clamp(min=1e-6) / (levels / 2 - 0.5)).to(torch.bfloat16)}
    scale = ((hi.clamp(min=0) - lo.clamp(max=0)).clamp(min=1e-6) / (levels - 1)).to(torch.bfloat16)
    zero = (torch.round(-lo.clamp(max=0) / scale.float()) - levels // 2).clamp(-levels // 2, levels // 2 - 1)
    return {"weight_scale": scale, "weight_zero_point": zero.to(torch.int8)}


def compressed_checkpoint(path: Path, family: str, case: str, leave: tuple[str, ...] = (), listed: bool = True
                          ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny checkpoint whose decoder Linears `compressed_tensors` compressed by `case` (the embeddings, norms and
    LM head left float, as llm-compressor's `ignore: [lm_head]` does), and beside it (`{path}-float`) the same model
    with each matrix as `compressed_tensors` decompresses it (its scales in float32, as transformers loads them for
    a float32 run). `leave`: modules left float (named in `ignore` where `listed`; else as a module its `targets`
    do not match is, e.g. experts transformers 5 fuses into one parameter, which is no Linear). Returns each
    module's (decompressed matrix, the original)."""
    preset, group_size, block = CASES[case]
    torch.manual_seed(0)
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "phi3": ("Phi3Config", "Phi3ForCausalLM")}[family]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SIZES))
    model.save_pretrained(path)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights.group_size = group_size or scheme.weights.group_size
    scheme.weights.block_structure = list(block) if block else scheme.weights.block_structure
    kind = str(getattr(scheme.weights.type, "value", scheme.weights.type))
    fmt = "float-quantized" if kind == "float" else "pack-quantized" if scheme.input_activations is None \
        else "int-quantized"
    compressor = BaseCompressor.load_from_registry(fmt)
    tensors, modules = {k: v.contiguous() for k, v in model.state_dict().items()}, {}
    dense = dict(tensors)
    for name in [k for k, w in tensors.items() if ".layers." in k and k.endswith(".weight") and w.dim() == 2
                 and k.removesuffix(".weight") not in leave]:
        w, module = tensors.pop(name), name.removesuffix(".weight")
        parts = compressor.compress({"weight": w} | _scales(w, scheme.weights, not scheme.weights.symmetric), scheme)
        tensors |= {f"{module}.{p}": t.contiguous() for p, t in parts.items()}
        parts["weight_scale"] = parts["weight_scale"].float()
        dense[name] = compressor.decompress(parts, scheme)["weight"].float()
        modules[module] = (dense[name], w)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        dense.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.save_pretrained(f"{path}-float")
    save_file(dense, f"{path}-float/model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    ignore = ["lm_head", *(leave if listed else ())]
    raw["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed", ignore=ignore
    ).model_dump(exclude_none=True, mode="json")
    (path / "config.json").write_text(json.dumps(raw))
    return modules


def greedy(raw: dict) -> tuple[list[list[int]], str, set[str], tuple[str, int]]:
    with Runner(raw) as r:
        tokens = [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                             stop_on_eos=False)]
        fmt = r.target.weights.fmt
        return tokens, r.cfg.impl, set(r.plan.homes.values()), (fmt.quantization, fmt.group_size)


@pytest.mark.parametrize("case", list(CASES))
def test_every_matrix_reads_as_compressed_tensors_decompresses_it(tmp_path, case):
    modules = compressed_checkpoint(tmp_path / "model", "llama", case)
    ck = Checkpoint(tmp_path / "model")
    assert len(ck.compressed) == len(modules) == 21
    for module, (want, original) in modules.items():
        got = torch.empty(want.shape, dtype=torch.float32)
        ck.read_into(f"{module.removeprefix('model.')}.weight", got)
        assert torch.equal(got, want), module
        assert not torch.equal(got, original)  # (quantized: the comparison is not of two float copies)
        rows = torch.empty((5, want.shape[1]), dtype=torch.float32)  # rows starting inside a scale's block
        ck.read_rows_into(f"{module.removeprefix('model.')}.weight", tuple(want.shape), 3, rows)
        assert torch.equal(rows, want[3:8]), module


@pytest.mark.parametrize("family, impl, case", [("llama", "native", "w4a16-asym-g32"),
                                                ("phi3", "transformers", "w8a16-g64"),
                                                ("llama", "native", "int8-channel")])
def test_a_compressed_checkpoint_gives_transformers_tokens_resident_and_streamed(tmp_path, family, impl, case):
    """Its int codes kept as they are (Offload's int4 / int8 of the checkpoint's groups), the greedy tokens are
    transformers' own on the checkpoint, on both paths, resident and streamed from disk."""
    compressed_checkpoint(tmp_path / "model", family, case)
    # transformers reads the compressed checkpoint itself where it can (it expects an asymmetric int4 checkpoint's
    # zero points unpacked, where compressed_tensors packs them): else the float copy of its decompressed weights
    reference = tmp_path / ("model-float" if case == "w4a16-asym-g32" else "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
                              )[0, len(p):].tolist() for p in PROMPTS]
    # weights.quantization none: the checkpoint's int4 / int8 codes kept, in Offload's packed format of its groups
    kept = {"w4a16-asym-g32": ("int4", 32), "w8a16-g64": ("int8", 64), "int8-channel": ("int8", 64)}[case]
    tokens, got_impl, _, fmt = greedy(run_config(tmp_path / "model"))
    assert (tokens, got_impl, fmt) == (ref, impl, kept)
    streamed = run_config(tmp_path / "model", prefetch={"depth": 1},
                          tiers={"gpu": {"capacity": "400KiB"}, "cpu": {"capacity": "60KiB"},
                                 "disk": {"path": str(tmp_path / "store")}})
    tokens, _, homes, fmt = greedy(streamed)
    assert "disk" in homes and (tokens, fmt) == (ref, kept)


def test_other_formats_and_damaged_parts_are_refused_in_one_sentence(tmp_path):
    compressed_checkpoint(tmp_path / "model", "llama", "w4a16-g32")
    path = tmp_path / "model"
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"quantization_config": raw["quantization_config"] |
                                                        {"format": "nvfp4-pack-quantized"}}))
    with pytest.raises(CheckpointError, match="compressed-tensors format 'nvfp4-pack-quantized' is not read by "
                                              "Offload .* use a checkpoint in one of those or its float original"):
        Runner(run_config(path))
    qc = json.loads(json.dumps(raw["quantization_config"]))
    qc["config_groups"]["group_0"]["weights"]["group_size"] = 16  # scales of 32 columns a group, said to be 16
    (path / "config.json").write_text(json.dumps(raw | {"quantization_config": qc}))
    with pytest.raises(CheckpointError, match=r"weight_scale is \[\d+, (\d+)\] torch.bfloat16, not the float "
                                              r"scales \[\d+, \d+\] of a \[\d+, \d+\] matrix quantized by group; "
                                              "the checkpoint does not match its quantization_config"):
        Runner(run_config(path))
    (path / "config.json").write_text(json.dumps(raw))
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight_packed"
    tensors[name] = tensors[name][:, :-1].contiguous()  # a column of words short
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight_packed' is \[128, 7\], not the "
                                              r"4-bit packing of a \[128, 64\] matrix; the checkpoint is damaged"):
        Runner(run_config(path))


@pytest.mark.parametrize("case, bits, group, exact", [
    ("w4a16-g32", 4, 32, True), ("w4a16-asym-g32", 4, 32, True), ("w4a16-g32", 8, 32, True),
    ("w4a16-g32", 4, 16, True), ("w8a16-g64", 8, 64, True), ("w4a16-g32", 4, 64, False),
    ("w8a16-g64", 4, 64, False), ("fp8-channel", 8, 32, False)])
def test_int4_and_int8_checkpoints_pack_into_offload_formats_exactly(tmp_path, case, bits, group, exact):
    """`weights.quantization` of a checkpoint already int4 / int8: each group of columns that one scale covers, with
    no more levels than the format's, keeps its values (the codes its integers); the others are quantized anew."""
    modules = compressed_checkpoint(tmp_path / "model", "llama", case)
    ck = Checkpoint(tmp_path / "model")
    for module, (want, _) in modules.items():
        short, (n, k) = f"{module.removeprefix('model.')}.weight", want.shape
        shapes = quant.packed_shapes(n, k, bits, group)
        q, sz = torch.empty(shapes["q"], dtype=torch.uint8), torch.empty(shapes["sz"], dtype=torch.float32)
        quant.quantize_into(CheckpointRows(ck, [(short, (n, k))]), bits, group, q, sz)
        got = quant.dequantize(q, sz)[:n]
        assert torch.equal(got, want) == exact, module
        if not exact:  # each group kept (one scale covers it, by chance here) or quantized anew, as a float one
            ref = quant.quantize(want, bits, group, torch.float32)
            anew = quant.dequantize(ref["q"], ref["sz"])[:n]
            assert ((got - want).abs() <= (anew - want).abs()).all(), module


def test_act_order_groups_read_by_their_map(tmp_path):
    """`weight_g_idx` (GPTQ's activation order, as earlier llm-compressor releases saved it): column k's scale is its
    group's, wherever the group's columns lie; a map of consecutive columns packs exactly, as without one."""
    compressed_checkpoint(tmp_path / "model", "llama", "w4a16-g32")
    path, module = tmp_path / "model", "model.layers.1.mlp.down_proj"
    tensors = load_file(path / "model.safetensors")
    (n, k), g = tensors[f"{module}.weight_shape"].tolist(), torch.Generator().manual_seed(3)
    shuffled = (torch.arange(k) // 32)[torch.randperm(k, generator=g)].to(torch.int32)
    q = unpack_from_int32(tensors[f"{module}.weight_packed"], 4, torch.Size((n, k))).float()
    for g_idx, exact in ((shuffled, False), (torch.arange(k, dtype=torch.int32) // 32, True)):
        save_file(tensors | {f"{module}.weight_g_idx": g_idx}, str(path / "model.safetensors"))
        want = q * tensors[f"{module}.weight_scale"].float()[:, g_idx.long()]
        ck = Checkpoint(path)
        got = torch.empty(n, k)
        ck.read_into("layers.1.mlp.down_proj.weight", got)
        assert torch.equal(got, want)
        shapes = quant.packed_shapes(n, k, 4, 32)
        packed_q, sz = torch.empty(shapes["q"], dtype=torch.uint8), torch.empty(shapes["sz"])
        quant.quantize_into(CheckpointRows(ck, [("layers.1.mlp.down_proj.weight", (n, k))]), 4, 32, packed_q, sz)
        assert torch.equal(quant.dequantize(packed_q, sz)[:n], want) == exact


@pytest.mark.parametrize("listed", [True, False])
def test_a_checkpoint_leaving_a_decoder_matrix_float_is_read_dense(tmp_path, listed):
    """Its int codes are not kept as Offload's int4 (which would quantize the float matrix anew), whether its config
    names the matrix or not: read dense, the tokens are transformers' own on its weights."""
    compressed_checkpoint(tmp_path / "model", "llama", "w4a16-g32", ("model.layers.1.mlp.down_proj",), listed)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model-float", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
                              )[0, len(p):].tolist() for p in PROMPTS]
    tokens, _, _, fmt = greedy(run_config(tmp_path / "model"))
    assert (tokens, fmt) == (ref, ("none", 64))


def test_a_checkpoint_of_small_groups_packs_in_its_groups(tmp_path):
    """`weights.quantization: int4 | int8` of group size 64 (a YAML's, `offload chat --auto --weights`'s) on an int4
    checkpoint of 32 columns a group: groups of 32, its codes kept (the int4 run's tokens are the `none` run's, which
    stores the checkpoint's codes), where 64 would quantize every group anew; a checkpoint whose codes have more
    levels (int4 of int8 codes) or none (FP8) keeps the asked group size."""
    for name, case in (("int4", "w4a16-g32"), ("int8", "w8a16-g64"), ("fp8", "fp8-channel")):
        compressed_checkpoint(tmp_path / name, "llama", case)
    assert [packed(str(tmp_path / "int4"), q).group_size for q in ("int4", "int8")] == [32, 32]
    assert packed(str(tmp_path / "fp8"), "int4").group_size == packed(str(tmp_path / "int8"), "int4").group_size == 64
    none, _, _, kept = greedy(run_config(tmp_path / "int4"))
    assert kept == ("int4", 32)
    for q, group in (("int4", 32), ("int8", 32)):
        w = {"quantization": q, "group_size": 64, "keep": ["lm_head"]}  # (`none` leaves the head as it is: dense)
        tokens, _, _, fmt = greedy(run_config(tmp_path / "int4", weights=w))
        assert fmt == (q, group)
        assert q != "int4" or tokens == none
    assert greedy(run_config(tmp_path / "int8", weights={"quantization": "int4", "group_size": 64}))[3] == ("int4", 64)


def test_offload_convert_keeps_the_codes_as_a_run_does(tmp_path):
    """`offload convert` (its --weights none) of an int4 checkpoint writes the int4 store a run reads, not a dense
    one 2-4x its size (it built its format from the flags alone)."""
    compressed_checkpoint(tmp_path / "model", "llama", "w4a16-g32")
    assert main(["convert", str(tmp_path / "model"), str(tmp_path / "store"), "--dtype", "float32"]) == 0
    meta = json.loads((tmp_path / "store" / "manifest.json").read_text())["meta"]["weights"]
    assert (meta["quantization"], meta["group_size"], meta["keep"]) == ("int4", 32, ["lm_head"])
