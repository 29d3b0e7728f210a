"""Replication to file:// mirrors, end to end: real mounts, real Spark (local mode, one session
for the whole test run), the mirror mounted read-only and compared with the source snapshot
after every cycle."""

from __future__ import annotations

import inspect
import json
import shutil
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import blake3
import pytest
from py4j.protocol import Py4JError

from mountfs import schema as S
from mountfs import snapshots
from mountfs.interrupts import Interrupted, signals_raise
from mountfs.namespace import Live
from mountfs.store import Store
from replicator import changeset, mirror as mirrormod, transfer
from replicator.cycle import replicate
from replicator.endpoints import FileSink, LocalMirror
from replicator.mirror import MirrorError

from conftest import Mount, cli


def tree_state(root: Path) -> dict:
    """Everything a copy must reproduce, by path: type, mode, owner, mtime, content,
    symlink target, xattrs, and hard-link groups (by inode number within this tree)."""
    out, groups = {}, {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            entry = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid,
                     "mtime": st.st_mtime_ns,
                     "xattrs": {k: os.getxattr(p, k, follow_symlinks=False)
                                for k in os.listxattr(p, follow_symlinks=False)}}
            if stat.S_ISREG(st.st_mode):
                entry["data"] = blake3.blake3(p.read_bytes()).hexdigest()
                entry["size"] = st.st_size
                if st.st_nlink > 1:
                    entry["link_group"] = groups.setdefault(st.st_ino, len(groups))
            elif stat.S_ISLNK(st.st_mode):
                entry["target"] = os.readlink(p)
            out[rel] = entry
    return out


def send(m: Mount, mirror_path: Path, snapshot: str, **kw):
    mirror = LocalMirror(mirror_path, Store.open(m.store, readonly=True, lock=False).chunk_size)
    try:
        return replicate(str(m.store), mirror, snapshot, **kw)
    finally:
        mirror.close()


