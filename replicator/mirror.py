"""The receiving side of replication: a mountfs store that mirrors a source store.

A mirror keeps the source's inode numbers and snapshot uuids. A replication cycle stages the
chunks the mirror lacks (each verified against its digest on arrival), then commits: the
changeset (replicator.changeset) and the new snapshot go in ONE transaction, so the mirror is
at its base or at the new snapshot, never in between. Staged chunks survive an interrupted
cycle (a re-run does not send them again) and are dropped by the next commit.

Everything here distrusts its input: a commit is checked for names that could escape
(``/``, NUL, ``.``/``..``), references to chunks or inodes the mirror does not have,
directory cycles, and a mirror that changed since its base.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import blake3

from mountfs import buckets, chunkfile, gc, invariants
from mountfs import schema as S
from mountfs import snapshots as snaps
from mountfs.namespace import FsError, Live, View, add_written, check_name
from mountfs.store import Store, StoreError, delete_live, put_live

from .changeset import Changeset

log = logging.getLogger(__name__)
Parts = Callable[[], Iterator[Changeset]]     # a fresh iterator over a changeset's parts


class MirrorError(StoreError):
    """A replication request the mirror refuses (one clear line for the user)."""


@dataclass(frozen=True)
class SnapshotRef:
    name: str
    uuid: str          # hex
    created_ns: int


# ---- staging chunks -----------------------------------------------------------------------

@dataclass(frozen=True)
class StagingLimits:
    """How much a token holder may leave staged but not committed. An initial copy stages
    every chunk of the snapshot before its one commit, so the default is not a fixed cap
    but the disk: staging always leaves ``keep_free`` bytes free. Staging that saw no new
    batch for ``idle_seconds`` belongs to an abandoned cycle and is dropped."""

    max_bytes: int | None = None
    idle_seconds: float | None = 24 * 3600.0
    keep_free: int = 2 << 30


def stage(txn, dbs, chunks, limits: StagingLimits = StagingLimits(),
          free_bytes: int | None = None) -> tuple[int, int]:
    """Store chunks received for a cycle: ``chunks`` is [(digest, data)]. Each digest is
    checked before anything is written. Returns (chunks stored, bytes stored); chunks the
    mirror already has are skipped. ``free_bytes``: the disk's free space now (None: not
    checked). A batch over ``limits`` is refused whole."""
    for digest, data in chunks:
        digest = bytes(digest)
        if len(digest) != S.DIGEST_SIZE or blake3.blake3(data).digest() != digest:
            raise MirrorError(f"chunk {digest.hex()[:16]} does not match its digest "
                              f"(corrupted in transit?); nothing of this batch was stored")
    held, last = _staged_account(txn, dbs)
    if held and limits.idle_seconds is not None and time.time() - last > limits.idle_seconds:
        _drop_staged(txn, dbs)
        held = 0
    new = {bytes(d): data for d, data in chunks if not _present(txn, dbs, bytes(d))}
    nbytes = sum(len(data) for data in new.values())
    _check_room(held, nbytes, limits, free_bytes)
    for digest, data in new.items():
        txn.put(digest, data, db=dbs["blobs"])
        txn.put(digest, b"", db=dbs["staged"])
    if new:
        txn.put(b"staged_bytes", S.u64(held + nbytes) + S.u64(int(time.time())),
                db=dbs["meta"])
    return len(new), nbytes


def _check_room(held: int, adding: int, limits: StagingLimits, free_bytes: int | None):
    if limits.max_bytes is not None and held + adding > limits.max_bytes:
        raise MirrorError(f"the mirror holds {held} bytes staged but not committed, its "
                          f"limit is {limits.max_bytes}; commit (or let the abandoned "
                          f"staging expire) before sending more")
    if free_bytes is not None and free_bytes - adding < limits.keep_free:
        raise MirrorError(f"staging {adding} more bytes would leave less than "
                          f"{limits.keep_free} bytes free on the mirror's disk "
                          f"({free_bytes} free, {held} of them staged); free space there")


def _staged_account(txn, dbs) -> tuple[int, float]:
    """(bytes staged and not committed, when the last batch was staged) from meta."""
    raw = txn.get(b"staged_bytes", db=dbs["meta"])
    if raw is None:
        return 0, 0.0
    raw = bytes(raw)
    return S.from_u64(raw[:8]), float(S.from_u64(raw[8:]))


def _present(txn, dbs, digest: bytes) -> bool:
    return txn.get(digest, db=dbs["refs"]) is not None or \
        txn.get(digest, db=dbs["staged"]) is not None


def missing(txn, dbs, digests) -> list[bytes]:
    """The digests the mirror has neither committed nor staged."""
    return [bytes(d) for d in digests if not _present(txn, dbs, bytes(d))]


# ---- staging changeset parts ---------------------------------------------------------------

MAX_PART_BYTES = 16 << 20     # one part's JSON, decompressed (the source cuts at ~4 MiB)
MAX_PARTS = 1 << 16           # parts one commit may name
PART_PREFIX = b"part"         # blobs key: prefix + transfer id (16) + index (u32): 24 bytes,
                              # never a chunk digest (32)


def part_key(transfer: bytes, index: int) -> bytes:
    if len(transfer) != 16 or not 0 <= index < MAX_PARTS:
        raise MirrorError(f"a changeset part needs a transfer id of 16 bytes and an index "
                          f"0..{MAX_PARTS - 1}")
    return PART_PREFIX + transfer + index.to_bytes(4, "big")


def parse_part(raw: bytes, chunk_size: int) -> Changeset:
    """A part as received: bounded, JSON, a well-formed changeset, every record in range
    (refused here, before it is staged, as a chunk that does not match its digest is)."""
    if len(raw) > MAX_PART_BYTES:
        raise MirrorError(f"a changeset part of {len(raw)} bytes is over the limit of "
                          f"{MAX_PART_BYTES}")
    cs = Changeset.from_json(json.loads(raw))    # malformed: ValueError (the peer's 400)
    _validate(cs, chunk_size)
    return cs


def stage_part(txn, dbs, chunk_size: int, transfer: bytes, index: int, raw: bytes,
               limits: StagingLimits = StagingLimits(), free_bytes: int | None = None) -> bytes:
    """Stage part ``index`` of transfer ``transfer`` (validated first); it counts against
    the same staging limits as chunks (a part staged again replaces the first) and is
    dropped with them. Returns its digest, which the commit names."""
    key = part_key(transfer, index)
    parse_part(raw, chunk_size)
    held, last = _staged_account(txn, dbs)
    if held and limits.idle_seconds is not None and time.time() - last > limits.idle_seconds:
        _drop_staged(txn, dbs)
        held = 0
    old = txn.get(key, db=dbs["blobs"])
    held -= len(old) if old is not None else 0
    _check_room(held, len(raw), limits, free_bytes)
    txn.put(key, raw, db=dbs["blobs"])
    txn.put(key, b"", db=dbs["staged"])
    txn.put(b"staged_bytes", S.u64(max(held, 0) + len(raw)) + S.u64(int(time.time())),
            db=dbs["meta"])
    return blake3.blake3(raw).digest()


def staged_parts(txn, dbs, transfer: bytes, digests: list[bytes]) -> Parts:
    """The parts a commit names, as a re-iterable stream read from staging: all of them
    present and matching their digests, checked before anything is applied (each part was
    validated when staged, and every part is validated again before anything is written)."""
    if not 0 < len(digests) <= MAX_PARTS:
        raise MirrorError(f"a commit names 1..{MAX_PARTS} changeset parts, not "
                          f"{len(digests)}")
    for index, digest in enumerate(digests):
        raw = txn.get(part_key(transfer, index), db=dbs["blobs"])
        if raw is None:
            raise MirrorError(f"changeset part {index} of transfer {transfer.hex()} is not "
                              f"staged on the mirror (expired or never sent); re-run")
        if blake3.blake3(raw).digest() != bytes(digest):
            raise MirrorError(f"changeset part {index} of transfer {transfer.hex()} does not "
                              f"match the digest the commit names")
    return lambda: (load_part(txn, dbs, transfer, i) for i in range(len(digests)))


def load_part(txn, dbs, transfer: bytes, index: int) -> Changeset:
    raw = txn.get(part_key(transfer, index), db=dbs["blobs"])
    return Changeset.from_json(json.loads(bytes(raw)))


# ---- what the mirror holds ----------------------------------------------------------------

def info(store: Store) -> dict:
    """Identity, chunk size, snapshots, and whether the live tree changed since each."""
    with store.read() as txn:
        dbs = store.db
        live = snaps.readable_live_epoch(txn, dbs)
        root = View(txn, dbs, live, store.chunk_size).get(S.ROOT_INO)
        source = txn.get(b"mirror_of", db=dbs["meta"])
        return {
            "format": S.FORMAT_VERSION,
            "uuid": store.uuid.hex(),
            "mirror_of": bytes(source).hex() if source else None,
            "chunk_size": store.chunk_size,
            "buckets": store.bucket_count,
            "empty": _is_empty(txn, dbs, live, store.chunk_size),
            "snapshots": [{"name": s.name, "uuid": s.uuid.hex(), "epoch": s.epoch,
                           "created_ns": s.created_ns,
                           "changed_since": _changed_since(txn, dbs, root, s)}
                          for s in snaps.list_all(txn, dbs)],
        }


def _is_empty(txn, dbs, live: int, chunk_size: int) -> bool:
    view = View(txn, dbs, live, chunk_size)
    return not snaps.list_all(txn, dbs) and view.is_empty_dir(S.ROOT_INO)


def overwrites(mirror_of: bytes | str | None, empty: bool) -> bool:
    """Whether replicating would replace a filesystem of its own: a store that is nobody's
    mirror yet holds snapshots or files (one made by mkfs and written to, a promoted
    mirror). Its live tree would become the source's, its own files gone; so, as ZFS will
    not receive over a modified dataset without -F, that takes --force. A store fresh from
    mkfs (no snapshot, an empty root) has nothing to lose: making it first is fine."""
    return mirror_of is None and not empty


def not_a_mirror(name: str) -> MirrorError:
    return MirrorError(f"{name} is a mountfs store with files of its own, not a mirror: "
                       f"replicating would replace them; pass --force to make it a mirror "
                       f"of this filesystem, or choose another directory")


# ---- committing a cycle -------------------------------------------------------------------

def commit(txn, dbs, chunk_size: int, source_uuid: bytes, base_uuid: str | None,
           snapshot: SnapshotRef, cs: Changeset | Parts,
           reconcile: bool = False) -> S.Snapshot:
    """Check the preconditions, apply ``cs`` (a changeset, or its staged parts: see
    staged_parts) and take ``snapshot``, in the caller's one write transaction (an
    exception aborts all of it). ``reconcile``: there is no base and ``cs`` was computed
    against the mirror's live tree by bucket comparison."""
    _check_commit(txn, dbs, chunk_size, source_uuid, base_uuid, snapshot, reconcile)
    apply_parts(Live(txn, dbs, snaps.live_epoch(txn, dbs), chunk_size),
                cs if callable(cs) else (lambda: iter([cs])))
    return _take_snapshot(txn, dbs, chunk_size, source_uuid, snapshot)


