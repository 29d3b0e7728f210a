"""Bad input gets one clear line and a non-zero status, and nothing committed is lost:
stores that are missing, foreign, busy or of another format, a full disk, a corrupt chunk,
and kill -9 of the mount in the middle of a workload."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

from mountfs import schema as S
from conftest import Mount, cli, fsck_clean


def fails_clearly(*args, code=1, contains="") -> str:
    res = cli(*args, check=False)
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert contains in res.stderr, res.stderr
    return res.stderr


def test_mkfs_refuses_what_is_not_empty(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy/file").write_text("someone's data")
    fails_clearly("mountfs", "mkfs", tmp_path / "busy", contains="is not empty")
    assert (tmp_path / "busy/file").read_text() == "someone's data"
    cli("mountfs", "mkfs", tmp_path / "s")
    fails_clearly("mountfs", "mkfs", tmp_path / "s", contains="is not empty")
    fails_clearly("mountfs", "mkfs", "--chunk-size", "3000", tmp_path / "odd",
                  contains="power of two")


def test_mount_refuses_bad_stores_and_mountpoints(store, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fails_clearly("mountfs", "mount", tmp_path / "nowhere", mnt, contains="no such store")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign/x").write_text("x")
    fails_clearly("mountfs", "mount", tmp_path / "foreign", mnt, contains="not a mountfs store")
    fails_clearly("mountfs", "mount", store, tmp_path / "no-mnt", contains="does not exist")
    fails_clearly("mountfs", "umount", mnt, contains="not")
    fails_clearly("snapctl", "-m", tmp_path, "list", code=1, contains="not in a mountfs")


def test_a_store_is_mounted_once(make_mount, tmp_path):
    m = make_mount()
    other = tmp_path / "other"
    other.mkdir()
    fails_clearly("mountfs", "mount", m.store, other, contains="is in use")
    (m.mnt / "still").write_text("works")
    assert (m.mnt / "still").read_text() == "works"
    fails_clearly("mountfs", "fsck", m.store, code=2, contains="is in use")


def test_a_store_of_another_format_is_refused(store, tmp_path):
    env = lmdb.open(str(store), max_dbs=len(S.DB_NAMES) + 2, map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"format", S.U32.pack(S.FORMAT_VERSION + 7), db=env.open_db(b"meta", txn=txn))
    env.close()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for args in (("mountfs", "mount", store, mnt), ("mountfs", "fsck", store)):
        err = fails_clearly(*args, code=1 if args[1] == "mount" else 2)
        assert str(S.FORMAT_VERSION + 7) in err and str(S.FORMAT_VERSION) in err


@pytest.fixture
def small_disk(tmp_path):
    path = tmp_path / "small"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(path)], check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_reaches_the_writer_and_loses_nothing(make_mount, small_disk):
    store = small_disk / "store"
    cli("mountfs", "mkfs", store)
    m = make_mount(store)
    keep = os.urandom(2 << 20)
    with open(m.mnt / "keep", "wb") as h:
        h.write(keep)
        os.fsync(h.fileno())
    with pytest.raises(OSError) as info:
        with open(m.mnt / "flood", "wb") as h:
            for _ in range(200):
                h.write(os.urandom(1 << 20))
            os.fsync(h.fileno())
    assert info.value.errno == errno.ENOSPC
    os.unlink(m.mnt / "flood")
    assert (m.mnt / "keep").read_bytes() == keep
    (m.mnt / "after").write_text("space again")        # the mount still works
    m.umount()
    m.mount()
    assert (m.mnt / "keep").read_bytes() == keep and (m.mnt / "after").exists()
    m.umount()
    fsck_clean(store)                                  # before the small disk goes away
    m.check_fsck = False


def test_a_corrupt_chunk_is_found_by_fsck_and_never_served(make_mount):
    m = make_mount()
    data = os.urandom(300_000)
    (m.mnt / "f").write_bytes(data)
    m.umount()
    m.check_fsck = False                               # it is corrupt on purpose
    env = lmdb.open(str(m.store), max_dbs=len(S.DB_NAMES) + 2, map_size=1 << 30)
    blobs = env.open_db(b"blobs")
    with env.begin(write=True) as txn:
        digest, value = next(iter(txn.cursor(db=blobs)))
        digest = bytes(digest)
        txn.put(digest, bytes(value)[:-1] + b"\0" if value[-1] else bytes(value)[:-1] + b"\1",
                db=blobs)
    env.close()
    res = cli("mountfs", "fsck", "-q", m.store, check=False)
    assert res.returncode == 1 and f"chunk {digest.hex()[:16]}" in res.stdout
    assert "does not match its digest" in res.stdout
    m.mount()
    with pytest.raises(OSError) as info:
        (m.mnt / "f").read_bytes()
    assert info.value.errno == errno.EIO


# ---- kill -9 ------------------------------------------------------------------------------

WORKLOAD = r"""
import hashlib, json, os, subprocess, sys
mnt, out = sys.argv[1], sys.argv[2]
os.makedirs(f"{mnt}/w", exist_ok=True)
with open(out, "a") as log:
    for i in range(100000):
        data = os.urandom(200_000 + i)
        path = f"{mnt}/w/f{i}"
        with open(path, "wb") as h:
            h.write(data)
            h.flush()
            os.fsync(h.fileno())
        log.write(json.dumps({"fsynced": path, "sha": hashlib.sha256(data).hexdigest()}) + "\n")
        log.flush()
        if i % 3 == 0:
            os.rename(path, path + ".renamed")
            log.write(json.dumps({"renamed": path}) + "\n")
            log.flush()
        if i % 5 == 0:
            name = f"s{i}"
            if subprocess.run([sys.executable, "-m", "mountfs.snapctl", "-m", mnt, "create",
                               name], capture_output=True).returncode == 0:
                log.write(json.dumps({"snapshot": name}) + "\n")
                log.flush()
