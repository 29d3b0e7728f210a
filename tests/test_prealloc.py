"""The data file prepared ahead of LMDB's writes (mountfs.prealloc): allocated past LMDB's
last page (and in the page cache, where free pages go back to the host), counted as free
space, harmless to a crash, and given up on a disk running out of space."""

from __future__ import annotations

import mmap
import os
import time

import pytest

from conftest import cli, fill_disk, fsck_clean, tmpfs_disk
from mountfs.committer import DEFER_MARGIN
from mountfs.mapread import resident
from mountfs import prealloc
from mountfs.prealloc import AHEAD, STEP, Preallocator, pages_go_back_to_the_host
from mountfs.store import Store


def _tail(store_path) -> tuple[int, int]:
    """(where LMDB's pages end, the data file's size), read as another process would."""
    store = Store.open(store_path, readonly=True, lock=False)
    try:
        return store.pages_end(), os.stat(store.data_file).st_size
    finally:
        store.close()


def _resident(path, start: int, end: int) -> bool:
    """Whether every page of ``path`` in [start, end) is in the page cache."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), end, access=mmap.ACCESS_READ) as m:
        with memoryview(m)[start:end] as tail:
            return resident(tail)


def _prepared(store_path, cached: bool = True, within: float = 30.0,
              commit=None) -> tuple[int, int]:
    """Wait until the data file reaches at least STEP past LMDB's pages and (``cached``)
    that tail is in the page cache (the thread runs after a commit, and caches after it
    allocates): (pages end, file size). ``commit()``, called while the tail is not cached,
    makes one: reclaim may take the tail's pages (they are never read), and the thread
    brings them back after the next commit."""
    deadline = time.monotonic() + within
    while True:
        end, size = _tail(store_path)
        if size - end >= STEP and (not cached or _resident(store_path / "data.mdb", end, size)) \
                or time.monotonic() > deadline:
            return end, size
        if commit is not None and size - end >= STEP:
            commit()
        time.sleep(0.05)


def _committer(mnt):
    """A commit through the mount, on each call (a byte written and fsynced)."""
    def commit():
        with open(mnt / "nudge", "wb") as f:
            f.write(b"x")
            os.fsync(f.fileno())
    return commit


def test_the_data_file_is_prepared_ahead_of_lmdb_and_counted_free(make_mount):
    m = make_mount()
    data = os.urandom(1 << 20)
    with open(m.mnt / "big", "wb") as f:
        for i in range(48):
            f.write(i.to_bytes(8, "little") + data[8:])
        os.fsync(f.fileno())
    caching = pages_go_back_to_the_host()
    end, size = _prepared(m.store, cached=caching, commit=_committer(m.mnt))
    assert STEP <= size - end <= AHEAD + STEP, (end, size)
    assert _resident(m.store / "data.mdb", end, size) == caching
    disk, mounted = os.statvfs(m.store), os.statvfs(m.mnt)
    free_disk = disk.f_bavail * disk.f_frsize
    free_mount = mounted.f_bavail * mounted.f_frsize
    assert free_mount >= free_disk + (size - end) - (4 << 20), \
        "the mount's free space leaves out the data file's prepared tail"
    m.kill9()                                   # a crash leaves the longer file: harmless
    m.mount()
    with open(m.mnt / "big", "rb") as f:
        for i in range(48):
            assert f.read(1 << 20) == i.to_bytes(8, "little") + data[8:]
    m.umount()
    fsck_clean(m.store)
    m.mount()


@pytest.mark.skipif(not pages_go_back_to_the_host(),
                    reason="free pages stay this machine's: the tail is not cached")
def test_a_prepared_tail_that_reclaim_took_is_cached_again_after_the_next_commit(make_mount):
    """Reclaim takes the prepared pages first (never read; a VM's DAMON pageout does it
    within seconds), which left LMDB's next writes allocating pages again."""
    m = make_mount()
    with open(m.mnt / "f", "wb") as f:
        f.write(os.urandom(4 << 20))
        os.fsync(f.fileno())
    end, size = _prepared(m.store, commit=_committer(m.mnt))
    assert _resident(m.store / "data.mdb", end, size)
    fd = os.open(m.store / "data.mdb", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, end, size - end, os.POSIX_FADV_DONTNEED)      # as reclaim would
    finally:
        os.close(fd)
    assert not _resident(m.store / "data.mdb", end, size)
    end, size = _prepared(m.store, commit=_committer(m.mnt))
    assert _resident(m.store / "data.mdb", end, size)
    m.umount()


@pytest.fixture
def disk_of_400m(tmp_path):
    with tmpfs_disk(tmp_path / "disk", "400m") as path:
        yield path


