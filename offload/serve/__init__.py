"""Serving: the engine loop in its own thread, the OpenAI-compatible HTTP API, and the throughput mode for files.

`loop` owns the runner while it serves (the only code that touches tensors here), `text` turns
token deltas into text with stop strings, `api` maps OpenAI requests onto loop jobs (FastAPI),
`files` runs a JSONL file of prompts through the same loop. May import `offload.runtime` and
everything below it; only `offload.cli` imports this package.
"""
