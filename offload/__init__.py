"""Offload: run LLMs whose weights and KV cache do not fit in GPU memory.

    config.py, errors.py   the YAML run configuration; the errors a user can hit
    model/                 what a model is: shape, checkpoint, math, tokenizer
    weights/               a model's weights as groups of bytes: layouts, conversion, the tiered weight source
    kv/                    the paged KV cache over the tiers
    plan/                  capacities -> placement, KV pool, predictions (reads no weights)
    runtime/               the Runner (the Python API) over executors: forward passes, generation, sampling
    cli/                   every command
    testing/               synthetic checkpoints
"""

from offload.config import OffloadConfig
from offload.errors import CapacityError, CheckpointError, ConfigError, OffloadError, StoreError
from offload.runtime.conversation import Conversation, Reply
from offload.runtime.executor import Executor, ForwardBatch
from offload.runtime.results import Completion, GenerationResult, RunStats, TokenEvent
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling, SamplingError
from offload.version import __version__

__all__ = ["Runner", "Sampling", "GenerationResult", "Completion", "TokenEvent", "RunStats", "Conversation", "Reply",
           "Executor", "ForwardBatch", "OffloadConfig", "OffloadError", "ConfigError", "SamplingError",
           "CheckpointError", "StoreError", "CapacityError", "__version__"]
