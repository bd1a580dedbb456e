"""Where bytes live: device / host / disk tiers, pinned arenas, the zarr store and its manifest, the one
checksummed disk read path (`reader`), slot arrays, block pools, layouts, units (`blocks_for`, `fmt_bytes`).

Storage knows bytes, groups and names, never models: which tensors make up a group is
decided by the caller. This package imports nothing from `schedulers` or `offload`.
"""
