"""The malloc policy of the processes that move chunk data (mountfs.memory): chunk-sized
buffers on the heap from the first one, and freed ones kept there for the next, not
mapped afresh and faulted in again page by page."""

from __future__ import annotations

import subprocess
import sys

POLICY_PROBE = r"""
import ctypes, sys
from mountfs.memory import keep_freed_buffers
if sys.argv[1] == "policy":
    keep_freed_buffers()

def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            return tuple(int(x, 16) for x in line.split()[0].split("-"))
    return 0, 0

first = bytearray(1 << 20)
lo, hi = heap()
on_heap = lo <= ctypes.addressof((ctypes.c_char * 1).from_buffer(first)) < hi
buffers = [bytearray(1 << 20) for _ in range(64)]
del first, buffers
lo, hi = heap()
print(on_heap, (hi - lo) >> 20)
"""


def _probe(mode: str) -> tuple[bool, int]:
    """(whether a first 1 MiB buffer lies on the heap, MiB of heap left after 64 such
    buffers are freed), in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", POLICY_PROBE, mode], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_chunk_sized_buffers_stay_on_the_heap_once_freed():
    """What the mount and its writer call at start (mount.run_foreground, writer.main)."""
    on_heap, kept = _probe("policy")
    assert on_heap and kept >= 64
    # and the probe can tell: glibc's defaults map each such buffer and trim what is freed
    on_heap, kept = _probe("none")
    assert not on_heap and kept < 16