"""


@pytest.mark.parametrize("delay", [0.7, 2.0, 4.0])
def test_kill_9_during_writes_loses_nothing_committed(mounted, tmp_path, delay):
    journal = tmp_path / "journal.jsonl"
    worker = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(mounted.mnt), str(journal)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    mounted.kill9()
    worker.wait(timeout=60)
    fsck_clean(mounted.store)                         # straight after the crash
    mounted.mount()
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    assert events, "the workload did nothing before the kill"
    renamed = {e["renamed"] for e in events if "renamed" in e}
    for e in events:
        if "fsynced" in e:
            path = Path(e["fsynced"] + (".renamed" if e["fsynced"] in renamed else ""))
            assert hashlib.sha256(path.read_bytes()).hexdigest() == e["sha"], path
        if "snapshot" in e:
            assert (mounted.mnt / ".snapshot" / e["snapshot"] / "w").is_dir()


def test_kill_9_during_snapshot_delete_and_rollback(mounted):
    (mounted.mnt / "big").write_bytes(os.urandom(30 << 20))
    mounted.snapctl("create", "s1")
    (mounted.mnt / "big").unlink()
    mounted.snapctl("create", "s2")
    mounted.snapctl("delete", "s1")                    # reclamation runs in the background
    mounted.kill9()
    fsck_clean(mounted.store)
    mounted.mount()
    mounted.snapctl("restore", "s2", "--force")
    mounted.kill9()
    fsck_clean(mounted.store)
    mounted.mount()
    listed = mounted.snapctl("list", "--json").stdout.splitlines()
    assert [json.loads(line)["name"] for line in listed] == ["s2"]


def test_an_open_unlinked_file_is_cleaned_up_after_a_crash(mounted):
    h = open(mounted.mnt / "tmp", "wb")
    h.write(os.urandom(5 << 20))
    h.flush()
    os.unlink(mounted.mnt / "tmp")
    mounted.kill9()
    try:
        h.close()
    except OSError:                                     # its mount is gone
        pass
    mounted.mount()                                     # deletes the orphan at mount
    assert os.listdir(mounted.mnt) == []


def test_fsck_reports_problems_with_exit_1(make_mount):
    m = make_mount()
    (m.mnt / "f").write_text("x")
    m.umount()
    m.check_fsck = False
    env = lmdb.open(str(m.store), max_dbs=len(S.DB_NAMES) + 2, map_size=1 << 30)
    refs = env.open_db(b"refs")
    with env.begin(write=True) as txn:
        digest, count = next(iter(txn.cursor(db=refs)))
        txn.put(bytes(digest), S.u64(S.from_u64(bytes(count)) + 5), db=refs)
    env.close()
    res = cli("mountfs", "fsck", "-q", m.store, check=False)
    assert res.returncode == 1 and "reference count 6, but 1 chunk-map version(s)" in res.stdout
