"""The changeset travels in bounded parts (issue 11 point 3): staged on the receiver under
the cycle's transfer id, named by digest in the commit, applied part by part: in one
transaction, or, past MOUNTFS_COMMIT_BATCH records, in several with the snapshot in the last. A real ``mountfs serve-mirror`` on loopback, real mounts; Spark kept
out (every transfer is small enough to go from the source process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import httpx
import pytest
import zstandard

from mountfs.store import Store
from replicator import changeset
from replicator.changeset import Changeset
from replicator.mirror import part_key

from conftest import TOKEN, cli
from test_replicate import (assert_mirror_equals, churn, mirror_info, populate, send,
                            staged_count)
from test_replicate_http import send as send_http

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PART_RECORDS = 40              # parts of 40 records: a few hundred files make many parts


def many_files(root: Path, n: int, tag: str) -> None:
    d = root / f"many-{tag}"
    d.mkdir()
    for i in range(n):
        (d / f"f{i:04d}").write_bytes(f"{tag} {i}\n".encode() * (i % 7 + 1))


def committed_parts(log: str) -> list[int]:
    """The part counts of the commits the receiver logged."""
    return [int(n) for n in re.findall(
        r"committed snapshot \S+ \(\d+ names and \d+ inodes changed\) from (\d+) "
        r"changeset parts", log)]


def staged_parts(store_path: Path) -> int:
    return staged_count(store_path, key_length=len(part_key(bytes(16), 0)))


# ---- a changeset of many parts, over HTTP and to a file:// mirror ---------------------------

# A commit of more records than MOUNTFS_COMMIT_BATCH is applied in several transactions
# (an undoable change of the live tree, snapshotted in the last); the default, in one.
BATCHES = pytest.mark.parametrize("batch", [None, 60], ids=["one-transaction", "batched"])


def commit_batch(monkeypatch, batch: int | None) -> None:
    """Records per commit transaction, for the receivers and file:// mirrors started next."""
    if batch is not None:
        monkeypatch.setenv("MOUNTFS_COMMIT_BATCH", str(batch))


@BATCHES
def test_a_changeset_of_many_parts_replicates_equal_over_http(mounted, receiver, tmp_path,
                                                              monkeypatch, batch):
    m = mounted
    commit_batch(monkeypatch, batch)
    r = receiver()
    populate(m.mnt)
    many_files(m.mnt, 300, "a")
    m.snapctl("create", "s1")
    send_http(m, r.url, "s1", inline_bytes=1 << 40, part_records=PART_RECORDS)
    churn(m.mnt)
    many_files(m.mnt, 200, "b")
    for i in range(0, 300, 3):
        os.unlink(m.mnt / "many-a" / f"f{i:04d}")
    os.rename(m.mnt / "many-a", m.mnt / "docs2" / "moved-many")
    m.snapctl("create", "s2")
    second = send_http(m, r.url, "s2", inline_bytes=1 << 40, part_records=PART_RECORDS)
    assert second.base == "s1"
    r.stop()
    counts = committed_parts(r.log())
    assert len(counts) == 2 and min(counts) >= 5, r.log()
    assert staged_parts(tmp_path / "mirror") == 0          # the commit dropped its parts
    assert_mirror_equals(m, tmp_path / "mirror", "s1", tmp_path, latest=False)
    assert_mirror_equals(m, tmp_path / "mirror", "s2", tmp_path)


@BATCHES
def test_a_file_mirror_takes_the_same_parts(mounted, tmp_path, monkeypatch, batch):
    m, mirror = mounted, tmp_path / "mirror"
    commit_batch(monkeypatch, batch)
    populate(m.mnt)
    many_files(m.mnt, 150, "a")
    m.snapctl("create", "s1")
    send(m, mirror, "s1", inline_bytes=1 << 40, part_records=PART_RECORDS)
    churn(m.mnt)
    m.snapctl("create", "s2")
    send(m, mirror, "s2", inline_bytes=1 << 40, part_records=PART_RECORDS)
    assert staged_parts(mirror) == 0
    assert_mirror_equals(m, mirror, "s2", tmp_path)


