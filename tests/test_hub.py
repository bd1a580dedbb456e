"""Hub ids as `model:`: fetched with huggingface_hub from a fake Hub on loopback (never the network).

huggingface_hub reads HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE / HF_TOKEN when it is imported, so
each scenario runs in its own process with the environment a user would set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offload.model.hub import is_hub_id, split_id
from offload.runtime.runner import Runner
from tests.conftest import run_config
from tests.fake_hub import FakeHub, Repo

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 13, 200]

DRIVER = textwrap.dedent("""
    import json, sys
    from offload.config import OffloadConfig
    from offload.errors import OffloadError
    from offload.runtime.runner import Runner
    out = {}
    for model in sys.argv[1:]:
        try:
            cfg = OffloadConfig.load({"model": model, "device": "cpu", "dtype": "float32"})
            entry = {"hub": cfg.hub, "loaded": str(cfg.model)}  # loading fetches nothing
            with Runner(cfg) as r:
                entry["tokens"] = r.generate([PROMPT], max_new_tokens=4, stop_on_eos=False)[0].token_ids
                entry["weights"] = sorted(p.name for p in r.config.model.glob("*.safetensors"))
        except OffloadError as e:
            entry = {"error": str(e)}
        out[model] = entry
    print(json.dumps(out))
""").replace("PROMPT", str(PROMPT))


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama):
    repo = tmp_path_factory.mktemp("hub") / "tiny"
    shutil.copytree(tiny_llama, repo)
    (repo / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle that must never be downloaded")
    (repo / "README.md").write_text("# tiny\n")
    (repo / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "do_sample": False}))
    fake = FakeHub({"org/tiny": Repo(repo), "org/gated": Repo(repo, gated=True)})
    yield fake
    fake.close()


def drive(env: dict[str, str], *models: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"PYTHONPATH": str(ROOT)} | env
    proc = subprocess.run([sys.executable, "-c", DRIVER, *models], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hub_ids_are_told_from_paths(tmp_path):
    assert is_hub_id("meta-llama/Llama-3.1-70B-Instruct") and is_hub_id("Qwen/Qwen3-32B@main")
    assert split_id("org/name@0123abc") == ("org/name", "0123abc") and split_id("org/name") == ("org/name", None)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name", tmp_path)  # an existing directory always wins
    assert not is_hub_id("./org/name") and not is_hub_id("/abs/path") and not is_hub_id("name")


def test_download_only_what_a_run_reads_then_run_offline_from_the_cache(hub, tmp_path, tiny_llama):
    with Runner.from_config(run_config(tiny_llama)) as r:
        local = r.generate([PROMPT], max_new_tokens=4, stop_on_eos=False)[0].token_ids
    home = str(tmp_path / "hf")
    online = drive({"HF_ENDPOINT": hub.url, "HF_HOME": home}, "org/tiny", f"org/tiny@{Repo(Path()).sha}",
                   "org/missing", "org/tiny@v9", "org/gated")
    got = online["org/tiny"]
    shards = sorted(p.name for p in tiny_llama.glob("*.safetensors"))
    assert got["hub"] == "org/tiny" and got["tokens"] == local and got["weights"] == shards
    assert got["loaded"] == "org/tiny"  # the config names the id until the runner fetches it
    assert online[f"org/tiny@{Repo(Path()).sha}"]["tokens"] == local
    fetched = set(hub.downloaded())
    assert {"config.json", "tokenizer.json", "generation_config.json", "model.safetensors.index.json"} <= fetched
    assert set(shards) <= fetched
    assert not fetched & {"pytorch_model.bin", "README.md"}  # never pickles, never what a run does not read
    assert "no such repository" in online["org/missing"]["error"]
    assert "revision 'v9' does not exist" in online["org/tiny@v9"]["error"]
    assert "gated" in online["org/gated"]["error"] and "HF_TOKEN" in online["org/gated"]["error"]

    hub.requests.clear()
    offline = drive({"HF_HUB_OFFLINE": "1", "HF_HOME": home, "HF_ENDPOINT": "http://127.0.0.1:9"}, "org/tiny")
    assert offline["org/tiny"]["tokens"] == local and hub.requests == []
    empty = drive({"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty")}, "org/tiny")
    assert "HF_HUB_OFFLINE is set" in empty["org/tiny"]["error"]

    # a download cut short: the files already in the cache are not fetched again, the missing one is
    link = Path(home) / "hub" / "models--org--tiny" / "snapshots" / Repo(Path()).sha / shards[-1]
    link.resolve().unlink()
    link.unlink()
    again = drive({"HF_ENDPOINT": hub.url, "HF_HOME": home}, "org/tiny")
    assert again["org/tiny"]["tokens"] == local and hub.downloaded() == [shards[-1]]


def test_a_token_opens_a_gated_repository(hub, tmp_path):
    got = drive({"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_test"}, "org/gated")
    assert "tokens" in got["org/gated"], got


DRAFT_DRIVER = textwrap.dedent("""
    import json, sys
    from offload.errors import OffloadError
    from offload.runtime.runner import Runner
    out = {}
    for draft in sys.argv[2:]:
        cfg = {"model": sys.argv[1], "device": "cpu", "dtype": "float32", "speculative": {"draft": draft, "tokens": 3}}
        try:
            with Runner.from_config(cfg) as r:
                res = r.generate([PROMPT], max_new_tokens=6, stop_on_eos=False)[0]
                out[draft] = {"tokens": res.token_ids, "draft": str(r.draft.config.model),
                              "weights": sorted(p.name for p in r.draft.config.model.glob("*.safetensors"))}
        except OffloadError as e:
            out[draft] = {"error": str(e)}
    print(json.dumps(out))
""").replace("PROMPT", str(PROMPT))


def test_a_hub_id_as_the_draft_is_fetched_like_the_model(hub, tmp_path, tiny_llama):
    """speculative.draft: org/name: the draft's config and tokenizer when the config loads, its weights when its
    runner starts (from the same cache, resumable, no pickles); greedy tokens are the target's own; a missing
    repository is one sentence naming speculative.draft."""
    with Runner.from_config(run_config(tiny_llama)) as r:
        local = r.generate([PROMPT], max_new_tokens=6, stop_on_eos=False)[0].token_ids
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"PYTHONPATH": str(ROOT)}
    env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-c", DRAFT_DRIVER, str(tiny_llama), "org/tiny", "org/missing"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["org/tiny"]["tokens"] == local
    assert str(tmp_path / "hf") in got["org/tiny"]["draft"] and got["org/tiny"]["weights"]
    assert got["org/missing"]["error"].startswith("speculative.draft: org/missing: no such repository")
