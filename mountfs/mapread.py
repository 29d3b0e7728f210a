"""Copying large values out of a store mapped without readahead.

Replication opens stores without readahead: its metadata reads are random B-tree pages
that readahead would each inflate to ~128 KiB (a 1M-file source and receiver thrashed a
512 MiB memory limit that way). Its chunk reads are the opposite case: a value's overflow
pages are contiguous, and faulting a cold 1 MiB chunk in through such a map is 256
separate 4 KiB disk reads (~65 MiB/s here, against ~900 MiB/s with readahead; asking for
the pages with MADV_WILLNEED did not help). ``MapReader`` reads a large value with one
pread(2) of the data file at the value's place in the map instead: the file's own
readahead applies, and the page cache is the one LMDB maps, so the bytes are the same.
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
