"""snapctl verify: bucket-hash comparison of a mirror with its source, finding and repairing
a tampered entry, a corrupted chunk and a lost chunk."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from mountfs import schema as S
from mountfs import snapshots
from mountfs.namespace import Live
from mountfs.store import Store
from replicator.endpoints import LocalMirror
from replicator.verify import verify

from conftest import cli
from test_replicate import assert_mirror_equals, send


def run_verify(m, mirror: Path, *args, as_json: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cmdline.snapctl", "-m", str(m.mnt), "verify",
                           "--mirror", f"file://{mirror}", *(["--json"] if as_json else []),
                           *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def replicated(spark, mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "dir").mkdir()
    for i in range(20):
        (m.mnt / "dir" / f"f{i}").write_bytes(os.urandom(50_000 + i))
    os.setxattr(m.mnt / "dir", "user.k", b"v")
    m.snapctl("create", "s1")
    send(m, mirror, "s1")
    return m, mirror


def test_an_exact_mirror_verifies_clean(replicated):
    m, mirror = replicated
    res = run_verify(m, mirror)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["clean"] and out["mismatched_buckets"] == {"snapshot": 0}
    assert out["buckets"] == 1024
    full = json.loads(run_verify(m, mirror, "--full").stdout)
    assert full["clean"] and full["bad_chunks"] == {"missing": [], "corrupt": []}
    as_replicate_names_it = m.snapctl("verify", "--to", f"file://{mirror}", check=False)
    assert as_replicate_names_it.returncode == 0, as_replicate_names_it.stderr


def tamper_live(mirror: Path) -> None:
    """Someone changed the mirror's tree through the store: a file gone, one added, a mode."""
    store = Store.open(mirror)
    try:
        with store.write() as txn:
            live = Live(txn, store.db, snapshots.live_epoch(txn, store.db), store.chunk_size)
            d = live.lookup(S.ROOT_INO, b"dir")
            ino, _ = live.unlink(d, b"f3")
            live.destroy(ino)
            live.create(d, b"intruder", stat.S_IFREG | 0o644, 0, 0)
            f5 = live.lookup(d, b"f5")
            live.setattr(f5, mode=stat.S_IFREG | 0o777)
    finally:
        store.close()


def test_tampered_entries_are_found_and_repaired(replicated, tmp_path):
    m, mirror = replicated
    tamper_live(mirror)
    res = run_verify(m, mirror)
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["mismatched_buckets"]["snapshot"] == 0          # the snapshot is intact
    assert 0 < out["mismatched_buckets"]["live"] <= 6
    text = "\n".join(out["differences"])
    assert "entry 'f3'" in text and "entry 'intruder'" in text
    res = run_verify(m, mirror, "--repair")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["repaired"]
    assert json.loads(run_verify(m, mirror).stdout)["clean"]
    assert_mirror_equals(m, mirror, "s1", tmp_path)
    (m.mnt / "later").write_text("the next cycle goes on from the repaired base")
    m.snapctl("create", "s2")
    assert send(m, mirror, "s2").base == "s1"
    assert_mirror_equals(m, mirror, "s2", tmp_path)


def test_a_promoted_mirror_is_never_repaired(replicated):
    """A promoted mirror still holds the source's newest snapshot, but its tree is its own
    now: --repair must not rewrite it to the source's (it did)."""
    m, mirror = replicated
    cli("mountfs", "promote", mirror)
    tamper_live(mirror)                               # its users' changes
    res = run_verify(m, mirror, "--repair")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "no longer a mirror (it was promoted)" in res.stderr
    store = Store.open(mirror, readonly=True, lock=False)
    try:
        with store.read() as txn:
            live = Live(txn, store.db, snapshots.live_epoch(txn, store.db), store.chunk_size)
            assert live.lookup(live.lookup(S.ROOT_INO, b"dir"), b"intruder") is not None
    finally:
        store.close()


def damage_chunk(mirror: Path, delete: bool) -> str:
    """Corrupt or delete one chunk's data under the store (a disk error, a bad tool)."""
    env = lmdb.open(str(mirror), max_dbs=len(S.DB_NAMES) + 2, map_size=1 << 40)
    blobs = env.open_db(b"blobs")
    with env.begin(write=True) as txn:
        digest, data = next(iter(txn.cursor(db=blobs)))
        digest = bytes(digest)
        if delete:
            txn.delete(digest, db=blobs)
        else:
            txn.put(digest, b"\xff" + bytes(data)[1:], db=blobs)
    env.close()
    return digest.hex()


@pytest.mark.parametrize("delete", [False, True], ids=["corrupt", "deleted"])
def test_damaged_chunks_are_found_by_full_and_repaired(replicated, tmp_path, delete):
    m, mirror = replicated
    digest = damage_chunk(mirror, delete)
    assert json.loads(run_verify(m, mirror).stdout)["clean"]   # buckets cannot see it...
    res = run_verify(m, mirror, "--full")                        # ...a scrub does
    assert res.returncode == 1
    bad = json.loads(res.stdout)["bad_chunks"]
    assert bad == {"missing": [digest] if delete else [], "corrupt": [] if delete else [digest]}
    text = run_verify(m, mirror, "--full", as_json=False).stdout.splitlines()
    assert text[0] == f"chunk data {'missing' if delete else 'corrupt'}: {digest}"
    assert text[-1].endswith(": 1024 buckets compared, mismatched: snapshot 0; chunk data "
                             f"scrubbed, {int(delete)} missing, {int(not delete)} corrupt")
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 1
    res = run_verify(m, mirror, "--full", "--repair")
    assert res.returncode == 0, res.stdout + res.stderr
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0
    assert_mirror_equals(m, mirror, "s1", tmp_path)


def test_verify_errors(replicated, tmp_path):
    m, mirror = replicated
    res = run_verify(m, mirror, "--snapshot", "nope")
    assert res.returncode == 2 and "no snapshot named 'nope'" in res.stderr
    res = run_verify(m, tmp_path / "nowhere")
    assert res.returncode == 2 and "no such store" in res.stderr
    m.snapctl("create", "s2")
    res = run_verify(m, mirror, "--snapshot", "s2")
    assert res.returncode == 2 and "does not hold snapshot 's2'" in res.stderr


def test_verify_in_process_counts_only_mismatched_buckets(replicated):
    m, mirror = replicated
    tamper_live(mirror)
    lm = LocalMirror(mirror, 1 << 20, create=False)
    try:
        result = verify(str(m.store), lm)
    finally:
        lm.close()
    assert not result.clean
    assert {d.where for d in result.differences} == {"live"}