def test_a_disk_filling_up_stops_the_preparing_and_loses_nothing(disk_of_400m, make_mount):
    """With 400 MiB the store starts above the margin where it prepares space, and fills
    the disk past it: ENOSPC reaches the program, what it fsynced before stays, a file can
    be written after a delete, and the store mounts again (even though, on a disk this
    full, the deleted file's inode could not be reclaimed at its close)."""
    store = disk_of_400m / "store"
    cli("mountfs", "mkfs", store)
    m = make_mount(store)
    keep = os.urandom(8 << 20)
    with open(m.mnt / "keep", "wb") as h:
        h.write(keep)
        os.fsync(h.fileno())
    end, size = _prepared(store, cached=False)          # tmpfs: no page cache of its own
    assert size - end >= STEP, "nothing was prepared while the disk had room"
    for n in range(240):        # 248 of 400 MiB: below the margin. In LMDB, through its
        with open(m.mnt / f"most{n}", "wb") as h:  # tail and past it: chunks under the
            h.write(os.urandom(1_000_000))         # chunk size (full ones go to chunks.dat)
    with open(m.mnt / "most0", "rb+") as h:
        os.fsync(h.fileno())
    end, size = _tail(store)
    assert os.statvfs(store).f_bavail * os.statvfs(store).f_frsize < DEFER_MARGIN
    assert size - end < STEP, "the data file was prepared on a disk below the margin"
    fill_disk(m.mnt / "flood", 600)
    assert os.path.ismount(m.mnt)
    os.unlink(m.mnt / "flood")
    assert (m.mnt / "keep").read_bytes() == keep
    with open(m.mnt / "after", "wb") as h:
        h.write(keep)
        os.fsync(h.fileno())
    m.umount()
    fsck_clean(store)
    m.mount()                   # a deletion that could not commit does not stop it
    assert (m.mnt / "after").read_bytes() == keep


def test_no_allocation_leaves_the_disk_below_the_margin(disk_of_400m):
    """The tail counts as free for the store, but what the preparing takes from the disk is
    weighed against the disk alone: with DEFER_MARGIN + AHEAD / 2 free nothing is
    allocated; with DEFER_MARGIN + 2 * AHEAD free it is, and the disk keeps the margin."""
    store_path = disk_of_400m / "store"
    cli("mountfs", "mkfs", store_path)
    store = Store.open(store_path)
    try:
        filler = disk_of_400m / "filler"
        fd = os.open(store.data_file, os.O_RDWR)
        try:
            prepared = os.fstat(fd).st_size
            for free, allocates in ((DEFER_MARGIN + AHEAD // 2, False),
                                    (DEFER_MARGIN + 2 * AHEAD, True)):
                filler.unlink(missing_ok=True)
                with open(filler, "wb") as f:
                    f.truncate(0)
                    f.write(bytes(store.disk_free() - free))
                now = Preallocator(store)._prepare(fd, prepared)
                grew = os.fstat(fd).st_size - prepared
                assert (grew >= STEP) == allocates, (free >> 20, grew >> 20)
                assert (now > prepared) == allocates
                assert store.disk_free() >= DEFER_MARGIN
        finally:
            os.close(fd)
    finally:
        store.close()


def _sysfs(tmp_path, order: str, features: str | None):
    """A fake page_reporting order and, with ``features``, a virtio balloon offering them."""
    (tmp_path / "order").write_text(order + "\n")
    devices = tmp_path / "virtio"
    devices.mkdir()
    if features is not None:
        (devices / "virtio0").mkdir()
        (devices / "virtio0" / "device").write_text("0x0005\n")
        (devices / "virtio0" / "features").write_text(features + "\n")
    return tmp_path / "order", devices


@pytest.mark.parametrize("order, features, reported", [
    ("9", "0110010100", True),          # this machine: a balloon taking reports, order 9
    ("11", "0110010100", False),        # reporting suspended (bench_io.pages_kept)
    ("9", "0110000100", False),         # a balloon without free page reporting
    ("9", None, False),                 # no balloon: the parameter alone reports nothing
    ("x", "0110010100", False),         # unreadable: as if absent
])
def test_pages_count_as_going_back_only_with_a_reporting_balloon(tmp_path, monkeypatch, order,
                                                                  features, reported):
    path, devices = _sysfs(tmp_path, order, features)
    monkeypatch.setattr(prealloc, "REPORTING_ORDER", path)
    monkeypatch.setattr(prealloc, "VIRTIO_DEVICES", devices)
    prealloc._reporting_device.cache_clear()
    try:
        assert pages_go_back_to_the_host() is reported
    finally:
        prealloc._reporting_device.cache_clear()


@pytest.mark.parametrize("reported", [True, False])
def test_the_tail_is_cached_only_where_pages_go_back_to_the_host(tmp_path, monkeypatch,
                                                                 reported):
    """Caching ahead pays where a fresh page costs the host a fault, and costs the committer
    a fifth of its speed where it does not: the tail is allocated either way, cached only in
    the first case."""
    monkeypatch.setattr(prealloc, "pages_go_back_to_the_host", lambda: reported)
    store_path = tmp_path / "store"
    cli("mountfs", "mkfs", store_path)
    store = Store.open(store_path)
    try:
        fd = os.open(store.data_file, os.O_RDWR)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            end = store.pages_end()
            now = Preallocator(store)._prepare(fd, os.fstat(fd).st_size)
            assert now == end + AHEAD == os.fstat(fd).st_size
            deadline = time.monotonic() + 10
            while reported and not _resident(store.data_file, end, now) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _resident(store.data_file, end, now) == reported
        finally:
            os.close(fd)
    finally:
        store.close()
