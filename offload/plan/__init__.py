"""Deciding before running: the planner (`planner`: capacities -> placement, KV pool, every `auto`),
the model's costs for the cost model (`predict`) and the layer-kernel calibration (`calibrate`).

May import `offload.model`, `offload.weights` (group layouts), `offload.kv` (block sizes),
`schedulers` (placement, cost model, link calibration). Reads no weights.
"""
