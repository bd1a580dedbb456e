"""Synthetic checkpoints for tests, the demo and benchmarks (`make_model`): seeded random weights in the
Hugging Face layout, with a byte-level BPE tokenizer trained on a shipped corpus; GPTQ / AWQ packed
copies of them (`prequant`), written from the published formats.

Imports nothing of Offload's: it writes files that any tool can read.
"""
