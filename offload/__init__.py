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

from offload.plan.machine import busy  # (no torch: read before torch and numba start their OpenMP runtimes)


def _omp_wait_policy() -> None:
    """Two OpenMP runtimes share the cores in a CPU run: torch's and numba's (the row-invariant kernels). Idle
    workers spin for a while after a parallel region (OpenMP's default): on free cores that saves a wake-up per
    kernel (~150 a decode step); on cores other work needs, the spinning takes them. SmolLM2-135M's bf16 decode
    step on 2 AVX2 cores, interleaved runs: quiet machine 40-45 ms spinning vs 55-61 ms passive; with 2 busy
    processes beside it 160-1400 ms spinning vs 69-94 ms passive; its int4 step on 2 Zen 4 cores: quiet 5.6-6.7 ms
    spinning vs 15-17 passive, beside 2 busy processes 25-30 spinning vs 10-12 passive (a bounded spin between:
    GOMP_SPINCOUNT 30000 / 100000, 15-22 ms). So: passive when other work takes the cores when offload is imported
    (`machine.busy`: the load average and the tasks runnable now; the average alone trails by a minute and made a
    run started just after a conversion on an idle machine 2.5x slower), OpenMP's default otherwise. Read by each
    runtime when it loads, so this holds where offload is imported before torch (the CLI, the scripts); an
    explicit OMP_WAIT_POLICY wins."""
    if "OMP_WAIT_POLICY" not in os.environ and busy():
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


_omp_wait_policy()

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
