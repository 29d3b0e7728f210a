"""``snapctl verify``: is the mirror really a copy of the source? (the hbr paper)

Both stores keep K bucket hashes of their items (mountfs.buckets). Verifying snapshot S
compares the source's K hashes at S with the mirror's copy of S and, when S is the mirror's
newest snapshot and its live tree changed since (what a promotion would serve), with that
too. Only buckets that differ are compared item by item. Cost: K hashes (32 KiB for K=1024)
plus the differing buckets, not the size of the stores.

``full`` recomputes every bucket from the items on both sides and re-reads every chunk on the
mirror (silent corruption, tampering beneath the store). ``repair`` re-sends exactly what
differs: chunk data the mirror lost or holds corrupted, and the items of differing buckets,
applied to the mirror's live tree (snapshots are immutable).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mountfs import buckets, chunkfile, snapshots as snaps
from mountfs import schema as S
from mountfs.namespace import View
from mountfs.store import Store

from .changeset import Changeset
from .mirror import MirrorError

KIND_NAMES = {b"i": "inode", b"d": "entry", b"c": "chunk", b"x": "xattr"}


@dataclass
class Difference:
    where: str            # "snapshot" (the mirror's copy of S) or "live" (its live tree)
    problem: str          # "differs", "missing on mirror", "extra on mirror"
    identity: bytes

    def text(self) -> str:
        return f"{self.where}: {self.problem}: {describe(self.identity)}"


@dataclass
class VerifyResult:
    snapshot: str
    buckets: int
    mismatched: dict[str, int] = field(default_factory=dict)
    differences: list[Difference] = field(default_factory=list)
    bad_chunks: dict[str, list[str]] = field(default_factory=dict)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not self.differences and not any(self.bad_chunks.values())

    def to_json(self) -> dict:
        return {"snapshot": self.snapshot, "buckets": self.buckets,
                "mismatched_buckets": self.mismatched, "clean": self.clean,
                "differences": [d.text() for d in self.differences],
                "bad_chunks": self.bad_chunks, "repaired": self.repaired}


def describe(identity: bytes) -> str:
    kind, base = identity[:1], identity[1:]
    ino = S.from_u64(base[:8])
    if kind == b"i":
        return f"inode {ino}"
    if kind == b"c":
        return f"chunk {S.from_u64(base[8:16])} of inode {ino}"
    name = base[8:-1].decode("utf-8", "backslashreplace")
    return f"{KIND_NAMES[kind]} {name!r} of inode {ino}"


def verify(source_path: str, mirror, snapshot: str | None = None, full: bool = False,
           repair: bool = False) -> VerifyResult:
    source = Store.open(source_path, readonly=True, lock=False)
    try:
        snap, live_changed = _pick_snapshot(source, mirror.info(), snapshot)
        result = _compare(source, mirror, snap, live_changed, full)
        if repair and not result.clean:
            _repair(source, mirror, snap, result)
            result = _compare(source, mirror, snap, False, full)
            result.repaired = True
        return result
    finally:
        source.close()


def _pick_snapshot(source: Store, info: dict, name: str | None) -> tuple[S.Snapshot, bool]:
    on_mirror = [s["uuid"] for s in info["snapshots"]]
    with source.read() as txn:
        common = [s for s in snaps.list_all(txn, source.db) if s.uuid.hex() in on_mirror]
        if name is not None:
            snap = snaps.get(txn, source.db, name)
            if snap.uuid.hex() not in on_mirror:
                raise MirrorError(f"the mirror does not hold snapshot {name!r}")
        elif not common:
            raise MirrorError("the mirror holds no snapshot of this source")
        else:
            snap = common[-1]
    if info["buckets"] != source.bucket_count:
        raise MirrorError(f"the mirror keeps {info['buckets']} buckets, the source "
                          f"{source.bucket_count}")
    newest = bool(on_mirror) and on_mirror[-1] == snap.uuid.hex()
    changed = any(s["uuid"] == snap.uuid.hex() and s["changed_since"] for s in info["snapshots"])
    return snap, newest and changed


def _compare(source: Store, mirror, snap: S.Snapshot, live_changed: bool, full: bool):
    result = VerifyResult(snap.name, source.bucket_count)
    with source.read() as txn:
        compute = buckets.compute if full else buckets.at
        mine = compute(txn, source.db, snap.epoch, source.bucket_count)
    targets = [("snapshot", snap.uuid.hex())] + ([("live", None)] if live_changed else [])
    for where, uuid in targets:
        theirs = mirror.bucket_hashes(uuid, recompute=full)
        wrong = [b for b in range(len(mine)) if mine[b] != theirs[b]]
        result.mismatched[where] = len(wrong)
        if wrong:
            result.differences += _item_differences(source, mirror, snap, where, uuid, wrong)
    if full:
        result.bad_chunks = {k: [d.hex() for d in v] for k, v in mirror.scrub().items()}
    return result


def _item_differences(source, mirror, snap, where, uuid, wrong) -> list[Difference]:
    with source.read() as txn:
        top = S.from_u64(txn.get(b"next_ino", db=source.db["meta"]))
        mine = {b: buckets.items(txn, source.db, snap.epoch, source.bucket_count, b, top)
                for b in wrong}
    theirs = mirror.bucket_items(uuid, wrong)
    out = []
    for b in wrong:
        a, m = mine[b], theirs[b]
        for ident in sorted(a.keys() | m.keys()):
            if ident not in m:
                out.append(Difference(where, "missing on mirror", ident))
            elif ident not in a:
                out.append(Difference(where, "extra on mirror", ident))
            elif a[ident] != m[ident]:
                out.append(Difference(where, "differs", ident))
    return out


def reconcile(source: Store, mirror, snap: S.Snapshot) -> Changeset:
    """The changeset that turns the mirror's live tree into ``snap`` when they share no
    snapshot (a lost base, a mirror seeded another way): found by comparing buckets, so its
    cost is the differing buckets, and only chunks the mirror lacks travel afterwards."""
    with source.read() as txn:
        mine = buckets.at(txn, source.db, snap.epoch, source.bucket_count)
    theirs = mirror.bucket_hashes(None)
    wrong = [b for b in range(len(mine)) if mine[b] != theirs[b]]
    diffs = _item_differences(source, mirror, snap, "live", None, wrong) if wrong else []
    return _repair_changeset(source, snap, diffs)


def _repair(source: Store, mirror, snap: S.Snapshot, result: VerifyResult) -> None:
    bad = [bytes.fromhex(d) for kind in ("missing", "corrupt")
           for d in result.bad_chunks.get(kind, [])]
    live_diffs = [d for d in result.differences if d.where == "live"]
    cs = _repair_changeset(source, snap, live_diffs)
    with source.read() as txn:
        wanted = set(bad) | (set(cs.digests()) & set(mirror.missing(list(cs.digests()))))
        chunks = [(d, bytes(chunkfile.get(txn, source.db, d))) for d in sorted(wanted)]
    if bad:
        mirror.replace_chunks([c for c in chunks if c[0] in set(bad)])
    if live_diffs:
        mirror.stage([c for c in chunks if c[0] not in set(bad)])
        mirror.repair(snap.uuid.hex(), cs)


def _repair_changeset(source: Store, snap: S.Snapshot, diffs: list[Difference]) -> Changeset:
    """The source's values at ``snap`` of every differing item (None where it has none)."""
    cs = Changeset()
    with source.read() as txn:
        view = View(txn, source.db, snap.epoch, source.chunk_size)
        for d in diffs:
            kind, base = d.identity[:1], d.identity[1:]
            ino = S.from_u64(base[:8])
            if kind == b"i":
                rec = view.inode(ino)
                cs.inodes[ino] = rec
                if rec is not None:
                    cs.xattrs[ino] = view.xattrs(ino)
            elif kind == b"d":
                cs.entries[(ino, S.name_of_dirent_key(base))] = \
                    view.lookup(ino, S.name_of_dirent_key(base))
            elif kind == b"x":
                cs.xattrs[ino] = view.xattrs(ino)
            elif kind == b"c":
                index = S.from_u64(base[8:16])
                value = view.chunk(ino, index)
                cs.chunks.setdefault(ino, {})[index] = \
                    (bytes(value[0]), value[1]) if value else None
    return cs
