"""Errors a user can hit. All derive from `OffloadError` (defined in `storage.errors`)."""

from __future__ import annotations

from storage.errors import CapacityError, OffloadError, StoreError


class ConfigError(OffloadError):
    """The YAML (or dict) configuration is invalid."""


class CheckpointError(OffloadError):
    """The checkpoint directory is missing, unsupported or inconsistent."""


__all__ = ["OffloadError", "ConfigError", "CheckpointError", "StoreError", "CapacityError"]
