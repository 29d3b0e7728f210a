"""A mirror only moves forward: the receiver itself refuses, whatever the token (the client
is not trusted), a commit that would move a mirror of the source back to an older snapshot."""

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
from test_replicate import assert_mirror_equals, mirror_info


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
