"""The command line as a user types it."""

from __future__ import annotations

import json
import subprocess
import sys

from offload.cli.main import main
from offload.runtime.runner import Runner
from storage.manifest import VERSION as STORE_VERSION
from tests.conftest import run_config


def write_config(tmp_path, model, **extra):
    import yaml
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config(model, **extra)))
    return path


def test_run_json_matches_the_python_api(tmp_path, tiny_llama, capsys):
    cfg = write_config(tmp_path, tiny_llama)
    assert main(["run", "--config", str(cfg), "--prompt", "Hello there", "--max-new-tokens", "6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    with Runner.from_config(cfg) as r:
        [ref] = r.generate(["Hello there"], max_new_tokens=6)
    assert data["results"][0]["token_ids"] == ref.token_ids
    assert data["results"][0]["text"] == ref.text
    assert data["stats"]["prompt_tokens"] == len(ref.prompt_ids)


def test_run_streams_text_on_stdout_and_ends_stderr_with_a_speed_line(tmp_path, tiny_llama, capsys):
    cfg = write_config(tmp_path, tiny_llama)
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("Once upon a time")
    assert main(["run", "--config", str(cfg), "--prompt-file", str(prompt_file), "--max-new-tokens", "5",
                 "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Once upon a time") and captured.out.endswith("\n")
    assert "ms/step" not in captured.out
    last = captured.err.splitlines()[-1]
    assert "ms/step" in last and "tok/s" in last


def test_batch_of_prompts_prints_each_result(tmp_path, tiny_llama, capsys):
    cfg = write_config(tmp_path, tiny_llama)
    assert main(["run", "--config", str(cfg), "--prompt", "a", "--prompt", "b c", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "--- [0] a" in out and "--- [1] b c" in out


def test_errors_are_one_line_and_exit_2(tmp_path, tiny_llama):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {tiny_llama}\nprefetch: {{dept: 2}}\n")
    proc = subprocess.run([sys.executable, "-m", "offload", "run", "--config", str(bad), "--prompt", "x"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("offload: error: prefetch.dept: unknown key; did you mean 'depth'? "
                                   "allowed here: depth")


def test_missing_prompt_is_an_error(tmp_path, tiny_llama, capsys):
    cfg = write_config(tmp_path, tiny_llama)
    assert main(["run", "--config", str(cfg)]) == 2
    assert "no prompt given" in capsys.readouterr().err


def test_demo_generates_its_model_once_and_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))
    assert main(["demo", "--max-new-tokens", "4", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (tmp_path / "cache" / "small-llama" / "config.json").is_file()
    assert (tmp_path / "cache" / "demo.yaml").is_file()
    assert len(first["results"][0]["token_ids"]) == 4
    assert main(["demo", "--max-new-tokens", "4", "--json"]) == 0
    captured = capsys.readouterr()
    assert "generating" not in captured.err  # reused, not regenerated
    assert json.loads(captured.out)["results"][0]["token_ids"] == first["results"][0]["token_ids"]


def test_demo_reads_a_store_of_an_earlier_version_or_converts_its_own_again(tmp_path, monkeypatch, capsys):
    """The demo's cache outlives an upgrade (CI keeps ~/.cache): a dense store converted with another `keep` list
    holds the same bytes and is read; one of another store version is the demo's own cache and is converted again.
    A store the user pointed the demo config at is theirs: refused with the command, not replaced."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE", str(cache))
    assert main(["demo", "--max-new-tokens", "4", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["results"][0]["token_ids"]
    manifest = cache / "small-llama-store" / "manifest.json"

    def edit(change, file=manifest):
        m = json.loads(file.read_text())
        change(m)
        file.write_text(json.dumps(m))

    edit(lambda m: m["meta"]["weights"].update(keep=["lm_head"]))  # what the earlier default `keep` wrote
    assert main(["demo", "--max-new-tokens", "4", "--json"]) == 0
    captured = capsys.readouterr()
    assert "converting" not in captured.err and json.loads(captured.out)["results"][0]["token_ids"] == first
    edit(lambda m: m.update(version=m["version"] + 1))
    assert main(["demo", "--max-new-tokens", "4", "--json"]) == 0
    captured = capsys.readouterr()
    assert "converting it again" in captured.err and json.loads(captured.out)["results"][0]["token_ids"] == first
    assert json.loads(manifest.read_text())["version"] == STORE_VERSION  # rewritten, not patched
    moved = cache / "mine"
    (cache / "small-llama-store").rename(moved)
    (cache / "demo.yaml").write_text((cache / "demo.yaml").read_text().replace("small-llama-store", "mine"))
    edit(lambda m: m.update(version=m["version"] + 1), moved / "manifest.json")
    assert main(["demo", "--max-new-tokens", "4", "--json"]) == 2
    assert "offload convert" in capsys.readouterr().err and (moved / "manifest.json").is_file()