def commit_batch_records() -> int:
    """Records one transaction of a large commit applies at most: what bounds the receiver's
    memory (LMDB keeps a transaction's written pages in memory until it commits)."""
    return int(os.environ.get("MOUNTFS_COMMIT_BATCH", 200_000))


@dataclass
class Committed:
    snapshot: S.Snapshot
    entries: int            # names the commit changed
    inodes: int             # inodes it changed


def commit_staged(store: Store, source_uuid: bytes, base_uuid: str | None,
                  snapshot: SnapshotRef, transfer: bytes, digests: list[bytes],
                  reconcile: bool = False, force: bool = False) -> Committed:
    """Commit a changeset staged as parts. One of at most commit_batch_records() records is
    applied and snapshotted in one transaction (as commit does). A larger one in several,
    so that memory is bounded by a transaction's worth of parts, not by the change: the
    first checks the preconditions and every part and opens an undoable change of the live
    tree (snapshots.begin_undoable); the writing steps then run over a few parts per
    transaction; the last finishes, checks and takes the snapshot. Until then no snapshot
    changes and only the live tree is half-applied; a refusal puts it back at once, a crash
    at the next open of the store (snapshots.undo_interrupted)."""
    dbs, batch, steps = store.db, commit_batch_records(), _Apply(store.chunk_size)
    with store.write() as txn:
        snaps.undo_interrupted(txn, dbs, store.chunk_size)
        # the base first: a commit that another run's beat also finds its parts dropped
        base = _check_commit(txn, dbs, store.chunk_size, source_uuid, base_uuid, snapshot,
                             reconcile, force)
        parts = staged_parts(txn, dbs, transfer, digests)
        live = Live(txn, dbs, snaps.live_epoch(txn, dbs), store.chunk_size)
        held = _checked(live, parts, steps, batch)
        if held is not None:
            for step in [steps.collect_named] + steps.writing_steps():
                for cs in held:
                    step(live, cs)
            steps.finish(live, lambda: iter(held))
            return Committed(_take_snapshot(txn, dbs, store.chunk_size, source_uuid, snapshot),
                             steps.entries, steps.inodes)
        for cs in parts():
            steps.collect_named(live, cs)
        snaps.begin_undoable(txn, dbs, base)
    try:
        for step in steps.writing_steps():
            _in_batches(store, transfer, len(digests), step, batch)
        with store.write() as txn:
            live = Live(txn, dbs, snaps.live_epoch(txn, dbs), store.chunk_size)
            steps.finish(live, staged_parts(txn, dbs, transfer, digests))
            snaps.end_undoable(txn, dbs)
            return Committed(_take_snapshot(txn, dbs, store.chunk_size, source_uuid, snapshot),
                             steps.entries, steps.inodes)
    except BaseException:
        _undo_refused(store)
        raise


