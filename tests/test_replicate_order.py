"""A mirror only moves forward. Replicating a snapshot older than one of the source's the
mirror holds is refused by the source (as ``zfs recv`` refuses an older snapshot) and by
the receiver itself, whatever the token (the client is not trusted); a mirror that went on
past a base the source then deleted (``snapctl delete --force``) stays reported by status
and check, and the next replicate reconciles it forward, keeping its snapshots."""

from __future__ import annotations

import json
import os
from pathlib import Path

import blake3
import pytest

from mountfs import snapshots as snaps
from mountfs.store import Store
from replicator import changeset, mirror as mirror_mod
from replicator.client import HttpMirror
from replicator.mirror import MirrorError, SnapshotRef
from replicator.verify import reconcile

from conftest import ADMIN_TOKEN, TOKEN, Mount, cli
from test_replicate import assert_mirror_equals, mirror_info, send, tamper


def dump(store_path: Path) -> dict:
    """Every record of every table of a store (what 'unchanged' is checked on)."""
    store = Store.open(store_path, readonly=True, lock=False)
    try:
        return records(store)
    finally:
        store.close()


def records(store: Store) -> dict:
    with store.read() as txn:
        return {name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
                for name, db in store.db.items()}


def replicate(m: Mount, url: str, *args, token: Path | None = None):
    extra = ["--token-file", token] if token else []
    return m.snapctl("replicate", "--to", url, *extra, *args, check=False)


def replicated(m: Mount, url: str, *args, token: Path | None = None) -> dict:
    res = replicate(m, url, "--json", *args, token=token)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def not_newer(name: str, newest: str) -> str:
    return (f"snapctl: snapshot {name!r} is not newer than {newest!r}, the newest snapshot "
            f"of this source the mirror holds; a mirror only moves forward: replicate a "
            f"newer snapshot\n")


def names(store_path: Path) -> list[str]:
    return [s["name"] for s in mirror_info(store_path)["snapshots"]]


# ---- A: an older snapshot never rolls a mirror back -------------------------------------------

def older_snapshot_is_refused(m: Mount, url: str, store_path: Path, tmp_path: Path,
                              token: Path | None = None) -> str:
    """The report's steps: 'old', then a replicate (a newer snapshot), then --snapshot old
    (with and without --force): refused in one line, the mirror unchanged; the next
    replicate goes on from the newer snapshot."""
    (m.mnt / "f").write_text("old\n")
    m.snapctl("create", "old")
    (m.mnt / "f").write_text("new\n")
    first = replicated(m, url, token=token)["snapshot"]
    before = dump(store_path)
    for force in ([], ["--force"]):
        res = replicate(m, url, "--snapshot", "old", *force, token=token)
        assert (res.returncode, res.stdout, res.stderr) == (1, "", not_newer("old", first))
        assert dump(store_path) == before          # neither tree nor snapshots moved
    (m.mnt / "x").write_text("x\n")
    after = replicated(m, url, token=token)
    assert after["base"] == first and not after["reconciled"]
    assert names(store_path) == [first, after["snapshot"]]
    return after["snapshot"]


def test_an_older_snapshot_is_refused_by_a_file_mirror(mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    newest = older_snapshot_is_refused(m, f"file://{mirror}", mirror, tmp_path)
    assert_mirror_equals(m, mirror, newest, tmp_path)


def test_an_older_snapshot_is_refused_over_http_with_the_replicate_token(mounted, receiver,
                                                                         tmp_path):
    m, r = mounted, receiver()
    newest = older_snapshot_is_refused(m, r.url, r.store, tmp_path, token=tmp_path / "token")
    r.stop()
    assert_mirror_equals(m, r.store, newest, tmp_path)


def staged_reconciliation(m: Mount, client: HttpMirror, name: str):
    """What a client that does not check (an older snapctl, or a hostile one) stages to
    bring the mirror's live tree to snapshot ``name``: the reconciliation's chunks and
    parts. Returns (source uuid, snapshot ref, transfer id, part digests)."""
    source = Store.open(m.store, readonly=True, lock=False)
    try:
        with source.read() as txn:
            snap = snaps.get(txn, source.db, name)
        cs = reconcile(source, client, snap)
        with source.read() as txn:
            client.stage([(d, bytes(txn.get(d, db=source.db["blobs"])))
                          for d in client.missing(list(cs.digests()))])
        transfer, digests = os.urandom(16), []
        for i, part in enumerate(changeset.split(cs, changeset.PART_RECORDS)):
            raw = json.dumps(part.to_json()).encode()
            client.stage_part(transfer, i, raw)
            digests.append(blake3.blake3(raw).digest())
        return (source.uuid, SnapshotRef(snap.name, snap.uuid.hex(), snap.created_ns),
                transfer, digests)
    finally:
        source.close()


@pytest.mark.parametrize("token", [TOKEN, ADMIN_TOKEN])
def test_the_receiver_refuses_a_reconciliation_to_an_older_snapshot(mounted, receiver,
                                                                     tmp_path, token):
    """The commit the old client sent for 'replicate --snapshot old', sent as it is: the
    receiver refuses it (for either token) and nothing changes."""
    m, r = mounted, receiver()
    (m.mnt / "f").write_text("old\n")
    m.snapctl("create", "old")
    (m.mnt / "f").write_text("new\n")
    first = replicated(m, r.url, token=tmp_path / "token")["snapshot"]
    client = HttpMirror(r.url, token)
    try:
        source_uuid, ref, transfer, digests = staged_reconciliation(m, client, "old")
        before = dump(r.store)
        with pytest.raises(MirrorError) as refused:
            client.commit_parts(source_uuid, None, ref, transfer, digests, reconcile=True)
        assert str(refused.value).endswith(not_newer("old", first)[len("snapctl: "):-1])
        assert "\n" not in str(refused.value)
        assert dump(r.store) == before
    finally:
        client.close()
    assert "not newer than" in r.log()
    r.stop()
    assert names(r.store) == [first]
    assert_mirror_equals(m, r.store, first, tmp_path)


def test_the_receiver_takes_an_increment_only_from_its_newest_snapshot(mounted, tmp_path):
    """An incremental commit whose base is not the mirror's newest snapshot (here an older
    one the live tree still equals: the newer snapshot changed nothing) is refused."""
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "f").write_text("1")
    s1 = replicated(m, f"file://{mirror}")["snapshot"]
    s2 = replicated(m, f"file://{mirror}")["snapshot"]       # nothing changed since s1
    info = mirror_info(mirror)
    base = next(s["uuid"] for s in info["snapshots"] if s["name"] == s1)
    store = Store.open(mirror)
    try:
        raw, transfer = json.dumps(changeset.Changeset().to_json()).encode(), os.urandom(16)
        with store.write() as txn:
            mirror_mod.stage_part(txn, store.db, store.chunk_size, transfer, 0, raw)
        before = records(store)
        with pytest.raises(MirrorError) as refused:
            mirror_mod.commit_staged(store, bytes.fromhex(info["mirror_of"]), base,
                                     SnapshotRef("late", "44" * 16, 1 << 62), transfer,
                                     [blake3.blake3(raw).digest()])
        assert records(store) == before
    finally:
        store.close()
    assert str(refused.value) == (f"the mirror's newest snapshot is {s2!r}, not {s1!r} that "
                                  f"this commit starts from; a mirror only moves forward "
                                  f"from its newest snapshot: re-run replicate")


