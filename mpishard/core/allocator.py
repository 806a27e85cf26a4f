"""The process's memory allocator, set for training (see [Note: freed activations]).

Applied once, when the first NumPy backend is built (:class:`mpishard.core.backend.Backend`).
"""
from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["keep_freed_memory"]

#: set by :func:`keep_freed_memory` (once per process)
_ALLOCATOR_TUNED = []


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep the memory a step frees for the next step.

    [Note: freed activations]
    By default glibc serves arrays above a moving threshold (128 KiB at first)
    with fresh ``mmap`` pages and returns them to the system when freed, and it
    trims the heap's freed top: every training step then takes its activations
    from new pages again, page fault by page fault (about 6,700 per step of GPT
    config S, against PyTorch's 2,200, whose allocator keeps them). Raising
    both thresholds (``mallopt``: arrays up to 1 GiB from the heap, up to 1 GiB
    of freed heap kept) makes the step 4-7% faster on NumPy; the peak
    memory stays what it was, a rank just keeps it between steps. Once per
    process, on Linux with glibc; ``MPISHARD_MALLOC=system`` leaves malloc alone.
    Returns whether it was applied.
    """
    if _ALLOCATOR_TUNED:
        return _ALLOCATOR_TUNED[0]
    applied = False
    if sys.platform.startswith("linux") and os.environ.get("MPISHARD_MALLOC") != "system":
        try:
            libc = ctypes.CDLL(None)
            M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
            applied = bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(
                libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
        except (OSError, AttributeError):
            applied = False
    _ALLOCATOR_TUNED.append(applied)
    return applied
