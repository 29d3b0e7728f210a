"""Bad input gets one clear line on stderr and a non-zero status, and nothing is lost or left
behind: stores that are missing, foreign, busy or of another format, mountpoints that are
missing or not ours, unknown options, a full disk, a corrupt chunk, fsck's findings.
(kill -9 of the mount is in test_crash.py.)"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import blake3
import lmdb
import pytest
from conftest import cli, fill_disk, free_port, fsck_clean, gone, tmpfs_disk

from mountfs import schema as S


def fails_clearly(*args, code=1, contains="", cwd=None) -> str:
    """Run a command that must fail: status ``code``, exactly one line on stderr (no
    traceback, no usage text) containing ``contains``. Returns that line."""
    tool, *rest = args
    module = {"mountfs": "cmdline.mountfs", "snapctl": "cmdline.snapctl"}[tool]
    res = subprocess.run([sys.executable, "-m", module, *map(str, rest)], capture_output=True,
                         text=True, cwd=cwd, timeout=120, check=False)
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert contains in res.stderr, res.stderr
    return res.stderr.strip()


def lmdb_env(store: Path) -> lmdb.Environment:
    """The store's LMDB environment opened directly, as a test that tampers with it must."""
    return lmdb.open(str(store), max_dbs=len(S.DB_NAMES) + 2, map_size=1 << 30)


def listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# ---- mkfs -------------------------------------------------------------------------------------

