"""A converted model on disk: a zarr group of layer-packed byte arrays plus `manifest.json`.

    STORE/zarr.json                 the zarr group
    STORE/layer.3/zarr.json         one uint8 array per group, one chunk, bytes + crc32c codecs
    STORE/layer.3/c.0               the chunk: the group's packed bytes, then its crc32c
    STORE/manifest.json             written last: format version, each group's layout and
                                    checksum, and the caller's opaque `meta` (model config,
                                    checkpoint fingerprint, dtype)
    STORE/.offload-converting       present only while a conversion is running

A directory with a marker and no manifest is a conversion that was interrupted: it is
wiped and started again. A complete store is never overwritten without `force`. A
directory that is neither is not ours, and is never deleted. This module knows groups,
layouts and bytes; the meaning of `meta` belongs to the caller.
"""

from __future__ import annotations

import enum
import json
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from storage import io
from storage.errors import CapacityError, StoreError
from storage.layout import GroupLayout
from storage.tiers import DiskTier, read_json

FORMAT = "offload-store"
#: 2: groups may hold packed (quantized) tensors, and the meta records the weight format per tensor.
VERSION = 2
MANIFEST = "manifest.json"
MARKER = ".offload-converting"
#: Room left on the file system beyond the store itself (metadata, temp files).
FREE_SPACE_MARGIN = 64 * 2**20


class StoreState(enum.Enum):
    MISSING = "missing"  # no directory, or an empty one
    PARTIAL = "partial"  # our marker without a manifest: an interrupted conversion
    COMPLETE = "complete"  # a manifest is present (validated on open)
    FOREIGN = "foreign"  # a non-empty directory that is not an Offload store


def store_state(path: str | Path) -> StoreState:
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return StoreState.MISSING
    if not path.is_dir():
        return StoreState.FOREIGN
    if (path / MANIFEST).exists():
        return StoreState.COMPLETE
    if (path / MARKER).exists():
        return StoreState.PARTIAL
    return StoreState.FOREIGN


@dataclass(frozen=True)
class GroupRecord:
    layout: GroupLayout
    crc32c: int

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


