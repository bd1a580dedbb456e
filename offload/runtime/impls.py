"""Which executor runs a model (`model_impl`): Offload's own, or the transformers path found by name.

`offload.hf` (transformers and accelerate at the top of its modules) depends on the runtime; the runtime
knows it only as a module name here, imported when a run asks for it, so transformers stays an optional
dependency (the `hf` extra) and nothing else of Offload pays for importing it.
"""

from __future__ import annotations

import importlib
import json

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.model.generic import resolve_impl
from offload.runtime.executor import Executor

#: model_impl -> (module, class) of its executor, other than the native one
IMPLS = {"transformers": ("offload.hf.executor", "HFExecutor")}
#: the distributions that path needs, as the extra installs them
EXTRA = "pip install 'offload[hf]'"


def model_impl(config: OffloadConfig) -> str:
    """`native` or `transformers` for this config's model (auto: native when Offload knows the family). A
    config.json that cannot be read counts as native: the native checkpoint reader names what is wrong."""
    try:
        raw = json.loads((config.model / "config.json").read_text())
    except (OSError, ValueError):
        return "native"
    return resolve_impl(config.model_impl, raw) if isinstance(raw, dict) else "native"


def executor_class(config: OffloadConfig) -> type[Executor]:
    """The Executor subclass that runs this config's model."""
    impl = model_impl(config)
    if impl == "native":
        return Executor
    module, name = IMPLS[impl]
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in ("transformers", "accelerate"):
            raise
        why = "model_impl: transformers" if config.model_impl == "transformers" else \
            f"{config.model}'s family is not one Offload runs natively, so model_impl auto"
        raise ConfigError(f"{why} needs transformers, which is not installed; {EXTRA}") from None
