"""Any transformers causal LM through the tiers (model_impl: transformers): greedy tokens equal transformers'
own on tiny Gemma 2, Gemma 3 (text), Phi-3, StableLM, GPT-NeoX, Phi-MoE (both renamed and stacked by transformers
as it loads them), Apertus and Llama 4 (text) checkpoints, resident and streamed from the disk tier; a native
family forced through the generic path gives the native path's tokens; what the path cannot do is refused in one
sentence."""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from offload import Runner
from offload.cli.main import main
from offload.errors import CheckpointError, ConfigError, StoreError
from offload.hf import lockstep
from offload.model.checkpoint import Checkpoint
from offload.runtime.conversation import Conversation
from offload.serve.background import BackgroundServer
from offload.serve.files import FileDefaults, run_file
from offload.serve.loop import Limits
from offload.testing.make_model import train_tokenizer
from tests.conftest import run_config
from tests.test_chat import TURNS, hf_conversation
from tests.test_chat import greedy as chat_greedy
from tests.test_chat_template import CHATML

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
#: (config class, model class, extra config keys): sliding windows of 8 so that a 20-token context uses them
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(partial_rotary_factor=0.5)),
    # checkpoints whose tensors transformers 5 renames (embed_out -> lm_head; block_sparse_moe -> mlp) and whose
    # experts it stacks ([E, 2I, H] from experts.{e}.w1 / w3) as it loads them
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(tie_word_embeddings=False)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                          intermediate_size=32)),
    # scalar parameters (its activation's beta and eps); ids moved to the embeddings' device before they run
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(pad_token_id=0)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                                             intermediate_size=32, intermediate_size_mlp=64,
                                                             interleave_moe_layer_step=1, pad_token_id=0)),
}
PROMPTS = [[5, 17, 33, 2, 9, 100, 41, 7, 8, 12, 13], [3, 4, 200]]
NEW = 10


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]]]]:
    """Each family's tiny random checkpoint (safetensors, via save_pretrained) and transformers' greedy tokens."""
    out = {}
    for family, (config_cls, model_cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**(SIZES | extra))).eval()
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        with torch.no_grad():
            ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
                                  )[0, len(p):].tolist() for p in PROMPTS]
        out[family] = (path, ref)
    return out


def greedy(raw: dict) -> list[list[int]]:
    with Runner(raw) as r:
        assert r.cfg.impl == "transformers"
        return [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                              stop_on_eos=False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_resident(hf_models, family):
    path, ref = hf_models[family]
    assert greedy(run_config(path)) == ref  # model_impl auto: not a native family, so transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_streamed_from_disk(hf_models, family, tmp_path):
    path, ref = hf_models[family]
    raw = run_config(path, tiers={"gpu": {"capacity": "420KiB"}, "cpu": {"capacity": "160KiB"},
                                  "disk": {"path": str(tmp_path / "store")}}, prefetch={"depth": 1},
                     activations={"prefill_chunk": 4})
    with Runner(raw) as r:
        assert "disk" in r.plan.homes.values() and r.plan.streamed  # some blocks really come from the store
        assert r.kv.logical.num_blocks > 0 and "kv" not in r.weights.tiers["gpu"]  # its region: DynamicCaches'
        got = [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                          stop_on_eos=False)]
    assert got == ref


def test_a_native_family_forced_through_transformers_gives_the_native_tokens(tiny_llama):
    with Runner(run_config(tiny_llama)) as r:
        assert r.cfg.impl == "native"
        native = [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                             stop_on_eos=False)]
    assert greedy(run_config(tiny_llama, model_impl="transformers")) == native


