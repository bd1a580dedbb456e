"""The shape of the code: one-way dependencies, no import cycles, no hidden imports, small modules.

The import graph is read from the source (every `import`, at any depth, TYPE_CHECKING blocks
included), so an import moved into a function to dodge a cycle still counts as an edge.
"""

from __future__ import annotations

import ast
import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

from offload.runtime.executor import WeightSource

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("storage", "schedulers", "offload")
#: What each top-level package may import of ours (the card's one-way dependency).
ALLOWED = {"storage": {"storage"}, "schedulers": {"schedulers", "storage"},
           "offload": {"offload", "schedulers", "storage"}}
#: Library modules (every package above) stay small: one idea a newcomer reads top to bottom.
MAX_LINES = 400
#: Scripts (thin commands, benchmarks) and test modules (cases of one behaviour area) are exempt from that
#: cap, not from any: past this they are several ideas and should be split.
MAX_LINES_LOOSE = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = modules()


def resolve(name: str) -> str | None:
    """The module (or package) of ours that `name` denotes, None if it is not ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module of ours imported, line, inside a function or class?) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in MODULES else child.module
                           for a in child.names]
            else:
                visit(child, inner)
                continue
            for t in targets:
                ours = resolve(t)
                if ours is not None:
                    out.append((ours, child.lineno, nested))
    visit(tree, False)
    return out


GRAPH = {m: imports(p) for m, p in MODULES.items()}


def unit(module: str) -> str:
    """The unit cycles are checked between: a subpackage of offload, else the module itself."""
    parts = module.split(".")
    if parts[0] == "offload" and len(parts) >= 2 and (ROOT / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return found


def test_the_graph_sees_the_packages_and_their_imports():
    # guards the test itself: an empty graph would pass everything below
    assert {"storage.tiers", "schedulers.prefetch", "offload.runtime.runner"} <= set(MODULES)
    assert "storage.errors" in {m for m, _, _ in GRAPH["storage.tiers"]}
    assert any(m.startswith("offload.kv") for m, _, _ in GRAPH["offload.runtime.runner"])


def test_no_upward_imports():
    bad = [f"{m} imports {t} (line {line})" for m, edges in GRAPH.items() for t, line, _ in edges
           if t.split(".")[0] not in ALLOWED[m.split(".")[0]]]
    assert bad == [], "storage imports nothing of ours; schedulers only storage:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    edges = {m: {t for t, _, _ in e if t != m} for m, e in GRAPH.items()}
    assert cycles(edges) == []


def test_no_import_cycles_between_the_concepts_of_offload():
    edges: dict[str, set[str]] = {}
    for m, e in GRAPH.items():
        edges.setdefault(unit(m), set()).update(unit(t) for t, _, _ in e if unit(t) != unit(m))
    assert cycles(edges) == []


def test_nothing_imports_the_top_level_package_or_the_cli():
    # `offload/__init__` imports the runtime: importing it from inside would close a loop
    bad = [f"{m} imports {t}" for m, e in GRAPH.items() for t, _, _ in e
           if (t == "offload" or t.startswith("offload.cli")) and not m.startswith(("offload.cli", "offload.__main__"))]
    assert bad == []


def test_no_function_level_imports_of_our_own_code():
    hidden = [f"{m}: line {line} imports {t}" for m, e in GRAPH.items() for t, line, nested in e if nested]
    assert hidden == [], "an import inside a function usually hides a cycle:\n" + "\n".join(hidden)


def test_the_product_never_imports_scripts():
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "scripts" or n.startswith("scripts.") for n in names), m


def test_only_the_three_packages_are_installed():
    # `scripts` stays a folder of the checkout (`python -m scripts.x` from its root), never a top-level package
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    include = cfg["options.packages.find"]["include"].split()
    found = setuptools.find_packages(str(ROOT), include=include)
    assert {p.split(".")[0] for p in found} == {"offload", "schedulers", "storage"}
    assert not any(k.startswith("scripts") for k in cfg["options.package_data"])


def test_one_lint_configuration():
    assert (ROOT / "ruff.toml").is_file() and not (ROOT / ".flake8").exists()
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "flake8" not in cfg and "ruff check ." in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("package", sorted(p for p in MODULES if (ROOT / p.replace(".", "/")).is_dir()))
def test_every_package_says_what_lives_there(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text()))
    assert doc and len(doc.split()) >= 8, f"{package}/__init__.py needs a docstring saying what lives there"


def test_modules_stay_small():
    assert {m.split(".")[0] for m in MODULES} == set(PACKAGES)  # every package is measured
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}, f"modules over {MAX_LINES} lines (split them by idea): {big}"


# ----------------------------------------------------------------------------- private members
#: (module, private member) reads of another module's internals, each with its reason
PRIVATE_ALLOWED = {
    ("scripts.stream_cost", "_verified"): "a benchmark of the disk tier's raw read path: primes its checksum cache",
    ("scripts.stream_cost", "_direct_fds"): "... and reports whether the reads really went through O_DIRECT",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_privates(tree: ast.AST) -> set[str]:
    """Private members the classes of a module define: methods, class attributes, `self._x` / `cls._x`."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in ("self", "cls") and _is_private(node.attr):
                names.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id))
    return names


