"""`snapctl restore`: one file or tree brought back in place (--force over an existing path)
or under another name (--to), the whole tree rolled back (refused without --force when the
live tree changed since the snapshot), no chunk data copied, and the same offline.

Path restores share one mount (each test in its own directory, with its own snapshots);
rollbacks change the whole tree, so each has its own mount. Every store must pass fsck at
the end (the fixtures check).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest
from conftest import Mount, cli, drop_caches, fsck_clean
from diffapply import tree_state
from test_snapshots import store_used, take, wait_gc_idle

from mountfs import control

pytestmark = pytest.mark.fuse


@pytest.fixture(scope="module")
def fs(tmp_path_factory) -> Mount:
    """One mount for the path restores; its store must pass fsck at the end."""
    base = tmp_path_factory.mktemp("restorefs")
    cli("mountfs", "mkfs", base / "store")
    (base / "mnt").mkdir()
    m = Mount(base / "store", base / "mnt").mount()
    yield m
    m.cleanup()
    fsck_clean(m.store)


@pytest.fixture
def here(fs, request) -> Path:
    """This test's own directory on the shared mount."""
    d = fs.mnt / re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    d.mkdir()
    return d


def rel(m: Mount, p: Path) -> str:
    """``p`` relative to the filesystem root, as restore takes it."""
    return str(p.relative_to(m.mnt))


def restore(m: Mount, *args, check=True):
    return m.snapctl("restore", *args, check=check)


def refused(res, message: str) -> None:
    assert (res.returncode, res.stdout, res.stderr) == (1, "", f"snapctl: {message}\n")


