"""Crash safety: kill -9 of the mount process at several moments (a write workload with
fsyncs, renames, mkdirs and snapshots; many writers' small operations sharing group commits;
an fsyncdir in the middle of them; reclamation after a snapshot delete; a rollback; an
unlinked-but-open file), then remount. The mount must come up, fsck must find the store
consistent both straight after the crash and after the remount, and what survives must be
what the README promises: everything that returned before a later fsync, fsyncdir or
snapshot returned, exactly; of what returned after it, only a tail may be lost (each
process's surviving calls are a prefix of its calls); and changes are committed soon
without anyone asking."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import blake3
import lmdb
import pytest
from conftest import fsck_clean

from mountfs import chunkfile, control
from mountfs import schema as S
from mountfs.namespace import FsError, View

# ---- helpers ------------------------------------------------------------------------------


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextmanager
def raw_store(store: Path):
    """A read-only look at the store's tables with the lmdb module (a mount may be writing:
    LMDB lets any number of processes read)."""
    env = lmdb.open(str(store), readonly=True, max_dbs=len(S.DB_NAMES) + 2)
    try:
        with env.begin() as txn:
            yield txn, {n: env.open_db(n.encode(), txn=txn, create=False) for n in S.DB_NAMES}
    finally:
        env.close()


def chunk_digests(data: bytes, chunk_size: int) -> set[bytes]:
    return {blake3.blake3(data[i:i + chunk_size]).digest()
            for i in range(0, len(data), chunk_size)}


def stored_blobs(store: Path, digests: set[bytes]) -> set[bytes]:
    """Which of ``digests`` still have their data in the store (in LMDB or a slot of the
    chunk file)."""
    with raw_store(store) as (txn, db):
        return {d for d in digests if chunkfile.has(txn, db, d)}


def wait_until_reclaimed(store: Path, digests: set[bytes], limit: float = 60.0) -> None:
    """Wait for the mount's background collector to drop the data of ``digests`` (the
    limit only keeps a broken collector from hanging the suite)."""
    deadline = time.monotonic() + limit
    while stored_blobs(store, digests):
        assert time.monotonic() < deadline, \
            f"{len(stored_blobs(store, digests))} chunks were never reclaimed"
        time.sleep(0.1)


def tree(root: Path) -> dict[str, str]:
    """path -> sha256 of content ('dir' for directories) of everything under ``root``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = "dir"
        for f in filenames:
            out[os.path.normpath(os.path.join(rel, f))] = sha(Path(dirpath, f).read_bytes())
    return out


def tree_of(top: Path, name: str) -> dict[str, str]:
    """Like tree(), for the directory ``name`` under ``top`` (itself included), with paths
    relative to ``top``; empty when it does not exist."""
    if not (top / name).is_dir():
        return {}
    return {name: "dir", **{f"{name}/{k}": v for k, v in tree(top / name).items()}}


def snapshot_names(m) -> list[str]:
    return [json.loads(line)["name"] for line in m.snapctl("list", "--json").stdout.splitlines()]


# ---- kill -9 in the middle of a write workload --------------------------------------------

