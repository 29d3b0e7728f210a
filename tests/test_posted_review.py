"""Review of posted steps (Engine.post): what a process can observe when the trio thread
answers faster than the committer applies."""

from __future__ import annotations

import os
import random
import stat
import time

from conftest import drop_caches
from test_posted import answers_hold


def test_kill9_takes_back_only_the_last_moments(mounted):
    """README: kill -9 "can take back only the last few milliseconds of other calls (about
    5 ms, more while a commit waits for the disk), and always a suffix of them". Posted
    creates are answered before their step runs: if nothing bounds the steps queued for the
    committer, calls answered long before the kill are lost."""
    d = mounted.mnt / "d"
    d.mkdir()
    os.sync()
    answered = []
    for i in _for_seconds(4.0):
        os.symlink("x", d / f"s{i}")
        answered.append(time.monotonic())
    killed = time.monotonic()
    mounted.kill9()
    mounted.mount()
    present = set(os.listdir(d))
    _lost_only_the_last_moments([f"s{k}" not in present for k in range(len(answered))],
                                answered, killed, "answered creates")


def test_kill9_takes_back_only_the_last_rmdirs(mounted):
    """The same for rmdir, answered before its step runs when the directory is known to be
    empty: after kill -9 the tree is what some prefix of the answered calls made, and what
    is lost was answered just before the kill."""
    d = mounted.mnt / "d"
    d.mkdir()
    os.sync()
    calls = []                      # ("mkdir" | "rmdir", name), in the order answered
    answered = []
    for i in _for_seconds(4.0):
        os.mkdir(d / f"s{i}")
        calls.append(("mkdir", f"s{i}"))
        answered.append(time.monotonic())
        if i:
            os.rmdir(d / f"s{i - 1}")
            calls.append(("rmdir", f"s{i - 1}"))
            answered.append(time.monotonic())
    killed = time.monotonic()
    mounted.kill9()
    mounted.mount()
    present = set(os.listdir(d))
    made, prefix = set(), None
    for n in range(len(calls) + 1):
        if made == present:
            prefix = n
            break
        if n < len(calls):
            verb, name = calls[n]
            made.add(name) if verb == "mkdir" else made.discard(name)
    assert prefix is not None, f"{sorted(present)[:5]}: no prefix of the calls made this"
    _lost_only_the_last_moments([n >= prefix for n in range(len(calls))], answered, killed,
                                "answered mkdirs and rmdirs")


def _content(i: int) -> bytes:
    """File i's data: more than a chunk (its first chunk commits as it fills, the rest at
    close), the rest more than the mount hashes on the trio thread."""
    return random.Random(i).randbytes((2 << 20) - 4096)


def test_kill9_keeps_the_data_of_a_file_closed_before_its_rename(make_mount, monkeypatch):
    """A file written, closed, then renamed into place: after kill -9 the renamed file holds
    all of its data (not the empty file a crash left on ext4 in 2009), and what survived is
    a prefix of the calls. close(2) waits for the data to be posted (FLUSH): with close
    answered first and the data committed at RELEASE, a renamed file lost its data in 4 of
    7 runs of this test.
    Commits follow each change at once here, so a rename committed before the data would
    show; the kill comes right after a rename."""
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", "0")
    m = make_mount()
    for cycle in range(6):
        d = m.mnt / f"d{cycle}"
        d.mkdir()
        os.sync()
        answered = []                   # when each rename was answered
        for i in _for_seconds(0.5):
            with open(d / f"tmp{i}", "wb") as h:
                h.write(_content(i))
            os.rename(d / f"tmp{i}", d / f"f{i}")
            answered.append(time.monotonic())
        killed = time.monotonic()
        m.kill9()
        m.mount()
        renamed = [(d / f"f{i}").exists() for i in range(len(answered))]
        for i, there in enumerate(renamed):
            if there:
                assert (d / f"f{i}").read_bytes() == _content(i), \
                    f"cycle {cycle}: f{i} lost data written before its rename"
        _lost_only_the_last_moments([not there for there in renamed], answered, killed,
                                    "answered renames")


def _for_seconds(seconds: float):
    """0, 1, 2, ... for ``seconds``."""
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        yield i
        i += 1


