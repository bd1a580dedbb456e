"""A model's weights as groups of bytes: which tensors form each group (`groups`), packing them into the
store (`convert`), and the runner's weight source over the tiers (`tiered`).

May import `offload.model`, `offload.config`, `schedulers`, `storage`. Executes placement plans; does
not make them (that is `offload.plan`).
"""