def _checked(live: Live, parts: Parts, steps: "_Apply", batch: int) -> list | None:
    """Run the check step over every part; return the parts parsed, if they hold at most
    ``batch`` records (one transaction's worth, so the steps need not parse them again),
    else None (they are read back for each step)."""
    held: list | None = []
    for cs in parts():
        steps.check(live, cs)
        if held is not None and steps.checked <= batch:
            held.append(cs)
        else:
            held = None
    return held


def _undo_refused(store: Store) -> None:
    """Put the live tree back after a batched commit failed part-way. If that fails too
    (a full disk), the error that refused the commit is the one to report: the undo mark
    stays, and the next open of the store undoes the change (snapshots.undo_interrupted)."""
    try:
        with store.write() as txn:
            snaps.undo_interrupted(txn, store.db, store.chunk_size)
    except Exception as e:
        log.warning("could not undo the half-applied commit now (%s); the next open of "
                    "the store undoes it", e)


def _in_batches(store: Store, transfer: bytes, count: int, step, batch: int) -> None:
    """``step`` over every staged part, in transactions of about ``batch`` records."""
    index = 0
    while index < count:
        with store.write() as txn:
            live = Live(txn, store.db, snaps.live_epoch(txn, store.db), store.chunk_size)
            records = 0
            while index < count and records < batch:
                cs = load_part(txn, store.db, transfer, index)
                step(live, cs)
                records += cs.records()
                index += 1


def _check_commit(txn, dbs, chunk_size: int, source_uuid: bytes, base_uuid: str | None,
                  snapshot: SnapshotRef, reconcile: bool,
                  force: bool = False) -> S.Snapshot | None:
    """The preconditions of a commit; the base snapshot, if any. ``force``: the store may
    be one of its own (overwrites), made a mirror by this commit."""
    base = _check_base(txn, dbs, chunk_size, snaps.live_epoch(txn, dbs), source_uuid,
                       base_uuid, reconcile, force)
    held = snaps.list_all(txn, dbs)
    for s in held:
        if s.name == snapshot.name or s.uuid.hex() == snapshot.uuid:
            raise MirrorError(f"the mirror already has snapshot {s.name!r}")
    mirror_of = txn.get(b"mirror_of", db=dbs["meta"])
    if mirror_of is not None and bytes(mirror_of) == source_uuid:
        _check_forward(held, base, snapshot)
    return base


