"""Keep freed memory in the process during a fit, so big activations are not mapped and zeroed afresh every step.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and gives it back with
``munmap`` on free. A CPU training step at a long lookback allocates and frees gigabytes of such tensors (Mamba-2 at
4,096 bars, batch 128: ~3 million page faults a step), so the step spends most of its time in the kernel, faulting in
and zeroing pages it had a moment ago. Inside :func:`retain_freed_memory` glibc keeps freed memory on its heap and
reuses it, as PyTorch's CUDA caching allocator does on the GPU: measured step time of that Mamba-2 x2.9 faster, the
TFT's x1.7, peak RSS +26% (fragmentation; the quick start's fit: -7%, and 14% less CPU). See docs/ARCHITECTURE.md.

It is a process setting (``mallopt``), so it is scoped like ``torch.set_num_threads`` in ``foxhunt.fit``: set on
entry, glibc's defaults restored on exit and the retained memory trimmed back to the system. Elsewhere than glibc
(macOS, Windows, musl) it does nothing and says so (it yields False). The plain path is the system allocator, with
``foxhunt.fit --retain_freed_memory false``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager

# mallopt parameters and glibc's defaults (malloc/malloc.c)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536


def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    needed = ("gnu_get_libc_version", "mallopt", "malloc_trim")
    return libc if all(hasattr(libc, f) for f in needed) else None


@contextmanager
def retain_freed_memory(enabled: bool = True) -> Iterator[bool]:
    """Within the block, glibc neither maps big allocations one by one nor returns freed memory to the system.

    Yields whether the setting is in force (False when ``enabled`` is False or the C library is not glibc). On exit
    glibc's default limits are set again (glibc no longer adapts its mmap threshold once a limit was set) and the
    retained memory is trimmed. Not re-entrant (the setting is the process's): an inner block's exit ends it.
    """
    libc = glibc() if enabled else None
    if libc is None:
        yield False
        return
    # the trim threshold is a size_t: -1 is "never trim"; no mmap means every block comes from the reusable heap
    applied = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
    try:
        yield applied
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
