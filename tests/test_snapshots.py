"""Snapshots: create/list/delete through snapctl (text and --json), the hidden `.snapshot`
directory, frozen content (files, dirs, symlinks, xattrs, modes, owners, times, hard links),
EROFS on every write, atomicity with a file being written, many versions of one file, names,
space given back after a delete, a delete while a file of the snapshot is open, persistence,
offline use and the store lock.

Most tests share one mount (module fixture ``fs``), each in its own directory with its own
snapshot names, because a mount and its fsck cost seconds on a busy machine; tests that
unmount or need exact store figures say so. Bulk snapshot creation goes through the control
socket (``take``): the very request snapctl sends, without starting a Python process per
snapshot; what snapctl itself prints and returns is tested where it is the point.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Mount, cli, fsck_clean
from diffapply import tree_state

from mountfs import control, gc
from mountfs.store import Store

pytestmark = pytest.mark.fuse


# ---- helpers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fs(tmp_path_factory) -> Mount:
    """One mount for the tests that need only their own directory and snapshot names; its
    store must pass fsck at the end."""
    base = tmp_path_factory.mktemp("snapfs")
    cli("mountfs", "mkfs", base / "store")
    (base / "mnt").mkdir()
    m = Mount(base / "store", base / "mnt").mount()
    yield m
    m.cleanup()
    fsck_clean(m.store)


@pytest.fixture
def here(fs, request) -> Path:
    """This test's own directory on the shared mount (its name also prefixes snapshots)."""
    d = fs.mnt / re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    d.mkdir()
    return d


def take(m: Mount, name: str) -> Path:
    """Snapshot through the control socket; returns the snapshot's root directory."""
    control.request(m.store, {"op": "create", "name": name})
    return m.mnt / ".snapshot" / name


def drop(m: Mount, name: str) -> None:
    control.request(m.store, {"op": "delete", "name": name})


def listing(m: Mount) -> list[dict]:
    return [json.loads(line) for line in m.snapctl("list", "--json").stdout.splitlines()]


def names(m: Mount) -> list[str]:
    return [s["name"] for s in listing(m)]


def browsable(m: Mount) -> list[str]:
    """The snapshots as `.snapshot` shows them (no process to start)."""
    return sorted(os.listdir(m.mnt / ".snapshot"))


def raises_errno(code: int, fn, *args, **kw) -> None:
    with pytest.raises(OSError) as info:
        fn(*args, **kw)
    assert info.value.errno == code, f"{fn}: {info.value} (wanted {errno.errorcode[code]})"


