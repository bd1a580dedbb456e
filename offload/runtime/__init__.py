"""Running a model: executors (one model's forward pass over a weight source and a KV pool), the engine
loop on them (requests join and leave at pass boundaries; kept sequences continued), speculative decoding
(a draft executor, verification), sampling, stop strings, a multi-turn `Conversation`, the results, and
the `Runner` that assembles it all from a config (the Python API).

May import every other part of `offload` except `cli`.
"""
