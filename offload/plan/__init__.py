"""Deciding before running, all of it in one place.

    planner      config + model shape + capacities -> RunPlan (every `auto` resolved)
    placement    the placement algorithm: group sizes + capacities -> `schedulers.plan.Plan`
    costmodel    a plan's pass time, by simulating the prefetch pipeline (groups, bytes, links, seconds)
    predict      the model's side of the cost model: compute seconds per group, decode/prefill, what-ifs
    calibrate    this machine's links and layer kernels, measured, saved and loaded; the compute dtype
    speculative  what speculative decoding should gain, and the draft's share of the device

May import `offload.model`, `offload.weights` (group layouts), `offload.kv` (block sizes),
`schedulers` (the `Plan` it returns, which the prefetcher executes), `storage`. Reads no weights.
"""