def test_parts_rebuild_the_whole_changeset(mounted):
    """The parts, merged, are exactly the changeset built whole (nothing lost at a cut)."""
    m = mounted
    populate(m.mnt)
    m.snapctl("create", "s1")
    churn(m.mnt)
    many_files(m.mnt, 50, "c")
    m.snapctl("create", "s2")
    store = Store.open(m.store, readonly=True, lock=False)
    try:
        with store.read() as txn:
            from mountfs import snapshots as snaps
            e1, e2 = (snaps.get(txn, store.db, n).epoch for n in ("s1", "s2"))
            whole = changeset.build(txn, store.db, store.chunk_size, e1, e2)
            parts = list(changeset.parts(txn, store.db, store.chunk_size, e1, e2,
                                         part_records=7))
    finally:
        store.close()
    assert len(parts) > 10 and all(p.records() <= 7 for p in parts)
    merged = Changeset()
    for p in parts:
        merged.merge(p)
    assert merged.to_json() == whole.to_json()


# ---- kill -9 of either side between parts and during the commit -----------------------------

CLIENT = """
import sys
from replicator.client import HttpMirror
from replicator.cycle import replicate
mirror = HttpMirror(sys.argv[3], sys.argv[4])
replicate(sys.argv[1], mirror, sys.argv[2], inline_bytes=1 << 40, part_records=int(sys.argv[5]),
          phase=lambda text: print(text, flush=True))
print("done", flush=True)
"""