def _check_forward(held: list[S.Snapshot], base: S.Snapshot | None,
                   snapshot: SnapshotRef) -> None:
    """A commit to a mirror of the source moves it forward, never back (as ``zfs recv``
    takes an incremental stream only from the newest snapshot), whatever the token: an
    incremental commit starts from the mirror's newest snapshot; a reconciliation, which
    replaces the live tree whatever it holds, brings a snapshot newer than every one the
    mirror holds (by creation time: the order the receiver can check, check_newer)."""
    if base is not None and held and held[-1].uuid != base.uuid:
        raise MirrorError(f"the mirror's newest snapshot is {held[-1].name!r}, not "
                          f"{base.name!r} that this commit starts from; a mirror only moves "
                          f"forward from its newest snapshot: re-run replicate")
    if base is None:
        check_newer([(s.name, s.created_ns) for s in held], snapshot)


def check_newer(held: list[tuple[str, int]], snapshot: SnapshotRef) -> None:
    """Refuse ``snapshot`` unless it was created after every snapshot ``held`` (name,
    created_ns) by the mirror: what the receiver checks of a reconciliation, and the
    source before it sends one."""
    if held:
        name, created_ns = max(held, key=lambda s: s[1])
        if created_ns >= snapshot.created_ns:
            raise not_newer(snapshot.name, name)


def not_newer(name: str, newest: str) -> MirrorError:
    return MirrorError(f"snapshot {name!r} is not newer than {newest!r}, the newest snapshot "
                       f"of this source the mirror holds; a mirror only moves forward: "
                       f"replicate a newer snapshot")


def _take_snapshot(txn, dbs, chunk_size: int, source_uuid: bytes,
                   snapshot: SnapshotRef) -> S.Snapshot:
    txn.put(b"mirror_of", source_uuid, db=dbs["meta"])
    gc.settle_purges(txn, dbs, chunk_size)
    snap = snaps.create(txn, dbs, snapshot.name, snap_uuid=bytes.fromhex(snapshot.uuid),
                        created_ns=snapshot.created_ns)
    _drop_staged(txn, dbs)
    return snap


def _check_base(txn, dbs, chunk_size: int, live_epoch: int, source_uuid: bytes,
                base_uuid: str | None, reconcile: bool, force: bool) -> S.Snapshot | None:
    mirror_of = txn.get(b"mirror_of", db=dbs["meta"])
    if mirror_of is not None and bytes(mirror_of) != source_uuid:
        raise MirrorError(f"the mirror holds another store ({bytes(mirror_of).hex()}), "
                          f"not this source ({source_uuid.hex()})")
    if not force and overwrites(mirror_of, _is_empty(txn, dbs, live_epoch, chunk_size)):
        raise not_a_mirror("the receiving store")
    if base_uuid is None:
        if not reconcile and not _is_empty(txn, dbs, live_epoch, chunk_size):
            raise MirrorError("the mirror is not empty and shares no snapshot with the "
                              "source; a full copy needs an empty mirror")
        return None
    base = next((s for s in snaps.list_all(txn, dbs) if s.uuid.hex() == base_uuid), None)
    if base is None:
        raise MirrorError(f"the mirror no longer has the base snapshot ({base_uuid})")
    root = View(txn, dbs, live_epoch, chunk_size).get(S.ROOT_INO)
    if _changed_since(txn, dbs, root, base):
        newest = snaps.list_all(txn, dbs)[-1]
        if newest.epoch > base.epoch and not _changed_since(txn, dbs, root, newest):
            raise MirrorError(f"the mirror received snapshot {newest.name!r} after this run "
                              f"chose its base {base.name!r} (another replicate committed "
                              f"first); re-run to send from it")
        raise MirrorError(f"the mirror has changed since its copy of base snapshot "
                          f"{base.name!r}; pass --force to roll it back to the base")
    return base


def _changed_since(txn, dbs, root: S.Inode, snap: S.Snapshot) -> bool:
    """Whether the live tree changed after ``snap`` (O(1): the root's mepoch), not counting
    a rollback to ``snap`` itself (see rollback_to)."""
    if root.mepoch <= snap.epoch:
        return False
    clean = txn.get(b"rolled_back_to", db=dbs["meta"])
    return not (clean is not None and bytes(clean)[8:] == snap.uuid
                and root.mepoch <= S.from_u64(bytes(clean)[:8]))


def rollback_to(txn, dbs, chunk_size: int, base_uuid: str) -> None:
    """Discard whatever changed on the mirror since the base (replicate --force). The
    rollback writes in the live epoch, which is then closed, so that the tree counts as
    unchanged since the base until something writes again."""
    base = next((s for s in snaps.list_all(txn, dbs) if s.uuid.hex() == base_uuid), None)
    if base is None:
        raise MirrorError(f"the mirror does not have the base snapshot ({base_uuid})")
    snaps.rollback(txn, dbs, chunk_size, base, force=True)
    snaps.mark_equal(txn, dbs, base)


