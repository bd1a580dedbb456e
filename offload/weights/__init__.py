"""A model's weights as groups of bytes: which tensors form each group (`groups`), packing them into the
store (`convert`), and the runner's weight source over the tiers (`tiered`); group-wise int8/int4 codecs
and the packed matrix the math multiplies (`quant`, pure torch), GPTQ/AWQ checkpoint formats (`gptq`).

May import `offload.model`, `offload.config`, `schedulers`, `storage`. Executes placement plans; does
not make them (that is `offload.plan`).
"""
