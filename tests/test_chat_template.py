"""Chat templates and generation defaults, checked against transformers on the same files."""

from __future__ import annotations

import json
import shutil

import pytest

from offload.errors import ConfigError
from offload.model.chat import ChatTemplate, GenerationDefaults
from offload.model.tokenizer import TextTokenizer

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{% if loop.index0 == 0 and message['role'] != 'system' %}"
          "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nToday: ' + strftime_now('%Y') + '<|eot_id|>' }}"
          "{% endif %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
          "message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
STRICT = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
          "{{ raise_exception('roles must be user or assistant') }}{% endif %}{{ m['content'] }}{% endfor %}")
CONVERSATION = [{"role": "user", "content": "Where is the kettle?"},
                {"role": "assistant", "content": "On the stove, by the window."},
                {"role": "user", "content": "  And the tea? <b>&</b> {\"json\": 1}  "}]


@pytest.fixture
def chat_model(tmp_path, tiny_llama):
    def make(template: str, **special) -> object:
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_llama, d)
        cfg = {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>", **special}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        return d
    return make


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_rendered_ids_equal_transformers_apply_chat_template(chat_model, template, gen_prompt):
    transformers = pytest.importorskip("transformers")
    d = chat_model(template)
    ours = ChatTemplate.from_checkpoint(d)
    tok = TextTokenizer.from_checkpoint(d)
    ids = tok.encode(ours.render(CONVERSATION, add_generation_prompt=gen_prompt), add_special_tokens=False)
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    expected = ref.apply_chat_template(CONVERSATION, add_generation_prompt=gen_prompt, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ids == list(expected)
    assert ours.render(CONVERSATION, add_generation_prompt=gen_prompt) == ref.apply_chat_template(
        CONVERSATION, add_generation_prompt=gen_prompt, tokenize=False)


def test_template_errors_and_sandbox_are_config_errors(chat_model):
    strict = ChatTemplate.from_checkpoint(chat_model(STRICT))
    with pytest.raises(ConfigError, match="roles must be user or assistant"):
        strict.render([{"role": "system", "content": "x"}])
    escape = ChatTemplate.from_checkpoint(chat_model("{{ messages.__class__.__mro__ }}"))
    with pytest.raises(ConfigError, match="refused"):  # the sandbox blocks attribute escapes
        escape.render(CONVERSATION)
    with pytest.raises(ConfigError, match="message 0 must be an object with a 'role'"):
        strict.render(["hello"])


def test_no_template_is_none(tiny_llama):
    assert ChatTemplate.from_checkpoint(tiny_llama) is None


def test_generation_defaults_gather_every_eos(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [128001, 128009], "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    g = GenerationDefaults.from_checkpoint(tmp_path, config_eos=(128001, 7))
    assert g.eos_token_ids == (128001, 128009, 7) and g.temperature == 0.6 and g.top_p == 0.9
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.6}))
    g = GenerationDefaults.from_checkpoint(tmp_path)
    assert g.eos_token_ids == (2,) and g.temperature == 0.0  # do_sample false: greedy


def test_stream_decoder_is_incremental_and_complete(tiny_llama):
    tok = TextTokenizer.from_checkpoint(tiny_llama)
    text = "The kettle — on Larkspur Lane — sang: ☕ naïve café ✓"
    ids = tok.encode(text, add_special_tokens=False)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids)
    assert sum(1 for p in pieces if p) > len(ids) // 2  # text flows token by token, not all at the end
