"""Prefix blocks persisted in the store's disk tier (`kv_cache.prefix_cache: persist`), found by later processes.

    <disk tier>/prefix-cache/<identity digest>/<block key>.kvb     one file per full block, mode 0600

    header  b"OFFKVPB1" | identity digest (16) | block key (16) | crc32c of the payload (4) | payload bytes (8)
    payload every array of the device format, [layers, *shape] each, in the format's order

A file is written once, by this store's own thread (the engine loop only copies the block's bytes), under a
temporary name and renamed, so a reader sees a whole file or none; a
torn or damaged one fails its magic, identity, key, length or crc32c check, is deleted and the block
is computed again. Another model identity (model, weights format, dtype, KV format, block size) has
its own directory and its digest inside every header, so its blocks are never used. The directory
holds at most `capacity` blocks: past that, the least recently used (by modification time; a hit
touches its file) are deleted, by whichever process is writing. A write that fails (a full disk)
stops persisting for this process with one warning; nothing else is lost. The files are K/V derived
from prompts: whoever can read them learns about those prompts.

This module knows files and bytes; keys and blocks are `offload.kv.prefix`'s.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from offload.kv.formats import ColdFormat
from storage import interrupts, io

log = logging.getLogger(__name__)

MAGIC = b"OFFKVPB1"
HEADER = len(MAGIC) + 16 + 16 + 4 + 8


class PersistedBlocks:
    def __init__(self, root: Path, identity: str, capacity: int) -> None:
        self.digest = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self.dir = Path(root) / self.digest.hex()
        self.capacity = max(capacity, 1)
        self.enabled = True
        self.saved = self.damaged = 0
        self._lock = threading.Lock()  # `_files`: the engine's thread adds, the writer's thread trims
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="prefix-persist")  # files written off the loop
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._files = self._listing()  # file name -> last use
        except OSError as e:
            self._stop(e)
            self._files = {}

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kvb"

    def _stop(self, e: OSError) -> None:
        log.warning("prefix cache: persisting KV blocks under %s stopped (%s); the cache stays in memory",
                    self.dir, e.strerror or e)
        self.enabled = False

    def save(self, key: bytes, parts: dict[str, torch.Tensor] | None) -> None:
        """Write one block ({array: [layers, *shape]} in the device format) unless it is there already. Its bytes
        are copied now (its slot may be reused); the file is written by this store's own thread."""
        if not self.enabled or parts is None:
            return
        path = self._path(key)
        with self._lock:
            if path.name in self._files:
                return
            self._files[path.name] = time.time()  # claimed: not queued twice
        payload = b"".join(parts[k].detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
                           for k in sorted(parts))
        with interrupts.critical:  # the pool's locks: no Ctrl-C inside (`storage.interrupts`)
            self._writer.submit(self._write, path, key, payload)

    def _write(self, path: Path, key: bytes, payload: bytes) -> None:
        if not self.enabled:
            return
        size = len(payload).to_bytes(8, "little")
        header = MAGIC + self.digest + key + io.crc32c(payload).to_bytes(4, "little") + size
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".", suffix=".partial")  # created 0600
            with os.fdopen(fd, "wb") as f:
                f.write(header + payload)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            with self._lock:
                self._files.pop(path.name, None)
            if self.enabled:
                self._stop(e)
            return
        self.saved += 1
        self._trim()

    def flush(self) -> None:
        """Wait for the files queued so far."""
        with interrupts.critical:
            done = self._writer.submit(lambda: None)
        interrupts.result(done)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def load(self, key: bytes, fmt: ColdFormat, layers: int) -> dict[str, torch.Tensor] | None:
        """The block of `key` ({array: [layers, *shape]}), or None when absent or damaged (then deleted)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        sizes = {k: layers * math.prod(shape) * dt.itemsize for k, (shape, dt) in fmt.arrays.items()}
        n = int.from_bytes(data[HEADER - 8 : HEADER], "little") if len(data) >= HEADER else -1
        ok = (data[: len(MAGIC)] == MAGIC and data[len(MAGIC) : len(MAGIC) + 16] == self.digest
              and data[len(MAGIC) + 16 : len(MAGIC) + 32] == key and n == sum(sizes.values())
              and len(data) == HEADER + n
              and io.crc32c(data[HEADER:]) == int.from_bytes(data[HEADER - 12 : HEADER - 8], "little"))
        if not ok:
            log.warning("prefix cache: %s is damaged (its checksum or header does not match); computing the block "
                        "again", path)
            self.damaged += 1
            path.unlink(missing_ok=True)
            with self._lock:
                self._files.pop(path.name, None)
            return None
        parts, offset = {}, HEADER
        for k in sorted(fmt.arrays):
            shape, dt = fmt.arrays[k]
            raw = torch.frombuffer(bytearray(data[offset : offset + sizes[k]]), dtype=torch.uint8)
            parts[k] = raw.view(dt).reshape(layers, *shape)
            offset += sizes[k]
        try:
            os.utime(path)
            with self._lock:
                self._files[path.name] = os.stat(path).st_mtime
        except OSError:
            pass
        return parts

    def _trim(self) -> None:
        """Delete the least recently used files past the capacity (other processes' files too)."""
        with self._lock:
            if len(self._files) <= self.capacity:
                return
            self._files = self._files | self._listing()  # other processes' files too; queued ones stay claimed
            for name in sorted(self._files, key=self._files.__getitem__)[: len(self._files) - self.capacity]:
                (self.dir / name).unlink(missing_ok=True)
                del self._files[name]

    def _listing(self) -> dict[str, float]:
        files = {}
        for p in self.dir.glob("*.kvb"):
            try:
                files[p.name] = p.stat().st_mtime
            except FileNotFoundError:  # another process deleted it meanwhile
                pass
        return files

    @property
    def count(self) -> int:
        return len(self._files)