def _drop_staged(txn, dbs) -> None:
    """Chunks staged but not adopted by this commit belong to no cycle any more."""
    cur = txn.cursor(dbs["staged"])
    # copied first: the keys are views into pages that the deletes below rewrite
    for digest in [bytes(k) for k in cur.iternext(values=False)]:
        if txn.get(digest, db=dbs["refs"]) is None:
            chunkfile.delete(txn, dbs, digest)
        txn.delete(digest, db=dbs["staged"])
    txn.delete(b"staged_bytes", db=dbs["meta"])


def purge_deleted(store: Store) -> None:
    """Work off the purge queue the commit left (chunk maps of dropped files), in short
    transactions after the commit."""
    while True:
        with store.write() as txn:
            if gc.purge_batch(txn, store.db, store.chunk_size):
                return


# ---- applying a changeset -----------------------------------------------------------------

def apply(live: Live, cs: Changeset) -> None:
    """Make the live tree hold every TO value of ``cs`` (see apply_parts)."""
    apply_parts(live, lambda: iter([cs]))


def apply_parts(live: Live, parts: Parts) -> None:
    """Make the live tree hold every TO value of the changeset whose parts ``parts()``
    yields (a fresh iterator each call: a part is read again for each step rather than all
    of them held), in one transaction: each step of _Apply over every part, then its
    finish."""
    steps = _Apply(live.chunk_size)
    for step in steps.steps():
        for cs in parts():
            step(live, cs)
    steps.finish(live, parts)


class _Apply:
    """One commit's steps, in DistCp's order across all parts: entries that go away or
    change first (deletes and rename sources), then inodes that are gone, then new entries
    (creates and rename targets), then records, then xattrs and chunks, then the names
    checked and the epochs of what changed raised up to the root; the finish raises those of
    the directories whose entries changed and checks the tree rules against the store's
    state. The finish writes only directories: the change's bulk is in the steps. Each step is called with (live tree, part) for every part in turn,
    in one transaction or in several (commit_staged). What the commit carries between parts
    is inode numbers only: directories whose entries changed, displaced inodes, subdirectory
    counts of directories, and, when something is dropped, the inodes the changeset names."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self.parents: set[int] = set()
        self.detached: set[int] = set()
        self.subdirs = _Subdirs()
        self.named: set[int] | None = None     # a set once any part drops an inode
        self.entries = self.inodes = 0          # what the commit changes, for its log line
        self.checked = 0                        # records checked so far

    def writing_steps(self) -> list:
        return [self.unlink, self.drop, self.link, self.records, self.content,
                self.check_names, self.settle]

    def steps(self) -> list:
        """Every step: two that only read the tree (every part is checked before the tree
        changes), then the writing ones."""
        return [self.check, self.collect_named] + self.writing_steps()

    def check(self, live: Live, cs: Changeset) -> None:
        """Validates a part, and raises the inode counter first (fsck checks every version
        of a half-applied commit against it too)."""
        _validate(cs, self.chunk_size)
        _raise_next_ino(live, cs)
        self.subdirs.note_before(live, cs)
        self.entries += len(cs.entries)
        self.inodes += len(cs.inodes)
        self.checked += cs.records()
        if self.named is None and any(rec is None for rec in cs.inodes.values()):
            self.named = set()

    def collect_named(self, live: Live, cs: Changeset) -> None:
        if self.named is not None:
            self.named.update(cs.inodes)

    def unlink(self, live: Live, cs: Changeset) -> None:
        for (d, name), child in cs.entries.items():
            now = live.lookup(d, name)
            if now is not None and now != child:
                live.delete_dirent(d, name)
                self.parents.add(d)
                self.detached.add(now)

    def drop(self, live: Live, cs: Changeset) -> None:
        if self.named is None:
            return
        for x, rec in cs.inodes.items():
            if rec is None and live.inode(x) is not None:
                _drop(live, x, self.named)

    def link(self, live: Live, cs: Changeset) -> None:
        for (d, name), child in cs.entries.items():
            if child is not None and live.lookup(d, name) != child:
                live.put_dirent(d, name, child)
                self.parents.add(d)

    def records(self, live: Live, cs: Changeset) -> None:
        for x, rec in cs.inodes.items():
            if rec is not None:
                put_live(live.txn, live.db["inodes"], S.inode_key(x),
                         rec.pack_at(live.live), live.live)

    def content(self, live: Live, cs: Changeset) -> None:
        for x, xattrs in cs.xattrs.items():
            _set_xattrs(live, x, xattrs)
        for x, leaves in cs.chunks.items():
            for index, value in leaves.items():
                _set_chunk(live, x, index, value)

    def check_names(self, live: Live, cs: Changeset) -> None:
        """Once every part is written: each name a part links leads to an inode the commit
        carries, under a directory, and no directory it moved is cut off from the root;
        before any epoch is raised along those names (settle)."""
        _check_tree(live, cs, [c for c in cs.entries.values() if c is not None])

    def settle(self, live: Live, cs: Changeset) -> None:
        """The epochs of what one part changed, up to the root."""
        for x in sorted(x for x, r in cs.inodes.items() if r is not None):
            live.propagate(x)
        for x in sorted((cs.xattrs.keys() | cs.chunks.keys()) - cs.inodes.keys()):
            if live.inode(x) is not None:
                live.touch(x)     # content-only changes raise the epochs too

    def finish(self, live: Live, parts: Parts) -> None:
        """The epochs of the directories whose entries changed, then the tree rules."""
        for x in sorted(self.parents):
            live.propagate(x)
        for x in sorted(self.parents):
            if live.inode(x) is not None:
                live.touch(x)     # as do entry-only ones
        for cs in parts():
            self.subdirs.count_arrivals(live, cs)
        for cs in parts():
            _check_invariants(live, cs, set(), self.subdirs)
        _check_invariants(live, Changeset(),
                          self.parents | self.detached | self.subdirs.retyped_parents,
                          self.subdirs)


class _Subdirs:
    """How many subdirectories each directory a commit touches holds afterwards, counted
    from the change (O(change), not O(entries): a commit adding one name to a directory of
    a million must not read the million). Before: nlink - 2, which the mirror's previous
    commits were checked to keep; then minus the directories the changed names named, plus
    those they name now, plus or minus children whose type changes under unchanged names.
    Only directories are remembered (anything else held none before), so a first copy of a
    million files holds a number per directory, not per file."""

    def __init__(self):
        self.before: dict[int, int] = {}
        self.delta: Counter = Counter()
        self.retyped_parents: set[int] = set()

    def note_before(self, live: Live, cs: Changeset) -> None:
        """Before the changes: the counts of the directories one part touches."""
        for (d, name), child in cs.entries.items():
            old = live.lookup(d, name)
            self._note(live, d, old, child)
            if old is not None and self._is_dir(live, old):
                self.delta[d] -= 1
        for x, rec in cs.inodes.items():
            old = live.inode(x)
            self._note(live, x)
            if old is None or rec is None or stat.S_ISDIR(old.mode) == stat.S_ISDIR(rec.mode):
                continue
            for p, name in live.links(x):
                if (p, name) not in cs.entries:
                    self._note(live, p)
                    self.delta[p] += 1 if stat.S_ISDIR(rec.mode) else -1
                    self.retyped_parents.add(p)
        for x in cs.xattrs.keys() | cs.chunks.keys():
            self._note(live, x)

    def _note(self, live: Live, *inos) -> None:
        for x in inos:
            if x is not None and x not in self.before:
                rec = live.inode(x)
                if rec is not None and stat.S_ISDIR(rec.mode):
                    self.before[x] = rec.nlink - 2

    @staticmethod
    def _is_dir(live: Live, x: int) -> bool:
        rec = live.inode(x)
        return rec is not None and stat.S_ISDIR(rec.mode)

    def count_arrivals(self, live: Live, cs: Changeset) -> None:
        """After the changes: the directories one part's changed names now name."""
        for (d, _), child in cs.entries.items():
            if child is not None and self._is_dir(live, child):
                self.delta[d] += 1

    def of(self, d: int) -> int:
        """Every directory asked about was noted before the changes (a commit's checks ask
        only about what it touched); one that was not a directory then held none."""
        return self.before.get(d, 0) + self.delta[d]


