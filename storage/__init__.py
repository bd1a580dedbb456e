"""Where bytes live: device / host / disk tiers, slab pools, the zarr layout, the manifest.

Storage knows bytes, groups and names, never models: which tensors make up a group is
decided by the caller. This package imports nothing from `schedulers` or `offload`.
"""
