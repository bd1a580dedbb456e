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
