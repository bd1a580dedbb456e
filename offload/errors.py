"""Errors a user can hit. All derive from `OffloadError` (defined in `storage.errors`)."""

from __future__ import annotations

from storage.errors import CapacityError, OffloadError, StaleStoreError, StoreError


class ConfigError(OffloadError):
    """The YAML (or dict) configuration is invalid."""


class CheckpointError(OffloadError):
    """The checkpoint directory is missing, unsupported or inconsistent."""


class ContextLengthError(ConfigError):
    """A prompt and its new tokens are longer than the context (the model's, or a smaller configured one)."""

    def __init__(self, message: str, prompt_tokens: int, max_new_tokens: int, context: int) -> None:
        super().__init__(message)
        self.prompt_tokens, self.max_new_tokens, self.context = prompt_tokens, max_new_tokens, context

    @property
    def prompt_too_long(self) -> bool:
        """The prompt alone leaves no room for a single new token (no max_new_tokens would fit)."""
        return self.prompt_tokens >= self.context


__all__ = ["OffloadError", "ConfigError", "CheckpointError", "ContextLengthError", "StoreError", "StaleStoreError",
           "CapacityError"]