def test_mkfs_refuses_what_is_not_empty_or_not_a_size(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy/file").write_text("someone's data")
    fails_clearly("mountfs", "mkfs", tmp_path / "busy", contains="is not empty")
    assert listing(tmp_path / "busy") == ["file"]
    assert (tmp_path / "busy/file").read_text() == "someone's data"
    cli("mountfs", "mkfs", tmp_path / "s")
    before = listing(tmp_path / "s")
    fails_clearly("mountfs", "mkfs", tmp_path / "s", contains="is not empty")   # mkfs twice
    assert listing(tmp_path / "s") == before
    fsck_clean(tmp_path / "s")                           # the first store is untouched
    fails_clearly("mountfs", "mkfs", "--chunk-size", "3000", tmp_path / "odd",
                  contains="power of two")
    fails_clearly("mountfs", "mkfs", "--chunk-size", "lots", tmp_path / "odd", code=2,
                  contains="expected a size like 16M, 256K, 1G or a number of bytes (got 'lots')")
    assert not (tmp_path / "odd").exists()


# ---- mount and umount -------------------------------------------------------------------------

def test_mount_refuses_missing_and_foreign_stores(store, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fails_clearly("mountfs", "mount", tmp_path / "nowhere", mnt, contains="no such store")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign/x").write_text("x")
    fails_clearly("mountfs", "mount", tmp_path / "foreign", mnt, contains="not a mountfs store")
    assert listing(tmp_path / "foreign") == ["x"]         # nothing written into it
    assert not os.path.ismount(mnt)


def test_a_refused_empty_directory_can_still_become_a_store(tmp_path):
    """'not a mountfs store ... create one with mountfs mkfs' must be advice that works."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "mnt").mkdir()
    err = fails_clearly("mountfs", "mount", tmp_path / "empty", tmp_path / "mnt",
                        contains="mountfs mkfs")
    assert listing(tmp_path / "empty") == [], err
    cli("mountfs", "mkfs", tmp_path / "empty")


def test_mount_refuses_missing_mountpoints(store, tmp_path):
    fails_clearly("mountfs", "mount", store, tmp_path / "no-mnt", contains="does not exist")
    (tmp_path / "file").write_text("not a directory")
    fails_clearly("mountfs", "mount", store, tmp_path / "file", contains="is not a directory")
    fsck_clean(store)                                    # and the store is not held
    assert not (tmp_path / "no-mnt").exists()


def test_umount_of_a_store_names_where_it_is_mounted(make_mount):
    """`mountfs umount STORE` (not its mountpoint), as mount and fsck name the mountpoint."""
    m = make_mount()
    fails_clearly("mountfs", "umount", m.store,
                  contains=f"{m.store} is not a mountfs mount but a store, mounted at {m.mnt}: "
                           f"run 'mountfs umount {m.mnt}'")


def test_umount_refuses_what_is_not_a_mountfs_mount(tmp_path):
    (tmp_path / "plain").mkdir()
    fails_clearly("mountfs", "umount", tmp_path / "plain", contains="is not a mountfs mount")
    fails_clearly("mountfs", "umount", tmp_path / "missing", contains="is not a mountfs mount")
    with tmpfs_disk(tmp_path / "tmpfs", "1m") as other:
        fails_clearly("mountfs", "umount", other, contains="is not a mountfs mount")
        assert os.path.ismount(other)                    # someone else's mount stays


def test_a_store_is_mounted_once(make_mount, tmp_path):
    m = make_mount()
    (m.mnt / "before").write_text("written")
    other = tmp_path / "other"
    other.mkdir()
    fails_clearly("mountfs", "mount", m.store, other, contains="is in use")
    assert not os.path.ismount(other)
    fails_clearly("mountfs", "mount", m.store, m.mnt, contains="already a mountpoint")
    fails_clearly("mountfs", "fsck", m.store, code=2, contains="is in use")
    (m.mnt / "still").write_text("works")                # the first mount keeps working
    assert (m.mnt / "still").read_text() == "works"
    assert (m.mnt / "before").read_text() == "written"
    m.snapctl("create", "after-refusals")
    assert (m.mnt / ".snapshot/after-refusals/still").read_text() == "works"


def fuse_mounts_under(path: Path) -> list[str]:
    """/proc/self/mountinfo's lines of FUSE mounts at or under ``path`` (whose spaces and
    backslashes the kernel writes as octal escapes)."""
    escaped = str(path).replace("\\", "\\134").replace(" ", "\\040")
    with open("/proc/self/mountinfo", errors="surrogateescape") as mountinfo:
        return [line for line in mountinfo if line.split(" - ")[1].startswith("fuse")
                and line.split()[4].startswith(escaped)]


def test_a_mountpoint_that_is_or_holds_its_store_is_refused(tmp_path):
    """Mounted there, the store would be hidden from its own writer, which opens it by its
    path: the mount hung for good, and 'mountfs umount' then printed a traceback."""
    cli("mountfs", "mkfs", tmp_path / "data/store")
    fails_clearly("mountfs", "mount", tmp_path / "data/store", tmp_path / "data",
                  contains=f"{tmp_path}/data contains the store {tmp_path}/data/store")
    fails_clearly("mountfs", "mount", tmp_path / "data/store", tmp_path / "data/store",
                  contains="is the store's own directory")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    fails_clearly("mountfs", "mount", tmp_path / "data/store", tmp_path / "link",
                  contains="contains the store")
    assert fuse_mounts_under(tmp_path) == []
    fsck_clean(tmp_path / "data/store")


@pytest.mark.parametrize("name", ["s,allow_other", "b\\ack", "caf\u00e9 x,y=1"])
def test_a_store_path_is_a_name_not_mount_options(tmp_path, name):
    """libfuse splits its options at commas: a store named 's,allow_other' let other users
    in without --allow-other, one named 'st,x=1' could not be mounted, and one with a
    non-ASCII character failed inside pyfuse3."""
    store, mnt = tmp_path / name, tmp_path / f"mnt {name}"
    cli("mountfs", "mkfs", store)
    mnt.mkdir()
    cli("mountfs", "mount", store, mnt)
    try:
        (line,) = fuse_mounts_under(mnt)
        options = line.split()[-1].split(",")        # the superblock's: FUSE's own
        assert "allow_other" not in options and "x=1" not in options, line
        assert options == ["rw", "user_id=0", "group_id=0", "default_permissions"], line
        from mountfs.mountinfo import find_mount
        assert find_mount(str(mnt)).store == str(store)
        (mnt / "f").write_text("kept")
        cli("snapctl", "-m", mnt, "create", "first")
        assert (mnt / ".snapshot/first/f").read_text() == "kept"
    finally:
        cli("mountfs", "umount", mnt)
    assert fuse_mounts_under(tmp_path) == []
    fsck_clean(store)


@pytest.mark.parametrize("setting", ["MOUNTFS_COMMIT_DELAY=abc", "MOUNTFS_COMMIT_DELAY=nan",
                                     "MOUNTFS_DIRTY_EXPIRE=-1", "MOUNTFS_DIRTY_EXPIRE=0",
                                     "MOUNTFS_IDLE_POLL=fast", "MOUNTFS_IDLE_POLL=1s"])
def test_a_bad_tuning_variable_is_refused_before_anything_is_mounted(store, tmp_path,
                                                                     monkeypatch, setting):
    """They were read unchecked: a traceback, or a mount process dying after it had mounted
    (a dead mount left behind, and 'exited (status None) without mounting'). A duration
    over a variable's limit (the idle poll's 10 ms) is refused the same way."""
    name, value = setting.split("=")
    monkeypatch.setenv(name, value)
    (tmp_path / "mnt").mkdir()
    problem = "is more than 0.01 s" if setting == "MOUNTFS_IDLE_POLL=1s" else "is not a duration"
    for foreground in ([], ["--foreground"]):
        fails_clearly("mountfs", "mount", *foreground, store, tmp_path / "mnt",
                      contains=f"${name}={value!r} {problem}")
    assert fuse_mounts_under(tmp_path) == []


def test_a_mountpoint_given_for_its_store_points_at_the_store(mounted):
    """'mountfs fsck MNT' said to run 'mountfs mkfs MNT', which then made a store inside the
    mounted filesystem."""
    for args, code in ((("mountfs", "fsck", mounted.mnt), 2), (("mountfs", "mkfs", mounted.mnt), 1),
                       (("snapctl", "--store", mounted.mnt, "list"), 1)):
        fails_clearly(*args, code=code,
                      contains=f"{mounted.mnt} is where the store {mounted.store} is mounted")
    assert os.listdir(mounted.mnt) == []


def test_snapctl_on_a_dead_mount_is_one_line(make_mount):
    m = make_mount()
    os.kill(m.pid, 9)
    assert gone(m.pid)
    fails_clearly("snapctl", "-m", m.mnt, "create", "late",
                  contains=f"the mount at {m.mnt} is dead (its process is gone): run "
                           f"'mountfs umount {m.mnt}'")
    cli("mountfs", "umount", m.mnt)


def test_a_mount_killed_while_snapctl_create_runs_gives_one_line(tmp_path):
    """Killed while 'snapctl create' starts, syncs or waits for its answer, the mount gave
    snapctl a traceback (ENOTCONN or ECONNABORTED from FUSE, or from the control socket).
    The kill falls at 11 points over the command's first 0.2 s (it takes about 0.15 s
    here): whatever it meets, the outcome is the snapshot or one line."""
    for n, delay in enumerate(i * 0.02 for i in range(11)):
        store, mnt = tmp_path / f"store{n}", tmp_path / f"mnt{n}"
        cli("mountfs", "mkfs", store)
        mnt.mkdir()
        cli("mountfs", "mount", store, mnt)
        pid = int((store / "lock").read_text().split()[1])
        snap = subprocess.Popen([sys.executable, "-m", "cmdline.snapctl", "-m", str(mnt),
                                 "create", "during"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        os.kill(pid, 9)
        out, err = snap.communicate(timeout=120)
        assert gone(pid)
        if "Traceback" in err:
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
        assert "Traceback" not in err, (delay, err)
        if snap.returncode:
            assert snap.returncode == 1 and len(err.strip().splitlines()) == 1, (delay, err)
            assert err.startswith("snapctl: "), (delay, err)
        else:
            assert out.startswith("created snapshot during"), (delay, out)
        cli("mountfs", "umount", mnt)
        fsck_clean(store)


def test_a_store_of_another_format_is_refused_naming_both_versions(store, tmp_path):
    other = S.FORMAT_VERSION + 7
    env = lmdb_env(store)
    with env.begin(write=True) as txn:
        txn.put(b"format", S.U32.pack(other), db=env.open_db(b"meta", txn=txn))
    env.close()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for args, code in ((("mountfs", "mount", store, mnt), 1), (("mountfs", "fsck", store), 2)):
        err = fails_clearly(*args, code=code)
        assert f"version {other}" in err and f"version {S.FORMAT_VERSION}" in err, err
    assert not os.path.ismount(mnt)
    env = lmdb_env(store)                                # refused, not "upgraded"
    with env.begin() as txn:
        assert txn.get(b"format", db=env.open_db(b"meta", txn=txn)) == S.U32.pack(other)
    env.close()


# ---- snapctl ----------------------------------------------------------------------------------

def test_snapctl_outside_any_mountfs_mount(tmp_path):
    """-m given a directory nothing is mounted on says to mount it (it was told to use the
    -m it had used); from a directory outside any mount, to pass -m or --store."""
    fails_clearly("snapctl", "-m", tmp_path, "list",
                  contains=f"{tmp_path} is not a mounted mountfs filesystem: mount it first "
                           f"('mountfs mount STORE {tmp_path}')")
    fails_clearly("snapctl", "create", "x", cwd=tmp_path,
                  contains=f"the current directory {tmp_path} is not in a mountfs filesystem; "
                           f"pass -m MOUNTPOINT")


def test_unknown_commands_and_options_are_one_line(mounted):
    fails_clearly("snapctl", "-m", mounted.mnt, "list", "--bogus", code=2, contains="--bogus")
    fails_clearly("snapctl", "-m", mounted.mnt, "create", code=2, contains="NAME")
    fails_clearly("snapctl", "-m", mounted.mnt, "frobnicate", code=2, contains="frobnicate")
    fails_clearly("snapctl", "--bogus", "list", code=2, contains="--bogus")
    fails_clearly("mountfs", "mount", "--bogus", mounted.store, mounted.mnt, code=2,
                  contains="--bogus")
    mounted.snapctl("create", "fine")                    # the mount is unaffected
    assert "fine" in mounted.snapctl("list").stdout


# ---- a full disk ------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    with tmpfs_disk(tmp_path / "small", "40m") as path:
        yield path


def test_a_full_disk_is_told_without_fsync(small_disk, make_mount):
    """A program that fills the disk and never calls fsync hears ENOSPC, not silence and a
    file shorter than it wrote: from write(2) once a chunk that filled could not be
    committed, or from close(2), which commits what the file buffered (FLUSH)."""
    store = small_disk / "store"
    cli("mountfs", "mkfs", store)
    m = make_mount(store)
    pid = m.pid
    with pytest.raises(OSError) as info:
        fd = os.open(m.mnt / "flood", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for _ in range(200):
                os.write(fd, os.urandom(1 << 20))
        finally:
            os.close(fd)
    assert info.value.errno == errno.ENOSPC, info.value
    assert m.pid == pid and os.path.ismount(m.mnt)       # the mount survived it
    m.umount()
    fsck_clean(store)


def test_a_full_disk_reaches_the_writer_and_loses_nothing(small_disk, make_mount):
    store = small_disk / "store"
    cli("mountfs", "mkfs", store)
    m = make_mount(store)
    pid = m.pid
    keep = os.urandom(2 << 20)
    with open(m.mnt / "keep", "wb") as h:
        h.write(keep)
        os.fsync(h.fileno())
    fill_disk(m.mnt / "flood", 200)
    assert m.pid == pid and os.path.ismount(m.mnt)       # the mount survived it
    os.unlink(m.mnt / "flood")
    assert (m.mnt / "keep").read_bytes() == keep
    again = os.urandom(4 << 20)                          # the space came back
    with open(m.mnt / "after", "wb") as h:
        h.write(again)
        os.fsync(h.fileno())
    m.umount()
    fsck_clean(store)
    m.mount()
    assert (m.mnt / "keep").read_bytes() == keep
    assert (m.mnt / "after").read_bytes() == again
    m.umount()
    fsck_clean(store)                                    # before the small disk goes away
    m.check_fsck = False


def test_a_snapshot_the_full_disk_refuses_says_whose_disk(tmp_path):
    """A snapshot that finds no room said only "No space left on device"."""
    with tmpfs_disk(tmp_path / "tiny", "32k") as tiny:
        cli("mountfs", "mkfs", tiny / "store")
        (tmp_path / "mnt").mkdir()
        cli("mountfs", "mount", tiny / "store", tmp_path / "mnt")
        try:
            fails_clearly("snapctl", "-m", tmp_path / "mnt", "create", "s1",
                          contains=f"no space left on the disk of the store {tiny}/store: ")
        finally:
            cli("mountfs", "umount", tmp_path / "mnt")


_DELETE_THEN_WRITE = r"""
import errno, os, subprocess, sys
mnt, rounds, snapctl = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def fill():
    try:
        with open(f"{mnt}/flood", "wb") as h:
            for _ in range(200):
                h.write(os.urandom(1 << 20))
            os.fsync(h.fileno())
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    else:
        raise AssertionError("the disk did not fill")