def _raise_next_ino(live: Live, cs: Changeset) -> None:
    """Keep the inode counter above every inode the mirror holds (for a promoted mirror)."""
    meta = live.db["meta"]
    top = max([x for x in cs.inodes] + [0]) + 1
    if top > S.from_u64(live.txn.get(b"next_ino", db=meta)):
        live.txn.put(b"next_ino", S.u64(top), db=meta)


def _validate(cs: Changeset, chunk_size: int) -> None:
    """What can be refused before anything is written: numbers out of range, bad names,
    over-long chunks, content for inodes that do not exist."""
    for (d, name), child in cs.entries.items():
        _check_ino(d)
        if child is not None:
            _check_ino(child)
        try:
            check_name(name)
        except FsError:
            raise MirrorError(f"commit names an entry {name!r} that is not a valid file "
                              f"name") from None
    for x in cs.inodes:
        _check_ino(x)
    if cs.inodes.get(S.ROOT_INO, 0) is None:
        raise MirrorError("commit would delete the root directory")
    for x, xattrs in cs.xattrs.items():
        _check_ino(x)
        for name in xattrs:
            if not invariants.xattr_name_ok(name):
                raise MirrorError(f"commit sets an xattr with an invalid name {name!r} on "
                                  f"inode {x}")
    for x, leaves in cs.chunks.items():
        _check_ino(x)
        for index, value in leaves.items():
            if not 0 <= index <= invariants.MAX_CHUNK_INDEX:
                raise MirrorError(f"commit names chunk {index} of inode {x}, outside the "
                                  f"valid range")
            if value is not None and not 0 < value[1] <= chunk_size:
                raise MirrorError(f"commit names a chunk of {value[1]} bytes; this mirror's "
                                  f"chunks hold {chunk_size} at most")


def _check_ino(x: int) -> None:
    if not invariants.ino_in_range(x):
        raise MirrorError(f"commit names inode {x}, outside the valid range "
                          f"1..{S.MAX_INO}")


def _check_invariants(live: Live, cs: Changeset, around: set[int], subdirs: _Subdirs) -> None:
    """After the changes: every inode the commit touched, and every directory whose entries
    changed, obeys the tree rules fsck checks (mountfs.invariants); content for an inode
    that does not exist, or a name left pointing nowhere, is refused."""
    touched = set(cs.inodes) | set(cs.xattrs) | set(cs.chunks) | around | \
        {c for c in cs.entries.values() if c is not None}
    for x in sorted(touched):
        rec = live.inode(x)
        if rec is None:
            if cs.xattrs.get(x) or any(v is not None for v in cs.chunks.get(x, {}).values()):
                raise MirrorError(f"commit sets content of inode {x}, which does not exist")
            if live.links(x):
                raise MirrorError(f"commit deletes inode {x} but leaves a name pointing to "
                                  f"it")
            continue
        names = len(live.links(x))
        if x != S.ROOT_INO and not names:
            raise MirrorError(f"commit leaves inode {x} without a name")
        problems = invariants.inode_problems(
            live, x, rec, names, subdirs.of(x) if stat.S_ISDIR(rec.mode) else None,
            chunks=())
        if problems:
            raise MirrorError(f"commit refused: {problems[0]}")


