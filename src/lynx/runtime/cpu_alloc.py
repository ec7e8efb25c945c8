"""Keep freed CPU memory in the process heap, as CUDA's caching allocator keeps device memory.

With glibc's defaults, tensors above the (dynamic) mmap threshold are mapped on allocation and unmapped
on free, and the heap top is trimmed back to the kernel: every re-allocation then page-faults fresh zeroed
pages. Recomputation frees and re-allocates activations far more often than a plain run, so on CPU that
cost lands on the recomputing policies only and is not recomputation. Seen here (4-layer GPT, h=512, s=256,
micro-batch 2, 4 micro-batches, one thread, `getrusage` over one iteration, busy machine): the engine under
`selective` took 134k minor page faults and 0.52 s of system time against 4.6k and 0.01 s for a plain run;
with the settings below 66k and 0.08 s (docs/runtime.md, "Engine overhead"). The process keeps its peak heap.
On CUDA the caching allocator already does this; nothing is changed there.
Most of the engine's faults counted above were a leak in the engine's restorations, since fixed: with these
settings an engine iteration now takes ~10 minor faults (docs/runtime-overhead.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory(mmap_threshold: int = 1 << 30, top_pad: int = 256 << 20) -> bool:
    """mallopt: serve allocations below `mmap_threshold` from the heap, never trim it, grow it by `top_pad`.
    Returns False where glibc's mallopt is not available (other libcs, macOS)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = [libc.mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, 1 << 30)),  # glibc caps it at 32 MiB / HEAP_MAX
              libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30), libc.mallopt(_M_TOP_PAD, top_pad)]
    except (OSError, AttributeError):
        return False
    return all(r == 1 for r in ok)