for n in range(rounds):
    fill()
    os.unlink(f"{mnt}/flood")
    fd = os.open(f"{mnt}/after{n}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, bytes([n]) * (4 << 20))
    os.fsync(fd)
    os.close(fd)
    fill()
    os.unlink(f"{mnt}/flood")
    subprocess.run([*snapctl, "-m", mnt, "create", f"s{n}"], check=True)
"""


def test_the_space_a_delete_frees_is_usable_at_once(small_disk, make_mount):
    """Delete the file that filled the disk, then at once write and fsync another: it must
    find the room, as on any filesystem (and so must a snapshot taken next). LMDB reuses a
    freed page only from the second transaction after the one that freed it, so the
    file's commit failed with ENOSPC (about every other time) until some other commit came
    between. And the kernel sends RELEASE after close(2) has returned: the unlink that
    follows reached the mount while the filled file was still being closed there (its
    last writes failing), so it stayed open, undeleted, until after the next write's
    fsync had failed (about one run in three with four rounds; eight make it show in
    most runs). A process of its own deletes and writes, as a user's commands would (from
    the test's own process the failure did not show)."""
    store = small_disk / "store"
    cli("mountfs", "mkfs", store)
    m = make_mount(store)
    rounds = 8
    res = subprocess.run([sys.executable, "-c", _DELETE_THEN_WRITE, str(m.mnt), str(rounds),
                          sys.executable, "-m", "cmdline.snapctl"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    m.umount()
    fsck_clean(store)
    m.mount()
    for n in range(rounds):
        assert (m.mnt / f"after{n}").read_bytes() == bytes([n]) * (4 << 20)
        assert (m.mnt / ".snapshot" / f"s{rounds - 1}" / f"after{n}").stat().st_size == 4 << 20
    m.umount()
    fsck_clean(store)                                    # before the small disk goes away
    m.check_fsck = False


def test_writes_a_full_disk_dropped_leave_stat_and_read_agreeing(small_disk, make_mount):
    """Writes the full disk could not take are dropped at the file's last close; then stat
    and read must both show the committed file, and the ENOSPC is the writer's alone. The
    kernel kept the size the writes gave it (for the attribute timeout: minutes) and the
    pages a reader had read from the buffer (kept across opens): stat said 5 MB while a
    read returned nothing, or returned data the store never had. And a reader's close(2)
    committed the writer's buffer and failed with its ENOSPC."""
    store = small_disk / "store"
    cli("mountfs", "mkfs", store)
    m = make_mount(store)
    fill_disk(m.mnt / "flood", 200)
    path = m.mnt / "f2"
    data = os.urandom(5_000_000)
    written = 0
    w = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while written < len(data):
            written += os.write(w, data[written:written + (1 << 20)])
    except OSError as e:                        # a chunk that filled could not be committed
        assert e.errno == errno.ENOSPC, e
    with pytest.raises(OSError) as info:
        os.fsync(w)
    assert info.value.errno == errno.ENOSPC, info.value
    r = os.open(path, os.O_RDONLY)              # a reader, while the writes are buffered
    with open(r, "rb", closefd=False) as h:
        assert h.read() == data[:written]
    with pytest.raises(OSError) as info:
        os.close(w)                             # the writer hears it ...
    assert info.value.errno == errno.ENOSPC, info.value
    os.close(r)                                 # ... the reader does not
    deadline = time.monotonic() + 10            # RELEASE comes after close(2) returned
    while path.stat().st_size == written and time.monotonic() < deadline:
        time.sleep(0.05)
    size = path.stat().st_size
    seen = path.read_bytes()
    assert len(seen) == size and seen == data[:size]
    m.umount()
    m.mount()
    assert path.stat().st_size == size, "stat showed writes that were dropped"
    assert path.read_bytes() == seen
    m.umount()
    fsck_clean(store)                                    # before the small disk goes away
    m.check_fsck = False


def test_a_snapshot_the_full_disk_refuses_does_not_hold_the_writes(small_disk, make_mount):
    """A snapshot holds new writes while it commits what files buffered; when the disk
    refuses that commit, the snapshot fails, and the writes must go on. They waited for
    good: the hold was never released."""
    store = small_disk / "store"
    cli("mountfs", "mkfs", store)
    m = make_mount(store)
    fd = os.open(m.mnt / "buffered", os.O_WRONLY | os.O_CREAT, 0o644)
    for i in range(48):                         # chunks one byte short: buffered, not full
        os.pwrite(fd, os.urandom((1 << 20) - 1), i << 20)
    fails_clearly("snapctl", "-m", m.mnt, "create", "s1", contains="no space left")
    writer = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'wb')"
                               ".write(b'after')", str(m.mnt / "after")])
    try:
        writer.wait(timeout=30)
    except subprocess.TimeoutExpired:
        m.kill9()                   # what ends a write the mount never answers
        writer.wait()
        try:
            os.close(fd)
        except OSError:             # its mount is gone
            pass
        m.check_fsck = False
        pytest.fail("a write waited for good after a snapshot the disk refused")
    assert writer.returncode == 0
    assert (m.mnt / "after").read_bytes() == b"after"
    with pytest.raises(OSError) as info:
        os.close(fd)                            # its buffered writes never fitted
    assert info.value.errno == errno.ENOSPC, info.value
    os.unlink(m.mnt / "buffered")
    m.umount()
    fsck_clean(store)                                    # before the small disk goes away
    m.check_fsck = False


