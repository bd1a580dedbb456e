"""The README's promises that CI relies on."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_setup_commands_verbatim():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(pip install [^\n]+)\n```", readme)
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for cmd in commands:
        assert cmd in ci, f"{cmd!r} is in the README but not in .ci/run"
    assert "torch==2.13.0" in commands[0] and "offload demo" in commands[0]
    assert "[test]" in commands[1] and "pytest" in commands[1]


def test_the_python_api_section_runs_as_written(tiny_llama, tmp_path, capsys):
    """The README's Python API example, with the constructor pointed at a tiny local model (no tiers)."""
    import json
    import shutil

    from tests.test_chat_template import CHATML

    section = (ROOT / "README.md").read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    head, body = code.split(" as runner:", 1)
    assert head.startswith("from offload import Runner") and "Runner(model=" in head
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    local = f'from offload import Runner, Sampling\n\nwith Runner(model={str(model)!r}, device="cpu") as runner:'
    exec(compile(local + body, "README.md", "exec"), {})  # noqa: S102 - our own README
    assert "where every layer lives" not in capsys.readouterr().out  # it printed the plan, not the comment
