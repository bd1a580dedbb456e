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

import os

# Two OpenMP runtimes share the cores in a CPU run: torch's and numba's (the row-invariant kernels). With the
# default active wait, each one's idle workers spin after a parallel region and take the cores the other needs:
# SmolLM2-135M's bf16 decode step on 2 shared cores took 249-635 ms, 112-195 ms with passive waits. Read by
# each runtime when it loads, so this holds where offload is imported before torch (the CLI, the scripts); an
# explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from offload.config import OffloadConfig  # noqa: E402
from offload.errors import CapacityError, CheckpointError, ConfigError, OffloadError, StoreError  # noqa: E402
from offload.runtime.conversation import Conversation, Reply  # noqa: E402
from offload.runtime.executor import Executor, ForwardBatch  # noqa: E402
from offload.runtime.results import Completion, GenerationResult, RunStats, TokenEvent  # noqa: E402
from offload.runtime.runner import Runner  # noqa: E402
from offload.runtime.sampling import Sampling, SamplingError  # noqa: E402
from offload.version import __version__  # noqa: E402

__all__ = ["Runner", "Sampling", "GenerationResult", "Completion", "TokenEvent", "RunStats", "Conversation", "Reply",
           "Executor", "ForwardBatch", "OffloadConfig", "OffloadError", "ConfigError", "SamplingError",
           "CheckpointError", "StoreError", "CapacityError", "__version__"]
