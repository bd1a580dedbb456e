"""The manifest of a store: what `manifest.json` holds, and reading it back with every field checked.

    {"format": "offload-store", "version": 2, "created": ..., "total_bytes": N,
     "meta": {...the caller's, opaque...},
     "groups": {"layer.3": {"crc32c": C, ...its GroupLayout...}, ...}}

A manifest is written last, so its presence means a complete store (`storage.store`). It may
have been edited by hand: `read_manifest` checks every field and names the file and the field
of the first one that is wrong, before a byte is allocated. Knows groups, layouts and checksums.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.errors import StaleStoreError, StoreError, convert_again
from storage.layout import GroupLayout, check_name

FORMAT = "offload-store"
#: 2: groups may hold packed (quantized) tensors, and the meta records the weight format per tensor.
VERSION = 2


@dataclass(frozen=True)
class GroupRecord:
    layout: GroupLayout
    crc32c: int

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


#: A manifest is a few KiB per group; one larger than this is not ours and is not read.
MAX_MANIFEST_BYTES = 64 * 2**20


def read_manifest(file: Path, remedy: str | None = None) -> dict[str, Any]:
    """The manifest, every field checked (it may have been edited by hand), with `records`: each group's
    GroupRecord. Anything wrong is one StoreError naming the file and the field, before a byte is allocated
    (and `remedy`, the exact conversion command, when the caller knows it)."""
    again = convert_again(file.parent, remedy)

    def bad(field: str, why: str) -> StoreError:
        return StoreError(f"{file}: {field} {why}; the manifest was edited or damaged; {again}")

    try:
        if file.stat().st_size > MAX_MANIFEST_BYTES:
            raise bad("the file", f"is larger than {MAX_MANIFEST_BYTES} bytes")
        manifest = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError):
        raise StoreError(f"{file}: unreadable or not an Offload manifest; {again}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "groups" not in manifest:
        raise StoreError(f"{file}: unreadable or not an Offload manifest; {again}")
    if manifest.get("version") == 1:
        raise StaleStoreError(
            f"{file.parent}: this store has format version 1, from before quantized weights (this Offload reads "
            f"version {VERSION}); {again}"
        )
    if manifest.get("version") != VERSION:
        raise StaleStoreError(f"{file.parent}: store format version {str(manifest.get('version'))[:20]} is not "
                              f"{VERSION}, the one this Offload reads; {again}")
    groups, meta = manifest["groups"], manifest.get("meta")
    if not isinstance(meta, dict):
        raise bad("meta", "is not an object")
    if not isinstance(groups, dict) or not groups:
        raise bad("groups", "is not a non-empty object")
    records = {}
    for name, g in groups.items():
        try:
            check_name(name, "the group name")
            crc = g.get("crc32c") if isinstance(g, dict) else None
            if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 2**32:
                raise ValueError(f"crc32c {str(crc)[:20]} is not a 32-bit checksum")
            records[name] = GroupRecord(GroupLayout.from_json(name, g), crc)
        except ValueError as e:
            raise bad(f"groups.{name[:80]}:", str(e)) from None
    total = manifest.get("total_bytes")
    if total != sum(r.nbytes for r in records.values()) or isinstance(total, bool):
        raise bad("total_bytes", f"({str(total)[:20]}) is not the sum of its groups' sizes")
    return {**manifest, "records": records}