WORKLOAD = r'''
"""One writer: every step is journalled 'begin' before it starts and 'done' once the call
returned, so the checker knows exactly what the filesystem had promised at the kill."""
import hashlib, json, os, subprocess, sys

mnt, name, journal, take_snapshots = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
out = open(journal, "a")


def log(**event):
    out.write(json.dumps(event) + "\n")
    out.flush()


def step(op, run, **fields):
    log(op=op, phase="begin", **fields)
    result = run()
    log(op=op, phase="done", **fields, **(result or {}))


def sha(data):
    return hashlib.sha256(data).hexdigest()


def write(path, data, sync):
    with open(f"{mnt}/{path}", "wb") as h:
        h.write(data)
        if sync:
            h.flush()
            os.fsync(h.fileno())
    return {"sha": sha(data)}


grown = b""
step("mkdir", lambda: os.mkdir(f"{mnt}/{name}"), path=name)
step("mkdir", lambda: os.mkdir(f"{mnt}/{name}/moved"), path=f"{name}/moved")
step("write", lambda: write(f"{name}/grow", b"", sync=False), path=f"{name}/grow", sync=False)
grow = open(f"{mnt}/{name}/grow", "ab")            # one file kept open and growing
for i in range(10**6):
    d = f"{name}/d{i // 4}"
    if i % 4 == 0:
        step("mkdir", lambda: os.mkdir(f"{mnt}/{d}"), path=d)
    size = 40_000 + (i % 7) * 30_000 + (1_300_000 if i % 9 == 8 else 0)   # some span chunks
    data = os.urandom(size)
    step("write", lambda: write(f"{d}/f{i}", data, sync=i % 2 == 0), path=f"{d}/f{i}",
         sync=i % 2 == 0)
    piece = os.urandom(7_000)

    def append():
        global grown
        grow.write(piece)
        grow.flush()
        os.fsync(grow.fileno())
        grown += piece
        return {"size": len(grown), "sha": sha(grown)}
    step("append", append, path=f"{name}/grow", before=len(grown), before_sha=sha(grown))
    if i % 3 == 1:
        step("rename", lambda: os.rename(f"{mnt}/{d}/f{i}", f"{mnt}/{name}/moved/f{i}"),
             src=f"{d}/f{i}", dst=f"{name}/moved/f{i}")
    if take_snapshots and i % 6 == 2:
        def create():
            res = subprocess.run([sys.executable, "-m", "cmdline.snapctl", "-m", mnt,
                                  "create", f"s{i}"], capture_output=True)
            if res.returncode != 0:
                raise SystemExit(f"snapshot s{i} failed")
        step("snapshot", create, name=f"s{i}")
'''


def durable(e: dict) -> bool:
    """Whether a step's return promised it, and everything its writer did before it, on disk:
    an fsync (every append, half the writes) or a snapshot (snapctl create commits and syncs
    everything before it replies)."""
    return e["op"] in ("append", "snapshot") or (e["op"] == "write" and e["sync"])


def apply_step(state: dict[str, str], e: dict) -> None:
    """``state`` (a writer's tree as tree_of() gives it) after step ``e``. A write or an
    append that had not returned has no content to expect: it changes nothing here (see
    partly_done)."""
    if e["op"] == "mkdir":
        state[e["path"]] = "dir"
    elif e["op"] in ("write", "append") and "sha" in e:
        state[e["path"]] = e["sha"]
    elif e["op"] == "rename":
        state[e["dst"]] = state.pop(e["src"])


def partly_done(e: dict | None, path: str, top: Path) -> bool:
    """Whether ``path`` may differ from the expected tree because step ``e``, the first one
    past a cut, was cut half-way: a write's file created with any part of its data (full
    chunks are committed before the close), an append's file with its earlier content and
    part of the new piece. A mkdir or a rename is all or nothing: the next cut covers it."""
    if e is None or e.get("path") != path or not (top / path).is_file():
        return False
    if e["op"] == "write":
        return True
    if e["op"] == "append":
        data = (top / path).read_bytes()
        return sha(data[:e["before"]]) == e["before_sha"] and len(data) <= e["before"] + 7_000
    return False


class Promises:
    """What one writer's journal says the filesystem must hold. Its steps up to its last
    durable one are promised exactly, and so is every snapshot (the state at its creation).
    The steps that returned after it, and the one that had begun but not returned at the
    kill, are a tail of which a prefix survived: the live tree is the state after some cut
    of the tail, the first step past the cut possibly half-done."""

    def __init__(self, journal: Path, name: str):
        self.name = name
        done: list[dict] = []
        self.pending: dict | None = None
        for line in journal.read_text().splitlines():
            e = json.loads(line)
            self.pending = e if e["phase"] == "begin" else None
            if e["phase"] == "done":
                done.append(e)
        last_durable = max((k + 1 for k, e in enumerate(done) if durable(e)), default=0)
        self.kept: dict[str, str] = {}
        self.snapshots: dict[str, dict[str, str]] = {}
        for e in done[:last_durable]:
            apply_step(self.kept, e)
            if e["op"] == "snapshot":
                self.snapshots[e["name"]] = dict(self.kept)
        self.tail = done[last_durable:] + ([self.pending] if self.pending else [])

    def cuts(self) -> list[tuple[dict[str, str], dict | None]]:
        """(the tree expected, the step just past the cut) for every cut of the tail, the
        longest first."""
        state, out = dict(self.kept), []
        for k in range(len(self.tail) + 1):
            out.append((dict(state), self.tail[k] if k < len(self.tail) else None))
            if k < len(self.tail):
                apply_step(state, self.tail[k])
        return out[::-1]

    def check_live(self, mnt: Path) -> None:
        live = tree_of(mnt, self.name)
        closest: list[str] | None = None
        for expected, past in self.cuts():
            bad = [f"{p} (expected {expected.get(p, 'nothing')[:12]}, found "
                   f"{live.get(p, 'nothing')[:12]})" for p in sorted(set(live) | set(expected))
                   if live.get(p) != expected.get(p) and not partly_done(past, p, mnt)]
            if not bad:
                return
            closest = bad if closest is None or len(bad) < len(closest) else closest
        raise AssertionError(f"writer {self.name}: the live tree is the state after no cut of "
                             f"the {len(self.tail)} steps past its last durable one; the "
                             f"closest cut differs at {'; '.join(closest[:10])}")

    def check_snapshots(self, m) -> None:
        listed = snapshot_names(m)
        assert set(self.snapshots) <= set(listed), (self.snapshots.keys(), listed)
        p = self.pending or {}
        if p.get("op") == "snapshot" and p["name"] in listed:    # made, but not reported
            assert (m.mnt / ".snapshot" / p["name"]).is_dir()
        for name, state in self.snapshots.items():
            assert tree_of(m.mnt / ".snapshot" / name, self.name) == state, name