class StoreWriter:
    """Creates a store group by group; `finish` writes the manifest (last) and returns the opened store."""

    def __init__(self, path: str | Path, total_bytes: int, force: bool = False,
                 capacity: int | None = None) -> None:
        self.path = Path(path)
        state = store_state(self.path)
        if state is StoreState.FOREIGN:
            raise StoreError(
                f"{self.path} exists and is not an Offload store; choose an empty or new directory "
                "(Offload never deletes a directory it did not create)"
            )
        if state is StoreState.COMPLETE and not force:
            raise StoreError(f"{self.path} already holds a converted store; pass --force to replace it")
        if capacity is not None and total_bytes > capacity:
            raise CapacityError(
                f"the converted model needs {total_bytes / 2**30:.2f} GiB on disk but tiers.disk.capacity is "
                f"{capacity / 2**30:.2f} GiB; raise it to at least {total_bytes / 2**30:.2f} GiB"
            )
        if state in (StoreState.PARTIAL, StoreState.COMPLETE):
            _wipe(self.path)  # ours: an interrupted conversion, or a forced replacement
        anchor = self.path
        while not anchor.exists():
            anchor = anchor.parent
        free = shutil.disk_usage(anchor).free
        if free < total_bytes + FREE_SPACE_MARGIN:
            raise StoreError(
                f"{self.path}: converting needs {(total_bytes + FREE_SPACE_MARGIN) / 2**30:.2f} GiB free but the "
                f"disk has {free / 2**30:.2f} GiB; free space or choose another tiers.disk.path"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            (self.path / MARKER).write_text(json.dumps({"started": time.time()}))
        except OSError as e:
            raise io.disk_error(e, self.path) from None
        self.tier = DiskTier(self.path, read_only=False, read_threads=1)
        self.records: dict[str, GroupRecord] = {}

    def write_group(self, layout: GroupLayout, data: torch.Tensor) -> None:
        """Write one packed group (a uint8 CPU tensor of layout.nbytes)."""
        assert data.dtype == torch.uint8 and data.numel() == layout.nbytes
        self.tier.allocate(layout.name, layout.nbytes)
        self.tier.write(layout.name, data)
        self.records[layout.name] = GroupRecord(layout, io.crc32c(data))

    def finish(self, meta: Mapping[str, Any]) -> Store:
        manifest = {
            "format": FORMAT, "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "total_bytes": sum(r.nbytes for r in self.records.values()),
            "meta": dict(meta),
            "groups": {name: {"crc32c": r.crc32c, **r.layout.to_json()} for name, r in self.records.items()},
        }
        self.tier.close()
        io.atomic_write_bytes(self.path / MANIFEST, json.dumps(manifest, indent=1).encode())
        (self.path / MARKER).unlink(missing_ok=True)
        return Store.open(self.path)

    def abort(self) -> None:
        """Remove what was written (the directory was empty or ours when we started)."""
        self.tier.close()
        _wipe(self.path)


def _wipe(path: Path) -> None:
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


class Store:
    """A complete store, validated on open; `tier` reads its groups."""

    def __init__(self, path: Path, manifest: dict[str, Any], tier: DiskTier) -> None:
        self.path = path
        self.manifest = manifest
        self.meta: dict[str, Any] = manifest["meta"]
        self.groups: dict[str, GroupRecord] = {
            name: GroupRecord(GroupLayout.from_json(name, g), int(g["crc32c"]))
            for name, g in manifest["groups"].items()
        }
        self.tier = tier

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.groups.values())

    @classmethod
    def open(cls, path: str | Path, page_cache: bool = False, verify: str = "always",
             read_threads: int = 4, capacity: int | None = None) -> Store:
        path = Path(path)
        state = store_state(path)
        if state is StoreState.MISSING:
            raise StoreError(f"{path}: no store here; run `offload convert CHECKPOINT {path}` first")
        if state is StoreState.PARTIAL:
            raise StoreError(f"{path}: the conversion into this store was interrupted; run `offload convert` again")
        if state is StoreState.FOREIGN:
            raise StoreError(f"{path}: not an Offload store (no {MANIFEST}); convert a checkpoint into it first")
        manifest = read_json(path / MANIFEST)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "groups" not in manifest:
            raise StoreError(f"{path / MANIFEST}: unreadable or not an Offload manifest; convert again with --force")
        if manifest.get("version") == 1:
            raise StoreError(
                f"{path}: this store has format version 1, from before quantized weights (this Offload reads "
                f"version {VERSION}); convert it again with `offload convert CHECKPOINT {path} --force`"
            )
        if manifest.get("version") != VERSION:
            raise StoreError(
                f"{path}: store format version {manifest.get('version')} is not {VERSION}, the one this Offload "
                "reads; convert again with --force"
            )
        if capacity is not None and manifest.get("total_bytes", 0) > capacity:
            raise CapacityError(
                f"{path}: the store takes {manifest['total_bytes'] / 2**30:.2f} GiB but tiers.disk.capacity is "
                f"{capacity / 2**30:.2f} GiB; raise it"
            )
        tier = DiskTier(path, read_only=True, page_cache=page_cache, verify=verify, read_threads=read_threads)
        try:
            store = cls(path, manifest, tier)
        except (KeyError, TypeError, ValueError) as e:
            tier.close()
            raise StoreError(f"{path / MANIFEST}: malformed ({e}); convert again with --force") from None
        try:
            for name, rec in store.groups.items():
                tier.open_existing(name, rec.nbytes)
                if tier.stored_crc(name) != rec.crc32c:
                    raise StoreError(
                        f"{path}: group {name!r} does not match the manifest (checksum differs); the store was "
                        "modified after conversion, convert again with --force"
                    )
        except BaseException:
            tier.close()
            raise
        return store

    def close(self) -> None:
        self.tier.close()
