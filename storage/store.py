"""A converted model on disk: a zarr group of layer-packed byte arrays plus `manifest.json`.

    STORE/zarr.json                 the zarr group
    STORE/layer.3/zarr.json         one uint8 array per group, one chunk, bytes + crc32c codecs
    STORE/layer.3/c.0               the chunk: the group's packed bytes, then its crc32c
    STORE/manifest.json             written last (storage.manifest): format version, each group's
                                    layout and checksum, and the caller's opaque `meta` (model
                                    config, checkpoint fingerprint, dtype)
    STORE/.offload-converting       present only while a conversion is running
    STORE/.offload-lock             the inter-process lock (storage.lock): exclusive while converting,
                                    shared by every process reading the complete store

A directory with a marker and no manifest is a conversion that was interrupted: it is
wiped and started again. A complete store is never overwritten without `force`. A
directory that is neither is not ours, and is never deleted. This module knows groups,
layouts and bytes; the meaning of `meta` belongs to the caller.

Several processes may start on one store at once (`open_or_build`): the first takes the lock
exclusively and converts, the others wait (saying for whom) and then share the finished
store; a converter that died (even by SIGKILL) releases the lock with its life, and the
next process finds its half-written store and converts again. A forced re-conversion waits
until no process reads the store.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from storage import io
from storage.disk import DiskTier
from storage.errors import CapacityError, StoreError, convert_again
from storage.layout import GroupLayout
from storage.lock import FileLock
from storage.manifest import FORMAT, VERSION, GroupRecord, read_manifest
from storage.units import fmt_bytes

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MARKER = ".offload-converting"
JOURNAL = ".offload-converted.jsonl"  # a line per group written (fsync'ed): what an interrupted conversion resumes
LOCK = ".offload-lock"
#: Room left on the file system beyond the store itself (metadata, temp files).
FREE_SPACE_MARGIN = 64 * 2**20


class StoreState(enum.Enum):
    MISSING = "missing"  # no directory, or an empty one
    PARTIAL = "partial"  # our marker without a manifest: an interrupted conversion
    COMPLETE = "complete"  # a manifest is present (validated on open)
    FOREIGN = "foreign"  # a non-empty directory that is not an Offload store


def store_state(path: str | Path) -> StoreState:
    path = Path(path)
    if not path.exists() or (path.is_dir() and all(p.name == LOCK for p in path.iterdir())):
        return StoreState.MISSING
    if not path.is_dir():
        return StoreState.FOREIGN
    if (path / MANIFEST).exists():
        return StoreState.COMPLETE
    if (path / MARKER).exists():
        return StoreState.PARTIAL
    return StoreState.FOREIGN


def _waiting(path: Path) -> Callable[[str], None]:
    return lambda holder: log.warning("%s: waiting for %s to finish with this store", path, holder)


def _refuse_foreign(path: Path) -> None:
    if store_state(path) is StoreState.FOREIGN:
        raise StoreError(
            f"{path} exists and is not an Offload store; choose an empty or new directory "
            "(Offload never deletes a directory it did not create)"
        )


class StoreWriter:
    """Creates a store group by group; `finish` writes the manifest (last) and returns the opened store.

    Holds the store's lock exclusively from start to finish: `lock`, already exclusive, when the caller
    took it (`open_or_build`), else its own, taken here (waiting for other users of the store).
    """

    def __init__(self, path: str | Path, total_bytes: int, force: bool = False,
                 capacity: int | None = None, lock: FileLock | None = None,
                 identity: Mapping[str, Any] | None = None) -> None:
        """`identity`: what the store is converted from (checkpoint, dtype, format); an interrupted conversion
        of the same identity resumes (its journaled groups whose bytes are intact are kept), any other is
        wiped."""
        self.path = Path(path)
        _refuse_foreign(self.path)
        created = not self.path.exists()
        self._own_lock = lock is None
        if lock is None:
            self.path.mkdir(parents=True, exist_ok=True)
            lock = FileLock(self.path / LOCK)
            lock.exclusive(on_wait=_waiting(self.path))
        assert lock.mode == "exclusive", "a store is written under its exclusive lock"
        self.lock = lock
        try:
            self._start(total_bytes, force, capacity, identity)
        except BaseException:
            if self._own_lock:
                lock.close()
            if created and store_state(self.path) is StoreState.MISSING:  # leave no trace of a refusal
                (self.path / LOCK).unlink(missing_ok=True)
                self.path.rmdir()
            raise

    def _start(self, total_bytes: int, force: bool, capacity: int | None,
               identity: Mapping[str, Any] | None) -> None:
        state = store_state(self.path)
        if state is StoreState.COMPLETE and not force:
            raise StoreError(f"{self.path} already holds a converted store; pass --force to replace it")
        if capacity is not None and total_bytes > capacity:
            raise CapacityError(
                f"the converted model needs {fmt_bytes(total_bytes, 'GiB')} on disk but tiers.disk.capacity is "
                f"{fmt_bytes(capacity, 'GiB')}; raise it to at least {fmt_bytes(total_bytes, 'GiB')}"
            )
        identity = None if identity is None else json.loads(json.dumps(identity))
        resume = state is StoreState.PARTIAL and not force and identity is not None and _marker(self.path) == identity
        if state in (StoreState.PARTIAL, StoreState.COMPLETE) and not resume:
            _wipe(self.path)  # ours: an interrupted conversion of something else, or a forced replacement
        if not resume:
            self._check_free(total_bytes)  # before anything is created
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.announce("converting")
            if not resume:
                (self.path / MARKER).write_text(json.dumps({"started": time.time(), "identity": identity}))
        except OSError as e:
            raise io.disk_error(e, self.path) from None
        self.tier = DiskTier(self.path, read_only=False, read_threads=1)
        self.records: dict[str, GroupRecord] = self._journaled() if resume else {}
        if resume:
            try:
                self._check_free(total_bytes - sum(r.nbytes for r in self.records.values()))
            except BaseException:
                self.tier.close()
                raise

    def _check_free(self, nbytes: int) -> None:
        anchor = self.path
        while not anchor.exists():
            anchor = anchor.parent
        free = shutil.disk_usage(anchor).free
        if free < nbytes + FREE_SPACE_MARGIN:
            raise StoreError(
                f"{self.path}: converting needs {fmt_bytes(nbytes + FREE_SPACE_MARGIN, 'GiB')} free but the "
                f"disk has {fmt_bytes(free, 'GiB')}; free space or choose another tiers.disk.path"
            )

    def _journaled(self) -> dict[str, GroupRecord]:
        """The groups an interrupted conversion finished whose chunk files are whole and carry the journaled
        checksum (a group written but not journaled, or damaged since, is written again)."""
        records = {}
        try:
            lines = (self.path / JOURNAL).read_text().splitlines()
        except OSError:
            return records
        for line in lines:
            try:
                entry = json.loads(line)
                layout = GroupLayout.from_json(entry["name"], entry["layout"])
                self.tier.open_existing(layout.name, layout.nbytes)
                with open(self.tier.chunk_path(layout.name), "rb") as f:
                    f.seek(layout.nbytes)
                    trailer = f.read(4)
                if int.from_bytes(trailer, "little") == entry["crc32c"]:
                    records[layout.name] = GroupRecord(layout, entry["crc32c"])
            except (ValueError, KeyError, TypeError, OSError, StoreError):
                continue  # a torn last line, or a group to write again
        return records

    def done(self, layout: GroupLayout) -> bool:
        """Was this group written whole by the conversion this one resumes?"""
        r = self.records.get(layout.name)
        return r is not None and r.layout.to_json() == layout.to_json()

    def write_group(self, layout: GroupLayout, data: torch.Tensor) -> None:
        """Write one packed group (a uint8 CPU tensor of layout.nbytes)."""
        assert data.dtype == torch.uint8 and data.numel() == layout.nbytes
        self.tier.allocate(layout.name, layout.nbytes)
        self.tier.write(layout.name, data)
        record = GroupRecord(layout, io.crc32c(data))
        self.records[layout.name] = record
        try:  # journaled once its bytes are on disk: a conversion cut short resumes after it
            with open(self.path / JOURNAL, "a") as f:
                f.write(json.dumps({"name": layout.name, "crc32c": record.crc32c, "layout": layout.to_json()}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise io.disk_error(e, self.path / JOURNAL) from None

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
        (self.path / JOURNAL).unlink(missing_ok=True)
        if not self._own_lock:
            return Store.open(self.path, lock=self.lock)
        self.lock.shared()  # from writer to reader; the store now owns the lock
        try:
            return Store.open(self.path, lock=self.lock, own_lock=True)
        except BaseException:
            self.lock.close()
            raise

    def abort(self, keep: bool = False) -> None:
        """Remove what was written (the directory was empty or ours when we started); keeps the lock file.
        With `keep` (Ctrl-C, SIGTERM) the groups written stay, journaled: the next conversion resumes."""
        try:
            self.tier.close()
            if not keep:
                _wipe(self.path)
        finally:
            if self._own_lock:
                self.lock.close()


def _marker(path: Path) -> Any:
    """The identity an interrupted conversion recorded in its marker (None if unreadable)."""
    try:
        return json.loads((path / MARKER).read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return None


def _wipe(path: Path) -> None:
    for child in path.iterdir():
        if child.name == LOCK:
            continue  # others may be waiting on it
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


class Store:
    """A complete store, validated on open; `tier` reads its groups."""

    def __init__(self, path: Path, manifest: dict[str, Any], tier: DiskTier) -> None:
        self.path = path
        self._lock: FileLock | None = None  # the shared lock this store releases on close, if it owns one
        self.manifest = manifest
        self.meta: dict[str, Any] = manifest["meta"]
        self.groups: dict[str, GroupRecord] = manifest["records"]
        self.tier = tier
        self.built = False  # converted by the `open_or_build` that opened it

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.groups.values())

    @classmethod
    def open(cls, path: str | Path, page_cache: bool = False, verify: str = "always",
             read_threads: int = 4, capacity: int | None = None, lock: FileLock | None = None,
             own_lock: bool = False, direct_io: bool = False, remedy: str | None = None) -> Store:
        """Open a complete store. Without `lock`, takes the store's lock shared (waiting while a conversion
        runs) and releases it on close; with one (held by the caller), releases it only if `own_lock`. `remedy`:
        the exact `offload convert` command that rebuilds it, named by every error that finds it damaged."""
        path = Path(path)
        if lock is None:
            if store_state(path) in (StoreState.MISSING, StoreState.FOREIGN):
                cls._refuse(path, store_state(path))
            lock, own_lock = FileLock(path / LOCK), True
            try:
                lock.shared(on_wait=_waiting(path))
            except BaseException:
                lock.close()
                raise
        try:
            store = cls._open(path, page_cache, verify, read_threads, capacity, direct_io, remedy)
        except BaseException:
            if own_lock:
                lock.close()
            raise
        store._lock = lock if own_lock else None
        return store

    @staticmethod
    def _refuse(path: Path, state: StoreState) -> None:
        if state is StoreState.MISSING:
            raise StoreError(f"{path}: no store here; run `offload convert CHECKPOINT {path}` first")
        if state is StoreState.PARTIAL:
            raise StoreError(f"{path}: the conversion into this store was interrupted; run `offload convert` again")
        if state is StoreState.FOREIGN:
            raise StoreError(f"{path}: not an Offload store (no {MANIFEST}); point at a store, or convert a "
                             "checkpoint into an empty or new directory")

    @classmethod
    def _open(cls, path: Path, page_cache: bool, verify: str, read_threads: int, capacity: int | None,
              direct_io: bool = False, remedy: str | None = None) -> Store:
        state = store_state(path)
        if state is not StoreState.COMPLETE:
            cls._refuse(path, state)
        manifest = read_manifest(path / MANIFEST, remedy)
        if capacity is not None and manifest["total_bytes"] > capacity:
            raise CapacityError(
                f"{path}: the store takes {fmt_bytes(manifest['total_bytes'], 'GiB')} but tiers.disk.capacity is "
                f"{fmt_bytes(capacity, 'GiB')}; raise it"
            )
        tier = DiskTier(path, read_only=True, page_cache=page_cache, verify=verify, read_threads=read_threads,
                        direct_io=direct_io, remedy=remedy)
        store = cls(path, manifest, tier)
        try:
            for name, rec in store.groups.items():
                tier.open_existing(name, rec.nbytes)
                if tier.stored_crc(name) != rec.crc32c:
                    raise StoreError(
                        f"{path}: group {name!r} does not match the manifest (checksum differs); the store was "
                        "modified after conversion; " + convert_again(path, remedy)
                    )
        except BaseException:
            tier.close()
            raise
        return store

    def close(self) -> None:
        self.tier.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def open_or_build(path: str | Path, build: Callable[[FileLock], None] | None, **open_args: Any) -> Store:
    """Open the store at `path`, safely shared with other processes; `build(lock)` converts it (holding the lock
    exclusively) when it is missing or half-written. Waits, with a message naming the holder, while another
    process converts; `build=None` only opens. The returned store holds the lock shared until closed; its `built`
    says whether this call converted it (not a process it waited for)."""
    path = Path(path)
    if store_state(path) is StoreState.FOREIGN:
        Store._refuse(path, StoreState.FOREIGN)
    path.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path / LOCK)
    built = False
    try:
        while True:
            if build is not None and store_state(path) is not StoreState.COMPLETE:
                lock.exclusive(on_wait=_waiting(path))
                if store_state(path) is not StoreState.COMPLETE:  # nobody finished it while we waited
                    build(lock)
                    built = True
                lock.shared()  # not atomic: a forced re-conversion may slip in between, hence the loop
            else:
                lock.shared(on_wait=_waiting(path))
            if build is None or store_state(path) is StoreState.COMPLETE:
                store = Store.open(path, lock=lock, own_lock=True, **open_args)
                store.built = built
                return store
            lock.unlock()
    except BaseException:
        lock.close()
        raise
