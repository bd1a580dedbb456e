"""Offload: run LLMs whose weights and KV cache do not fit in GPU memory.

    config.py, errors.py   the YAML run configuration; the errors a user can hit
    model/                 what a model is: shape, checkpoint, math, tokenizer
    weights/               a model's weights as groups of bytes: layouts, conversion, the tiered weight source
    kv/                    the paged KV cache over the tiers
    plan/                  capacities -> placement, KV pool, predictions (reads no weights)
    runtime/               the Runner: forward passes, generation, sampling
    cli/                   every command
    testing/               synthetic checkpoints
"""

from offload.config import OffloadConfig
from offload.errors import CapacityError, CheckpointError, ConfigError, OffloadError, StoreError
from offload.runtime.results import GenerationResult
from offload.runtime.runner import Runner
from offload.version import __version__

__all__ = ["Runner", "GenerationResult", "OffloadConfig", "OffloadError", "ConfigError", "CheckpointError",
           "StoreError", "CapacityError", "__version__"]
