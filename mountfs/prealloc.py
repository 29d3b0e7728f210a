"""Keeps the store's data file allocated, and (where free pages go back to the host) its
pages in the page cache, ahead of LMDB's writes: a thread of the writer process, woken after
each commit.

Why: the committer's one thread is what a sequential write waits for, and 58% of its time
went into the kernel copying each commit's pages into the data file (``pwrite`` past the
end of the file: a page-cache page allocated, charged and filled per 4 KiB, a delayed block
reserved, the extent tree updated). Here the next AHEAD bytes are allocated with
``fallocate`` (unwritten extents: no data is written, they read as zeros) and brought into
the page cache with ``POSIX_FADV_WILLNEED`` (zero-filled, clean, never written back), in
this thread, in steps of STEP: LMDB's writes then land in pages that exist. A 1 GiB write
went from 344-442 to 669-703 MiB/s, and the writer process's CPU from 1.7-2.4 s to 0.9 s,
this thread's included (docs/benchmarks.md, fourteenth round). That was on a VM whose free
pages go back to its host (virtio-balloon free page reporting), where a fresh page costs a
fault in the host. Where free pages stay the machine's, the caching made the mount's 1 GiB
write 20-25% slower instead (549-613 MB/s against 711-817 without it, thirty-third round), so
the tail is cached only while ``pages_go_back_to_the_host()``; it is allocated either way.

Why it is safe: LMDB reads no page past the last one its meta page names, so a longer file
changes nothing it reads, after a crash either; ``fallocate`` never changes bytes already
written. Only growth is prepared: pages LMDB reuses from its free list are left alone.
Space: the file is at most AHEAD longer than LMDB's pages (``Store.free_bytes`` counts it as
free), and no allocation leaves the disk with less than DEFER_MARGIN free. A filesystem
without ``fallocate`` (FUSE, some network filesystems) just goes without; so does the
power-loss test's recording filesystem, which is why ``tests/test_prealloc.py`` checks a
kill -9 with a prepared tail instead.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from functools import cache
from pathlib import Path

from .committer import DEFER_MARGIN
from .mapread import resident
from .store import Store

log = logging.getLogger(__name__)

AHEAD = 64 << 20        # allocated and cached past LMDB's last page (two TXN_BYTES commits)
STEP = 8 << 20          # prepared at once at least (one fallocate per 8 MiB or more)
READAHEAD = 128 << 10   # the kernel's default readahead window: what one WILLNEED brings in
RECHECK = 1.0           # seconds between checks that reclaim left the prepared tail cached
                        # (after every commit, the check cost the writer 4 s of CPU per untar)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)     # no fallocate here
REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
MAX_PAGE_ORDER = 10     # the kernel's largest page order: a reporting order above it reports
                        # nothing (how a benchmark suspends it, bench_io.pages_kept)
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
_BALLOON, _F_REPORTING = "0x0005", 5    # virtio device id; feature bit: free page reporting

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _fallocate(fd: int, offset: int, length: int) -> None:
    """fallocate(2) mode 0 (the file grows). Not ``os.posix_fallocate``: glibc's falls back
    to writing zeros where the filesystem has no fallocate."""
    if _libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _evicted(fd: int, start: int, end: int) -> bool:
    """Whether a page of [start, end) of the file (``start`` page-aligned) has left the
    page cache. Pages brought in by WILLNEED and not yet written are never read, so memory
    reclaim takes them first (on a VM, its DAMON pageout scheme can within seconds)."""
    with mmap.mmap(fd, end - start, prot=mmap.PROT_READ, offset=start) as m:
        with memoryview(m) as pages:
            return not resident(pages)


@cache
def _reporting_device() -> bool:
    """Whether a virtio balloon that takes free page reports is present (read once)."""
    try:
        devices = list(VIRTIO_DEVICES.iterdir())
    except OSError:
        return False
    for device in devices:
        try:
            if (device / "device").read_text().strip() == _BALLOON and \
                    (device / "features").read_text()[_F_REPORTING] == "1":
                return True
        except (OSError, IndexError):
            continue
    return False


def pages_go_back_to_the_host() -> bool:
    """Whether free pages are being handed back to a hypervisor (virtio-balloon free page
    reporting, on): the first touch of such a page then costs a fault in the host, and a
    committer allocating its own page-cache pages wrote up to 35-40% slower; where pages
    stay the guest's, caching the tail ahead made it 20% slower instead (docs/benchmarks.md,
    thirty-third round). Read at each preparing: the reporting order can change at run
    time."""
    try:
        order = int(REPORTING_ORDER.read_text())
    except (OSError, ValueError):
        return False
    return order <= MAX_PAGE_ORDER and _reporting_device()


def _cache(fd: int, start: int, end: int) -> None:
    """Bring [start, end) of the file into the page cache (allocated, unwritten: zeros, no
    disk read). The kernel reads at most its readahead window per POSIX_FADV_WILLNEED
    (128 KiB by default), hence one call per READAHEAD."""
    for offset in range(start, end, READAHEAD):
        os.posix_fadvise(fd, offset, min(READAHEAD, end - offset), os.POSIX_FADV_WILLNEED)


class Preallocator:
    def __init__(self, store: Store):
        self.store = store
        self._woken = threading.Event()
        self._stopping = False
        self._checked = 0.0         # when the prepared tail was last checked (monotonic)
        self._thread = threading.Thread(target=self._run, name="mountfs-prealloc",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """After a commit: LMDB's end may have moved."""
        self._woken.set()

    def stop(self) -> None:
        self._stopping = True
        self._woken.set()
        self._thread.join()

    def _run(self) -> None:
        fd = os.open(self.store.data_file, os.O_RDWR | os.O_CLOEXEC)
        try:
            prepared = os.fstat(fd).st_size
            while True:
                self._woken.wait()
                self._woken.clear()
                if self._stopping:
                    return
                prepared = self._prepare(fd, prepared)
        except OSError as e:
            log.info("%s: the data file is no longer prepared ahead of LMDB (%s): it grows "
                     "as LMDB writes", self.store.path, e.strerror)
        except Exception:
            log.exception("%s: the data file is no longer prepared ahead of LMDB",
                          self.store.path)
        finally:
            os.close(fd)

    def _prepare(self, fd: int, prepared: int) -> int:
        """Allocate and cache from LMDB's end (or what is prepared already, if further) to
        AHEAD past LMDB's end, if that is STEP or more and leaves DEFER_MARGIN free on the
        disk; bring back into the cache what reclaim took of the part already prepared
        (checked at most every RECHECK seconds).
        Returns how far the file is prepared. OSError: preparing is not possible here (no
        fallocate)."""
        end = self.store.pages_end()
        start, want = max(prepared, end), end + AHEAD
        now = time.monotonic()
        if end < start and now - self._checked >= RECHECK:
            self._checked = now
            if pages_go_back_to_the_host() and _evicted(fd, end, start):
                _cache(fd, end, start)
        if want - start < STEP or self.store.disk_free() - (want - start) < DEFER_MARGIN:
            return prepared
        try:
            _fallocate(fd, start, want - start)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                raise
            return max(prepared, os.fstat(fd).st_size)    # a full disk: what it did allocate
        if pages_go_back_to_the_host():        # read here: most wake-ups allocate nothing
            _cache(fd, start, want)
        return want