def test_samples_fork_the_prompts_cache_and_prompt_chunks_continue_it(hf_models):
    path, ref = hf_models["gemma2"]
    with Runner(run_config(path, activations={"prefill_chunk": 3})) as r:
        [res] = r.generate([PROMPTS[0]], max_new_tokens=NEW, temperature=0, stop_on_eos=False, num_samples=2)
        assert [o.token_ids for o in res.outputs] == [ref[0], ref[0]]
        logits = r.prefill_logits([PROMPTS[0]])  # every position's logits, as transformers gives them
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([PROMPTS[0]])).logits
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_the_groups_are_the_checkpoints_blocks_named_as_transformers_names_them(hf_models):
    cfg = Checkpoint(hf_models["phi3"][0]).config
    assert (cfg.impl, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("transformers", 3, 64, 256)
    names = [n for n, _ in cfg.tensors.layers[1]]
    assert "model.layers.1.self_attn.qkv_proj.weight" in names and all(n.startswith("model.layers.1.") for n in names)
    with pytest.raises(CheckpointError, match=r"model_type 'phi3'.* is not supported"):
        Checkpoint(hf_models["phi3"][0], "native")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("family", ["phi3", "phimoe"])  # (Phi-MoE's experts: stacked by transformers, packed whole)
def test_packed_blocks_stream_and_give_every_placement_the_same_tokens_near_the_float_logits(hf_models, family,
                                                                                             scheme, tmp_path):
    path, _ = hf_models[family]
    weights = {"quantization": scheme, "group_size": 32}
    with Runner(run_config(path, weights=weights)) as r:
        resident = [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                               stop_on_eos=False)]
        logits = r.prefill_logits([PROMPTS[0]])
        layer = r.plan.sizes["layer.0"]
    with Runner(run_config(path)) as dense:
        assert layer < dense.plan.sizes["layer.0"] / (1.8 if scheme == "int8" else 3)  # the blocks stream packed
        want = dense.prefill_logits([PROMPTS[0]])
    raw = run_config(path, weights=weights, tiers={"gpu": {"capacity": "200KiB"}, "cpu": {"capacity": "60KiB"},
                                                   "disk": {"path": str(tmp_path / "store")}},
                     prefetch={"depth": 1}, activations={"prefill_chunk": 4})
    with Runner(raw) as r:
        assert "disk" in r.plan.homes.values()
        assert [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                           stop_on_eos=False)] == resident
    err = ((logits - want).norm() / want.norm()).item()
    assert err < (0.02 if scheme == "int8" else 0.2), err


THREE = PROMPTS + [[7, 7, 1, 90, 64]]


def _acquired(r: Runner) -> tuple[list[int], dict[str, int]]:
    """Record the sequences of each pass and how often each group is acquired (the ring's reads of a streamed one)."""
    ex, weights, passes, counts = r.target, r.target.weights, [], {}
    forward, acquire = ex.forward, weights.acquire

    def counted_forward(batch, hidden=None):
        passes.append(len(batch.sids))
        return forward(batch, hidden)

    def counted(group):
        counts[group] = counts.get(group, 0) + 1
        return acquire(group)

    ex.forward, weights.acquire = counted_forward, counted
    return passes, counts


@pytest.mark.parametrize("family", ["gemma2", "phimoe"])
def test_a_pass_of_several_sequences_reads_each_streamed_block_once(hf_models, family, tmp_path, monkeypatch):
    """Each sequence runs its own forward (its own DynamicCache and length), in lockstep with the others block by
    block (`offload.hf.lockstep`): a block's group is acquired once a pass, not once a sequence, and every prompt
    gets transformers' own tokens; one after the other (no greenlet) reads each block once a sequence."""
    path, _ = hf_models[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
                              )[0, len(p):].tolist() for p in THREE]
    raw = run_config(path, tiers={"gpu": {"capacity": "600KiB"}, "cpu": {"capacity": "160KiB"},
                                  "disk": {"path": str(tmp_path / "store")}}, prefetch={"depth": 1},
                     kv_cache={"gpu_blocks": 12}, activations={"prefill_chunk": 4})
    for together in (True, False):
        if not together:
            monkeypatch.setattr(lockstep.Lockstep, "available", staticmethod(lambda: False))
        with Runner(raw) as r:
            assert r.plan.streamed and "disk" in r.plan.homes.values()
            passes, counts = _acquired(r)
            got = [x.outputs[0].token_ids for x in r.generate(THREE, max_new_tokens=NEW, temperature=0,
                                                              stop_on_eos=False)]
        assert got == ref and max(passes) == 3
        streamed = [g for g in r.plan.streamed if g.startswith("layer.")]
        assert {counts[g] for g in streamed} == {len(passes) if together else sum(passes)}


