"""Crash safety: kill -9 of the mount process at several moments (a write workload with
fsyncs, renames, mkdirs and snapshots; reclamation after a snapshot delete; a rollback; an
unlinked-but-open file), then remount. The mount must come up, everything the filesystem
promised before the kill must be there exactly, and fsck must find the store consistent both
straight after the crash and after the remount."""

from __future__ import annotations

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

from mountfs import control
from mountfs import schema as S

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
    """Which of ``digests`` still have their data in the store."""
    with raw_store(store) as (txn, db):
        return {d for d in digests if txn.get(d, db=db["blobs"]) is not None}


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
grow = open(f"{mnt}/{name}/grow", "ab")            # one file kept open and growing
for i in range(10**6):
    d = f"{name}/d{i // 4}"
    if i % 4 == 0:
        step("mkdir", lambda: os.mkdir(f"{mnt}/{d}"), path=d)
    size = 40_000 + (i % 7) * 30_000 + (1_300_000 if i % 9 == 8 else 0)   # some span chunks
    data = os.urandom(size)
    step("write", lambda: write(f"{d}/f{i}", data, sync=i % 2 == 0), path=f"{d}/f{i}")
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


class Promises:
    """What a writer's journal says the filesystem must hold: files whose write returned
    (closed, some fsync'ed) with their content, the growing file's fsync'ed content, the
    directories made, every snapshot with the state at its creation, and the one step that
    had begun but not returned at the kill (it may or may not have happened)."""

    def __init__(self, journal: Path):
        self.files: dict[str, str] = {}
        self.grown: dict[str, tuple[int, str]] = {}
        self.dirs: set[str] = set()
        self.snapshots: dict[str, tuple[dict, dict, set]] = {}
        self.pending: dict | None = None
        for line in journal.read_text().splitlines():
            self._apply(json.loads(line))

    def _apply(self, e: dict) -> None:
        if e["phase"] == "begin":
            self.pending = e
            return
        self.pending = None
        if e["op"] == "mkdir":
            self.dirs.add(e["path"])
        elif e["op"] == "write":
            self.files[e["path"]] = e["sha"]
        elif e["op"] == "append":
            self.grown[e["path"]] = (e["size"], e["sha"])
        elif e["op"] == "rename":
            self.files[e["dst"]] = self.files.pop(e["src"])
        elif e["op"] == "snapshot":
            self.snapshots[e["name"]] = (dict(self.files), dict(self.grown), set(self.dirs))

    def check_live(self, mnt: Path) -> None:
        p = self.pending or {}
        for d in self.dirs:
            assert (mnt / d).is_dir(), d
        for path, digest in self.files.items():
            if p.get("op") == "rename" and p["src"] == path and not (mnt / path).exists():
                path = p["dst"]                    # the rename reached the mount
            assert sha((mnt / path).read_bytes()) == digest, path
        for path, (size, digest) in self.grown.items():
            data = (mnt / path).read_bytes()
            if p.get("op") == "append" and p["path"] == path:
                assert sha(data[:size]) == digest, f"{path}: fsync'ed prefix lost"
            else:
                assert len(data) == size and sha(data) == digest, path

    def check_snapshots(self, m) -> None:
        listed = snapshot_names(m)
        assert set(self.snapshots) <= set(listed), (self.snapshots.keys(), listed)
        p = self.pending or {}
        if p.get("op") == "snapshot" and p["name"] in listed:    # made, but not reported
            assert (m.mnt / ".snapshot" / p["name"]).is_dir()
        for name, (files, grown, dirs) in self.snapshots.items():
            top = m.mnt / ".snapshot" / name
            for d in dirs:
                assert (top / d).is_dir(), (name, d)
            for path, digest in list(files.items()) + [(k, v[1]) for k, v in grown.items()]:
                assert sha((top / path).read_bytes()) == digest, (name, path)


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
    for journal, _ in writers:
        promised = Promises(journal)
        promised.check_live(mounted.mnt)
        promised.check_snapshots(mounted)
    assert Promises(writers[0][0]).snapshots or moment == "early"
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
    h.seek(0)
    assert h.read() == data                        # alive while open
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
shares a commit with others' steps), renames, chmod, xattrs. 'done' once each call returned."""
import json, os, sys

mnt, name, journal = sys.argv[1], sys.argv[2], sys.argv[3]
out = open(journal, "a")
os.mkdir(f"{mnt}/{name}")
for i in range(10**6):
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
    out.write(json.dumps({"path": os.path.relpath(path, mnt), "i": i}) + "\n")
    out.flush()
'''


def test_kill_9_during_group_commits_loses_no_returned_operation(mounted, tmp_path):
    """Concurrent writers' steps are committed together; a step that fails (EEXIST) must not
    take others with it, and nothing whose call returned may be lost to a kill -9."""
    journals = [tmp_path / f"meta-{n}.jsonl" for n in "abcd"]
    procs = [subprocess.Popen([sys.executable, "-c", METADATA_WORKLOAD, str(mounted.mnt), n,
                               str(j)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              cwd="/") for n, j in zip("abcd", journals)]
    for j in journals:
        wait_for(j, lambda events: len(events) >= 150)
    mounted.kill9()
    for proc in procs:
        assert proc.wait(timeout=60) != 0
    fsck_clean(mounted.store)
    mounted.mount()
    checked = 0
    for j in journals:
        for line in j.read_text().splitlines():
            e = json.loads(line)
            p = mounted.mnt / e["path"]
            assert p.read_bytes() == b"%d" % e["i"] * 50, e
            assert p.stat().st_mode & 0o777 == 0o600 + e["i"] % 64, e
            assert os.getxattr(p, "user.i") == b"%d" % e["i"], e
            checked += 1
    assert checked >= 600
    mounted.umount()
    fsck_clean(mounted.store)