def start_client(m, url: str, snapshot: str, part_records: int = 10) -> subprocess.Popen:
    """A replication client in a process of its own (so that it can be killed -9)."""
    return subprocess.Popen([sys.executable, "-c", CLIENT, str(m.store), snapshot, url, TOKEN,
                             str(part_records)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_parts(mirror: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.monotonic() + 240
    while staged_parts(mirror) < n:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the parts never arrived"
        time.sleep(0.02)


def base_and_change(m, url: str) -> None:
    """s0 on the mirror; s1 a change of several hundred records on the source."""
    populate(m.mnt)
    m.snapctl("create", "s0")
    proc = start_client(m, url, "s0", 1000)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    churn(m.mnt)
    many_files(m.mnt, 250, "k")
    m.snapctl("create", "s1")


def assert_at_base_then_converges(m, r, tmp_path, allow_new: bool = False) -> None:
    mirror = tmp_path / "mirror"
    assert cli("mountfs", "fsck", "-q", mirror, check=False).returncode == 0
    held = [s["name"] for s in mirror_info(mirror)["snapshots"]]
    assert held == ["s0"] or (allow_new and held == ["s0", "s1"]), held
    if held == ["s0"]:
        assert_mirror_equals(m, mirror, "s0", tmp_path)     # exactly the base, nothing between
    r.start()
    proc = start_client(m, r.url, "s1")
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    r.stop()
    assert_mirror_equals(m, mirror, "s1", tmp_path)


def test_kill_9_of_the_client_between_parts(mounted, receiver, tmp_path):
    r = receiver()
    base_and_change(mounted, r.url)
    proc = start_client(mounted, r.url, "s1")
    wait_for_parts(tmp_path / "mirror", proc, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r.stop()
    assert_at_base_then_converges(mounted, r, tmp_path)


def test_kill_9_of_the_receiver_between_parts(mounted, receiver, tmp_path):
    r = receiver()
    base_and_change(mounted, r.url)
    proc = start_client(mounted, r.url, "s1")
    wait_for_parts(tmp_path / "mirror", proc, 3)
    r.kill9()
    assert proc.wait(timeout=120) != 0
    assert "cannot reach the mirror" in proc.stderr.read()
    assert_at_base_then_converges(mounted, r, tmp_path)


@pytest.mark.parametrize("side", ["client", "receiver"])
def test_kill_9_during_the_commit(mounted, receiver, tmp_path, side):
    r = receiver()
    base_and_change(mounted, r.url)
    proc = start_client(mounted, r.url, "s1", part_records=5)
    for line in proc.stdout:
        if line.startswith("committing"):
            break
    time.sleep(0.05)                      # the commit request is on its way or being applied
    if side == "client":
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(2)                     # a commit the receiver already began completes
    else:
        r.kill9()
        proc.wait(timeout=120)
    r.stop()
    assert_at_base_then_converges(mounted, r, tmp_path, allow_new=True)


def undo_mark(mirror: Path) -> bytes | None:
    """The mark of a commit under way in several transactions (or cut short), if any."""
    from mountfs.snapshots import UNDO_MARK
    try:
        store = Store.open(mirror, readonly=True, lock=False)
    except Exception:
        return None
    try:
        with store.read() as txn:
            raw = txn.get(UNDO_MARK, db=store.db["meta"])
            return bytes(raw) if raw is not None else None
    finally:
        store.close()


def test_kill_9_of_the_receiver_inside_a_commit_of_many_transactions(mounted, receiver,
                                                                      tmp_path, monkeypatch):
    """Killed while a batched commit has written some of its transactions: fsck is clean,
    the mirror reads as the base everywhere (snapshots and its live tree), the next open
    undoes the half-applied live tree, and a re-run converges."""
    commit_batch(monkeypatch, 7)
    r = receiver()
    base_and_change(mounted, r.url)
    proc = start_client(mounted, r.url, "s1", part_records=5)
    deadline = time.monotonic() + 240
    while undo_mark(tmp_path / "mirror") is None:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the commit never began"
    time.sleep(0.1)                       # a few of its transactions are committed
    r.kill9()
    assert proc.wait(timeout=120) != 0
    assert undo_mark(tmp_path / "mirror") is not None, "the commit ended before the kill"
    assert_at_base_then_converges(mounted, r, tmp_path)
    assert "undid a change of the live tree that was cut short" in r.log()
    assert undo_mark(tmp_path / "mirror") is None


def test_a_batched_commit_refused_at_its_last_check_leaves_the_mirror_as_it_was(
        mounted, receiver, tmp_path, monkeypatch):
    """Every part is valid on its own; only the finished tree is wrong (a name linked to
    an inode no part carries). The refusal comes after transactions were written: the
    live tree is put back at once and nothing else changed."""
    commit_batch(monkeypatch, 5)
    r = receiver()
    populate(mounted.mnt)
    mounted.snapctl("create", "s0")
    send_http(mounted, r.url, "s0", inline_bytes=1 << 40)
    before = mirror_info(tmp_path / "mirror")
    transfer = os.urandom(16).hex()
    parts = [part_json(Changeset(entries={(1, b"new%d" % (i * 10 + j)): None
                                          for j in range(10)})) for i in range(3)]
    parts.append(part_json(Changeset(entries={(1, b"dangling"): 999})))
    for i, raw in enumerate(parts):
        res = httpx.post(f"{r.url}/v1/parts/{transfer}/{i}", headers=AUTH, content=zstd(raw),
                         timeout=60)
        assert res.status_code == 200, res.text
    body = commit_body(transfer, [blake3.blake3(p).digest() for p in parts],
                       source_uuid=before["mirror_of"],
                       base_uuid=before["snapshots"][0]["uuid"])
    res = httpx.post(f"{r.url}/v1/commit-parts", headers=AUTH, content=body, timeout=60)
    assert res.status_code == 409 and "inode 999" in res.json()["error"], res.text
    r.stop()
    assert undo_mark(tmp_path / "mirror") is None
    after = mirror_info(tmp_path / "mirror")
    assert after["snapshots"] == before["snapshots"]       # not changed since s0 either
    assert_mirror_equals(mounted, tmp_path / "mirror", "s0", tmp_path)


def test_an_undo_that_fails_after_a_refusal_reports_the_refusal(mounted, tmp_path,
                                                                monkeypatch):
    """A batched commit is refused part-way and putting the live tree back fails too (as
    on a full disk): the refusal is what the caller hears, the undo mark stays, and the
    next locked open of the store undoes the change. The undo's failure is injected; the
    store, the parts and the refusal are real."""
    from mountfs import snapshots
    from replicator import mirror as mirror_mod
    monkeypatch.setenv("MOUNTFS_COMMIT_BATCH", "5")
    populate(mounted.mnt)
    mounted.snapctl("create", "s0")
    send(mounted, tmp_path / "mirror", "s0", inline_bytes=1 << 40)
    before = mirror_info(tmp_path / "mirror")
    parts = [part_json(Changeset(entries={(1, b"new%d" % (i * 10 + j)): None
                                          for j in range(10)})) for i in range(3)]
    parts.append(part_json(Changeset(entries={(1, b"dangling"): 999})))
    transfer = os.urandom(16)
    store = Store.open(tmp_path / "mirror")
    try:
        with store.write() as txn:
            digests = [mirror_mod.stage_part(txn, store.db, store.chunk_size, transfer, i, raw)
                       for i, raw in enumerate(parts)]
        real_undo, calls = snapshots.undo_interrupted, []

        def undo_on_a_full_disk(*args):
            calls.append(args)
            if len(calls) > 1:                  # the first call only looks for a mark
                raise OSError(28, "No space left on device")
            return real_undo(*args)

        monkeypatch.setattr(snapshots, "undo_interrupted", undo_on_a_full_disk)
        with pytest.raises(mirror_mod.MirrorError, match="inode 999"):
            mirror_mod.commit_staged(
                store, bytes.fromhex(before["mirror_of"]), before["snapshots"][0]["uuid"],
                mirror_mod.SnapshotRef("evil", "22" * 16, 1), transfer, digests)
        assert len(calls) == 2, "the undo was never tried"
        monkeypatch.setattr(snapshots, "undo_interrupted", real_undo)
    finally:
        store.close()
    assert undo_mark(tmp_path / "mirror") is not None     # left for the next open
    Store.open(tmp_path / "mirror").close()                # which undoes it
    assert undo_mark(tmp_path / "mirror") is None
    assert mirror_info(tmp_path / "mirror")["snapshots"] == before["snapshots"]
    assert_mirror_equals(mounted, tmp_path / "mirror", "s0", tmp_path)


# ---- hostile parts get 4xx and change nothing -----------------------------------------------

def zstd(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(raw)


def part_json(cs: Changeset) -> bytes:
    return json.dumps(cs.to_json()).encode()


def commit_body(transfer: str, digests: list, **fields) -> bytes:
    body = {"source_uuid": "11" * 16, "base_uuid": None, "reconcile": False,
            "snapshot": {"name": "evil", "uuid": "22" * 16, "created_ns": 1},
            "transfer": transfer,
            "parts": [d.hex() if isinstance(d, bytes) else d for d in digests]}
    return zstd(json.dumps({**body, **fields}).encode())


def test_hostile_parts_get_4xx_and_change_nothing(receiver, tmp_path):
    r = receiver(extra=("--max-staged", "64K"))
    transfer = os.urandom(16).hex()
    url = f"{r.url}/v1/parts/{transfer}"
    good = [part_json(Changeset(entries={(1, b"a%d" % i): None})) for i in range(2)]

    def post(path, body):
        return httpx.post(path, headers=AUTH, content=body, timeout=60)

    refusals = {
        "over the part size": post(f"{url}/0", zstd(b" " * (17 << 20))),
        "not JSON": post(f"{url}/0", zstd(b"{nope")),
        "not a changeset": post(f"{url}/0", zstd(b'{"entries": 5}')),
        "an escaping name": post(f"{url}/0", zstd(part_json(
            Changeset(entries={(1, b"../x"): 2})))),
        "an inode out of range": post(f"{url}/0", zstd(part_json(
            Changeset(entries={(1, b"x"): 1 << 63})))),
        "over the staging limit": post(f"{url}/0", zstd(part_json(
            Changeset(entries={(1, b"b%d" % i): None for i in range(3000)})))),
        "a bad transfer id": post(f"{r.url}/v1/parts/xyz/0", zstd(good[0])),
        "an index out of range": post(f"{url}/{1 << 20}", zstd(good[0])),
        "not zstd": post(f"{url}/0", good[0]),
    }
    for what, res in refusals.items():
        assert 400 <= res.status_code < 500, (what, res.status_code, res.text)
        assert "\n" not in res.json()["error"], what
    assert refusals["over the part size"].status_code == 413
    assert staged_parts(tmp_path / "mirror") == 0

    for i, raw in enumerate(good):
        assert post(f"{url}/{i}", zstd(raw)).status_code == 200
    digests = [blake3.blake3(raw).digest() for raw in good]
    bad_commits = [   # (what the commit names, the refusal's status and reason)
        ([digests[0], b"\0" * 32], transfer, 409, "part 1 of transfer .* does not match"),
        (digests[::-1], transfer, 409, "part 0 of transfer .* does not match"),
        (digests + [digests[0]], transfer, 409, "part 2 of transfer .* is not staged"),
        (digests, os.urandom(16).hex(), 409, "part 0 of transfer .* is not staged"),
        ([], transfer, 400, "parts must be a list of 1"),
        (["zz"], transfer, 400, "a part digest is 64 hex digits"),
    ]
    for names, tid, status, reason in bad_commits:
        res = post(f"{r.url}/v1/commit-parts", commit_body(tid, names))
        assert res.status_code == status and re.search(reason, res.json()["error"]), res.text
    r.stop()
    info = mirror_info(tmp_path / "mirror")
    assert info["snapshots"] == [] and info["empty"]
    assert staged_parts(tmp_path / "mirror") == 2     # still staged, for a commit that names them