def test_a_sequence_failing_mid_pass_ends_the_pass_and_the_next_one_runs_clean(hf_models, tmp_path):
    """An error in one sequence's forward (here at block 2 of the second sequence) throws every other one out
    where it waits, raises the error, leaves no group bound; the next generate gets transformers' tokens."""
    path, ref = hf_models["gemma2"]
    raw = run_config(path, tiers={"gpu": {"capacity": "600KiB"}, "cpu": {"capacity": "160KiB"},
                                  "disk": {"path": str(tmp_path / "store")}}, prefetch={"depth": 1},
                     kv_cache={"gpu_blocks": 12}, activations={"prefill_chunk": 4})
    with Runner(raw) as r:
        tiered = r.target.model
        fail = {"at": 1}

        def boom(module, args):
            steps = tiered.lockstep
            if steps is not None and steps.index == fail["at"]:
                fail["at"] = None
                raise RuntimeError("injected")

        handle = tiered.model.model.layers[2].register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="injected"):
            r.generate(PROMPTS, max_new_tokens=NEW, temperature=0, stop_on_eos=False)
        handle.remove()
        assert not any(b.held for b in tiered.bounds) and tiered.lockstep is None
        assert [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                           stop_on_eos=False)] == ref


def test_what_the_transformers_path_cannot_do_is_refused_in_one_sentence(hf_models):
    path, _ = hf_models["gemma2"]
    with pytest.raises(ConfigError, match=r"speculative: .* needs Offload's own math"):
        Runner(run_config(path, speculative={"draft": "self-int8"}))