# ---- B: a base deleted with --force ------------------------------------------------------------

def base_deleted_then_reconciled(m: Mount, url: str, store_path: Path, first: str,
                                 token: Path | None = None, monitoring: bool = True) -> str:
    """The report's steps: two replicates, the newest snapshot (the mirror's base) deleted
    with --force; check and status say so (``monitoring``); the next replicate reconciles
    without --force and keeps the mirror's snapshots. ``first``: "repl-" (the report's:
    the second run removes the first one's snapshot, so nothing stays shared), or the name
    of a snapshot of the user's sent first (it stays: an older snapshot both still hold,
    while the mirror's newest is gone from the source)."""
    (m.mnt / "a").write_text("a\n")
    if first == "repl-":
        first = replicated(m, url, token=token)["snapshot"]
    else:
        m.snapctl("create", first)
        replicated(m, url, "--snapshot", first, token=token)
    (m.mnt / "b").write_text("b\n")
    second = replicated(m, url, token=token)["snapshot"]
    m.snapctl("delete", second, "--force")
    if monitoring:
        check = m.snapctl("check", check=False)
        said = ("its base was deleted on the source (lag unknown; the next replicate "
                "reconciles it)")
        assert (check.returncode, check.stdout) == \
            (2, f"CRITICAL: {m.mnt.name} -> {url}: {said}\n")
        status = m.snapctl("status")
        assert f"  {url}: {said}, pending " in status.stdout, status.stdout
    (m.mnt / "c").write_text("c\n")
    res = replicate(m, url, token=token)
    assert res.returncode == 0, res.stderr
    third = res.stdout.split()[1]
    assert res.stdout.startswith(f"replicated {third} (reconciled by hash buckets): ")
    assert names(store_path) == [first, second, third]      # none of its snapshots lost
    check = m.snapctl("check", check=False)
    assert (check.returncode, check.stdout) == (0, f"OK: {m.mnt.name} -> {url}: lag 0s\n")
    (m.mnt / "d").write_text("d\n")
    after = replicated(m, url, token=token)
    assert after["base"] == third                            # incremental again
    return after["snapshot"]


@pytest.mark.parametrize("first", ["repl-", "mine"])
def test_a_deleted_base_is_reported_and_the_next_replicate_reconciles(mounted, tmp_path,
                                                                      first):
    m, mirror = mounted, tmp_path / "mirror"
    newest = base_deleted_then_reconciled(m, f"file://{mirror}", mirror, first)
    assert_mirror_equals(m, mirror, newest, tmp_path)


def test_a_deleted_base_reconciles_over_http_with_the_replicate_token(mounted, receiver,
                                                                      tmp_path):
    m, r = mounted, receiver()
    newest = base_deleted_then_reconciled(m, r.url, r.store, "mine",
                                          token=tmp_path / "token", monitoring=False)
    r.stop()
    assert_mirror_equals(m, r.store, newest, tmp_path)


def test_a_mirror_changed_past_a_deleted_base_is_refused_then_forced(spark, mounted, tmp_path):
    """Changed since its newest snapshot (which the source deleted): refused, naming that
    snapshot; --force rolls it back to it, then reconciles."""
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "a").write_text("a")
    m.snapctl("create", "s1")
    send(m, mirror, "s1")
    (m.mnt / "b").write_text("b")
    m.snapctl("create", "s2")
    send(m, mirror, "s2")
    m.snapctl("delete", "s2", "--force")
    tamper(mirror)
    (m.mnt / "c").write_text("c")
    m.snapctl("create", "s3")
    with pytest.raises(MirrorError) as refused:
        send(m, mirror, "s3")
    assert str(refused.value) == ("the mirror has changed since its copy of 's2'; pass "
                                  "--force to roll it back to 's2'")
    result = send(m, mirror, "s3", force=True)
    assert result.base is None and result.reconciled
    assert names(mirror) == ["s1", "s2", "s3"]
    assert_mirror_equals(m, mirror, "s3", tmp_path)