def digest(p: Path) -> str:
    h = blake3.blake3()
    with open(p, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def build_tree(t: Path) -> int:
    """Nested directories, symlinks, hard links inside the tree, xattrs, modes, owners, a
    fifo, set times. Returns how many inodes it holds."""
    (t / "a/b/c").mkdir(parents=True)
    (t / "empty").mkdir()
    (t / "a/b/c/deep").write_bytes(os.urandom(1_500_000))        # two chunks
    (t / "a/file").write_text("file")
    os.link(t / "a/file", t / "a/b/file-link")
    os.link(t / "a/file", t / "file-link2")
    os.symlink("a/b/c/deep", t / "sym")
    os.symlink("/nowhere/at/all", t / "a/dangling")
    os.setxattr(t / "a/file", "user.f", b"on a file")
    os.setxattr(t / "a/b", "user.d", b"on a dir")
    os.chmod(t / "a/b", 0o711)
    os.chmod(t / "a/file", 0o604)
    os.chown(t / "a/b/c/deep", 4321, 8765)
    os.mkfifo(t / "a/fifo")
    os.utime(t / "a/b/c/deep", ns=(7, 1_000_000_000_000_000_007))
    os.utime(t / "a/b", ns=(8, 2_000_000_000))
    os.utime(t / "a", ns=(9, 3_000_000_000))
    return 10          # t, a, b, c, empty, deep, file (3 names), sym, dangling, fifo


def mess_up(t: Path) -> None:
    (t / "a/file").write_text("changed")
    os.removexattr(t / "a/file", "user.f")
    shutil.rmtree(t / "a/b")
    os.unlink(t / "sym")
    os.symlink("elsewhere", t / "sym")
    os.chmod(t / "empty", 0o700)
    (t / "empty/new").write_text("new")
    (t / "added").write_text("added")


# ---- one path ------------------------------------------------------------------------------

def test_restore_a_file_needs_force_over_an_existing_one(fs, here):
    f = here / "f"
    f.write_text("good")
    os.chmod(f, 0o640)
    os.setxattr(f, "user.v", b"1")
    os.utime(f, ns=(1, 1_234_567_890_123_456_789))
    take(fs, "file")
    snap_state = tree_state(fs.mnt / ".snapshot/file" / here.name)["f"]
    f.write_text("bad!")
    os.chmod(f, 0o600)
    os.setxattr(f, "user.v", b"2")
    os.setxattr(f, "user.extra", b"x")
    live_state = tree_state(here)
    path = rel(fs, f)
    refused(restore(fs, "file", path, check=False), f"{path!r} exists; pass --force to replace it")
    assert tree_state(here) == live_state                       # nothing changed
    with open(f, "rb") as old:                                   # held across the restore
        res = restore(fs, "file", path, "--force")
        assert res.stdout == f"restored ./{path} from file to ./{path} (1 inode); " \
                             f"replaced ./{path}\n"
        assert tree_state(here)["f"] == snap_state               # data, mode, xattrs, mtime
        assert old.read() == b"bad!"                             # the replaced inode, still open
    f.unlink()
    restore(fs, "file", str(f))                                  # deleted: no --force needed;
    assert tree_state(here)["f"] == snap_state                   # an absolute path works too


def test_restore_over_a_file_a_writer_holds_open(fs, here):
    """A path restore puts a new file in the name's place, as a rename over it would: the
    logger holding the old one keeps it (unlinked: its buffered and later writes go there,
    and away with it), and every open of the name once the restore has answered (the next
    ``>>`` too) finds the restored file, nothing of the old one."""
    f = here / "app.log"
    f.write_bytes(b"one\n")
    take(fs, "held")
    h = Holder([f], os.O_RDWR | os.O_APPEND)
    try:
        append(f, b"two\n")                                     # committed
        h.append(0, b"three\n")                                 # buffered in the mount
        restore(fs, "held", rel(fs, f), "--force")
        append(f, b"new-line\n")
        assert f.read_bytes() == b"one\nnew-line\n"
        assert h.read(0) == b"one\ntwo\nthree\n"
        h.append(0, b"four\n")
        assert (h.size(0), h.read(0)) == (19, b"one\ntwo\nthree\nfour\n")
    finally:
        h.stop()
    drop_caches()
    assert f.read_bytes() == b"one\nnew-line\n"


def test_restore_a_tree_in_place(fs, here):
    t = here / "t"
    t.mkdir()
    inodes = build_tree(t)
    take(fs, "tree")
    snap = fs.mnt / ".snapshot/tree" / here.name / "t"
    frozen = tree_state(snap)
    mess_up(t)
    assert not (t / "a/b").exists()         # a negative entry the kernel keeps: the restore
    res = restore(fs, "tree", rel(fs, t), "--force")            # must drop it
    assert res.stdout.endswith(f"({inodes} inodes); replaced ./{rel(fs, t)} (9 entries)\n")
    assert tree_state(t) == frozen                               # names, data, links, times...
    assert os.stat(t / "a/file").st_nlink == 3
    assert os.stat(t / "a/file").st_ino == os.stat(t / "file-link2").st_ino
    assert tree_state(snap) == frozen                            # the snapshot is untouched
    (t / "a/file").write_text("live again")                      # the copy is a live file
    assert (t / "file-link2").read_text() == "live again"
    assert (snap / "a/file").read_text() == "file"


def test_restore_to_another_path(fs, here):
    t = here / "t"
    t.mkdir()
    build_tree(t)
    os.link(t / "a/file", here / "outside")                      # a link from outside the tree
    take(fs, "to")
    snap = fs.mnt / ".snapshot/to" / here.name / "t"
    mess_up(t)
    live = tree_state(t)
    live_inos = {p: os.lstat(t / p).st_ino for p in live}
    dest = here / "t-back"
    assert not dest.exists()                # a negative entry the kernel keeps
    restore(fs, "to", rel(fs, t), "--to", rel(fs, dest))
    want = tree_state(snap)
    want["a/file"].pop("link_group")                             # 4 links there, 3 in the copy
    got = tree_state(dest)
    assert got.pop("a/file")["link_group"] == got["a/b/file-link"]["link_group"]
    want.pop("a/file")
    assert got == want
    assert os.stat(dest / "a/file").st_nlink == 3
    assert (here / "outside").read_text() == "changed"          # still the live inode
    assert tree_state(t) == live                                 # the original is untouched
    assert {p: os.lstat(t / p).st_ino for p in live} == live_inos
    # DEST exists: --force, or nothing happens
    (dest / "a/file").write_text("the copy changed")
    before = tree_state(dest)
    refused(restore(fs, "to", rel(fs, t), "--to", rel(fs, dest), check=False),
            f"{rel(fs, dest)!r} exists; pass --force to replace it")
    assert tree_state(dest) == before
    restore(fs, "to", rel(fs, t), "--to", rel(fs, dest), "--force")
    assert (dest / "a/file").read_text() == "file"


def test_restore_errors(fs, here):
    (here / "f").write_text("x")
    take(fs, "err")
    p = rel(fs, here / "f")
    refused(restore(fs, "err", rel(fs, here / "missing"), check=False),
            f"{rel(fs, here / 'missing')!r} does not exist in snapshot 'err'")
    refused(restore(fs, "err", p, "--to", rel(fs, here / "no/such/dir"), check=False),
            f"the parent directory of {rel(fs, here / 'no/such/dir')!r} does not exist")
    refused(restore(fs, "err", p, "--to", f"{p}/under-a-file", check=False),
            f"the parent of '{p}/under-a-file' is not a directory")
    refused(restore(fs, "err", p, "--to", ".", "--force", check=False),
            "cannot restore over the root by path; use 'snapctl restore NAME' to roll the "
            "whole tree back")
    refused(restore(fs, "err", "--to", "x", check=False), "--to needs a PATH to restore")
    for into in (".snapshot/", ".snapshot/err/x", "./.snapshot"):   # was "create it first"
        refused(restore(fs, "err", p, "--to", into, check=False),
                f"{into!r} is inside .snapshot, whose snapshots never change: restore into "
                f"the live tree (--to PATH outside .snapshot)")
    assert os.listdir(here) == ["f"]


def test_a_path_outside_the_filesystem_is_refused_not_taken_as_relative(fs, here, tmp_path):
    """'--to /tmp/x' and '/etc/passwd' had been taken as paths from the root (the parent
    'tmp/x' does not exist), '--to ../x' as './../x' clamped to the root: each names a place
    the user did not mean. Refused in one line; an absolute path under the mountpoint works."""
    (here / "f").write_text("x")
    take(fs, "out")
    p = rel(fs, here / "f")
    outside = str(tmp_path / "outside")
    refused(restore(fs, "out", p, "--to", outside, check=False),
            f"{outside!r} is outside the filesystem mounted at {fs.mnt}: give a path under "
            f"it, or one relative to its root")
    refused(restore(fs, "out", "/etc/passwd", check=False),
            f"'/etc/passwd' is outside the filesystem mounted at {fs.mnt}: give a path under "
            f"it, or one relative to its root")
    for escape in ("../escape", f"{p}/../../../escape"):
        refused(restore(fs, "out", p, "--to", escape, check=False),
                f"{escape!r} leads outside the filesystem's root; paths are relative to the root")
    assert not os.path.exists(outside) and os.listdir(here) == ["f"]
    res = restore(fs, "out", str(here / "f"), "--to", str(here / "g"))
    assert res.stdout == f"restored ./{p} from out to ./{rel(fs, here / 'g')} (1 inode)\n"
    assert (here / "g").read_text() == "x"


def test_a_file_goes_into_a_directory_never_over_it(fs, here):
    """The user's slip: 'restore SNAP log --to wholetree/ --force' replaced the directory by
    the file. A DEST ending in '/' is a directory to restore into (as cp); a file never
    replaces a directory, nor a directory a file, even with --force."""
    tree = here / "wholetree"
    tree.mkdir()
    for i in range(9):
        (tree / f"e{i}").write_text(str(i))
    (here / "log").write_text("1\n")
    take(fs, "into")
    log, whole = rel(fs, here / "log"), rel(fs, tree)
    before = tree_state(here)
    for dest in (whole, whole + "/."):
        refused(restore(fs, "into", log, "--to", dest, "--force", check=False),
                f"{dest!r} is a directory and {log!r} a file: to restore the file into it, "
                f"use --to {dest}/log")
    refused(restore(fs, "into", whole, "--to", log, "--force", check=False),
            f"{log!r} is a file and {whole!r} a directory: restore it elsewhere with --to, "
            f"or move {log!r} away first")
    refused(restore(fs, "into", log, "--to", rel(fs, here / "none") + "/", check=False),
            f"{rel(fs, here / 'none') + '/'!r} is not an existing directory; create it "
            f"first, or drop the '/' to restore under that name")
    assert tree_state(here) == before                            # nothing changed
    res = restore(fs, "into", log, "--to", whole + "/")
    assert res.stdout == f"restored ./{log} from into to ./{whole}/log (1 inode)\n"
    assert sorted(os.listdir(tree)) == [f"e{i}" for i in range(9)] + ["log"]
    assert (tree / "log").read_text() == "1\n"
    refused(restore(fs, "into", log, "--to", whole + "/", check=False),
            f"'{whole}/log' exists; pass --force to replace it")
    res = restore(fs, "into", log, "--to", str(tree) + "/", "--force")   # absolute, too
    assert res.stdout == f"restored ./{log} from into to ./{whole}/log (1 inode); " \
                         f"replaced ./{whole}/log\n"


def test_in_place_the_kinds_must_match_too(fs, here):
    (here / "f").write_text("file")
    (here / "d").mkdir()
    take(fs, "kinds")
    (here / "f").unlink()
    (here / "f").mkdir()
    shutil.rmtree(here / "d")
    (here / "d").write_text("now a file")
    f, d = rel(fs, here / "f"), rel(fs, here / "d")
    refused(restore(fs, "kinds", f, "--force", check=False),
            f"{f!r} is a directory and {f!r} a file: to restore the file into it, use "
            f"--to {f}/f")
    refused(restore(fs, "kinds", d, "--force", check=False),
            f"{d!r} is a file and {d!r} a directory: restore it elsewhere with --to, or "
            f"move {d!r} away first")
    assert (here / "f").is_dir() and (here / "d").read_text() == "now a file"


def test_restore_copies_no_chunk_data(fs, here):
    """A 50 MiB file comes back (--to, and over a rewritten original) with the store's own
    use (statfs: blocks - free) grown by metadata only; the copies keep their data after the
    snapshot is deleted and reclaimed (the chunks are shared by reference count)."""
    big = here / "big"
    big.write_bytes(os.urandom(50 << 20))
    want = digest(big)
    take(fs, "share")
    with open(big, "r+b") as f:                                  # one chunk rewritten
        f.write(b"new data")
        f.flush()
        os.fsync(f.fileno())        # committed before used0: the new 1 MiB chunk landing
    wait_gc_idle(fs)                # after it (within the 5 ms commit delay) read as growth
    used0 = store_used(fs)
    restore(fs, "share", rel(fs, big), "--to", rel(fs, here / "copy"))
    restore(fs, "share", rel(fs, big), "--force")
    assert store_used(fs) - used0 < 1 << 20                      # 2 x 50 MiB restored
    assert digest(here / "copy") == digest(big) == want
    fs.snapctl("delete", "share")
    wait_gc_idle(fs)
    assert digest(here / "copy") == digest(big) == want


# ---- the whole tree ------------------------------------------------------------------------

def test_rollback_refused_without_force_when_the_live_tree_changed(make_mount):
    """The rule (snapshots.rollback): the root's mepoch, i.e. anything committed since the
    snapshot, even if it was undone since; later snapshots alone do not count."""
    m = make_mount()
    (m.mnt / "f").write_text("one")
    m.snapctl("create", "s1")
    m.snapctl("create", "s2")                                    # nothing changed in between
    assert restore(m, "s1").stdout == "rolled back to s1 (0 inodes changed)\n"
    (m.mnt / "f").write_text("two")
    (m.mnt / "f").write_text("one")                              # undone, but it changed
    state = tree_state(m.mnt)
    refused(restore(m, "s1", check=False), "the live tree has changed since snapshot 's1'; "
            "pass --force to discard those changes (take a snapshot first to keep them)")
    assert tree_state(m.mnt) == state
    (m.mnt / "g").write_text("new")
    restore(m, "s1", "--force")
    assert tree_state(m.mnt) == tree_state(m.mnt / ".snapshot/s1")
    assert sorted(os.listdir(m.mnt)) == ["f"]


def test_rollback_with_force_and_what_follows(make_mount):
    m = make_mount()
    t = m.mnt / "t"
    t.mkdir()
    build_tree(t)
    (m.mnt / "top").write_text("top v1")
    kept_ino = os.stat(t / "a/file").st_ino
    m.snapctl("create", "s1")
    s1_state = tree_state(m.mnt / ".snapshot/s1")
    mess_up(t)
    (m.mnt / "top").write_text("top v2")
    os.rename(t / "a", m.mnt / "a-moved")
    assert not (t / "a").exists()           # a negative entry the kernel keeps
    m.snapctl("create", "s2")
    (m.mnt / "after-s2").write_text("lost by the rollback")
    s2_state = tree_state(m.mnt / ".snapshot/s2")
    diff_before = m.snapctl("diff", "s1", "s2").stdout
    assert (m.mnt / "top").read_text() == "top v2"               # in the kernel's page cache
    restore(m, "s1", "--force")
    assert tree_state(m.mnt) == s1_state                         # the whole tree, exactly
    assert (t / "a").is_dir()                                    # the negative entry dropped
    assert (m.mnt / "top").read_text() == "top v1"               # not a stale cached page
    assert os.stat(t / "a/file").st_ino == kept_ino              # identities are kept
    # later snapshots stay, unchanged, and still compare
    assert sorted(os.listdir(m.mnt / ".snapshot")) == ["s1", "s2"]
    assert tree_state(m.mnt / ".snapshot/s2") == s2_state
    assert m.snapctl("diff", "s1", "s2").stdout == diff_before
    # life goes on: write, snapshot, diff against the rolled-back state
    (m.mnt / "after").write_text("life goes on")
    (t / "a/file").write_text("edited")
    m.snapctl("create", "s3")
    report = m.snapctl("diff", "s1", "s3").stdout.splitlines()
    assert report[:2] == ["M .", "+ ./after"] and len(report) == 3
    assert report[2] in ("M ./t/a/file", "M ./t/a/b/file-link", "M ./t/file-link2")  # one name
    assert (m.mnt / ".snapshot/s3/t/a/b/file-link").read_text() == "edited"
    live = tree_state(m.mnt)
    m.umount()
    m.mount()
    assert tree_state(m.mnt) == live
    assert tree_state(m.mnt / ".snapshot/s1") == s1_state


HOLDER = r"""
import os, sys
fds = [os.open(path, int(sys.argv[1])) for path in sys.argv[2:]]
print("ready", flush=True)
for line in sys.stdin:
    op, i, *arg = line.split()
    fd = fds[int(i)]
    if op == "append":
        out = os.write(fd, bytes.fromhex(arg[0]))
    elif op == "truncate":
        out = os.ftruncate(fd, int(arg[0]))
    elif op == "fsync":
        out = os.fsync(fd)
    elif op == "read":
        out = os.pread(fd, 1 << 16, 0).hex()
    elif op == "size":
        out = os.fstat(fd).st_size
    elif op == "close":
        out = os.close(fd)
    print(out, flush=True)
"""


class Holder:
    """Another process holding files open (``flags``), a logger or a ``tail -f``: it does
    with them what it is told, and never forks (a child's copy of a descriptor, closed,
    would have the kernel send FLUSH, which commits buffered writes)."""

    def __init__(self, paths: list[Path], flags: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(flags), *map(str, paths)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "ready\n"

    def ask(self, *words) -> str:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, "the holder died"
        return answer.strip()

    def append(self, i: int, data: bytes) -> None:
        assert self.ask("append", i, data.hex()) == str(len(data))

    def read(self, i: int) -> bytes:
        return bytes.fromhex(self.ask("read", i))

    def size(self, i: int) -> int:
        return int(self.ask("size", i))

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def append(path: Path, data: bytes) -> None:
    """``printf DATA >> PATH``, from a process of its own."""
    subprocess.run([sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], "
                    "os.O_WRONLY | os.O_APPEND); os.write(fd, bytes.fromhex(sys.argv[2]))",
                    str(path), data.hex()], check=True)


@pytest.mark.parametrize("holder", ["reader", "appender", "buffered"])
def test_a_rollback_reaches_the_files_held_open(make_mount, holder):
    """The reviewer's case: a rollback while another process holds a log open (``tail -f``
    reading it, or the logger appending to it, its last writes committed or still buffered
    in the mount): every holder and everyone else must see the rolled-back size and data
    at once, and the next O_APPEND write go at its end. It used to go at the size before
    the rollback (the open file's size in the mount, and the size the kernel keeps for an
    open file until a stat asks for it again), leaving a hole of NULs for good; buffered
    writes from before the rollback must never be written back over it either.
    ``grown``: appended to since the snapshot, appended to again first thing after the
    rollback; ``looked``: the same, looked at first; ``shrunk``: cut shorter since."""
    m = make_mount()
    paths = [m.mnt / name for name in ("grown.log", "looked.log", "shrunk.log")]
    then = [b"one\n", b"one\n", b"0123456789\n"]
    for path, data in zip(paths, then):
        path.write_bytes(data)
    m.snapctl("create", "good")
    h = Holder(paths, os.O_RDONLY if holder == "reader" else os.O_RDWR | os.O_APPEND)
    try:
        for i, path in enumerate(paths):
            if holder == "reader":
                if i == 2:
                    path.write_bytes(b"x\n")
                else:
                    append(path, b"two-two-two-two\n")
                continue
            if i == 2:
                h.ask("truncate", i, 0)
            h.append(i, b"x\n" if i == 2 else b"two-two-two-two\n")
            if holder == "appender":
                h.ask("fsync", i)
        now = [b"one\ntwo-two-two-two\n"] * 2 + [b"x\n"]
        assert [h.read(i) for i in range(3)] == now
        assert [os.stat(path).st_size for path in paths] == [20, 20, 2]
        dirty = control.request(m.store, {"op": "status"})["dirty_bytes"]
        assert (dirty > 0) == (holder == "buffered")
        restore(m, "good", "--force")
        drop_caches()
        assert control.request(m.store, {"op": "status"})["dirty_bytes"] == 0

        def add(i: int, data: bytes) -> None:
            if holder == "reader":
                append(paths[i], data)
            else:
                h.append(i, data)
        add(0, b"new-line\n")                  # before anything looks at the file
        add(2, b"new-line\n")
        assert os.stat(paths[1]).st_size == 4
        assert (h.size(1), h.read(1), paths[1].read_bytes()) == (4, b"one\n", b"one\n")
        add(1, b"new-line\n")
        want = [data + b"new-line\n" for data in then]
        assert [path.read_bytes() for path in paths] == want
        assert [h.read(i) for i in range(3)] == want
        assert [h.size(i) for i in range(3)] == [len(data) for data in want]
    finally:
        h.stop()                                # its last close: nothing written back
    drop_caches()
    assert [path.read_bytes() for path in paths] == want
    m.snapctl("create", "after")
    assert [(m.mnt / ".snapshot/after" / path.name).read_bytes() for path in paths] == want
    m.umount()
    m.mount()
    assert [path.read_bytes() for path in paths] == want


LOGGER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
i = 0
while not os.path.exists(sys.argv[2]) or i < 1000:
    os.write(fd, b"line %07d\n" % i)
    i += 1
print(i)
"""


def test_a_rollback_under_a_logger_appending_without_pause(make_mount, tmp_path):
    """The writes of a logger that never stops are held across the rollback; those the
    kernel placed by the size from before it (while the mount has it take the new one)
    are dropped as made before it. The log is the snapshot's, then whole lines in order."""
    m = make_mount()
    log, stop = m.mnt / "app.log", tmp_path / "stop"
    log.write_bytes(b"one\n")
    m.snapctl("create", "good")
    logger = subprocess.Popen([sys.executable, "-c", LOGGER, str(log), str(stop)],
                              stdout=subprocess.PIPE)
    try:
        while os.stat(log).st_size < 100_000:
            assert logger.poll() is None
            time.sleep(0.01)
        restore(m, "good", "--force")
        rolled_back = os.stat(log).st_size
        deadline = time.monotonic() + 60       # it goes on appending (stopped too soon, the
        while os.stat(log).st_size <= rolled_back and time.monotonic() < deadline:
            time.sleep(0.01)                   # logger may not have written once more)
    finally:
        stop.touch()
        out, _ = logger.communicate(timeout=60)
        assert logger.returncode == 0
    data = log.read_bytes()
    assert data.startswith(b"one\n") and len(data) > rolled_back
    assert data.endswith(b"line %07d\n" % (int(out) - 1))     # its last write was kept
    assert re.fullmatch(rb"(line \d{7}\n)*", data[4:]), data[:64]
    numbers = [int(n) for n in re.findall(rb"\d{7}", data)]
    assert numbers == sorted(numbers) and numbers[-1] >= 999
    m.umount()
    m.mount()
    assert log.read_bytes() == data


def test_restore_offline(make_mount):
    """snapctl --store on the unmounted store: a file, a tree --to, a rollback (refused, then
    forced); a snapshot taken offline in between keeps the path restores."""
    m = make_mount()
    (m.mnt / "f").write_text("one")
    (m.mnt / "d").mkdir()
    (m.mnt / "d/x").write_text("x")
    m.snapctl("create", "s1")
    (m.mnt / "f").write_text("two")
    m.umount()

    def offline(*args, check=True):
        return cli("snapctl", "--store", m.store, *args, check=check)
    refused(offline("restore", "s1", "f", check=False), "'f' exists; pass --force to replace it")
    assert offline("restore", "s1", "f", "--force").stdout == \
        "restored ./f from s1 to ./f (1 inode); replaced ./f\n"
    offline("restore", "s1", "d", "--to", "d2")
    offline("create", "s2")
    refused(offline("restore", "s1", check=False), "the live tree has changed since snapshot "
            "'s1'; pass --force to discard those changes (take a snapshot first to keep them)")
    assert offline("restore", "s1", "--force").stdout.startswith("rolled back to s1 (")
    m.mount()
    assert tree_state(m.mnt) == tree_state(m.mnt / ".snapshot/s1")
    s2 = m.mnt / ".snapshot/s2"
    assert sorted(os.listdir(s2)) == ["d", "d2", "f"]
    assert (s2 / "f").read_text() == "one" and (s2 / "d2/x").read_text() == "x"
