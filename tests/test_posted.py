"""Changes answered before they run (Engine.post): creates, attribute changes, a closed
file's chunks, unlinks and the deletion of forgotten inodes. Their answers are computed on
the trio thread from what it knows; the committer's step then writes them, and the mount
logs an error if that differs from the answer. Commits are held for an hour here, so stats
are answered from those records until the remount, after which the store answers: the
same to the nanosecond."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import tarfile

from conftest import drop_caches
from test_writer import writer_pid


def _source_tree(root):
    """Files of several sizes (empty, partial chunk, several chunks), modes, old mtimes,
    a setgid directory, symlinks and a hard link: what tar restores with attribute calls."""
    root.mkdir()
    for d in range(4):
        sub = root / f"d{d}"
        sub.mkdir()
        for i in range(25):
            f = sub / f"f{i}"
            f.write_bytes(os.urandom((i * 3001) % 20000))
            os.chmod(f, 0o600 + (i % 3) * 0o44)
            os.utime(f, ns=(1_500_000_000_000_000_000 + i, 1_600_000_000_123_456_789 + i))
        os.symlink(f"f{d}", sub / "link")
    os.chmod(root / "d1", 0o2775)
    os.link(root / "d0" / "f3", root / "d0" / "hard")
    os.utime(root / "d2", ns=(1_400_000_000_000_000_000, 1_400_000_000_000_000_000))


def _stats(root) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (
                st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid,
                st.st_size if not stat.S_ISDIR(st.st_mode) else None,
                st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)
    return out


def test_posted_answers_are_what_the_steps_wrote(make_mount, tmp_path, monkeypatch):
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", "3600")
    src = tmp_path / "src"
    _source_tree(src)
    tarball = tmp_path / "src.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(src, arcname="t")
    plain = tmp_path / "plain"
    plain.mkdir()
    subprocess.run(["tar", "-xf", tarball, "-C", plain], check=True)

    m = make_mount(chunk_size="4K")
    subprocess.run(["tar", "-xf", tarball, "-C", m.mnt], check=True)
    t = m.mnt / "t"
    for i in range(0, 25, 2):                       # posted unlinks, then forgets
        os.unlink(t / "d3" / f"f{i}")
        os.unlink(plain / "t" / "d3" / f"f{i}")
    for p in (t / "d2" / "f1", plain / "t" / "d2" / "f1"):
        os.chmod(p, 0o4711)
        os.utime(p, ns=(7, 8))
    for new in (t / "new", plain / "t" / "new"):    # creates no attribute call follows
        new.mkdir()
        for i in range(20):
            (new / f"n{i}").write_bytes(b"n" * i * 500)
            os.symlink(f"n{i}", new / f"s{i}")
        os.mkfifo(new / "fifo")

    def as_plain(stats):            # what a plain directory must agree on: not the times
        return {k: v[1:6] + (v[7] if k.startswith("t/d") and k != "t/d3" else None,)
                for k, v in stats.items()}      # of the unlinks and of t/new
    answered = _stats(m.mnt)
    assert as_plain(answered) == as_plain(_stats(plain))
    answers_hold(m, _stats, answered)


def answers_hold(m, state, answered) -> None:
    """``state(m.mnt)`` stays ``answered`` once the kernel forgets the answers (GETATTR,
    LOOKUP), and after a remount, when the store answers; no posted step wrote other records
    than its caller answered with."""
    drop_caches()
    assert state(m.mnt) == answered
    m.umount()
    assert "differ from what it wrote" not in m.log()
    m.mount()
    assert state(m.mnt) == answered


def test_inode_numbers_stay_unique_across_remounts(make_mount):
    """Posted creates take their numbers from blocks reserved in the store: a remount
    starts a new block and never hands out a number again."""
    m = make_mount()
    inos = set()
    for round_ in range(3):
        for i in range(50):
            p = m.mnt / f"r{round_}-{i}"
            p.write_bytes(b"x")
            inos.add(p.stat().st_ino)
        (m.mnt / f"dir{round_}").mkdir()
        inos.add((m.mnt / f"dir{round_}").stat().st_ino)
        m.umount()
        m.mount()
    assert len(inos) == 3 * 51
    assert {p.stat().st_ino for p in m.mnt.iterdir()} == inos


_RMDIR = """import os, sys
try:
    os.rmdir(sys.argv[1])
