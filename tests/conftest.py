"""Shared fixtures: tiny seeded checkpoints made with the project's own generator (cached per session)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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