def _lost_only_the_last_moments(lost: list[bool], answered: list[float], killed: float,
                                what: str) -> None:
    """``lost[k]``: whether call k (answered at ``answered[k]``) is gone after the kill:
    the lost ones must be a suffix, and the first of them answered just before it."""
    missing = [k for k, gone in enumerate(lost) if gone]
    assert missing == list(range(len(lost) - len(missing), len(lost))), "not a suffix"
    if missing:
        lost_for = killed - answered[missing[0]]
        assert lost_for < 0.5, (f"{len(missing)} of {len(lost)} {what} lost, the first "
                                f"answered {lost_for:.2f} s before the kill")


def _change_attributes(files, seconds: float) -> list[float]:
    """For ``seconds``: change i sets the mtime (call 2i) and then the mode (call 2i + 1)
    of ``files[i % len]``, two calls in a row on one file, which join in one step, each
    to a value of i; when each call was answered."""
    answered = []
    for i in _for_seconds(seconds):
        f = files[i % len(files)]
        os.utime(f, ns=(0, 1_000_000_000 + i))
        answered.append(time.monotonic())
        os.chmod(f, 0o400 | i % 0o100)
        answered.append(time.monotonic())
    return answered


def _calls_kept(files, calls: int) -> list[bool]:
    """Whether each of ``calls`` (``_change_attributes``) is in the files: its file shows
    it or a later change. The mtime tells a file's last change i kept; its mode tells
    whether that change's chmod was kept too."""
    last, mode_kept = {}, {}
    for f in files:
        st = os.stat(f)
        last[f] = i = st.st_mtime_ns - 1_000_000_000
        mode_kept[f] = stat.S_IMODE(st.st_mode) == 0o400 | i % 0o100
    kept = []
    for call in range(calls):
        i, f = call // 2, files[call // 2 % len(files)]
        kept.append(last[f] > i or last[f] == i and (call % 2 == 0 or mode_kept[f]))
    return kept


def test_kill9_takes_back_only_the_last_attribute_changes(mounted):
    """Attribute calls in a row on one file join in one step that waits in the mount
    until the next change goes (Engine.post's merge): kill -9 may take back only the last
    moments of them, a suffix, like any other change."""
    d = mounted.mnt / "d"
    d.mkdir()
    files = [d / f"f{i}" for i in range(8)]
    for f in files:
        f.write_bytes(b"x")
    os.sync()
    answered = _change_attributes(files, 3.0)
    killed = time.monotonic()
    mounted.kill9()
    mounted.mount()
    kept = _calls_kept(files, len(answered))
    _lost_only_the_last_moments([not k for k in kept], answered, killed,
                                "attribute calls")