def _drop(live: Live, x: int, named) -> None:
    """Delete inode ``x`` and, for a directory, whatever only it held: entries under it
    whose inodes the changeset does not name (``named``) are implied deletes."""
    todo = [x]
    while todo:
        ino = todo.pop()
        rec = live.inode(ino)
        if rec is None:
            continue
        if stat.S_ISDIR(rec.mode):
            for name, child in list(live.listdir(ino)):
                live.delete_dirent(ino, name)
                if child not in named:
                    todo.append(child)
        live.destroy(ino)


def _set_xattrs(live: Live, x: int, xattrs: dict[bytes, bytes]) -> None:
    current = live.xattrs(x)
    for name in current.keys() - xattrs.keys():
        delete_live(live.txn, live.db["xattrs"], S.xattr_key(x, name), live.live)
    for name, value in xattrs.items():
        if current.get(name) != value:
            put_live(live.txn, live.db["xattrs"], S.xattr_key(x, name), b"\x01" + value,
                     live.live)


def _set_chunk(live: Live, x: int, index: int, value) -> None:
    if value is None:
        live.drop_chunk(x, index)
        return
    digest, length = value
    _adopt(live, digest, length)
    old = put_live(live.txn, live.db["chunks"], S.chunk_key(x, index),
                   S.pack_chunk(digest, length), live.live)
    live.txn.put(S.chunklog_key(x, live.live, index), b"", db=live.db["chunklog"])
    add_written(live.txn, live.db, live.live, length)
    if old:
        live.decref(S.unpack_chunk(old)[0])


def _adopt(live: Live, digest: bytes, length: int) -> None:
    """Reference a chunk the mirror holds, committed or staged for this cycle."""
    txn, dbs = live.txn, live.db
    stored = chunkfile.length(txn, dbs, digest)
    if stored is None:
        raise MirrorError(f"commit refers to chunk {digest.hex()[:16]} that the mirror "
                          f"lacks; send the chunks first")
    if stored != length:
        raise MirrorError(f"chunk {digest.hex()[:16]} is {stored} bytes on the mirror, "
                          f"the commit says {length}")
    raw = txn.get(digest, db=dbs["refs"])
    txn.put(digest, S.u64(S.from_u64(raw) + 1 if raw else 1), db=dbs["refs"])
    txn.delete(digest, db=dbs["staged"])


def _check_tree(live: Live, cs: Changeset, arrived_dirs: list[int]) -> None:
    """After the changes: every new entry names an inode that exists, and every directory
    that arrived somewhere (or that an entry names) still hangs from the root (no cycle,
    nothing detached)."""
    for (d, name), child in cs.entries.items():
        if child is not None and live.inode(child) is None:
            raise MirrorError(f"commit links {name!r} to inode {child}, which it does not "
                              f"carry")
        parent = live.inode(d)
        if child is not None and (parent is None or not stat.S_ISDIR(parent.mode)):
            raise MirrorError(f"commit puts {name!r} under inode {d}, which is not a "
                              f"directory")
    for ino in arrived_dirs:
        if not stat.S_ISDIR(live.get(ino).mode):
            continue
        seen = set()
        while ino != S.ROOT_INO:
            parents = live.parents(ino)
            if ino in seen or len(parents) != 1:
                raise MirrorError("commit would leave a directory in a cycle or without a "
                                  "single parent")
            seen.add(ino)
            ino = parents[0]


# ---- verification and repair ----------------------------------------------------------------

def epoch_of(txn, dbs, snap_uuid: str | None) -> int:
    """The epoch to compare at: a snapshot's (by uuid), or the live tree's (None)."""
    if snap_uuid is None:
        return snaps.readable_live_epoch(txn, dbs)
    for s in snaps.list_all(txn, dbs):
        if s.uuid.hex() == snap_uuid:
            return s.epoch
    raise MirrorError(f"the mirror has no snapshot with uuid {snap_uuid}")


def bucket_hashes(store: Store, snap_uuid: str | None, recompute: bool = False) -> list[bytes]:
    """The K bucket hashes at a snapshot or the live tree; ``recompute`` derives them from
    the items (O(store): finds what the kept ones cannot, tampering beneath the store)."""
    with store.read() as txn:
        epoch = epoch_of(txn, store.db, snap_uuid)
        if recompute:
            return buckets.compute(txn, store.db, epoch, store.bucket_count)
        return buckets.at(txn, store.db, epoch, store.bucket_count)


def bucket_items(store: Store, snap_uuid: str | None, wanted: list[int]) -> dict:
    """{bucket: {identity: item hash}} for the buckets in ``wanted``."""
    with store.read() as txn:
        epoch = epoch_of(txn, store.db, snap_uuid)
        top = S.from_u64(txn.get(b"next_ino", db=store.db["meta"]))
        return {b: buckets.items(txn, store.db, epoch, store.bucket_count, b, top)
                for b in wanted}


