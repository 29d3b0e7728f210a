"""Where a value read with ``buffers=True`` lies in LMDB's map: copying large values out of a
store mapped without readahead, and telling whether a value is in memory.

Replication opens stores without readahead: its metadata reads are random B-tree pages
that readahead would each inflate to ~128 KiB (a 1M-file source and receiver thrashed a
512 MiB memory limit that way). Its chunk reads are the opposite case: a value's overflow
pages are contiguous, and faulting a cold 1 MiB chunk in through such a map is 256
separate 4 KiB disk reads (~65 MiB/s here, against ~900 MiB/s with readahead; asking for
the pages with MADV_WILLNEED did not help). ``MapReader`` reads a large value with one
pread(2) of the data file at the value's place in the map instead: the file's own
readahead applies, and the page cache is the one LMDB maps, so the bytes are the same.

``resident`` asks mincore(2) whether every page of a value is in the page cache: the mount
checks a small chunk on its serving thread only then, so that the disk is not waited for there.
"""

from __future__ import annotations

import ctypes
import os

LARGE = 64 << 10            # a value this large spans many pages: one pread for all


class _Buffer(ctypes.Structure):
    """CPython's Py_buffer: where in the map a value read with buffers=True lies."""
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int),
                ("ndim", ctypes.c_int), ("format", ctypes.c_char_p),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_Buffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_Buffer)]


def _address(value: memoryview) -> int:
    view = _Buffer()
    if _get_buffer(value, ctypes.byref(view), 0) != 0:
        raise ValueError("not a buffer")
    try:
        return view.buf
    finally:
        _release_buffer(ctypes.byref(view))


_libc = ctypes.CDLL(None, use_errno=True)
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident(value) -> bool:
    """Whether every page of ``value`` is in memory, so that reading it waits for no disk:
    a memoryview into a map (``buffers=True``) is asked of mincore(2); anything else has
    been copied into memory already. False when the kernel will not say."""
    if not isinstance(value, memoryview) or not len(value):
        return True
    address = _address(value)
    start = address & ~(PAGE - 1)
    length = address + len(value) - start
    pages = ctypes.create_string_buffer(-(-length // PAGE))
    if _mincore(start, length, pages) != 0:
        return False
    return all(flags & 1 for flags in pages.raw)


def _map_base(data_file: str) -> int | None:
    """Where this process maps ``data_file`` (LMDB maps it whole, from offset 0)."""
    ino = os.stat(data_file).st_ino
    bases = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and int(fields[4]) == ino \
                    and os.path.realpath(fields[5].rstrip("\n")) == os.path.realpath(data_file):
                bases.append(int(fields[0].split("-")[0], 16) - int(fields[2], 16))
    return min(bases) if bases else None


class MapReader:
    """Copies values of the open store whose data file is ``data_file``; large ones by
    pread. Values must come from a transaction still open (its pages cannot be reused
    before it ends)."""

    def __init__(self, data_file: str):
        self.fd = os.open(data_file, os.O_RDONLY | os.O_CLOEXEC)
        self.base = _map_base(data_file)

    def copy(self, value) -> bytes:
        if self.base is None or not isinstance(value, memoryview) or len(value) < LARGE:
            return bytes(value)
        data = os.pread(self.fd, len(value), _address(value) - self.base)
        return data if len(data) == len(value) else bytes(value)

    def close(self) -> None:
        os.close(self.fd)