def _private_reads(tree: ast.AST) -> list[tuple[str, int, str]]:
    """(member, line, expression) for every `x._member` whose `x` is not self, cls or super()."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            out.append((node.attr, node.lineno, ast.unparse(node)))
    return out


TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}
OWN = {m: _own_privates(t) for m, t in TREES.items()}
ALL_PRIVATES = set().union(*OWN.values())


def foreign_private_reads(module: str, tree: ast.AST, defined_by: set[str]) -> list[str]:
    """Reads of a private member that the classes of another module define (and this module's do not)."""
    own = OWN.get(module, set())
    return [f"{module}:{line}: {expr}" for name, line, expr in _private_reads(tree)
            if name in defined_by and name not in own and (module, name) not in PRIVATE_ALLOWED]


def test_the_private_member_check_sees_a_foreign_read():
    # guards the check itself: a module reaching into the executor's internals is caught
    tree = ast.parse("def f(runner):\n    return runner.target._res.kv\n")
    assert foreign_private_reads("offload.serve.x", tree, ALL_PRIVATES) == ["offload.serve.x:2: runner.target._res"]
    assert "_res" in OWN["offload.runtime.executor"] and "_finalizer" in OWN["offload.runtime.runner"]


def test_no_module_reads_the_private_members_of_another_modules_classes():
    """Layers meet at public seams (STYLE.md item 12): the engine, speculation, conversations and the server
    call the executor and the runner through their public methods; a module touches `_x` only of its own
    classes. Approximation: a private name its own classes also define is taken to be its own."""
    scripts = {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted((ROOT / "scripts").rglob("*.py"))}
    bad = [hit for m, tree in {**TREES, **scripts}.items() for hit in foreign_private_reads(m, tree, ALL_PRIVATES)]
    assert bad == [], "read through a public method or attribute instead:\n" + "\n".join(bad)


def test_tests_use_the_runtime_through_its_public_seam():
    """Tests may poke storage internals to check a layout, but the runner, executors, engine and speculator
    are exercised the way their callers use them."""
    runtime = set().union(*(OWN[m] for m in MODULES if m.startswith("offload.runtime")))
    elsewhere = set().union(*(OWN[m] for m in MODULES if not m.startswith("offload.runtime")))
    bad = [hit for p in sorted((ROOT / "tests").glob("*.py"))
           for hit in foreign_private_reads(module_name(p), ast.parse(p.read_text(), str(p)), runtime - elsewhere)]
    assert bad == [], "\n".join(bad)


def test_the_weight_source_protocol_names_every_call_the_executor_makes():
    calls = {node.attr for node in ast.walk(TREES["offload.runtime.executor"])
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
             and node.value.attr == "weights" and isinstance(node.value.value, ast.Name)
             and node.value.value.id == "self"}
    members = {n for n in [*vars(WeightSource), *WeightSource.__annotations__] if not n.startswith("_")}
    assert calls and calls <= members, f"the executor calls {sorted(calls - members)} beyond WeightSource"


@pytest.mark.parametrize("folder", ["scripts", "tests"])
def test_scripts_and_tests_stay_under_the_loose_cap(folder):
    files = sorted((ROOT / folder).glob("*.py"))
    assert files
    big = {p.name: n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES_LOOSE}
    assert big == {}, f"{folder} files over {MAX_LINES_LOOSE} lines (split them by behaviour): {big}"


FORK_AFTER_IMPORT = """
import os, sys, torch
torch.set_num_threads(2)
import offload, offload.cli.main, offload.serve.api, offload.hf, offload.weights, storage, schedulers
pid = os.fork()
if pid == 0:  # a forkserver's child: its first parallel regions must run, not wait on the parent's OpenMP pool
    x = torch.randn(512, 512)
    idx = torch.arange(0, 512, 2)
    x[idx] = (x @ x)[idx]
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_importing_the_packages_computes_nothing_so_a_fork_right_after_can_compute():
    """A module-level probe (a matmul, a packing check) starts torch's OpenMP pool at import; a process forked
    after that import (multiprocessing's forkserver preloads modules) then hangs in its first parallel op."""
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_IMPORT], cwd=Path(__file__).resolve().parents[1],
                          timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
