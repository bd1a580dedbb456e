"""What a model is: its shape (`config`), its checkpoint (`checkpoint`), its math (`functional`), its tokenizer.

May import `offload.errors`, `storage` (positional reads). Knows nothing about tiers, plans or the KV
cache's bookkeeping: the math takes its weights and a KV view as arguments.
"""
