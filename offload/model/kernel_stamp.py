"""numba's cache of this package's kernels, stamped with every kernel file (`kernels` calls it before compiling)."""

from __future__ import annotations

import hashlib
import os

#: The files whose compiled code numba's cache keeps for this package (see `stamp_kernel_sources`).
SOURCES = ("kernels.py", "cpu_bf16.py", "cpu_packed.py", "cpu_packed16.py", "cpu_packed_entry.py", "cpu_attention.py",
           "cpu_elementwise.py", "fused.py", "simd.py", "simd_int.py", "simd_math.py", "simd_amx.py",
           "cpu_bf16_tiles.py", "kernel_stamp.py", "cpu_attention_rows.py", "cpu_attention_blocks.py",
           "cpu_packed_close.py", "cpu_packed_fours.py", "cpu_packed_units.py", "simd_bytes.py",
           "simd_bf16.py")


def stamp_kernel_sources() -> None:
    """numba checks a cached function against its own file only, and a function's cache holds the kernels it calls
    compiled in: after a change to cpu_packed.py alone (a `git pull` touching only it) the fused layer would keep
    running the old packed kernels from its cache. Every cached function of this package's kernels is stamped with all
    their files instead. (numba's locator API is private: where it differs, only this guard is lost.)"""
    from numba.core import caching
    mixin = getattr(caching, "_SourceFileBackedLocatorMixin", None)
    if mixin is None or getattr(mixin.get_source_stamp, "offload", False):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    try:
        for name in SOURCES:
            with open(os.path.join(here, name), "rb") as f:
                digest.update(f.read())
    except OSError:  # not files on a disk (a zipped install): numba does not cache there either
        return
    stamp_all, own = digest.hexdigest(), mixin.get_source_stamp

    def get_source_stamp(self):
        stamp = own(self)
        return (stamp, stamp_all) if os.path.dirname(os.path.abspath(self._py_file)) == here else stamp
    get_source_stamp.offload = True
    mixin.get_source_stamp = get_source_stamp
