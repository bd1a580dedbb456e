"""The project's error types, defined at the bottom of the dependency graph.

Every error a user can cause (a bad YAML key, a missing checkpoint, a budget that cannot
fit, a corrupt store, a full disk) is an `OffloadError` whose message is one sentence
saying what is wrong and what to do. `storage` is the lowest package, so the hierarchy
lives here and `offload.errors` re-exports it; nothing here knows about models.
"""

from __future__ import annotations


class OffloadError(Exception):
    """Base class of every error Offload raises on purpose."""


class StoreError(OffloadError):
    """A store on disk is missing, half-written, corrupt, foreign or cannot be written."""


class CapacityError(OffloadError):
    """Something asked for more bytes than a tier (or all tiers together) can ever hold."""
