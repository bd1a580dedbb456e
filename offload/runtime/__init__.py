"""Running a model: the `Runner` (config -> plan -> weights + KV cache -> forward passes -> tokens),
sampling, and the results it returns.

May import every other part of `offload` except `cli`.
"""
