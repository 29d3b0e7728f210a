"""Inode numbers under .snapshot are a pure function of (snapshot, store inode): hard links
stay hard links, and a number never changes while the snapshot exists, whatever the kernel
forgets in between and across remounts. The kernel is made to forget (drop_caches), not hoped
to."""

from __future__ import annotations

import errno
import os
import pytest

from conftest import drop_caches


def inos(paths) -> list[int]:
    return [os.stat(p).st_ino for p in paths]


def test_snapshot_hard_links_keep_one_number_across_forgets_and_remounts(make_mount):
    m = make_mount()
    (m.mnt / "hl").mkdir()
    (m.mnt / "hl/a").write_text("linked")
    os.link(m.mnt / "hl/a", m.mnt / "hl/c")
    (m.mnt / "hl/other").write_text("x")
    m.snapctl("create", "s")
    m.snapctl("create", "t")
    snap = m.mnt / ".snapshot"
    a, c = snap / "s/hl/a", snap / "s/hl/c"
    first = os.stat(a).st_ino
    drop_caches()
    assert os.stat(c).st_ino == first                       # a second link of the same file
    drop_caches()
    assert os.stat(a).st_ino == first                       # the same path again
    assert os.stat(snap / "s/hl/other").st_ino != first
    t_ino = os.stat(snap / "t/hl/a").st_ino                 # another snapshot: its own number
    assert t_ino != first
    entries = {e.name: e.inode() for e in os.scandir(snap / "s/hl")}   # readdir agrees
    assert entries["a"] == entries["c"] == first
    m.umount()
    m.mount()
    assert inos([a, c, snap / "t/hl/a"]) == [first, first, t_ino]


def test_a_deleted_snapshot_is_stale_never_another_snapshots_data(make_mount):
    m = make_mount()
    (m.mnt / "f").write_bytes(b"A" * 3_000_000)
    m.snapctl("create", "s")
    fd = os.open(m.mnt / ".snapshot/s/f", os.O_RDONLY)
    try:
        old_ino = os.fstat(fd).st_ino
        m.snapctl("delete", "s", "--force")                 # open: refused without it
        (m.mnt / "f").write_bytes(b"B" * 3_000_000)
        m.snapctl("create", "s")                            # same name, a new snapshot
        drop_caches()
        with pytest.raises(OSError) as info:
            os.pread(fd, 100, 2_500_000)                    # a page the kernel never cached
        assert info.value.errno == errno.ESTALE
        assert os.stat(m.mnt / ".snapshot/s/f").st_ino != old_ino
        assert (m.mnt / ".snapshot/s/f").read_bytes() == b"B" * 3_000_000
    finally:
        os.close(fd)
