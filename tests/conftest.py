"""Shared fixtures: tiny seeded checkpoints made with the project's own generator (cached per session)."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest
import torch

from offload.plan import memory
from offload.testing.make_model import make_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(family="llama", size="tiny", **kw) -> path; identical arguments share one directory."""
    cache: dict[str, Path] = {}

    def make(family: str = "llama", size: str = "tiny", **kw) -> Path:
        key = json.dumps([family, size, kw], sort_keys=True, default=str)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-{size}")
            cache[key] = make_model(path, family=family, size=size, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> Path:
    return model_factory("llama")


def run_config(model: Path, **overrides) -> dict:
    """A float32 CPU config dict for tests."""
    cfg = {"model": str(model), "device": "cpu", "dtype": "float32"}
    cfg.update(overrides)
    return cfg


@pytest.fixture(autouse=True)
def _compiling_in_process():
    """Every test plans as a Runner made in Python does, keeping room for compiling the kernels in the process; a
    command that compiles them in child processes first (`prepare.before_run`) says so for its process."""
    memory.compile_apart(False)
    yield
    memory.compile_apart(False)


@pytest.fixture(autouse=True, scope="session")
def _sigint_handled():
    """A runner that starts the suite in the background (a non-interactive shell's `cmd &`) hands it SIGINT
    ignored, which every command a test starts inherits, and Offload honours an ignored SIGINT (`signals.install`):
    the Ctrl-C tests would wait for an interrupt that never comes. The suite takes SIGINT as a terminal gives it
    (Python's handler; a child starts with the default action)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


def within_split(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group: int, qmax: int = 32767) -> None:
    """The packed kernels multiply bf16 activations split into integer steps per group (`cpu_packed16._split`):
    each x[k] is off by at most half its group's step, max |x| over the group / qmax (int16 steps 32767, int8 127),
    so a product by at most sum_k |w[n, k]| * that, plus float32 rounding. Asserts got (the kernel's [M, n]) is
    x @ w.T within that bound."""
    M, K = x.shape
    x = x.double()
    half = (x.abs().view(M, K // group, group).amax(-1) / qmax / 2).repeat_interleave(group, dim=1)
    bound = half @ w.abs().double().T + 1e-5 * (x.abs() @ w.abs().double().T)
    err = (got.double() - x @ w.double().T).abs()
    assert bool((err <= bound).all()), f"largest error {float(err.max()):.3g}, its bound {float(bound.max()):.3g}"