def test_without_transformers_the_error_names_the_extra(hf_models, monkeypatch):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith(("transformers.", "offload.hf"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails as if not installed
    with pytest.raises(ConfigError, match=r"needs transformers, which is not installed; pip install 'offload\[hf\]'"):
        Runner(run_config(hf_models["gemma3"][0]))


def test_plan_shows_which_implementation_runs_the_model(hf_models, tiny_llama, capsys):
    assert main(["plan", "--model", str(hf_models["gemma3"][0]), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "gemma3_text model (run by transformers, KV in its DynamicCache; model_impl: auto)" in out
    assert main(["plan", "--model", str(tiny_llama), "--device", "cpu"]) == 0
    assert "llama model (Offload's own math; model_impl: auto)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def gemma_chat(hf_models, tmp_path_factory) -> Path:
    """The tiny Gemma 2 with a tokenizer and a chat template (sliding windows of 8: the kept cache records past
    them)."""
    d = tmp_path_factory.mktemp("chat") / "gemma2"
    shutil.copytree(hf_models["gemma2"][0], d)
    train_tokenizer(SIZES["vocab_size"]).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>"}))
    return d


def test_a_conversation_keeps_its_dynamic_cache_between_turns_and_equals_transformers(gemma_chat):
    d = gemma_chat
    with Runner(run_config(d, kv_cache={"block_size": 4})) as r:
        ref = hf_conversation(d, TURNS, NEW, r.generation.eos_token_ids)
        conv = Conversation(r, chat_greedy(r))
        crops = 0
        for i, (text, (ids, tokens, _)) in enumerate(zip(TURNS, ref)):
            reply = conv.say(text)
            assert reply.token_ids == tokens, f"turn {i}"
            if i:  # the history came from the kept cache, cut back to what it shares with the new prompt
                history = ref[i - 1][0] + ref[i - 1][1][:-1]
                shared = next((j for j, (a, b) in enumerate(zip(history, ids)) if a != b), len(history))
                assert reply.cached == shared >= len(ref[i - 1][0])
                crops += shared < len(history)
        assert crops  # some turn forgot the end of the kept cache (past the sliding window)
        conv.close()


def test_the_server_and_the_throughput_mode_run_the_transformers_path(gemma_chat, tmp_path):
    prompts = ["Once upon a time", "The kettle is on"]
    with Runner(run_config(gemma_chat)) as runner:
        alone = [runner.generate(p, max_new_tokens=6, temperature=0)[0].outputs[0] for p in prompts]
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text("".join(json.dumps({"id": str(i), "prompt": p, "max_tokens": 6}) + "\n"
                               for i, p in enumerate(prompts)))
        assert run_file(runner, inp, out, FileDefaults(), max_batch=2, progress=False).done == 2
        got = {r["id"]: r["choices"][0]["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
        assert [got["0"], got["1"]] == [a.token_ids for a in alone]
        runner.fix_kv_pool(64)
        with BackgroundServer(runner, Limits(max_batch=4, max_queue=8, timeout_s=60), name="g") as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
            with ThreadPoolExecutor(2) as pool:  # two requests at once: one engine step runs both
                texts = list(pool.map(lambda p: client.completions.create(
                    model="g", prompt=p, max_tokens=6, temperature=0).choices[0].text, prompts))
    assert texts == [a.text for a in alone]


def test_a_store_converted_for_the_native_path_is_refused_by_the_transformers_path_naming_the_fix(tiny_llama,
                                                                                                   tmp_path):
    store = tmp_path / "store"
    assert main(["convert", str(tiny_llama), str(store), "--dtype", "float32"]) == 0  # native layouts (auto)
    raw = run_config(tiny_llama, model_impl="transformers", tiers={"disk": {"path": str(store)}})
    with pytest.raises(StoreError, match=r"model_impl transformers .* --model-impl transformers --force"):
        Runner(raw)
    assert main(["convert", str(tiny_llama), str(store), "--dtype", "float32", "--model-impl", "transformers",
                 "--force"]) == 0
    with Runner(raw) as r:
        assert r.cfg.impl == "transformers" and r.generate([1, 5, 9], max_new_tokens=2)[0].outputs[0].token_ids


def test_a_checkpoint_transformers_converts_otherwise_than_by_renaming_or_stacking_is_refused(hf_models,
                                                                                            monkeypatch):
    """transformers 5 renames and stacks tensors as it loads (followed: the Phi-MoE family above); a conversion that
    cuts or reorders a tensor has no rows to bind in place, and is named."""
    from transformers import conversion_mapping, core_model_loading

    split = core_model_loading.WeightConverter(source_patterns="mlp.gate_up_proj.weight",
                                               target_patterns=["mlp.gate.weight", "mlp.up.weight"],
                                               operations=[core_model_loading.Chunk(dim=0)])
    with monkeypatch.context() as m:
        m.setattr(conversion_mapping, "get_checkpoint_conversion_mapping",
                  lambda key: [split] if key == "Phi3ForCausalLM" else None)
        with pytest.raises(CheckpointError, match=r"transformers converts tensor 'model.layers.0.mlp.gate_up_proj."
                                                  r"weight' as it loads it \(Chunk\), which Offload's transformers"):
            Checkpoint(hf_models["phi3"][0])
    cfg = Checkpoint(hf_models["phimoe"][0]).config  # (its own mapping: experts stacked, gate's rows then up's)
    up = dict(cfg.tensors.sources)["model.layers.0.mlp.experts.gate_up_proj"]
    assert [n for n, _ in up][:3] == ["model.layers.0.block_sparse_moe.experts.0.w1.weight",
                                      "model.layers.0.block_sparse_moe.experts.0.w3.weight",
                                      "model.layers.0.block_sparse_moe.experts.1.w1.weight"]


def test_a_model_with_recurrent_state_is_refused_in_one_sentence(tmp_path):
    """Jamba's Mamba layers keep a state that cropping a KV cache cannot take back (conversations, prompt cache):
    refused by name, where it failed inside transformers' scan."""
    torch.manual_seed(0)
    config = transformers.JambaConfig(**SIZES, num_experts=2, num_experts_per_tok=1, attn_layer_period=2,
                                      attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                      mamba_d_state=4, mamba_expand=2, use_mamba_kernels=False)
    transformers.JambaForCausalLM(config).save_pretrained(tmp_path / "jamba")
    mamba = transformers.MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=4)
    transformers.MambaForCausalLM(mamba).save_pretrained(tmp_path / "mamba")  # (its table: backbone.embeddings)
    for name in ("Jamba", "Mamba"):
        with pytest.raises(CheckpointError, match=rf"{name}ForCausalLM keeps a recurrent state \(linear-attention or "
                                                  r"Mamba layers\), which Offload's transformers path does not run"):
            Runner(run_config(tmp_path / name.lower()))


def mxfp4_gpt_oss(path: Path, scales_dtype: torch.dtype = torch.uint8) -> None:
    """A tiny gpt-oss checkpoint as OpenAI ships its models: the experts' matrices in MXFP4 (random codes, scales
    near 2^0), the rest float, `quantization_config: {quant_method: mxfp4}`."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = transformers.GptOssConfig(**(SIZES | dict(intermediate_size=64, num_hidden_layers=2, head_dim=16,
                                                        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                        layer_types=["sliding_attention", "full_attention"])))
    model = transformers.GptOssForCausalLM(config)
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # the model's [E, K, N]; the checkpoint's blocks [E, N, K / 32, 16]
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(120, 127, (e, n, k // 32), generator=g).to(scales_dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(raw))


def test_an_mxfp4_checkpoint_runs_dequantized_as_transformers_dequantizes_it(tmp_path):
    """gpt-oss ships MXFP4 experts only (refused before as a quantized checkpoint): read dense, expert by expert,
    the tokens equal transformers' own (it dequantizes on load), resident and streamed; packed int8 too, the same
    tokens in every placement; blocks and scales of another dtype refused in one sentence."""
    mxfp4_gpt_oss(tmp_path / "oss")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "oss", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
                              )[0, len(p):].tolist() for p in PROMPTS]
    assert greedy(run_config(tmp_path / "oss")) == ref
    for weights, gpu in (({}, "800KiB"), ({"weights": {"quantization": "int8", "group_size": 32}}, "400KiB")):
        raw = run_config(tmp_path / "oss", **weights, prefetch={"depth": 1},
                         tiers={"gpu": {"capacity": gpu}, "cpu": {"capacity": "60KiB"},
                                "disk": {"path": str(tmp_path / f"store{len(weights)}")}})
        with Runner(raw) as r:
            assert "disk" in r.plan.homes.values()
            got = [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                              stop_on_eos=False)]
        assert got == (ref if not weights else greedy(run_config(tmp_path / "oss", **weights)))
    mxfp4_gpt_oss(tmp_path / "bad", scales_dtype=torch.float16)
    with pytest.raises(CheckpointError, match=r"are not the uint8 blocks \[E, N, G, 16\] and scales \[E, N, G\] of "
                                              "an MXFP4 matrix"):
        Runner(run_config(tmp_path / "bad"))


def test_chat_auto_fits_the_packed_group_size_to_a_transformers_models_matrices(hf_models):
    """`chat --auto --weights int4` writes the group size that divides every matrix it packs: for a model
    transformers runs, read from its tensors (it stopped with 'not supported natively' before converting)."""
    from offload.cli import auto

    fmt = auto.packed(str(hf_models["phimoe"][0]), "int4")  # (its experts' down_proj: 32 inputs)
    assert (fmt.quantization, fmt.group_size) == ("int4", 32)
    assert auto.packed(str(hf_models["phi3"][0]), "int8").group_size == 64


def test_a_multimodal_checkpoint_runs_as_its_language_model(tmp_path):
    """Gemma 3 from 4B up ships as one multimodal checkpoint (its language model under `language_model.`, a vision
    tower beside): refused before ('cannot tell the token embeddings and decoder blocks apart'). Its language model
    runs alone, the vision tower's tensors left out: text prompts give the multimodal model's own greedy tokens,
    resident and streamed from disk."""
    torch.manual_seed(0)
    text = SIZES | dict(head_dim=16, sliding_window=8, pad_token_id=0, vocab_size=300)
    config = transformers.Gemma3Config(text_config=text, mm_tokens_per_image=4, image_token_index=299,
                                       boi_token_index=297, eoi_token_index=298,
                                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=2, image_size=28, patch_size=14))
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "model")
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
                              )[0, len(p):].tolist() for p in PROMPTS]
    assert greedy(run_config(tmp_path / "model")) == ref
    raw = run_config(tmp_path / "model", prefetch={"depth": 1},
                     tiers={"gpu": {"capacity": "640KiB"}, "cpu": {"capacity": "60KiB"},
                            "disk": {"path": str(tmp_path / "store")}})
    with Runner(raw) as r:
        assert "disk" in r.plan.homes.values() and r.cfg.family == "gemma3_text"
        assert [x.outputs[0].token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0,
                                                           stop_on_eos=False)] == ref


def test_a_multimodal_checkpoint_whose_language_model_has_no_causal_lm_is_refused_by_name(tmp_path):
    """Qwen2.5-VL keeps its language model under the causal LM's own names (`model.layers`) beside `visual.`, and
    transformers has no causal LM class for its text config: refused naming that class (it was 'cannot tell the
    token embeddings and decoder blocks apart')."""
    text = SIZES | dict(vocab_size=300, pad_token_id=0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=299,
                                           video_token_id=298, vision_start_token_id=297)
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"transformers cannot build a causal LM from its config.json "
                                              r"\(Unrecognized configuration class .*Qwen2_5_VLTextConfig"):
        Runner(run_config(tmp_path))