def test_a_waiting_attribute_change_goes_by_itself_and_with_an_fsync(mounted):
    """The last attribute change, joined or not, is sent within moments with nobody
    calling again, and at once by an fsync: after a quiet half second, or right after an
    fsync, kill -9 takes back nothing."""
    d = mounted.mnt / "d"
    d.mkdir()
    files = [d / f"f{i}" for i in range(8)]
    for f in files:
        f.write_bytes(b"x")
    answered = _change_attributes(files, 1.0)
    time.sleep(0.5)
    mounted.kill9()
    mounted.mount()
    assert all(_calls_kept(files, len(answered))), "a change answered 0.5 s before " \
        "kill -9 was lost"
    os.utime(files[0], ns=(0, 5))
    os.chmod(files[0], 0o640)
    fd = os.open(files[0], os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    mounted.kill9()
    mounted.mount()
    st = os.stat(files[0])
    assert (st.st_mtime_ns, stat.S_IMODE(st.st_mode)) == (5, 0o640), \
        "attribute changes fsync'ed before kill -9 were lost"


def test_fsyncdir_after_a_burst_waits_for_little(mounted):
    """The backlog of posted steps shows as the time an fsync right after a burst takes:
    it must wait for every answered change to be applied."""
    d = mounted.mnt / "d"
    d.mkdir()
    end = time.monotonic() + 4.0
    i = 0
    while time.monotonic() < end:
        os.symlink("x", d / f"s{i}")
        i += 1
    fd = os.open(d, os.O_RDONLY)
    try:
        t0 = time.monotonic()
        os.fsync(fd)
        took = time.monotonic() - t0
    finally:
        os.close(fd)
    assert took < 0.5, f"fsync after {i} creates took {took:.2f} s"


def _stats(root) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (
                st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid,
                st.st_size if not stat.S_ISDIR(st.st_mode) else None,
                st.st_mtime_ns, st.st_ctime_ns)
    return out


def test_mixed_posted_and_awaited_changes_agree_with_the_store(make_mount, monkeypatch):
    """Posted creates, unlinks and attribute changes mixed with awaited renames, links,
    truncations, xattrs and writes: what stat answers before the commit, after the kernel
    forgot, and after a remount must agree, and no step may write other records than its
    answer."""
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", "3600")
    m = make_mount(chunk_size="4K")
    r = m.mnt
    (r / "a").mkdir()
    os.chmod(r / "a", 0o2775)
    (r / "a" / "sub").mkdir()                       # setgid inherited
    (r / "a" / "f").write_bytes(b"x" * 5000)
    os.rename(r / "a" / "f", r / "a" / "g")         # awaited rename after a posted create
    os.chmod(r / "a" / "g", 0o640)                  # posted setattr after the rename
    os.link(r / "a" / "g", r / "a" / "h")           # awaited link
    os.unlink(r / "a" / "g")                        # two names: awaited
    os.chmod(r / "a" / "h", 0o600)
    os.unlink(r / "a" / "h")                        # one name left: posted
    (r / "b").write_bytes(b"y" * 9000)
    os.truncate(r / "b", 100)                       # awaited truncate
    os.utime(r / "b", ns=(5, 6))                    # posted after it
    os.setxattr(r / "b", "user.k", b"v")            # awaited xattr
    os.chmod(r / "b", 0o604)
    fd = os.open(r / "c", os.O_CREAT | os.O_RDWR, 0o644)
    os.write(fd, b"z" * 7000)
    os.unlink(r / "c")                              # open, unlinked: posted
    os.fchmod(fd, 0o600)
    assert os.fstat(fd).st_nlink == 0
    os.write(fd, b"w" * 100)
    os.close(fd)
    os.mkdir(r / "d")
    os.symlink("b", r / "d" / "s")
    os.rename(r / "d", r / "a" / "sub" / "d")      # a directory of posted creates moved
    os.mknod(r / "a" / "sub" / "d" / "fifo", 0o600 | stat.S_IFIFO)
    os.rename(r / "a" / "sub" / "d" / "fifo", r / "fifo2")
    os.unlink(r / "fifo2")
    answered = _stats(r)
    drop_caches()
    assert _stats(r) == answered
    m.umount()
    assert "differ from what it wrote" not in m.log()
    m.mount()
    assert _stats(r) == answered


def test_kill9_after_closes_takes_back_only_the_last_moments(mounted):
    """README: a closed file's data is committed in the order of the calls a few
    milliseconds after close returns; posted chunk steps queued without bound would let
    kill -9 take back files closed seconds before (and hold their data in memory)."""
    d = mounted.mnt / "d"
    d.mkdir()
    os.sync()
    base = os.urandom(1 << 20)
    answered = []
    end = time.monotonic() + 4.0
    i = 0
    while time.monotonic() < end:
        with open(d / f"f{i}", "wb") as f:
            for c in range(2):
                f.write(i.to_bytes(8, "little") + c.to_bytes(8, "little") + base[16:])
        answered.append(time.monotonic())
        i += 1
    killed = time.monotonic()
    mounted.kill9()
    mounted.mount()
    whole = {p.name for p in d.iterdir() if p.stat().st_size == 2 << 20}
    _lost_only_the_last_moments([f"f{k}" not in whole for k in range(i)], answered,
                                killed, "closed files")


def test_rollback_after_posted_changes(make_mount, monkeypatch):
    """Posted creates, unlinks and attribute changes, then a forced rollback while nothing
    was committed yet: the tree is the snapshot's, and posted changes after it are kept."""
    from diffapply import tree_state
    from test_restore import build_tree, mess_up
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", "3600")
    m = make_mount()
    t = m.mnt / "t"
    t.mkdir()
    build_tree(t)
    m.snapctl("create", "s1")
    s1 = tree_state(m.mnt / ".snapshot/s1")
    mess_up(t)
    os.chmod(t / "a/file", 0o600)
    (t / "p").mkdir()
    for i in range(30):
        (t / "p" / f"x{i}").write_bytes(b"x" * i)
    for i in range(0, 30, 3):
        os.unlink(t / "p" / f"x{i}")
    m.snapctl("restore", "s1", "--force")
    assert tree_state(m.mnt) == s1
    (t / "after").write_text("after")
    os.chmod(t / "a/file", 0o640)
    os.unlink(t / "a/file")
    os.mkdir(t / "p")
    (t / "p" / "y").write_text("y")
    answers_hold(m, tree_state, tree_state(m.mnt))


def test_a_time_the_store_cannot_hold_is_clamped_and_leaves_nothing_pending(mounted):
    """A time past what a record holds (2262, in signed 64-bit nanoseconds) made the record
    unpackable: the call failed, and it must not leave a change counted as pending for
    ever (the mount would then report the tree changed after every snapshot, and send
    every read of the inode through the committer), nor fail the mount. It is now
    clamped to the latest time a record holds, as ext4 and XFS clamp to their range."""
    from mountfs import control
    f = mounted.mnt / "f"
    f.write_bytes(b"x")
    far = 300 * 365 * 86400 * 10**9             # year 2270: beyond a signed 64-bit ns
    os.utime(f, ns=(far, far))
    assert os.stat(f).st_mtime_ns == (1 << 63) - 1
    drop_caches()
    assert os.stat(f).st_mtime_ns == (1 << 63) - 1, "answered otherwise than stored"
    mounted.snapctl("create", "s1")
    status = control.request(mounted.store, {"op": "status"})
    assert status["changed"] is False, status
    os.utime(f, ns=(5, 6))
    assert os.stat(f).st_mtime_ns == 6


def _concurrent(make_mount, monkeypatch, shared_writes: bool):
    """Threads creating, renaming, linking, chmodding, writing and unlinking in shared
    directories, and making, filling, emptying and removing directories in them (rmdir is
    answered on the trio thread when it knows the directory's entries). ``shared_writes``:
    shared files are rewritten in place, O_TRUNC racing other writers; else a file is
    written under the thread's own name, then renamed."""
    import random
    import threading
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", "3600")
    m = make_mount(chunk_size="4K")
    dirs = [m.mnt / f"d{k}" for k in range(3)]
    for d in dirs:
        d.mkdir()

    def worker(seed):
        rnd = random.Random(seed)
        for _ in range(1500):
            d = rnd.choice(dirs)
            p = d / f"n{rnd.randrange(20)}"
            q = rnd.choice(dirs) / f"n{rnd.randrange(20)}"
            op = rnd.randrange(10)
            try:
                if op == 0 and shared_writes:
                    p.write_bytes(b"z" * rnd.randrange(10000))
                elif op == 0:
                    own = d / f"w{seed}"
                    own.write_bytes(b"z" * rnd.randrange(10000))
                    os.rename(own, p)
                elif op == 1:
                    os.symlink("t", p)
                elif op == 2:
                    os.unlink(p)
                elif op == 3:
                    os.rename(p, q)
                elif op == 4:
                    os.link(p, q)
                elif op == 5:
                    os.chmod(p, 0o600 + rnd.randrange(0o100))
                elif op == 6:
                    os.utime(p, ns=(rnd.randrange(10**18), rnd.randrange(10**18)),
                             follow_symlinks=False)
                elif op == 7:
                    os.mkdir(p)
                elif op == 8:
                    os.rmdir(p)
                elif rnd.randrange(2):
                    os.symlink("t", p / "c")
                else:
                    os.unlink(p / "c")
            except (FileExistsError, FileNotFoundError, IsADirectoryError,
                    NotADirectoryError, PermissionError, OSError) as e:
                if e.errno == 5:
                    errors.append(f"EIO from op {op}")

    def run(seed):
        try:
            worker(seed)
        except BaseException as e:
            errors.append(repr(e))
    errors = []
    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    answered = _stats(m.mnt)
    drop_caches()
    assert _stats(m.mnt) == answered
    m.umount()
    log = m.log()
    assert "differ from what it wrote" not in log
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]
    m.mount()
    assert _stats(m.mnt) == answered


def test_concurrent_posted_and_awaited_changes(make_mount, monkeypatch):
    """No posted step may fail (ENOENT from a SETATTR racing a posted unlink put the mount
    in failed mode: every later change EIO) or write other records than were answered,
    and what stat answers survives the kernel forgetting and a remount (and fsck)."""
    _concurrent(make_mount, monkeypatch, shared_writes=False)


def test_concurrent_truncating_writers(make_mount, monkeypatch):
    """The same with files rewritten in place by several threads: a commit of a file's
    chunks posted between a truncation's step and the open file's size following it
    answered a size its step did not write; and a write racing a truncation (O_TRUNC)
    left a chunk beyond the file's size (fsck, run after every test, said so)."""
    _concurrent(make_mount, monkeypatch, shared_writes=True)