def scrub(store: Store) -> dict[str, list[bytes]]:
    """Every referenced chunk re-read and checked against its digest: O(data)."""
    missing, corrupt = [], []
    with store.read() as txn:
        for digest in txn.cursor(db=store.db["refs"]).iternext(values=False):
            digest = bytes(digest)
            data = chunkfile.get(txn, store.db, digest)
            if data is None:
                missing.append(digest)
            elif blake3.blake3(data).digest() != digest:
                corrupt.append(digest)
    return {"missing": missing, "corrupt": corrupt}


def replace_chunks(txn, dbs, chunks) -> int:
    """Write good copies of chunks the mirror references but lost or holds corrupted."""
    for digest, data in chunks:
        if blake3.blake3(data).digest() != bytes(digest):
            raise MirrorError(f"repair chunk {bytes(digest).hex()[:16]} does not match its "
                              f"digest")
    for digest, data in chunks:
        if txn.get(bytes(digest), db=dbs["refs"]) is None:
            raise MirrorError(f"repair chunk {bytes(digest).hex()[:16]} is not one the "
                              f"mirror references")
        chunkfile.replace(txn, dbs, bytes(digest), data)
    return len(chunks)


def repair(txn, dbs, chunk_size: int, base_uuid: str, cs: Changeset) -> None:
    """Make the live tree equal the source's ``base`` snapshot again (verify --repair): only
    the newest snapshot, since snapshots themselves are immutable, and only while the store
    is a mirror (a promoted one still holds the source's snapshots, but its tree is its
    own)."""
    if txn.get(b"mirror_of", db=dbs["meta"]) is None:      # promoted: its tree is its own
        raise MirrorError("the store is no longer a mirror (it was promoted): repairing "
                          "would rewrite its own files; verify it without --repair")
    newest = snaps.list_all(txn, dbs)[-1:]
    if not newest or newest[0].uuid.hex() != base_uuid:
        raise MirrorError("repair works on the mirror's newest snapshot only; older "
                          "snapshots are immutable")
    apply(Live(txn, dbs, snaps.live_epoch(txn, dbs), chunk_size), cs)
    snaps.mark_equal(txn, dbs, newest[0])


# ---- reading back (restore --from) ----------------------------------------------------------

def export(store: Store, snapshot: str, path: str) -> list[dict]:
    """Everything below ``path`` in ``snapshot``, parents before children: what a source
    needs to rebuild it (attributes, xattrs, symlink targets, chunk lists; a later name of a
    hard-linked file as ``link`` to its first). ``path`` '' or '.' is the whole tree."""
    with store.read() as txn:
        snap = snaps.get(txn, store.db, snapshot)
        view = View(txn, store.db, snap.epoch, store.chunk_size)
        try:
            top = view.resolve(path)
        except FsError:
            raise MirrorError(f"{path!r} does not exist in snapshot {snapshot!r} on the "
                              f"mirror") from None
        out, first_name = [], {}
        todo = [(top, ".")]
        while todo:
            ino, rel = todo.pop()
            rec = view.get(ino)
            entry = {"path": rel, "mode": rec.mode, "uid": rec.uid, "gid": rec.gid,
                     "atime_ns": rec.atime_ns, "mtime_ns": rec.mtime_ns, "size": rec.size,
                     "rdev": rec.rdev, "target": rec.target.hex(),
                     "xattrs": {k.hex(): v.hex() for k, v in view.xattrs(ino).items()}}
            if ino in first_name:
                entry = {"path": rel, "link": first_name[ino]}
            elif stat.S_ISREG(rec.mode):
                first_name[ino] = rel
                entry["chunks"] = [[i, *_hex_leaf(view.chunk(ino, i))]
                                   for i in view.chunk_indices(ino)]
            out.append(entry)
            if stat.S_ISDIR(rec.mode) and "link" not in entry:
                children = [(c, f"{rel}/{n.decode('utf-8', 'surrogateescape')}")
                            for n, c in view.listdir(ino)]
                todo.extend(reversed(children))
        return out


def _hex_leaf(value) -> list:
    return [bytes(value[0]).hex(), value[1]]


def read_chunks(store: Store, digests: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Committed chunk data by digest (checked: a corrupt chunk is an error, not data)."""
    out = []
    with store.read() as txn:
        for digest in digests:
            data = chunkfile.get(txn, store.db, bytes(digest))
            if data is None or txn.get(bytes(digest), db=store.db["refs"]) is None:
                raise MirrorError(f"the mirror has no chunk {bytes(digest).hex()[:16]}")
            data = store.copy(data)
            if blake3.blake3(data).digest() != bytes(digest):
                raise MirrorError(f"chunk {bytes(digest).hex()[:16]} is corrupt on the mirror "
                                  f"(run 'snapctl verify --full --repair')")
            out.append((bytes(digest), data))
    return out


def delete_snapshot(store: Store, name: str) -> None:
    """Prune a snapshot on the mirror (retention); never the newest, which is the base of the
    next cycle. Space is reclaimed before returning."""
    with store.write() as txn:
        held = snaps.list_all(txn, store.db)
        if held and held[-1].name == name:
            raise MirrorError(f"{name!r} is the mirror's newest snapshot (the replication "
                              f"base); it is not pruned")
        snaps.delete(txn, store.db, name)
    gc.run_to_completion(store)
    store.sync()
