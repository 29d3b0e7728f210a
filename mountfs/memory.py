"""The malloc policy of the processes that move chunk data (the mount and its writer).

Both handle chunk-sized (1 MiB) buffers by the thousand: pyfuse3's copy of each WRITE and
the chunk's bytes in the mount; LMDB's overflow pages of every commit in the writer. With glibc's defaults each such buffer is an mmap faulted in page
by page and unmapped when freed (a TLB shootdown to the other threads' cores), and the heap
is trimmed back to the kernel after every commit. On a VM that reports freed pages to its
host, a page faulted in again costs the host's fault too."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

MALLOC_MMAP_THRESHOLD = 32 << 20   # glibc's largest; a chunk-sized buffer stays on the heap
MALLOC_TRIM_THRESHOLD = 256 << 20  # freed heap kept up to this much (a few commit groups)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_buffers() -> None:
    """Have glibc's malloc reuse freed chunk-sized buffers instead of mapping fresh ones.
    Sequential write went from a median of 392 to 475 MB/s when the mount did this (and from
    399 to 455 MB/s when its writer process did too; docs/benchmarks.md). A C library
    without mallopt (not glibc) keeps its own policy; the mount works either way, and says
    so in its log."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        log.info("this C library has no mallopt: large buffers keep its default policy")
        return
    for option, value in ((_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD),
                          (_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)):
        if mallopt(option, value) != 1:
            log.info("mallopt(%d, %d) was refused: large buffers keep the default policy",
                     option, value)