def assert_mirror_equals(m: Mount, mirror_path: Path, snapshot: str, tmp_path: Path,
                         latest: bool = True) -> None:
    mnt = tmp_path / f"mirror-mnt-{snapshot}"
    mnt.mkdir()
    mirror_mount = Mount(mirror_path, mnt, ["--read-only"]).mount()
    try:
        want = tree_state(m.mnt / ".snapshot" / snapshot)
        got = tree_state(mnt / ".snapshot" / snapshot)
        assert got == want
        if latest:
            assert tree_state(mnt) == want      # the mirror's live tree is the snapshot
    finally:
        mirror_mount.umount()
    res = cli("mountfs", "fsck", "-q", mirror_path, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def populate(root: Path) -> None:
    (root / "docs/deep/er").mkdir(parents=True)
    (root / "docs/a.txt").write_text("alpha\n")
    (root / "docs/deep/er/b.bin").write_bytes(os.urandom(300_000))
    (root / "sparse").write_bytes(b"")
    with open(root / "sparse", "r+b") as f:
        f.seek(5_000_000)
        f.write(b"tail")
    os.link(root / "docs/a.txt", root / "hard")
    os.symlink("docs/a.txt", root / "link")
    os.mkfifo(root / "fifo")
    os.setxattr(root / "docs", "user.tag", b"v1")
    (root / "swap1").write_text("one")
    (root / "swap2").write_text("two")
    (root / "victim").write_text("replaced soon")
    (root / "gone").mkdir()
    (root / "gone/inside").write_text("x")


def churn(root: Path) -> None:
    """The diff issue's hard cases, in one cycle."""
    os.rename(root / "docs", root / "docs2")                       # rename a tree...
    os.rename(root / "docs2/deep/er/b.bin", root / "docs2/deep/er/b2.bin")   # ...and below it
    with open(root / "docs2/deep/er/b2.bin", "r+b") as f:          # ...modified underneath
        f.seek(100_000)
        f.write(b"changed")
    os.rename(root / "swap1", root / "tmp")                        # swap
    os.rename(root / "swap2", root / "swap1")
    os.rename(root / "tmp", root / "swap2")
    os.rename(root / "docs2/a.txt", root / "victim")               # rename over a file
    (root / "newdir/sub").mkdir(parents=True)                      # create, then move in
    (root / "newfile").write_text("fresh")
    os.rename(root / "newfile", root / "newdir/sub/newfile")
    os.rename(root / "gone/inside", root / "rescued")              # out of a deleted dir
    os.rmdir(root / "gone")
    os.unlink(root / "link")                                       # delete + recreate
    os.symlink("victim", root / "link")
    os.setxattr(root / "docs2", "user.tag", b"v2")                 # xattr-only change
    os.chmod(root / "hard", 0o600)                                 # mode-only change
    with open(root / "sparse", "r+b") as f:                        # one chunk of a sparse file
        f.seek(2_500_000)
        f.write(b"middle")
    os.link(root / "rescued", root / "newdir/rescued-link")        # new hard link


def test_full_then_incremental_cycles(spark, mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    populate(m.mnt)
    m.snapctl("create", "s1")
    first = send(m, mirror, "s1")
    assert first.base is None and first.chunks_sent > 0
    assert_mirror_equals(m, mirror, "s1", tmp_path)

    churn(m.mnt)
    m.snapctl("create", "s2")
    second = send(m, mirror, "s2")
    assert second.base == "s1"
    assert second.entries > 0
    # only the changed chunks travel: two writes into existing chunks, a few new small files
    assert second.bytes_sent < 3 * (1 << 20)
    assert_mirror_equals(m, mirror, "s2", tmp_path)

    again = send(m, mirror, "s2")
    assert again.entries == 0 and again.chunks_sent == 0


def test_renaming_a_big_directory_sends_no_data(spark, mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "big").mkdir()
    for i in range(4):
        (m.mnt / "big" / f"f{i}").write_bytes(os.urandom(1 << 20))
    m.snapctl("create", "s1")
    send(m, mirror, "s1")
    os.rename(m.mnt / "big", m.mnt / "moved")
    (m.mnt / "copy").write_bytes((m.mnt / "moved/f0").read_bytes())   # same content: dedup
    m.snapctl("create", "s2")
    result = send(m, mirror, "s2")
    assert result.bytes_sent == 0
    assert result.bytes_skipped >= 1 << 20
    assert_mirror_equals(m, mirror, "s2", tmp_path)


def test_changed_mirror_is_refused_then_rolled_back_with_force(spark, mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "f").write_text("1")
    m.snapctl("create", "s1")
    send(m, mirror, "s1")
    tamper(mirror)
    (m.mnt / "f").write_text("2")
    m.snapctl("create", "s2")
    with pytest.raises(MirrorError, match="changed since"):
        send(m, mirror, "s2")
    result = send(m, mirror, "s2", force=True)
    assert result.base == "s1"
    assert_mirror_equals(m, mirror, "s2", tmp_path)


def source_changeset(m: Mount, from_name: str, to_name: str) -> changeset.Changeset:
    src = Store.open(m.store, readonly=True, lock=False)
    try:
        with src.read() as txn:
            epochs = {s.name: s.epoch for s in snapshots.list_all(txn, src.db)}
            return changeset.build(txn, src.db, src.chunk_size, epochs[from_name],
                                   epochs[to_name])
    finally:
        src.close()


def mirror_info(path: Path) -> dict:
    store = Store.open(path, readonly=True, lock=False)
    try:
        return mirrormod.info(store)
    finally:
        store.close()


def tamper(store_path: Path) -> None:
    """Change a store's live tree behind everyone's back (a mirror someone wrote to)."""
    store = Store.open(store_path)
    try:
        with store.write() as txn:
            live = Live(txn, store.db, snapshots.live_epoch(txn, store.db), store.chunk_size)
            live.create(S.ROOT_INO, b"stray", stat.S_IFREG | 0o644, 0, 0)
    finally:
        store.close()


def test_a_mirror_mounts_read_only_until_promoted(spark, mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "f").write_text("1")
    m.snapctl("create", "s1")
    send(m, mirror, "s1")
    mnt = tmp_path / "mm"
    mnt.mkdir()
    res = cli("mountfs", "mount", mirror, mnt, check=False)
    assert res.returncode == 1 and "is a mirror" in res.stderr
    cli("mountfs", "promote", mirror)
    promoted = Mount(mirror, mnt).mount()
    (mnt / "new").write_text("the mirror is a source now")
    assert (mnt / "f").read_text() == "1"
    promoted.umount()
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0


def test_interrupted_cycle_resumes_without_resending(spark, mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    m.snapctl("create", "s0")
    send(m, mirror, "s0")
    for i in range(6):
        (m.mnt / f"f{i}").write_bytes(os.urandom(400_000))
    m.snapctl("create", "s1")
    # a cycle that stopped after staging half of its chunks (killed before its commit)
    wanted = sorted(source_changeset(m, "s0", "s1").digests().items())
    half = wanted[: len(wanted) // 2]
    source = Store.open(m.store, readonly=True, lock=False)
    try:
        transfer.send(source, FileSink(str(mirror)), transfer.batches(half))
    finally:
        source.close()
    assert "s1" not in [s["name"] for s in mirror_info(mirror)["snapshots"]]
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0
    result = send(m, mirror, "s1")
    assert result.bytes_sent == sum(n for _, n in wanted) - sum(n for _, n in half)
    assert_mirror_equals(m, mirror, "s1", tmp_path)


def test_a_spark_job_waiting_for_its_turn_does_not_start_after_cancel_all():
    """Spark jobs of one process take turns (the daemon sends to several mirrors at once);
    one still waiting when cancel_all runs (the daemon stopping) gives up instead of
    starting, so that the stop does not wait for a whole job more."""
    failed = []

    def second_job():
        try:
            transfer.send(None, None, [[("00" * 32, 1)]])
        except transfer.TransferFailed as e:
            failed.append(str(e))
    with transfer._one_job_at_a_time():                  # a job in flight
        waiting = threading.Thread(target=second_job)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()                         # waiting for its turn
        transfer.cancel_all()
    waiting.join(30)
    assert failed == ["cancelled before it started; run again to resume"]


def held_sink(release: Path):
    """A sink whose puts wait until ``release`` exists: a job that runs until the test lets
    it go (a class made here, so that Spark pickles it whole for its workers)."""
    class Held:
        def put(self, chunks):
            while not release.exists():
                time.sleep(0.05)
            return 0, 0

        def missing(self, digests):
            return digests
    return Held()


def signal_at(n: int, signum: int):
    """A trace function for the main thread that sends ``signum`` to this process at the
    ``n``-th line of py4j code it runs once the transfer has begun (``transfer._run``): the
    handler runs right there, as when the signal lands in the middle of a call to the JVM.
    (Earlier, a py4j finalizer of an earlier job may run: a signal there is not this
    transfer's.)"""
    seen, begun = 0, False

    def tracer(frame, event, arg):
        nonlocal seen, begun
        begun = begun or frame.f_code is transfer._run.__code__
        if not begun or "/py4j/" not in frame.f_code.co_filename:
            return None
        seen += 1
        if seen == n:
            sys.settrace(None)
            os.kill(os.getpid(), signum)
        return tracer
    return tracer


def two_batches(m: Mount) -> list:
    """Batches of the two chunks of a file written between snapshots s0 and s1 of ``m``."""
    m.snapctl("create", "s0")
    (m.mnt / "f").write_bytes(os.urandom(2 << 20))
    m.snapctl("create", "s1")
    return transfer.batches(sorted(source_changeset(m, "s0", "s1").digests().items()),
                            1 << 20)


def send_held(m: Mount, batches: list, release: Path) -> None:
    """Send ``batches`` to a sink that holds the job until ``send`` is interrupted; then let
    the job go and cancel it. A lost interrupt ends as a stall, not as a hung test."""
    source = Store.open(m.store, readonly=True, lock=False)
    try:
        transfer.send(source, held_sink(release), batches, stall_seconds=60)
    finally:
        release.touch()
        transfer.cancel_all()
        source.close()


@pytest.fixture
def ctrl_c_reaches_us():
    """This process takes SIGINT as a terminal's foreground job does (KeyboardInterrupt),
    however the test run was started: one started in the background of a script inherits
    SIGINT ignored, and Python leaves it so (CI's did: these tests then lost every Ctrl-C
    they sent)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("signum, raised", [
    (signal.SIGINT, KeyboardInterrupt),               # Ctrl-C
    (signal.SIGTERM, Interrupted),                    # under signals_raise, as replicate
], ids=["SIGINT", "SIGTERM"])
def test_a_signal_anywhere_in_a_spark_transfer_is_the_interruption(spark, mounted, tmp_path,
                                                                   ctrl_c_reaches_us, signum,
                                                                   raised):
    """Ctrl-C landing in the middle of a py4j call made while the job was watched came out
    as a Py4JError now and then ("lost the Spark driver"), or was dropped in a py4j
    finalizer. The signal lands at one point after another of those calls."""
    batches = two_batches(mounted)
    for n in range(1, 400, 7):
        sys.settrace(signal_at(n, signum))
        try:
            with signals_raise((signal.SIGTERM,)), pytest.raises(raised):
                send_held(mounted, batches, tmp_path / f"release{n}")
        finally:
            sys.settrace(None)


def test_signals_held_all_go_back_when_a_ctrl_c_comes_on_the_way(ctrl_c_reaches_us):
    """Leaving a transfer puts SIGINT's handler back first: a Ctrl-C just then raised
    before SIGTERM's and SIGHUP's were back, which then stayed noted by a holder nobody
    reads, so a later ``kill`` of the command did nothing."""
    before = {s: signal.getsignal(s) for s in transfer.HELD_SIGNALS}
    code = transfer._SignalsHeld._put_back.__code__
    swap_line = next(code.co_firstlineno + i for i, line in
                     enumerate(inspect.getsource(code).splitlines())
                     if "signal.signal(s, handler)" in line)
    sent = []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == swap_line and \
                frame.f_locals["s"] == signal.SIGTERM and not sent:
            sent.append(True)           # SIGINT's handler is back: Ctrl-C now
            os.kill(os.getpid(), signal.SIGINT)
        return tracer
    with signals_raise((signal.SIGTERM, signal.SIGHUP)):
        outer = {s: signal.getsignal(s) for s in transfer.HELD_SIGNALS}
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                with transfer._SignalsHeld():
                    pass
        finally:
            sys.settrace(None)
        assert sent
        assert {s: signal.getsignal(s) for s in transfer.HELD_SIGNALS} == outer
    assert {s: signal.getsignal(s) for s in transfer.HELD_SIGNALS} == before


@pytest.mark.parametrize("signalled", [False, True], ids=["alone", "after-ctrl-c"])
def test_a_py4j_error_is_a_lost_driver_unless_a_signal_came_first(spark, mounted, tmp_path,
                                                                  monkeypatch, ctrl_c_reaches_us,
                                                                  signalled):
    """A Py4JError while the job is watched is the driver lost; after a Ctrl-C it is taken
    for the interruption's doing: the run was interrupted."""
    def lost(tracker, group):
        if signalled:
            os.kill(os.getpid(), signal.SIGINT)
        raise Py4JError("An error occurred while calling o42.getJobIdsForGroup")
    monkeypatch.setattr(transfer, "_task_counts", lost)
    batches = two_batches(mounted)
    with pytest.raises(KeyboardInterrupt) if signalled else pytest.raises(
            transfer.TransferFailed, match=r"^lost the Spark driver \(Py4JError\)"):
        send_held(mounted, batches, tmp_path / "release")


# ---- what the mirror refuses --------------------------------------------------------------

def commit_by_hand(mirror_path: Path, cs: changeset.Changeset, name="evil") -> None:
    store = Store.open(mirror_path)
    try:
        with store.write() as txn:
            mirrormod.commit(txn, store.db, store.chunk_size, b"\x01" * 16, None,
                             mirrormod.SnapshotRef(name, "ab" * 16, 1), cs)
    finally:
        store.close()


def file_record(parent: int, name: bytes, size: int = 0) -> S.Inode:
    return S.Inode(stat.S_IFREG | 0o644, 0, 0, 1, size, 1, 1, 1, 0, 1, parent=parent,
                   name=name)


@pytest.mark.parametrize("name", [b"..", b".", b"a/b", b"nul\0", b"", b"x" * 256])
def test_commit_with_an_escaping_name_is_refused(tmp_path, name):
    mirror = tmp_path / "mirror"
    Store.mkfs(mirror)
    cs = changeset.Changeset(entries={(S.ROOT_INO, name): 2},
                             inodes={2: file_record(S.ROOT_INO, b"f")})
    with pytest.raises(MirrorError, match="not a valid file name"):
        commit_by_hand(mirror, cs)
    assert mirror_info(mirror)["empty"]


def test_commit_referring_to_a_missing_chunk_is_refused(tmp_path):
    mirror = tmp_path / "mirror"
    Store.mkfs(mirror)
    cs = changeset.Changeset(entries={(S.ROOT_INO, b"f"): 2},
                             inodes={2: file_record(S.ROOT_INO, b"f", 5)},
                             chunks={2: {0: (b"\x07" * 32, 5)}})
    with pytest.raises(MirrorError, match="lacks"):
        commit_by_hand(mirror, cs)
    assert mirror_info(mirror)["empty"]
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0


@pytest.mark.parametrize("case", ["unknown inode", "out of range", "root deleted", "cycle"])
def test_commit_with_broken_structure_is_refused(tmp_path, case):
    mirror = tmp_path / "mirror"
    Store.mkfs(mirror)
    dir_rec = S.Inode(stat.S_IFDIR | 0o755, 0, 0, 2, 0, 1, 1, 1, 0, 1, parent=S.ROOT_INO,
                      name=b"d")
    cs = {
        "unknown inode": changeset.Changeset(entries={(S.ROOT_INO, b"f"): 5}),
        "out of range": changeset.Changeset(entries={(S.ROOT_INO, b"f"): 1 << 62},
                                            inodes={1 << 62: file_record(1, b"f")}),
        "root deleted": changeset.Changeset(inodes={S.ROOT_INO: None}),
        "cycle": changeset.Changeset(entries={(2, b"d"): 2}, inodes={2: dir_rec}),
    }[case]
    with pytest.raises(MirrorError):
        commit_by_hand(mirror, cs)
    assert mirror_info(mirror)["empty"]
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0


def test_a_chunk_corrupted_in_transit_is_not_stored(tmp_path):
    mirror = tmp_path / "mirror"
    Store.mkfs(mirror)
    data = os.urandom(1000)
    good = (blake3.blake3(data).digest(), data)
    bad = (blake3.blake3(b"other").digest(), data)
    with pytest.raises(MirrorError, match="does not match its digest"):
        FileSink(str(mirror)).put([good, bad])
    store = Store.open(mirror, readonly=True, lock=False)
    with store.read() as txn:
        assert mirrormod.missing(txn, store.db, [good[0], bad[0]]) == [good[0], bad[0]]
    store.close()


def test_incompatible_mirrors_are_refused(spark, mounted, tmp_path):
    m = mounted
    (m.mnt / "f").write_text("x")
    m.snapctl("create", "s1")
    other_chunks = tmp_path / "other-chunks"
    Store.mkfs(other_chunks, chunk_size=64 << 10)
    with pytest.raises(MirrorError, match="chunk size"):
        send(m, other_chunks, "s1")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "some-file").write_text("not a store")
    with pytest.raises(Exception, match="not a mountfs store"):
        send(m, foreign, "s1")


def test_without_a_common_base_a_mirror_converges_by_buckets(spark, mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    for i in range(10):
        (m.mnt / f"f{i}").write_bytes(os.urandom(200_000))
    m.snapctl("create", "s1")
    send(m, mirror, "s1")
    m.snapctl("delete", "s1")                     # the base is lost on the source
    (m.mnt / "f0").write_bytes(os.urandom(200_000))
    os.rename(m.mnt / "f1", m.mnt / "f1-renamed")
    os.unlink(m.mnt / "f2")
    m.snapctl("create", "s2")
    result = send(m, mirror, "s2")
    assert result.base is None
    assert result.bytes_sent == 200_000           # only the rewritten file's data travels
    assert_mirror_equals(m, mirror, "s2", tmp_path, latest=True)


def test_a_store_of_its_own_is_refused_unless_forced(spark, mounted, tmp_path):
    """A store that is no mirror and holds a file (or a snapshot) of its own is refused, by
    the cycle and by the receiving side alone (an old client); --force reconciles it into
    a mirror. A store fresh from mkfs is taken as it is."""
    m, own, fresh = mounted, tmp_path / "own", tmp_path / "fresh"
    (m.mnt / "f").write_text("x")
    m.snapctl("create", "s1")
    Store.mkfs(own)
    tamper(own)                                   # holds a file the source never had
    with pytest.raises(MirrorError, match=f"^{own.as_uri()} is a mountfs store with files "
                                          f"of its own, not a mirror: .* pass --force"):
        send(m, own, "s1")
    with pytest.raises(MirrorError, match="receiving store is a mountfs store with files"):
        commit_by_hand(own, changeset.Changeset())
    info = mirror_info(own)
    assert info["mirror_of"] is None and info["snapshots"] == [] and not info["empty"]
    send(m, own, "s1", force=True)
    assert mirror_info(own)["mirror_of"] == mirror_info(m.store)["uuid"]
    assert_mirror_equals(m, own, "s1", tmp_path)
    Store.mkfs(fresh)
    assert send(m, fresh, "s1").base is None


def test_replicating_into_a_mirror_of_another_source_is_refused(spark, make_mount, tmp_path):
    a, b = make_mount(), make_mount()
    mirror = tmp_path / "mirror"
    (a.mnt / "f").write_text("a")
    a.snapctl("create", "s1")
    send(a, mirror, "s1")
    (b.mnt / "g").write_text("b")
    b.snapctl("create", "t1")
    with pytest.raises(MirrorError, match="another store"):
        send(b, mirror, "t1")


# ---- the command line, and a kill in the middle -------------------------------------------

def snapctl_replicate(m: Mount, mirror: Path, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cmdline.snapctl", "-m", str(m.mnt),
                             "replicate", "--to", f"file://{mirror}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_cli_replicate_json_summary(mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "f").write_bytes(os.urandom(100_000))
    proc = snapctl_replicate(m, mirror, "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert set(summary) == {"snapshot", "base", "entries", "inodes", "chunks_sent",
                            "bytes_sent", "bytes_skipped", "seconds", "executors",
                            "already_on_mirror", "reconciled"}
    assert summary["already_on_mirror"] is False
    assert summary["snapshot"].startswith("repl-") and summary["base"] is None
    assert summary["executors"] == {}             # sent inline: no Spark executor
    assert summary["bytes_sent"] == 100_000
    proc = snapctl_replicate(m, mirror, "--snapshot", "no-such-snapshot")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and err.strip() == "snapctl: no snapshot named 'no-such-snapshot'"


def staged_count(mirror: Path, key_length: int = 32) -> int:
    """Chunks staged on the mirror (keys of 32 bytes; changeset parts have 24)."""
    try:
        store = Store.open(mirror, readonly=True, lock=False)
    except Exception:
        return 0
    try:
        with store.read() as txn:
            return sum(len(k) == key_length
                       for k in txn.cursor(store.db["staged"]).iternext(values=False))
    finally:
        store.close()


def test_kill_9_during_transfer_then_rerun(mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    for i in range(24):
        (m.mnt / f"f{i}").write_bytes(os.urandom(1 << 20))
    m.snapctl("create", "s1")
    proc = snapctl_replicate(m, mirror, "--snapshot", "s1", "--batch-size", "1M")
    deadline = time.monotonic() + 240
    while staged_count(mirror) == 0 and proc.poll() is None:
        assert time.monotonic() < deadline, "the transfer never started"
        time.sleep(0.05)
    os.killpg(proc.pid, 9)
    proc.wait()
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0
    assert mirror_info(mirror)["snapshots"] == []          # at its base (empty), not between
    staged = staged_count(mirror)
    proc = snapctl_replicate(m, mirror, "--snapshot", "s1", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["bytes_sent"] <= 24 * (1 << 20) - staged * (1 << 20)
    assert_mirror_equals(m, mirror, "s1", tmp_path)


# ---- bringing data back from a mirror -----------------------------------------------------

def test_restore_from_mirror_path_and_whole_snapshot(spark, mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    populate(m.mnt)
    m.snapctl("create", "s1")
    send(m, mirror, "s1")
    want_docs = tree_state(m.mnt / ".snapshot/s1/docs")
    want_all = tree_state(m.mnt / ".snapshot/s1")
    shutil.rmtree(m.mnt / "docs")
    m.snapctl("delete", "s1")                      # the source no longer has it at all
    res = m.snapctl("restore", "--from", f"file://{mirror}", "s1", "docs", check=False)
    assert res.returncode == 0, res.stderr
    assert "fetched" in res.stdout
    for entry in want_docs.values():             # a link to a name outside docs/ stays out
        entry.pop("link_group", None)
    assert tree_state(m.mnt / "docs") == want_docs
    res = m.snapctl("restore", "--from", f"file://{mirror}", "s1", "docs", check=False)
    assert res.returncode == 1 and "exists; pass --force" in res.stderr
    m.snapctl("restore", "--from", f"file://{mirror}", "s1", "--to", "everything")
    got = tree_state(m.mnt / "everything")
    for rel, entry in want_all.items():             # hard links of the tree stay links
        assert got[rel] == entry, rel
    res = m.snapctl("restore", "--from", f"file://{mirror}", "s1", "nope", "--to", "x",
                    check=False)
    assert res.returncode == 1 and "does not exist in snapshot" in res.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs: a mirror that runs out of space."""
    path = tmp_path / "small"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(path)], check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_mirror_disk_is_a_clear_error_and_loses_nothing(spark, mounted, small_disk,
                                                                tmp_path):
    m, mirror = mounted, small_disk / "mirror"
    (m.mnt / "small").write_bytes(os.urandom(1 << 20))
    m.snapctl("create", "s1")
    send(m, mirror, "s1")
    for i in range(80):
        (m.mnt / f"big{i}").write_bytes(os.urandom(1 << 20))
    m.snapctl("create", "s2")
    with pytest.raises(Exception, match="(?i)no space|full"):
        send(m, mirror, "s2", batch_bytes=4 << 20)
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0
    assert [s["name"] for s in mirror_info(mirror)["snapshots"]] == ["s1"]
    assert_mirror_equals(m, mirror, "s1", tmp_path, latest=False)


@pytest.mark.parametrize("delay", [0.5, 4.0, 8.0])
def test_kill_9_at_any_moment_leaves_the_mirror_at_base_or_new(mounted, tmp_path, delay):
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "seed").write_text("base")
    m.snapctl("create", "s0")
    proc = snapctl_replicate(m, mirror, "--snapshot", "s0")
    assert proc.wait(timeout=300) == 0
    for i in range(12):
        (m.mnt / f"f{i}").write_bytes(os.urandom(1 << 20))
    os.rename(m.mnt / "seed", m.mnt / "seed2")
    m.snapctl("create", "s1")
    proc = snapctl_replicate(m, mirror, "--snapshot", "s1", "--batch-size", "1M")
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0
    held = [s["name"] for s in mirror_info(mirror)["snapshots"]]
    assert held in (["s0"], ["s0", "s1"])
    if held == ["s0"]:
        assert_mirror_equals(m, mirror, "s0", tmp_path)    # exactly the base, nothing between
    proc = snapctl_replicate(m, mirror, "--snapshot", "s1")
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert_mirror_equals(m, mirror, "s1", tmp_path)


def test_the_replication_base_is_kept_from_deletion(mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "f").write_text("1")
    m.snapctl("create", "s1")
    assert snapctl_replicate(m, mirror, "--snapshot", "s1").wait(timeout=300) == 0
    res = m.snapctl("delete", "s1", check=False)
    assert res.returncode == 1
    assert res.stderr.strip() == (f"snapctl: snapshot 's1' is the replication base of mirror "
                                  f"file://{mirror}; replicate a newer snapshot first, or "
                                  f"pass --force")
    other = tmp_path / "other"                     # the base of two mirrors names both
    assert snapctl_replicate(m, other, "--snapshot", "s1").wait(timeout=300) == 0
    res = m.snapctl("delete", "s1", check=False)
    assert res.stderr.strip() == (f"snapctl: snapshot 's1' is the replication base of mirrors "
                                  f"file://{mirror} and file://{other}; replicate a newer "
                                  f"snapshot first, or pass --force"), res.stderr
    m.snapctl("create", "s2")
    assert snapctl_replicate(m, mirror, "--snapshot", "s2").wait(timeout=300) == 0
    assert snapctl_replicate(m, other, "--snapshot", "s2").wait(timeout=300) == 0
    m.snapctl("delete", "s1")                      # no longer a base
    assert m.snapctl("delete", "s2", check=False).returncode == 1
    m.snapctl("delete", "s2", "--force")
    (m.mnt / "f").write_text("2")
    m.snapctl("create", "s3")
    proc = snapctl_replicate(m, mirror, "--snapshot", "s3", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert json.loads(out)["base"] is None          # converged by buckets, no common base
    assert_mirror_equals(m, mirror, "s3", tmp_path)


def test_resending_a_snapshot_the_mirror_holds_leaves_its_base_alone(mounted, tmp_path):
    """A re-run from the shell's history (an older snapshot the mirror already holds) sends
    nothing and says so; the base stays the newest snapshot both hold: still protected
    from deletion, and the next replicate goes on from it."""
    m, mirror = mounted, tmp_path / "mirror"
    for name in ("t1", "t2"):
        (m.mnt / name).write_text(name)
        m.snapctl("create", name)
        assert snapctl_replicate(m, mirror, "--snapshot", name).wait(timeout=300) == 0
    proc = snapctl_replicate(m, mirror, "--snapshot", "t1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert out.startswith("t1 is already on the mirror: nothing sent, its base stays t2"), out
    assert "full copy" not in out
    proc = snapctl_replicate(m, mirror, "--snapshot", "t1", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert json.loads(out)["already_on_mirror"] is True
    res = m.snapctl("delete", "t2", check=False)     # still the base: protected
    assert res.returncode == 1 and "replication base" in res.stderr, res.stderr
    (m.mnt / "t3").write_text("t3")
    proc = snapctl_replicate(m, mirror, "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert json.loads(out)["base"] == "t2"           # incremental from the real base