except OSError as e:
    sys.exit(e.errno)
"""


def _rmdir_while_stopped(writer: int, paths, seconds: float) -> list:
    """rmdir each of ``paths`` in another process while the writer process is stopped:
    the errno of each (0: removed; None: no answer within ``seconds``)."""
    codes, waiting = [], []
    os.kill(writer, signal.SIGSTOP)
    try:
        for path in paths:
            proc = subprocess.Popen([sys.executable, "-c", _RMDIR, path])
            try:
                codes.append(proc.wait(timeout=seconds))
            except subprocess.TimeoutExpired:
                codes.append(None)
                waiting.append(proc)
    finally:
        os.kill(writer, signal.SIGCONT)
        for proc in waiting:
            proc.wait(timeout=60)
    return codes


def _rmdir_errno(path) -> int:
    try:
        os.rmdir(path)
    except OSError as e:
        return e.errno
    return 0


def test_rmdir_of_a_directory_known_empty_is_answered_before_it_runs(make_mount, monkeypatch):
    """A checkout removes a directory right after its last file. The rmdir of a directory
    known to be empty (its committed entries unlinked by changes not yet committed, none
    added) is answered before its step runs, and so is ENOTEMPTY for one known to have an
    entry (git tries an rmdir after each file it removes): even while the writer process
    is stopped. Otherwise the step decides, and answers what a plain directory would."""
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", "3600")      # only fsync commits
    m = make_mount()
    r = m.mnt
    for d in ("a", "b", "c", "d", "held"):
        (r / d).mkdir()
        (r / d / "old").write_bytes(b"o")
    (r / "c" / "sub").mkdir()
    (r / "file").write_bytes(b"f")
    fd = os.open(r / "a" / "old", os.O_RDONLY)
    os.fsync(fd)                                # the entries above are committed
    os.close(fd)
    (r / "a" / "new").write_bytes(b"n")         # created and removed, both uncommitted
    for gone in ("a/old", "a/new", "b/old", "held/old"):
        os.unlink(r / gone)
    (r / "b" / "later").write_bytes(b"l")       # b: an entry the store has not seen yet
    held = os.open(r / "held", os.O_RDONLY | os.O_DIRECTORY)
    answered = _rmdir_while_stopped(writer_pid(m.pid), [r / d for d in ("a", "held", "b", "d")],
                                    20)
    assert answered == [0, 0, errno.ENOTEMPTY, errno.ENOTEMPTY]
    assert os.listdir(held) == [] and stat.S_ISDIR(os.fstat(held).st_mode)
    os.close(held)
    assert [_rmdir_errno(r / d) for d in ("b", "c", "file", "none")] == [
        errno.ENOTEMPTY, errno.ENOTEMPTY, errno.ENOTDIR, errno.ENOENT]
    os.unlink(r / "b" / "later")
    os.rmdir(r / "c" / "sub")
    os.unlink(r / "c" / "old")
    os.unlink(r / "d" / "old")
    assert [_rmdir_errno(r / d) for d in ("b", "c", "d")] == [0, 0, 0]
    assert sorted(os.listdir(r)) == ["file"] and os.lstat(r).st_nlink == 2
    answers_hold(m, lambda root: {**_stats(root), ".": _root_stat(root)},
                 {**_stats(r), ".": _root_stat(r)})


def _root_stat(root) -> tuple:
    """The mount's root as stat(2) gives it, but its device: a remount may be given another
    (one the kernel numbers anew while any other FUSE mount comes or goes)."""
    st = os.lstat(root)
    return (st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_size,
            st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)
