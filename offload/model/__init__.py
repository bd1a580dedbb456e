"""What a model is: its shape (`config`), its checkpoint (`checkpoint`), its math (`functional`), its tokenizer,
its chat template and generation defaults (`chat`), and where a Hub id's files come from (`hub`).

May import `offload.errors`, `storage` (positional reads), `huggingface_hub` (`hub` only). Knows nothing
about tiers, plans or the KV cache's bookkeeping: the math takes its weights and a KV view as arguments.
"""
