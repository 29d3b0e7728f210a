"""Snapshots: O(1) creation atomic with writers, read-only browsing under .snapshot, names,
deletion that gives space back, offline use, and restore of files, trees and the whole
tree without copying data."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest

from conftest import cli
from test_posix import raises_errno


def names(m) -> list[str]:
    return [json.loads(line)["name"] for line in m.snapctl("list", "--json").stdout.splitlines()]


# ---- creating and browsing ----------------------------------------------------------------

def test_snapshot_is_frozen_and_browsable(mounted):
    m = mounted.mnt
    (m / "d").mkdir()
    (m / "d/f").write_text("v1")
    os.link(m / "d/f", m / "hard")
    os.symlink("d/f", m / "ln")
    os.setxattr(m / "d/f", "user.k", b"1")
    os.chmod(m / "d", 0o750)
    mounted.snapctl("create", "s1")
    (m / "d/f").write_text("v2")                      # through one name of a hard link
    os.setxattr(m / "d/f", "user.k", b"2")
    os.chmod(m / "d", 0o700)
    os.unlink(m / "ln")
    (m / "new").write_text("n")
    snap = m / ".snapshot/s1"
    assert ".snapshot" not in os.listdir(m) and os.listdir(m / ".snapshot") == ["s1"]
    assert sorted(os.listdir(snap)) == ["d", "hard", "ln"]
    assert (snap / "d/f").read_text() == (snap / "hard").read_text() == "v1"
    assert (m / "hard").read_text() == "v2"
    assert os.getxattr(snap / "d/f", "user.k") == b"1"
    assert os.stat(snap / "d").st_mode & 0o777 == 0o750
    assert os.readlink(snap / "ln") == "d/f" and os.stat(snap / "hard").st_nlink == 2
    mounted.umount()
    mounted.mount()                                   # snapshots persist
    assert (snap / "d/f").read_text() == "v1"


def test_every_write_into_a_snapshot_is_erofs(mounted):
    m = mounted.mnt
    (m / "d").mkdir()
    (m / "d/f").write_text("x")
    mounted.snapctl("create", "s1")
    s = m / ".snapshot/s1"
    ops = [lambda: open(s / "d/f", "w"), lambda: open(s / "d/f", "a"),
           lambda: open(s / "d/new", "w"), lambda: os.mkdir(s / "d/sub"),
           lambda: os.unlink(s / "d/f"), lambda: os.rmdir(s / "d"),
           lambda: os.rename(s / "d/f", s / "d/g"), lambda: os.rename(s / "d/f", m / "out"),
           lambda: os.rename(m / "d/f", s / "in"), lambda: os.chmod(s / "d/f", 0o600),
           lambda: os.chown(s / "d/f", 1, 1), lambda: os.utime(s / "d/f", (1, 1)),
           lambda: os.truncate(s / "d/f", 0), lambda: os.setxattr(s / "d/f", "user.a", b"b"),
           lambda: os.removexattr(s / "d/f", "user.a"), lambda: os.link(s / "d/f", s / "l"),
           lambda: os.symlink("x", s / "sl"), lambda: os.mkfifo(s / "fifo"),
           lambda: os.mkdir(m / ".snapshot/new"), lambda: os.rmdir(s),
           lambda: os.chmod(s, 0o700)]
    for op in ops:
        with pytest.raises(OSError) as info:
            op()
        assert info.value.errno in (errno.EROFS, errno.EXDEV), op
    assert (s / "d/f").read_text() == "x"


def test_a_snapshot_holds_everything_written_before_create_returned(mounted):
    f = mounted.mnt / "log"
    stop = threading.Event()
    count = [0]

    def writer():
        with open(f, "wb") as h:                      # held open the whole time
            while not stop.is_set():
                h.write(b"record %08d\n" % count[0])
                h.flush()
                count[0] += 1
    t = threading.Thread(target=writer)
    t.start()
    try:
        while count[0] < 200:
            time.sleep(0.01)
        written_before = count[0]
        mounted.snapctl("create", "mid")
        after_create = count[0]
    finally:
        stop.set()
        t.join()
    records = (mounted.mnt / ".snapshot/mid/log").read_bytes().splitlines()
    assert written_before <= len(records) <= after_create
    assert records == [b"record %08d" % i for i in range(len(records))]   # a clean prefix


def test_many_snapshots_of_one_file(mounted):
    f = mounted.mnt / "f"
    for i in range(20):
        f.write_text(f"version {i}")
        mounted.snapctl("create", f"v{i}")
    for i in range(20):
        assert (mounted.mnt / f".snapshot/v{i}/f").read_text() == f"version {i}"
    assert names(mounted) == [f"v{i}" for i in range(20)]


@pytest.mark.parametrize("name, message", [
    ("", "must not be empty"), ("a/b", "must not contain '/'"), (".", "reserved"),
    ("..", "reserved"), ("x" * 256, "256 bytes long; the limit is 255"),
])
def test_bad_snapshot_names(mounted, name, message):
    res = mounted.snapctl("create", name, check=False)
    assert res.returncode == 1 and message in res.stderr and "Traceback" not in res.stderr
    assert names(mounted) == []


def test_duplicate_and_unknown_snapshots(mounted):
    mounted.snapctl("create", "s1")
    res = mounted.snapctl("create", "s1", check=False)
    assert res.returncode == 1 and res.stderr.strip() == \
        "snapctl: a snapshot named 's1' already exists"
    for args in (("delete", "nope"), ("restore", "nope"), ("restore", "nope", "f"),
                 ("diff", "nope", "s1")):
        res = mounted.snapctl(*args, check=False)
        assert res.returncode == 1 and res.stderr.strip() == "snapctl: no snapshot named 'nope'"


def test_delete_gives_the_space_back(mounted):
    def used() -> int:
        """What the store occupies (statfs: total - free; free counts the disk's free space,
        which other processes change, plus the store's own free pages)."""
        st = os.statvfs(mounted.mnt)
        return (st.f_blocks - st.f_bfree) * st.f_frsize
    f = mounted.mnt / "big"
    f.write_bytes(os.urandom(40 << 20))
    mounted.snapctl("create", "s1")
    f.unlink()
    os.sync()
    with_snapshot = used()
    assert with_snapshot > 40 << 20                   # the snapshot still holds the data
    mounted.snapctl("delete", "s1")
    deadline = time.monotonic() + 60
    while used() > with_snapshot - (30 << 20):
        assert time.monotonic() < deadline, "the space never came back"
        time.sleep(0.2)
    assert names(mounted) == [] and os.listdir(mounted.mnt / ".snapshot") == []


def test_deleting_a_snapshot_while_a_file_in_it_is_open(mounted):
    (mounted.mnt / "f").write_bytes(b"x" * 100_000)
    mounted.snapctl("create", "s1")
    with open(mounted.mnt / ".snapshot/s1/f", "rb") as h:
        assert h.read(10) == b"x" * 10
        mounted.snapctl("delete", "s1")
        try:
            h.read()                                  # either still readable or a clean EIO
        except OSError as e:
            assert e.errno in (errno.EIO, errno.ENOENT, errno.ESTALE)
    assert not (mounted.mnt / ".snapshot/s1").exists()
    (mounted.mnt / "g").write_text("the mount still works")


def test_snapshots_offline_and_the_store_lock(make_mount, tmp_path):
    m = make_mount()
    (m.mnt / "f").write_text("x")
    res = cli("snapctl", "--store", m.store, "list")         # mounted: goes to the mount
    assert res.returncode == 0
    m.umount()
    cli("snapctl", "--store", m.store, "create", "offline")
    assert "offline" in cli("snapctl", "--store", m.store, "list").stdout
    m.mount()
    assert (m.mnt / ".snapshot/offline/f").read_text() == "x"
    res = cli("mountfs", "fsck", m.store, check=False)
    assert res.returncode == 2 and "in use" in res.stderr


# ---- restore ----------------------------------------------------------------------------

def test_restore_a_file_needs_force_over_an_existing_one(mounted):
    f = mounted.mnt / "f"
    f.write_text("good")
    mounted.snapctl("create", "s1")
    f.write_text("bad")
    res = mounted.snapctl("restore", "s1", "f", check=False)
    assert res.returncode == 1 and "exists; pass --force" in res.stderr
    assert f.read_text() == "bad"
    mounted.snapctl("restore", "s1", "f", "--force")
    assert f.read_text() == "good"
    f.unlink()
    mounted.snapctl("restore", "s1", "f")                     # gone: no --force needed
    assert f.read_text() == "good"


def test_restore_a_tree_to_another_place(mounted):
    m = mounted.mnt
    (m / "t/sub").mkdir(parents=True)
    (m / "t/sub/a").write_bytes(os.urandom(3 << 20))
    os.link(m / "t/sub/a", m / "t/a-link")
    os.symlink("sub/a", m / "t/sym")
    os.setxattr(m / "t/sub", "user.k", b"v")
    os.chmod(m / "t/sub", 0o705)
    mounted.snapctl("create", "s1")
    import shutil
    shutil.rmtree(m / "t")
    os.sync()
    free_before = os.statvfs(m).f_bavail * os.statvfs(m).f_frsize
    mounted.snapctl("restore", "s1", "t", "--to", "t-back")
    back = m / "t-back"
    assert (back / "sub/a").read_bytes() == (m / ".snapshot/s1/t/sub/a").read_bytes()
    assert os.stat(back / "sub/a").st_ino == os.stat(back / "a-link").st_ino
    assert os.readlink(back / "sym") == "sub/a"
    assert os.getxattr(back / "sub", "user.k") == b"v"
    assert os.stat(back / "sub").st_mode & 0o777 == 0o705
    os.sync()
    free_after = os.statvfs(m).f_bavail * os.statvfs(m).f_frsize
    assert free_before - free_after < (1 << 20)               # no chunk data was copied
    res = mounted.snapctl("restore", "s1", "t", "--to", "t-back", check=False)
    assert res.returncode == 1 and "exists; pass --force" in res.stderr
    res = mounted.snapctl("restore", "s1", "missing", check=False)
    assert res.returncode == 1 and "does not exist in snapshot" in res.stderr


def test_rollback_of_the_whole_tree(mounted):
    m = mounted.mnt
    (m / "keep").write_text("1")
    (m / "d").mkdir()
    mounted.snapctl("create", "s1")
    (m / "keep").write_text("2")
    (m / "added").write_text("x")
    os.rmdir(m / "d")
    res = mounted.snapctl("restore", "s1", check=False)
    assert res.returncode == 1 and "--force" in res.stderr
    assert (m / "keep").read_text() == "2"
    mounted.snapctl("create", "s2")
    mounted.snapctl("restore", "s1", "--force")
    assert sorted(os.listdir(m)) == ["d", "keep"] and (m / "keep").read_text() == "1"
    assert (m / ".snapshot/s2/added").read_text() == "x"     # later snapshots stay
    (m / "after").write_text("life goes on")
    mounted.snapctl("create", "s3")
    assert sorted(os.listdir(m / ".snapshot/s3")) == ["after", "d", "keep"]


def test_restore_offline(make_mount):
    m = make_mount()
    (m.mnt / "f").write_text("one")
    m.snapctl("create", "s1")
    (m.mnt / "f").write_text("two")
    m.umount()
    cli("snapctl", "--store", m.store, "restore", "s1", "f", "--force")
    cli("snapctl", "--store", m.store, "restore", "s1", "f", "--to", "g")
    m.mount()
    assert (m.mnt / "f").read_text() == (m.mnt / "g").read_text() == "one"


def test_raises_errno_helper_is_strict(mounted):
    with pytest.raises(AssertionError):
        raises_errno(errno.ENOENT, os.mkdir, mounted.mnt)      # EEXIST is not ENOENT