# ---- corruption -------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [20_000, 300_000], ids=["small: checked inline",
                                                       "large: checked in a thread"])
def test_a_corrupt_chunk_is_found_by_fsck_and_never_served(make_mount, size):
    m = make_mount()
    bad, good = os.urandom(size), os.urandom(200_000)
    (m.mnt / "bad").write_bytes(bad)
    (m.mnt / "good").write_bytes(good)
    m.snapctl("create", "s")
    m.umount()
    m.check_fsck = False                                 # it is corrupt on purpose
    digest = blake3.blake3(bad).digest()                 # one chunk: the file's only one
    env = lmdb_env(m.store)
    blobs = env.open_db(b"blobs")
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(digest, db=blobs))
        value[1000] ^= 0xFF
        txn.put(digest, bytes(value), db=blobs)
    env.close()
    res = cli("mountfs", "fsck", "-q", m.store, check=False)
    assert res.returncode == 1, res
    problems = [line for line in res.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1, res.stdout
    assert f"chunk {digest.hex()[:16]}" in problems[0]
    assert "does not match its digest" in problems[0]
    assert "Traceback" not in res.stderr
    m.mount()
    for path in (m.mnt / "bad", m.mnt / ".snapshot/s/bad"):
        for _ in range(2):                               # not once, then cached as fine
            with pytest.raises(OSError) as info:
                path.read_bytes()
            assert info.value.errno == errno.EIO, path
    assert (m.mnt / "good").read_bytes() == good         # other data is still served


def test_fsck_reports_a_wrong_reference_count_with_exit_1(make_mount):
    m = make_mount()
    (m.mnt / "f").write_text("x")
    m.umount()
    m.check_fsck = False
    env = lmdb_env(m.store)
    refs = env.open_db(b"refs")
    with env.begin(write=True) as txn:
        digest, count = next(iter(txn.cursor(db=refs)))
        txn.put(bytes(digest), S.u64(S.from_u64(bytes(count)) + 5), db=refs)
    env.close()
    res = cli("mountfs", "fsck", "-q", m.store, check=False)
    assert res.returncode == 1
    assert "reference count 6, but 1 chunk-map version(s)" in res.stdout


def test_a_truncated_store_is_one_line_everywhere_never_a_bus_error(make_mount, tmp_path):
    """LMDB maps the data file: a page read past its end is SIGBUS (exit 135, no word). Every
    open of a store checks the file's size against LMDB's meta first."""
    m = make_mount()
    (m.mnt / "f").write_bytes(os.urandom(3 << 20))
    mirror = tmp_path / "mirror"
    cli("snapctl", "-m", m.mnt, "replicate", "--to", f"file://{mirror}")
    os.truncate(mirror / "data.mdb", 100_000)
    token = tmp_path / "token"
    token.write_text("a-token-only-its-owner-reads-0123")
    token.chmod(0o600)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for args, code in (
            (("mountfs", "fsck", mirror), 2),
            (("mountfs", "mount", mirror, mnt), 1),
            (("mountfs", "mount", "--read-only", mirror, mnt), 1),
            (("snapctl", "-m", m.mnt, "replicate", "--to", f"file://{mirror}"), 1),
            (("snapctl", "-m", m.mnt, "verify", "--mirror", f"file://{mirror}"), 2),
            (("mountfs", "serve-mirror", mirror, "--listen", f"127.0.0.1:{free_port()}",
              "--token-file", token), 1)):
        err = fails_clearly(*args, code=code, contains=f"{mirror}/data.mdb is truncated: "
                                                       f"100,000 bytes but its tree's root")
        assert "restore it from" in err, err
    assert not os.path.ismount(mnt)
    assert m.snapctl("list").stdout.count("repl-") == 1      # the refused runs left nothing


def test_an_empty_data_file_is_one_line_and_left_as_it_is(tmp_path):
    """A 0-byte data.mdb (an interrupted mkfs, a lost copy): fsck said "Bad file descriptor"
    and a writable open wrote a new, empty LMDB into it. One line, and nothing written."""
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    cli("mountfs", "mkfs", store)
    os.truncate(store / "data.mdb", 0)
    mnt.mkdir()
    for args, code in ((("mountfs", "fsck", store), 2), (("mountfs", "mount", store, mnt), 1),
                       (("snapctl", "--store", store, "create", "s"), 1)):
        err = fails_clearly(*args, code=code, contains=f"{store}/data.mdb is empty: an "
                                                       f"interrupted mkfs")
        assert "restore it from a backup or a mirror" in err
    assert os.path.getsize(store / "data.mdb") == 0 and not os.path.ismount(mnt)


def test_fsck_of_a_mounted_store_says_how_to_go_on(make_mount):
    """A new user ran fsck on a mounted store and got "a store has only one writer": the
    line now names the mount and both ways on."""
    m = make_mount()
    err = fails_clearly("mountfs", "fsck", m.store, code=2, contains=f"{m.store} is in use")
    assert err.endswith(f"a store has only one writer at a time: unmount it first ('mountfs "
                        f"umount {m.mnt}'), or work through the mount ('snapctl -m {m.mnt} "
                        f"...')"), err
