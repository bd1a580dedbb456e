"""Any transformers causal LM through the tiers (`model_impl: transformers`, the `hf` extra).

transformers builds the model on the meta device (accelerate's `init_empty_weights`) and runs its own
math and its own KV cache (`DynamicCache`); accelerate hooks (`model`) bind each decoder block's weights
from Offload's weight source (`TieredWeights`: the same store, placement, ring and prefetcher as the native
path) just before the block runs and hand them back after. `executor` fits it under the executor seam, so
the runner, the engine, the CLI and the server drive it as they drive the native executor.

May import transformers and accelerate (at the top of its modules), `offload.runtime`, `offload.weights`,
`offload.model`, `offload.kv`. Nothing of Offload imports this package: the runner finds it by name
(`offload.runtime.impls`), only when a run asks for it, so transformers stays optional.
"""