def store_used(m: Mount) -> int:
    """What the store itself occupies, from statfs (blocks - free: the disk's free space,
    which other processes change, is in both and cancels out)."""
    st = os.statvfs(m.mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def wait_gc_idle(m: Mount, timeout: float = 60) -> None:
    """Poll (read-only, no lock, as `snapctl diff` opens a store) until nothing is left to
    reclaim."""
    deadline = time.monotonic() + timeout
    while True:
        s = Store.open(m.store, readonly=True, lock=False, readahead=False)
        try:
            with s.read() as txn:
                if not gc.pending(txn, s.db):
                    return
        finally:
            s.close()
        assert time.monotonic() < deadline, "reclamation never finished"
        time.sleep(0.1)


def states_with_ctime(root: Path) -> dict:
    """tree_state plus every path's ctime (a snapshot freezes that too)."""
    out = tree_state(root)
    for rel, s in out.items():
        s["ctime"] = os.lstat(root / rel).st_ctime_ns
    return out


# ---- create, list, delete -----------------------------------------------------------------

def test_create_list_and_delete_through_snapctl(fs, here):
    t0 = time.time_ns()
    res = fs.snapctl("create", "cld-a")
    t1 = time.time_ns()
    (here / "f").write_bytes(os.urandom(300_000))
    fs.snapctl("create", "cld-b")
    (here / "g").write_bytes(b"z" * 5000)
    fs.snapctl("create", "cld-c")
    snaps = {s["name"]: s for s in listing(fs)}
    a, b, c = snaps["cld-a"], snaps["cld-b"], snaps["cld-c"]
    assert res.stdout == f"created snapshot cld-a (epoch {a['epoch']})\n"
    assert set(a) == {"name", "epoch", "created_ns", "id", "uuid", "written"}
    assert a["epoch"] < b["epoch"] < c["epoch"] and a["id"] < b["id"] < c["id"]
    assert len({a["uuid"], b["uuid"], c["uuid"]}) == 3 and len(bytes.fromhex(a["uuid"])) == 16
    assert t0 <= a["created_ns"] <= t1
    assert (b["written"], c["written"]) == (300_000, 5000)   # chunk bytes since the one before
    text = fs.snapctl("list").stdout.splitlines()
    assert text[0].split() == ["NAME", "EPOCH", "WRITTEN", "CREATED"]
    row = next(line for line in text if line.startswith("cld-b "))
    created = datetime.datetime.fromtimestamp(b["created_ns"] / 1e9).isoformat(
        sep=" ", timespec="seconds")
    assert row.split() == ["cld-b", str(b["epoch"]), "293.0", "KiB", *created.split()]
    assert [line.split()[0] for line in text[1:]] == list(snaps)    # the same order
    assert fs.snapctl("delete", "cld-b").stdout == "deleted snapshot cld-b\n"
    after = {s["name"]: s for s in listing(fs)}
    assert "cld-b" not in after and not (fs.mnt / ".snapshot/cld-b").exists()
    assert after["cld-c"]["written"] == 305_000                      # b's bytes merge into c
    assert (fs.mnt / f".snapshot/cld-c/{here.name}/f").read_bytes() == (here / "f").read_bytes()


def test_a_snapshot_being_read_is_not_deleted_under_its_reader(fs, here):
    """A backup reading .snapshot/NAME keeps it: while a file or directory of it is open,
    delete is refused with one line saying who to look for and --force (which deletes it,
    as before: the reader's next call fails ESTALE). Other snapshots are unaffected."""
    (here / "d").mkdir()
    (here / "d/f").write_text("keep me")
    fs.snapctl("create", "busy-a")
    fs.snapctl("create", "busy-b")
    snap = fs.mnt / ".snapshot/busy-a" / here.name
    with open(snap / "d/f") as reader:
        res = fs.snapctl("delete", "busy-a", check=False)
        assert res.returncode != 0 and res.stdout == ""
        assert res.stderr.count("\n") == 1 and "'busy-a' is in use: 1 open file or directory under" in res.stderr
        assert "fuser -vm" in res.stderr and "--force" in res.stderr
        assert fs.snapctl("delete", "busy-b").returncode == 0       # not the one in use
        assert reader.read() == "keep me"
    dfd = os.open(snap / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert "is in use" in fs.snapctl("delete", "busy-a", check=False).stderr
    finally:
        os.close(dfd)
    assert fs.snapctl("delete", "busy-a").returncode == 0          # closed: deleted
    fs.snapctl("create", "busy-c")
    with open(fs.mnt / ".snapshot/busy-c" / here.name / "d/f") as reader:
        assert fs.snapctl("delete", "busy-c", "--force").returncode == 0
    assert {"busy-a", "busy-b", "busy-c"}.isdisjoint(s["name"] for s in listing(fs))


def test_dot_snapshot_is_hidden_but_enterable(fs, here):
    take(fs, "hidden-1")
    root_names = os.listdir(fs.mnt)
    assert ".snapshot" not in root_names and here.name in root_names
    assert ".snapshot" not in [e.name for e in os.scandir(fs.mnt)]
    st = os.stat(fs.mnt / ".snapshot")
    assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 == 0o555
    assert sorted(os.listdir(fs.mnt / ".snapshot")) == sorted(names(fs))
    assert "hidden-1" in os.listdir(fs.mnt / ".snapshot")
    assert ".snapshot" not in os.listdir(fs.mnt / ".snapshot/hidden-1")
    raises_errno(errno.ENOENT, os.stat, fs.mnt / ".snapshot/no-such-snapshot")
    raises_errno(errno.EEXIST, os.mkdir, fs.mnt / ".snapshot")      # the name is taken


# ---- frozen content -----------------------------------------------------------------------

def build_tree(d: Path) -> None:
    """A small tree with every kind of thing a snapshot must freeze."""
    (d / "dir/sub").mkdir(parents=True)
    (d / "dir/f").write_text("v1")
    os.link(d / "dir/f", d / "hard")
    os.symlink("dir/f", d / "ln")
    os.setxattr(d / "dir/f", "user.k", b"1")
    os.setxattr(d / "dir", "user.onadir", b"x" * 300)
    (d / "big").write_bytes(os.urandom(1_200_000))               # two 1 MiB chunks
    (d / "gone").write_text("to be deleted")
    (d / "owned").write_text("o")
    os.chown(d / "owned", 1234, 5678)
    os.chmod(d / "owned", 0o4751)
    os.chmod(d / "dir", 0o750)
    os.mkfifo(d / "fifo")
    os.utime(d / "dir/sub", ns=(1_000_000_000_000_000_000, 1_000_000_000_123_456_789))


def change_everything(d: Path) -> None:
    with open(d / "hard", "r+") as h:                            # through the other name
        h.write("v2, longer")
    os.setxattr(d / "dir/f", "user.k", b"2")
    os.setxattr(d / "dir/f", "user.new", b"n")
    os.removexattr(d / "dir", "user.onadir")
    os.unlink(d / "ln")
    os.symlink("elsewhere", d / "ln")
    with open(d / "big", "r+b") as h:                            # one chunk of two
        h.seek(1_100_000)
        h.write(b"\0" * 1000)
    os.unlink(d / "gone")
    os.chown(d / "owned", 1, 1)
    os.chmod(d / "owned", 0o600)
    os.chmod(d / "dir", 0o700)
    os.utime(d / "dir/sub", ns=(5, 5))
    os.rename(d / "dir/sub", d / "moved")
    (d / "new").write_text("n")
    os.truncate(d / "big", 10)


def test_snapshot_content_is_the_state_at_creation(fs, here):
    build_tree(here)
    before = states_with_ctime(here)
    snap = take(fs, "frozen") / here.name
    change_everything(here)
    assert states_with_ctime(snap) == before
    assert (snap / "dir/f").read_text() == (snap / "hard").read_text() == "v1"
    assert (here / "dir/f").read_text() == (here / "hard").read_text() == "v2, longer"
    s1, s2 = os.stat(snap / "dir/f"), os.stat(snap / "hard")
    assert s1.st_ino == s2.st_ino and s1.st_nlink == 2         # still one inode in the snapshot
    assert os.stat(here / "dir/f").st_ino != s1.st_ino         # snapshot inodes are their own
    assert os.readlink(snap / "ln") == "dir/f" and os.readlink(here / "ln") == "elsewhere"
    assert os.getxattr(snap / "dir/f", "user.k") == b"1"
    assert os.listxattr(snap / "dir/f") == ["user.k"]
    assert sorted(os.listdir(snap)) == ["big", "dir", "fifo", "gone", "hard", "ln", "owned"]
    assert os.stat(here / "big").st_size == 10 and os.stat(snap / "big").st_size == 1_200_000
    assert states_with_ctime(snap) == before                   # reading changed nothing


def test_every_write_into_a_snapshot_is_erofs(fs, here):
    (here / "d").mkdir()
    (here / "d/f").write_text("x")
    os.setxattr(here / "d/f", "user.a", b"b")
    top = take(fs, "ro")
    s = top / here.name
    frozen, snapshots = states_with_ctime(s), browsable(fs)
    ops = {
        "open w": lambda: open(s / "d/f", "w"), "open a": lambda: open(s / "d/f", "a"),
        "open r+": lambda: open(s / "d/f", "r+"),
        "O_RDONLY|O_TRUNC": lambda: os.open(s / "d/f", os.O_RDONLY | os.O_TRUNC),
        "create": lambda: open(s / "d/new", "w"), "mkdir": lambda: os.mkdir(s / "d/sub"),
        "unlink": lambda: os.unlink(s / "d/f"), "rmdir": lambda: os.rmdir(s / "d"),
        "rename inside": lambda: os.rename(s / "d/f", s / "d/g"),
        "rename out": lambda: os.rename(s / "d/f", here / "out"),
        "rename in": lambda: os.rename(here / "d/f", s / "in"),
        "chmod": lambda: os.chmod(s / "d/f", 0o600), "chown": lambda: os.chown(s / "d/f", 1, 1),
        "utime": lambda: os.utime(s / "d/f", (1, 1)), "utime now": lambda: os.utime(s / "d/f"),
        "truncate": lambda: os.truncate(s / "d/f", 0),
        "setxattr": lambda: os.setxattr(s / "d/f", "user.a", b"c"),
        "removexattr": lambda: os.removexattr(s / "d/f", "user.a"),
        "link inside": lambda: os.link(s / "d/f", s / "l"),
        "link out": lambda: os.link(s / "d/f", here / "l"),
        "link in": lambda: os.link(here / "d/f", s / "l"),
        "symlink": lambda: os.symlink("x", s / "sl"), "mkfifo": lambda: os.mkfifo(s / "fifo"),
        "mknod": lambda: os.mknod(s / "node", stat.S_IFREG | 0o600),
        # .snapshot itself and the snapshot's root
        "create in .snapshot": lambda: open(fs.mnt / ".snapshot/x", "w"),
        "mkdir in .snapshot": lambda: os.mkdir(fs.mnt / ".snapshot/new"),
        "symlink in .snapshot": lambda: os.symlink("ro", fs.mnt / ".snapshot/sl"),
        "rename into .snapshot": lambda: os.rename(here / "d/f", fs.mnt / ".snapshot/f"),
        "rmdir a snapshot": lambda: os.rmdir(top),
        "rename a snapshot": lambda: os.rename(top, fs.mnt / ".snapshot/ro2"),
        "chmod .snapshot": lambda: os.chmod(fs.mnt / ".snapshot", 0o777),
        "chown .snapshot": lambda: os.chown(fs.mnt / ".snapshot", 1, 1),
        "utime .snapshot": lambda: os.utime(fs.mnt / ".snapshot", (1, 1)),
        "setxattr .snapshot": lambda: os.setxattr(fs.mnt / ".snapshot", "user.a", b"1"),
        "chmod snapshot root": lambda: os.chmod(top, 0o700),
    }
    wrong = {}
    for what, op in ops.items():
        try:
            op()
            wrong[what] = "succeeded"
        except OSError as e:
            if e.errno != errno.EROFS:
                wrong[what] = errno.errorcode[e.errno]
    assert wrong == {}
    assert states_with_ctime(s) == frozen
    assert browsable(fs) == snapshots
    assert os.listdir(here / "d") == ["f"]                       # the live tree is untouched


# ---- atomicity with writers ---------------------------------------------------------------

def test_snapshot_of_a_file_open_and_being_written(fs, here):
    fd = os.open(here / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        data = bytearray(os.urandom(2_500_123))                 # buffered chunks, not closed
        assert os.write(fd, data) == len(data)
        assert os.pwrite(fd, b"patched", 1_048_570) == 7        # across a chunk boundary
        data[1_048_570:1_048_577] = b"patched"
        fs.snapctl("create", "openwrite")                        # the CLI: syncfs + request
        os.write(fd, b"after the snapshot")
        os.pwrite(fd, b"XXXX", 10)
        snap = fs.mnt / f".snapshot/openwrite/{here.name}/f"
        assert os.stat(snap).st_size == len(data)
        assert snap.read_bytes() == bytes(data)
    finally:
        os.close(fd)
    data[10:14] = b"XXXX"
    assert (here / "f").read_bytes() == bytes(data) + b"after the snapshot"
    assert snap.read_bytes()[:len(data)][10:14] != b"XXXX"


RECORD = b"record %08d\n"


def test_snapshot_amid_a_writer_holds_a_clean_prefix(fs, here):
    f = here / "log"
    stop = threading.Event()
    count = [0]
    errors = []

    def writer():
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while not stop.is_set():
                os.write(fd, RECORD % count[0])
                count[0] += 1                                    # after write() returned
        except OSError as e:
            errors.append(e)
        finally:
            os.close(fd)
    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while count[0] < 300:
            assert time.monotonic() < deadline and t.is_alive(), "the writer made no progress"
            time.sleep(0.01)
        before = count[0]
        fs.snapctl("create", "midwrite")
        after = count[0]
        while count[0] < after + 100:                            # it goes on afterwards
            assert time.monotonic() < deadline and t.is_alive(), "the writer stalled"
            time.sleep(0.01)
    finally:
        stop.set()
        t.join()
    assert errors == []
    data = (fs.mnt / f".snapshot/midwrite/{here.name}/log").read_bytes()
    n = len(data) // len(RECORD % 0)
    assert before <= n <= after
    assert data == b"".join(RECORD % i for i in range(n))       # whole records, in order
    assert (here / "log").read_bytes() == b"".join(RECORD % i for i in range(count[0]))


def test_twenty_snapshots_of_one_file_and_deleting_every_other(fs, here):
    f = here / "f"

    def version(i: int) -> bytes:
        return (b"%02d" % i) * (i * 30_000 + 1)                 # 2 B to 1.1 MB: sizes differ
    for i in range(20):
        f.write_bytes(version(i))
        take(fs, f"many-{i}")
    for i in range(20):
        assert (fs.mnt / f".snapshot/many-{i}/{here.name}/f").read_bytes() == version(i), i
    mine = [n for n in names(fs) if n.startswith("many-")]
    assert mine == [f"many-{i}" for i in range(20)]               # listed oldest first
    for i in range(0, 20, 2):
        drop(fs, f"many-{i}")
    wait_gc_idle(fs)                                             # neighbours' versions survive
    for i in range(20):
        path = fs.mnt / f".snapshot/many-{i}/{here.name}/f"
        if i % 2:
            assert path.read_bytes() == version(i), i
        else:
            assert not path.exists()
    assert f.read_bytes() == version(19)


# ---- names --------------------------------------------------------------------------------

@pytest.mark.parametrize("name, message", [
    ("", "snapshot name must not be empty"),
    ("a/b", "snapshot name 'a/b' must not contain '/' or NUL"),
    (".", "snapshot name '.' is reserved"),
    ("..", "snapshot name '..' is reserved"),
    ("x" * 256, "snapshot name is 256 bytes long; the limit is 255"),
    ("é" * 128, "snapshot name is 256 bytes long; the limit is 255"),
])
def test_bad_snapshot_names_are_one_clear_line(fs, name, message):
    before = browsable(fs)
    res = fs.snapctl("create", name, check=False)
    assert (res.returncode, res.stdout, res.stderr) == (1, "", f"snapctl: {message}\n")
    assert browsable(fs) == before


@pytest.mark.parametrize("name", ["a\0b", "", "/", "..", "y" * 256])
def test_the_mount_refuses_bad_names_itself(fs, name):
    """The control protocol checks names too (snapctl is not the only client); NUL can only
    arrive this way."""
    with pytest.raises(control.ControlError, match="snapshot name"):
        control.request(fs.store, {"op": "create", "name": name})
    assert name not in browsable(fs)


def test_unusual_but_valid_names(fs, here):
    (here / "f").write_text("ok")
    longest = "n" * 255
    spaced = "week 47 – ünïcode"
    fs.snapctl("create", longest)
    fs.snapctl("create", spaced)
    assert {longest, spaced} <= set(browsable(fs)) and {longest, spaced} <= set(names(fs))
    for n in (longest, spaced):
        assert (fs.mnt / ".snapshot" / n / here.name / "f").read_text() == "ok"


def test_duplicate_and_unknown_snapshots(fs, here):
    take(fs, "dup")
    (here / "f").write_text("after")
    res = fs.snapctl("create", "dup", check=False)
    assert (res.returncode, res.stderr) == (1, "snapctl: a snapshot named 'dup' already exists\n")
    assert not (fs.mnt / f".snapshot/dup/{here.name}/f").exists()   # the old one is kept
    for args in (("delete", "nope"), ("restore", "nope"), ("restore", "nope", "f"),
                 ("diff", "nope", "dup")):
        res = fs.snapctl(*args, check=False)
        assert (res.returncode, res.stderr) == (1, "snapctl: no snapshot named 'nope'\n"), args


# ---- deleting ----------------------------------------------------------------------------

def test_deleting_a_snapshot_gives_its_space_back(fs, here):
    wait_gc_idle(fs)                                             # earlier tests' reclamation
    used0 = store_used(fs)
    (here / "big").write_bytes(os.urandom(20 << 20))
    take(fs, "space")
    os.unlink(here / "big")
    wait_gc_idle(fs)                                             # the live file is purged
    held = store_used(fs)
    assert held - used0 >= 19 << 20     # the snapshot holds the data (the metadata's pages
                                        # may take a few fewer: LMDB reuses freed ones)
    fs.snapctl("delete", "space")
    deadline = time.monotonic() + 60
    while store_used(fs) > held - (19 << 20):
        assert time.monotonic() < deadline, "the space never came back"
        time.sleep(0.2)
    assert "space" not in browsable(fs)


def test_deleting_a_snapshot_while_a_file_in_it_is_open(fs, here):
    """What happens when it is deleted anyway (--force; without it, refused: the test
    above): pages the kernel already cached still read (they are the snapshot's data);
    everything else through the deleted snapshot (reads, listings of a directory held open,
    lookups under it) is ESTALE, never data reclaimed or belonging to another epoch. The
    mount goes on, and the name can be reused for a new snapshot."""
    (here / "f").write_bytes(b"A" * 3_000_000)
    take(fs, "doomed")
    (here / "f").write_bytes(b"B" * 3_000_000)                   # the snapshot's data is its own
    snapdir = fs.mnt / f".snapshot/doomed/{here.name}"
    dfd = os.open(snapdir, os.O_RDONLY | os.O_DIRECTORY)
    h = open(snapdir / "f", "rb", buffering=0)
    try:
        assert h.read(10) == b"A" * 10
        fs.snapctl("delete", "doomed", "--force")
        h.seek(2_500_000)
        raises_errno(errno.ESTALE, h.read, 100)
        raises_errno(errno.ESTALE, os.listdir, dfd)
        wait_gc_idle(fs)                                         # and after reclamation
        raises_errno(errno.ESTALE, h.read, 100)
        raises_errno(errno.ESTALE, os.stat, "f", dir_fd=dfd)
        assert not (fs.mnt / ".snapshot/doomed").exists()
        take(fs, "doomed")                                       # the name is free again
        raises_errno(errno.ESTALE, h.read, 100)                  # still the old, deleted one
        assert (fs.mnt / f".snapshot/doomed/{here.name}/f").read_bytes() == b"B" * 3_000_000
    finally:
        h.close()
        os.close(dfd)
    (here / "g").write_text("the mount still works")
    assert (here / "g").read_text() == "the mount still works"


# ---- persistence, offline, the store lock ---------------------------------------------------

def hold_store_lock(store: Path) -> subprocess.Popen:
    """Another writer holding the store (as a mount elsewhere would), until stdin closes."""
    p = subprocess.Popen(
        [sys.executable, "-c", ("import sys; from mountfs.store import Store; "
                                "s = Store.open(sys.argv[1], holder='mountfs mount /elsewhere'); "
                                "print('ready', flush=True); sys.stdin.read()"), str(store)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    return p


def test_snapshots_persist_offline_use_and_the_store_lock(make_mount):
    m = make_mount()
    assert m.snapctl("list").stdout == "no snapshots\n"
    (m.mnt / "f").write_text("one")
    m.snapctl("create", "s1")
    (m.mnt / "f").write_text("two")
    cli("snapctl", "--store", m.store, "create", "via-store")    # mounted: through the mount
    assert (m.mnt / ".snapshot/via-store/f").read_text() == "two"
    m.umount()

    def offline(*args, check=True):
        return cli("snapctl", "--store", m.store, *args, check=check)
    assert offline("create", "s2").stdout.startswith("created snapshot s2 (epoch ")
    assert offline("delete", "via-store").stdout == "deleted snapshot via-store\n"
    listed = [json.loads(line)["name"] for line in offline("list", "--json").stdout.splitlines()]
    assert listed == ["s1", "s2"]
    holder = hold_store_lock(m.store)
    try:
        for args in (("list",), ("create", "x"), ("delete", "s2")):
            res = offline(*args, check=False)
            assert res.returncode == 1 and res.stdout == "", args
            assert re.fullmatch(rf"snapctl: {re.escape(str(m.store))} is in use \(pid "
                                rf"{holder.pid} mountfs mount /elsewhere\); a store has only one "
                                r"writer at a time\n", res.stderr), res.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    m.mount()
    assert browsable(m) == ["s1", "s2"]
    assert (m.mnt / ".snapshot/s1/f").read_text() == "one"
    assert (m.mnt / ".snapshot/s2/f").read_text() == "two"
    assert (m.mnt / "f").read_text() == "two"


def test_text_reports_escape_names_that_do_not_print(mounted):
    """A name with a newline is one line of 'snapctl diff', an escape sequence reaches no
    terminal, a byte that is not UTF-8 and a backslash stay unambiguous (as 'ls
    --quoting-style=escape' shows them); --json keeps the names as they are."""
    m = mounted
    m.snapctl("create", "a\\b")
    hostile = {"x\n+ fake": "x\\n+ fake", "\x1b]0;PWNED\x07": "\\x1b]0;PWNED\\x07",
               "back\\nslash": "back\\\\nslash", "t\tab": "t\\tab", "caf\u00e9": "caf\u00e9"}
    for name in hostile:
        (m.mnt / name).write_text("x")
    os.mkdir(os.fsencode(m.mnt) + b"/\xff\x85")
    out = m.snapctl("diff", "a\\b").stdout
    assert sorted(out.splitlines()) == sorted(
        ["M ."] + [f"+ ./{shown}" for shown in hostile.values()] + ["+ ./\\xff\\x85"])
    assert {json.loads(line)["path"] for line in
            m.snapctl("diff", "a\\b", "--json").stdout.splitlines()} >= \
        {f"./{name}" for name in hostile}
    assert m.snapctl("list").stdout.splitlines()[1].startswith("a\\\\b ")
    res = m.snapctl("restore", "a\\b", "x\n+ fake", "--to", "\x1b[2J", check=False)
    assert res.returncode == 1 and "\x1b" not in res.stdout + res.stderr
    m.snapctl("create", "b")
    res = m.snapctl("restore", "b", "x\n+ fake", "--to", "\x1b[2J")
    assert res.stdout == "restored ./x\\n+ fake from b to ./\\x1b[2J (1 inode)\n"