def wait_for(journal: Path, predicate, limit: float = 60.0) -> None:
    """Wait until the journal's events satisfy ``predicate`` (the limit guards a hang)."""
    deadline = time.monotonic() + limit
    while True:
        text = journal.read_text() if journal.exists() else ""
        events = [json.loads(x) for x in text.split("\n")[:-1]]    # whole lines only
        if predicate(events):
            return
        assert time.monotonic() < deadline, f"the workload stalled after {len(events)} events"
        time.sleep(0.02)


def done_count(n):
    return lambda events: sum(e["phase"] == "done" for e in events) >= n


def snapshot_begun(n):
    return lambda events: sum(e["op"] == "snapshot" and e["phase"] == "begin"
                              for e in events) >= n


MOMENTS = {
    "early": (done_count(6), 0.0),                 # first files, the growing file's start
    "busy": (done_count(40), 0.0),                 # several snapshots taken already
    "in-snapshot": (snapshot_begun(3), 0.35),      # snapctl create on its way or running
}


@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_kill_9_during_a_workload_loses_nothing_promised(mounted, tmp_path, moment):
    """What a writer did up to its last fsync or snapshot survives exactly, and so does every
    snapshot that returned; of what it did after, only a tail can be lost (Promises)."""
    when, then_sleep = MOMENTS[moment]
    writers = []
    for n, snaps in (("a", "1"), ("b", "0")):      # two writers; one also takes snapshots
        journal = tmp_path / f"journal-{n}.jsonl"
        writers.append((journal, subprocess.Popen(
            [sys.executable, "-c", WORKLOAD, str(mounted.mnt), n, str(journal), snaps],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")))
    for journal, _ in writers:                     # both under way, then the moment
        wait_for(journal, done_count(4))
    wait_for(writers[0][0], when)
    time.sleep(then_sleep)
    mounted.kill9()
    for _, proc in writers:
        assert proc.wait(timeout=60) != 0          # each one was cut off by the crash
    fsck_clean(mounted.store)                      # straight after the crash
    mounted.mount()
    for n, (journal, _) in zip("ab", writers):
        promised = Promises(journal, n)
        promised.check_live(mounted.mnt)
        promised.check_snapshots(mounted)
    assert Promises(writers[0][0], "a").snapshots or moment == "early"
    mounted.umount()
    fsck_clean(mounted.store)


# ---- kill -9 during reclamation, a rollback, with an open unlinked file --------------------

def test_kill_9_while_a_deleted_snapshot_is_reclaimed(make_mount):
    m = make_mount(chunk_size="4K")                # many chunk versions: many GC batches
    big = os.urandom(24 << 20)
    (m.mnt / "big").write_bytes(big)
    (m.mnt / "small").write_text("stays")
    m.snapctl("create", "s1")
    (m.mnt / "big").unlink()
    m.snapctl("create", "s2")
    digests = chunk_digests(big, 4096)
    assert stored_blobs(m.store, digests) == digests     # s1 still holds the data
    m.snapctl("delete", "s1")                      # reclamation runs in the background
    m.kill9()
    fsck_clean(m.store)                            # whatever part of it had committed
    m.mount()                                      # the collector resumes
    assert snapshot_names(m) == ["s2"]
    assert not (m.mnt / ".snapshot/s1").exists()
    assert (m.mnt / ".snapshot/s2/small").read_text() == "stays"
    assert not (m.mnt / ".snapshot/s2/big").exists()
    wait_until_reclaimed(m.store, digests)
    m.umount()
    fsck_clean(m.store)


def _rollback_workload(m) -> tuple[dict, dict]:
    """A snapshot 'base', then changes to undo: a big 4K-chunked file overwritten (thousands
    of chunk records to re-point), files added, removed and renamed. Returns the tree at the
    snapshot and the live tree before the rollback."""
    (m.mnt / "dir").mkdir()
    for i in range(10):
        (m.mnt / "dir" / f"f{i}").write_bytes(os.urandom(3000 + i))
    (m.mnt / "big").write_bytes(os.urandom(12 << 20))
    m.snapctl("create", "base")
    (m.mnt / "big").write_bytes(os.urandom(12 << 20))
    for i in range(0, 10, 3):
        (m.mnt / "dir" / f"f{i}").unlink()
    os.rename(m.mnt / "dir" / "f1", m.mnt / "f1-moved")
    (m.mnt / "new").mkdir()
    for i in range(200):
        (m.mnt / "new" / f"n{i}").write_bytes(b"n%d" % i)
    return tree(m.mnt / ".snapshot/base"), tree(m.mnt)


@pytest.mark.parametrize("delay", [0.01, 0.05, 0.1])
def test_kill_9_during_a_rollback_is_all_or_nothing(make_mount, delay):
    m = make_mount(chunk_size="4K")
    at_base, before = _rollback_workload(m)
    assert at_base != before
    answer: list = []

    def roll_back():                               # snapctl's request, without its start-up
        try:
            answer.append(control.request(m.store, {"op": "rollback", "name": "base",
                                                    "force": True}))
        except (control.ControlError, OSError) as e:      # cut off by the kill
            answer.append(e)
    asker = threading.Thread(target=roll_back)
    asker.start()
    time.sleep(delay)
    m.kill9()
    asker.join(timeout=60)
    fsck_clean(m.store)
    m.mount()
    now = tree(m.mnt)
    if answer and isinstance(answer[0], dict):     # it said it was done: it is
        assert now == at_base
    else:
        assert now in (at_base, before), "a rollback cut off half-way"
    assert snapshot_names(m) == ["base"]
    m.umount()
    fsck_clean(m.store)


def test_an_open_unlinked_file_is_reclaimed_at_the_next_mount(mounted):
    data = os.urandom(5 << 20)
    (mounted.mnt / "keep").write_text("kept")
    h = open(mounted.mnt / "tmp", "w+b")
    h.write(data)
    h.flush()
    os.fsync(h.fileno())
    os.unlink(mounted.mnt / "tmp")
    os.fsync(h.fileno())        # the unlink is committed: kill -9 may take back the calls
    h.seek(0)                   # answered in the last milliseconds, and a fast read left
    assert h.read() == data     # it uncommitted (alive while open)
    mounted.kill9()
    try:
        h.close()
    except OSError:                                # its mount is gone
        pass
    digests = chunk_digests(data, 1 << 20)
    with raw_store(mounted.store) as (txn, db):    # the crash left it behind, recorded
        assert txn.stat(db["orphans"])["entries"] == 1
    assert stored_blobs(mounted.store, digests) == digests
    fsck_clean(mounted.store)
    mounted.mount()                                # deletes the orphan
    assert os.listdir(mounted.mnt) == ["keep"]
    wait_until_reclaimed(mounted.store, digests)
    mounted.umount()
    with raw_store(mounted.store) as (txn, db):
        assert txn.stat(db["orphans"])["entries"] == 0
    fsck_clean(mounted.store)


def test_data_buffered_in_a_file_left_open_is_committed_once_it_expires(make_mount,
                                                                         monkeypatch):
    """A file kept open and written without close or fsync (a log, a database): its dirty
    chunks are committed once they are MOUNTFS_DIRTY_EXPIRE old, so a kill -9 takes at most
    that much of it (before, they stayed in memory until a close, however long)."""
    monkeypatch.setenv("MOUNTFS_DIRTY_EXPIRE", "1")
    m = make_mount()
    head, tail = os.urandom(300_000), os.urandom(5000)
    h = open(m.mnt / "open", "wb", buffering=0)
    h.write(head)                                    # a partial first chunk
    h.seek((1 << 20) + 4096)
    h.write(tail)                                    # and a piece of the second
    chunks = head, bytes(4096) + tail                # as buffered: no zeros past a write
    digests = {blake3.blake3(c).digest() for c in chunks}
    deadline = time.monotonic() + 60                 # only keeps a broken expiry from hanging
    while stored_blobs(m.store, digests) != digests:
        assert time.monotonic() < deadline, "buffered chunks were never committed"
        time.sleep(0.2)
    m.kill9()
    try:
        h.close()
    except OSError:                                  # its mount is gone
        pass
    fsck_clean(m.store)
    m.mount()
    assert (m.mnt / "open").read_bytes() == head + bytes((1 << 20) - len(head)) + chunks[1]
    m.umount()
    fsck_clean(m.store)


# ---- kill -9 while many operations share one group commit -----------------------------------

METADATA_WORKLOAD = r'''
"""Small operations as fast as they go (no fsync): creates, a refused mkdir (its failed step
shares a commit with others' steps), renames, chmod, xattrs. An iteration is journalled once
all its calls returned. With sync_after >= 0, after that many iterations one fsync of the
mount's root directory (fsyncdir), journalled once it returned."""
import json, os, sys

mnt, name, journal, sync_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
out = open(journal, "a")
os.mkdir(f"{mnt}/{name}")
for i in range(10**6):
    if i == sync_after:
        fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)
        out.write(json.dumps({"fsyncdir": i}) + "\n")
        out.flush()
    path = f"{mnt}/{name}/f{i}"
    with open(path, "wb") as h:
        h.write(b"%d" % i * 50)
    try:
        os.mkdir(f"{mnt}/{name}")
    except FileExistsError:
        pass
    if i % 3 == 0:
        os.rename(path, path + "r")
        path += "r"
    os.chmod(path, 0o600 + i % 64)
    os.setxattr(path, "user.i", b"%d" % i)
    out.write(json.dumps({"i": i}) + "\n")
    out.flush()
'''


def start_metadata_writers(m, tmp_path: Path, names: str, sync_after: int = -1):
    journals = [tmp_path / f"meta-{n}.jsonl" for n in names]
    procs = [subprocess.Popen([sys.executable, "-c", METADATA_WORKLOAD, str(m.mnt), n, str(j),
                               str(sync_after)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd="/")
             for n, j in zip(names, journals)]
    return journals, procs


def journalled(journal: Path) -> list[dict]:
    """The journal's entries (its iterations that returned, its fsyncdir), in order."""
    return [json.loads(line) for line in journal.read_text().splitlines()]


def iterations(journal: Path) -> int:
    return sum("i" in e for e in journalled(journal))


def final_name(i: int) -> str:
    return f"f{i}r" if i % 3 == 0 else f"f{i}"


def finished(i: int) -> tuple:
    """(name, data, mode, xattr) of iteration i's file once all its calls returned."""
    return final_name(i), b"%d" % i * 50, 0o600 + i % 64, b"%d" % i


def half_done(i: int) -> set[tuple]:
    """What a cut in the middle of iteration i can leave besides nothing, in the order of its
    calls: the file created, empty; with its data (the close); renamed; chmod'ed. Never the
    xattr: that is the last call, after it the iteration is finished."""
    mask = os.umask(0)                             # the writers inherit ours
    os.umask(mask)
    made = 0o666 & ~mask
    name, data, mode, _ = finished(i)
    return {(f"f{i}", b"", made, None), (f"f{i}", data, made, None), (name, data, made, None),
            (name, data, mode, None)}


def seen(d: Path, name: str) -> tuple:
    """(name, data, mode, xattr) of the file ``name`` in ``d`` through the mount."""
    try:
        xattr = os.getxattr(d / name, "user.i")
    except OSError as e:
        assert e.errno == errno.ENODATA, e
        xattr = None
    return name, (d / name).read_bytes(), (d / name).stat().st_mode & 0o777, xattr


def surviving_prefix(mnt: Path, name: str, returned: int) -> int:
    """How many iterations of writer ``name`` survived, checking that they are a prefix:
    iterations 0..k-1 there exactly, iteration k (the first one missing) absent or half done,
    nothing of any later one. ``returned`` iterations were journalled; the next one may have
    finished without being journalled, none after it began."""
    d = mnt / name
    names = set(os.listdir(d))
    k = 0
    while k <= returned and final_name(k) in names and seen(d, final_name(k)) == finished(k):
        k += 1
    left = [seen(d, n) for n in sorted(names - {final_name(i) for i in range(k)})]
    allowed = half_done(k) if k <= returned else set()
    assert len(left) <= 1 and set(left) <= allowed, \
        f"writer {name}: past its first {k} iterations (of {returned} that returned), found " \
        f"{[(n, len(data), oct(mode), x) for n, data, mode, x in left[:10]]}"
    return k


def stored(view: View, path: str) -> tuple | None:
    """(data, mode, xattr) of the file at ``path`` in a view of the store."""
    try:
        ino = view.resolve(path)
    except FsError:
        return None
    rec = view.get(ino)
    return view.read(ino, 0, rec.size, rec.size), rec.mode & 0o777, view.xattr(ino, b"user.i")


def not_on_disk(store: Path, wanted: dict[str, tuple]) -> list[str]:
    """Which of ``wanted`` (path -> (data, mode, xattr)) the store on disk does not hold yet,
    as another process reading it sees it (as a kill -9 would leave it)."""
    with raw_store(store) as (txn, db):
        meta = db["meta"]
        view = View(txn, db, S.from_u64(txn.get(b"live_epoch", db=meta)),
                    S.U32.unpack(txn.get(b"chunk_size", db=meta))[0])
        return [path for path, want in wanted.items() if stored(view, path) != want]


def wait_on_disk(store: Path, wanted: dict[str, tuple], limit: float = 60.0) -> None:
    """Wait until the store on disk holds ``wanted``: changes that returned are committed
    soon, with no fsync asking (the limit only guards a hang)."""
    deadline = time.monotonic() + limit
    while missing := not_on_disk(store, wanted):
        assert time.monotonic() < deadline, \
            f"{len(missing)} changes that returned never reached the store, e.g. {missing[:5]}"
        time.sleep(0.1)


def test_kill_9_during_group_commits_keeps_a_prefix_of_each_writer(mounted, tmp_path):
    """Concurrent writers' steps are committed together, soon after they return and without
    any fsync (the store on disk shows them to another process); a step that fails (EEXIST)
    must not take others with it. A kill -9 may take only a tail of each writer's calls:
    what survives of it is a prefix of its journal, the iteration at the cut possibly half
    done, and holds at least everything seen committed before the kill."""
    names = "abcd"
    journals, procs = start_metadata_writers(mounted, tmp_path, names)
    for j in journals:
        wait_for(j, lambda events: len(events) >= 150)
    wait_on_disk(mounted.store, {f"{n}/{final_name(i)}": finished(i)[1:]
                                 for n in names for i in range(100)})
    mounted.kill9()
    for proc in procs:
        assert proc.wait(timeout=60) != 0
    fsck_clean(mounted.store)
    mounted.mount()
    for n, j in zip(names, journals):
        assert surviving_prefix(mounted.mnt, n, iterations(j)) >= 100, n
    mounted.umount()
    fsck_clean(mounted.store)


def test_kill_9_right_after_an_fsyncdir_keeps_everything_before_it(mounted, tmp_path):
    """An fsync of a directory commits and syncs every change that returned before it (here
    the root's: the changes are all below it): a kill -9 right after it loses none of them,
    and of the changes made after it only a tail, as a prefix survives."""
    [journal], [proc] = start_metadata_writers(mounted, tmp_path, "a", sync_after=300)
    wait_for(journal, lambda events: any("fsyncdir" in e for e in events))
    mounted.kill9()
    assert proc.wait(timeout=60) != 0
    fsck_clean(mounted.store)
    mounted.mount()
    synced = next(e["fsyncdir"] for e in journalled(journal) if "fsyncdir" in e)
    assert surviving_prefix(mounted.mnt, "a", iterations(journal)) >= synced
    mounted.umount()
    fsck_clean(mounted.store)
