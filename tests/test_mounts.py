"""Mounting and unmounting as a user meets it: a read-only mount beside the writable one
(either order of mount and unmount), a read-only mount of a mirror its receiver is serving,
and 'umount' that returns only once the store is released."""

from __future__ import annotations

import os

from conftest import cli, fsck_clean


def log_of(store) -> str:
    return (store / "mountfs.log").read_text()


def test_read_only_beside_writer_each_mount_owns_its_socket(make_mount):
    a = make_mount()
    (a.mnt / "f").write_text("one")
    b = make_mount(a.store, "--read-only")
    a.snapctl("create", "t")                                  # reaches A, not B
    res = b.snapctl("create", "u", check=False)
    assert res.returncode != 0 and "read-only" in res.stderr
    assert "t" in b.snapctl("list").stdout                    # B follows A's commits
    assert (b.mnt / ".snapshot/t/f").read_text() == "one"
    assert (b.mnt / "f").read_text() == "one"
    with open(b.mnt / "f") as h:                              # fsync on B syncs nothing
        os.fsync(h.fileno())
    b.umount()                                                # waits for B, not for A
    assert os.path.ismount(a.mnt) and not os.path.ismount(b.mnt)
    a.snapctl("create", "v")                                  # A's socket survived
    assert "v" in a.snapctl("list").stdout
    assert "Traceback" not in log_of(a.store) and "ReadonlyError" not in log_of(a.store)
    a.umount()
    fsck_clean(a.store)


def test_read_only_first_then_writer_unmounted_first(make_mount):
    a = make_mount()
    (a.mnt / "f").write_text("x")
    a.umount()
    b = make_mount(a.store, "--read-only")
    a.mount()                                                 # the writer comes second
    (a.mnt / "g").write_text("y")
    a.snapctl("create", "s")
    a.umount()
    fsck_clean(a.store)                                       # a read-only mount is no writer
    assert (b.mnt / ".snapshot/s/g").read_text() == "y"       # B goes on, on its own socket
    assert [line for line in b.snapctl("list").stdout.splitlines() if "s" in line.split()]
    b.umount()
    assert "Traceback" not in log_of(a.store)


def test_read_only_mount_of_a_mirror_being_served(make_mount, receiver, tmp_path):
    r = receiver(store=tmp_path / "mirror")                   # holds the mirror's store lock
    b = make_mount(r.store, "--read-only", fsck=False)
    assert os.listdir(b.mnt) == []
    res = cli("mountfs", "umount", "--timeout", "30", b.mnt, check=False)
    assert res.returncode == 0, res.stderr                    # never waits for the receiver
    assert r.proc.poll() is None


def test_umount_returns_once_the_store_is_released(make_mount):
    m = make_mount()
    payload = os.urandom(1 << 20)
    for round_ in range(3):
        for i in range(40):
            with open(m.mnt / f"f{i}", "wb") as h:
                for _ in range(4):
                    h.write(payload)
        m.umount()
        res = cli("mountfs", "fsck", "-q", m.store, check=False)
        assert res.returncode == 0, f"round {round_}: {res.stdout}{res.stderr}"
        m.mount()
