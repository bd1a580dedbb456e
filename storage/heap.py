"""The C heap under torch's CPU tensors: `trim_heap` gives its free pages back to the system.

glibc serves blocks below its mmap threshold from the heap and raises that threshold to each freed block's size (up
to 32 MiB), so the MiB-sized temporaries of an op-by-op layer stay in the heap once freed and, interleaved with blocks
that live on, grow it pass after pass. Measured on the 1.7B Llama shape, int4, a 1563-token prompt in passes of 512
over cold KV blocks: the process grew 270 MiB at its peak and kept 236 MiB after the prompt; trimmed after each
layer's attention and after each layer, 150-185 at its peak and 19-31 kept, prefill time within the run-to-run
spread (fixing the threshold instead, glibc's `M_MMAP_THRESHOLD`, gave as much back but cost 40% of prefill: every
large temporary of every pass faulted in again)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: tokens of a pass (a prompt's) after whose op-by-op steps a CPU run trims the heap: a decode step's temporaries
#: are small and the same each step, so they are reused, not grown
TRIM_ROWS = 64


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS, Windows)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (nothing where the C library cannot)."""
    if (trim := _malloc_trim()) is not None:
        trim(0)
