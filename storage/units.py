"""Counts and sizes every layer shares: tokens to blocks, and bytes as text.

    blocks_for(tokens, block_size)   blocks that hold `tokens` tokens (the ceiling)
    fmt_bytes(n)                     "1.50 GiB" / "12.5 MiB", for people (messages, plans, logs)
    config_size(n)                   "13MiB", a size the YAML reads back, rounded up (a value to set)

Sizes are bytes as `int` everywhere inside; text exists only where a person reads it. This module
knows arithmetic and units, nothing else.
"""

from __future__ import annotations

import math

KiB, MiB, GiB = 2**10, 2**20, 2**30


def ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `tokens` tokens (0 tokens: 0 blocks)."""
    return ceil_div(tokens, block_size)


def fmt_bytes(n: float, unit: str | None = None, digits: int = 2) -> str:
    """Bytes for people: in GiB from one GiB up, else in MiB (or always in `unit`, "GiB" or "MiB").

    `digits` decimals in GiB and one fewer in MiB (about the same absolute precision):
    fmt_bytes(3 * 2**29) == "1.50 GiB", fmt_bytes(2**20) == "1.0 MiB", fmt_bytes(2**31, digits=1) == "2.0 GiB".
    """
    if unit is None:
        unit = "GiB" if n >= GiB else "MiB"
    if unit == "GiB":
        return f"{n / GiB:.{digits}f} GiB"
    if unit == "MiB":
        return f"{n / MiB:.{max(digits - 1, 0)}f} MiB"
    raise ValueError(f"unit must be 'GiB' or 'MiB', not {unit!r}")


def config_size(n: int) -> str:
    """Bytes as a YAML size a person reads, rounded up: 0.1 MiB below 64 MiB, whole MiB up to 10 GiB, then 0.01 GiB."""
    if n > 10 * GiB:
        return f"{math.ceil(n / GiB * 100) / 100:.2f}GiB"
    return f"{ceil_div(n, MiB)}MiB" if n >= 64 * MiB else f"{ceil_div(n * 10, MiB) / 10:.1f}MiB"
