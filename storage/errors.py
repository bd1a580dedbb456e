"""The project's error types, defined at the bottom of the dependency graph.

Every error a user can cause (a bad YAML key, a missing checkpoint, a budget that cannot
fit, a corrupt store, a full disk) is an `OffloadError` whose message is one sentence
saying what is wrong and what to do. `storage` is the lowest package, so the hierarchy
lives here and `offload.errors` re-exports it; nothing here knows about models.
"""

from __future__ import annotations

from os import PathLike


class OffloadError(Exception):
    """Base class of every error Offload raises on purpose."""


class StoreError(OffloadError):
    """A store on disk is missing, half-written, corrupt, foreign or cannot be written."""


class StaleStoreError(StoreError):
    """A complete, intact store that holds other bytes than the run reads: another checkpoint, dtype, weight format,
    layout or store version. Nothing in it is damaged; converting again (`--force`) replaces it."""


def convert_again(store: str | PathLike, command: str | None = None) -> str:
    """How a damaged store is rebuilt, as the end of an error's sentence: `command` (the exact `offload convert`
    line of the run that opened it, which only the caller knows) or its shape with the store's path."""
    return f"convert it again: `{command or f'offload convert CHECKPOINT {store} --force'}`"


class CapacityError(OffloadError):
    """Something asked for more bytes than a tier (or all tiers together) can ever hold."""
