"""Running a model: the `Runner` (config -> plan -> weights + KV cache -> forward passes -> tokens),
the engine loop (requests join and leave at pass boundaries; kept sequences continued), sampling, stop
strings, a multi-turn `Conversation` on the engine, and the results it returns.

May import every other part of `offload` except `cli`.
"""
