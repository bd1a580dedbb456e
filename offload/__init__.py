"""Offload: run LLMs whose weights and KV cache do not fit in GPU memory."""

__version__ = "0.1.0"

from offload.config import OffloadConfig
from offload.errors import CapacityError, CheckpointError, ConfigError, OffloadError, StoreError
from offload.runner import GenerationResult, Runner

__all__ = ["Runner", "GenerationResult", "OffloadConfig", "OffloadError", "ConfigError", "CheckpointError",
           "StoreError", "CapacityError", "__version__"]
