"""glibc's malloc set to keep the memory torch frees, instead of handing it back to the
kernel and faulting it in again at the next batch.

By default glibc serves a block of 128 KiB or more with its own ``mmap`` (the threshold
rises to the largest block freed, up to 32 MiB) and trims the heap's top once more than
twice that is free. A forward pass frees activations of a few MiB each in turn, so at
some batch sizes every pass gives the pages back and takes them again: the small CNN's
evaluation of 1,000 images in batches of 512 took 11,300 page faults and 45 ms on one
thread, against none and 20 ms with the thresholds below (the same values; see
docs/BENCHMARKS.md). Blocks up to 32 MiB (glibc's largest threshold) then come from the
heap, and up to 128 MiB freed at its top stays with the process.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20

_tuned: bool | None = None


def keep_freed_memory() -> bool:
    """Set the thresholds in this process (and the processes it forks from now on); True
    where glibc took them, False where there is no glibc (nothing changes). Once per
    process: later calls return the first answer."""
    global _tuned
    if _tuned is None:
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not glibc
            _tuned = False
        else:
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            _tuned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
                bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _tuned
