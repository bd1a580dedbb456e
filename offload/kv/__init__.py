"""The paged KV cache: block tables and tiers (`cache`), what a layer sees of it (`view`), the cold
block formats (`formats`), cold blocks on their way to compute (`fetch`: pinned staging, the run's
transfer engine) and the bookkeeping types and settings (`blocks`).

May import `offload.model`, `schedulers` (eviction policies, the timeline, the transfer engine),
`storage` (block pools, slot arrays). Its settings arrive resolved (by `offload.plan`).
"""
