"""When bytes move: the plan the prefetcher executes (`plan`), prefetch and its side thread (`prefetch`,
`side`), the one transfer engine (`transfer`), eviction policies, the span timeline and trace files, the
bytes-moved counter (`traffic`).

Imports only from `storage`; knows groups of bytes and their order, never model math, and decides
nothing about placement (that is `offload.plan`: it hands over a finished `Plan`).
"""
