"""One replication cycle:

1. base: the newest source snapshot older than the one being sent whose uuid the mirror
   holds (none: a full first copy into an empty mirror); a store that is no mirror and
   holds something of its own is refused unless ``force`` (mirror.overwrites); a snapshot
   older than one of this source the mirror holds is refused, ``force`` or not (a mirror
   only moves forward, as ``zfs recv`` refuses an older snapshot; the receiver checks it
   too: mirror._check_forward);
2. the mirror must not have changed since its copy of the base (O(1): its root's mepoch);
   ``force`` rolls it back to the base first. Without a common snapshot, a mirror that is
   not empty (a lost base, seeded another way) is reconciled by bucket hashes instead, and
   so is one whose newest snapshot came after the base and is gone from the source (a base
   deleted with ``snapctl delete --force``): its live tree is that snapshot's, not the
   base's (changed since it: refused, ``force`` rolls it back to it);
3. the changeset base -> snapshot, built from the epoch-pruned diff in bounded parts; for
   each part, the mirror says which of its chunk digests it lacks, only those travel
   (from this process, or one Spark job after the last part when they are many), and the
   part is staged on the mirror under this cycle's transfer id;
4. one commit on the mirror names the parts (count and digest of each): the changeset and
   the snapshot of the same name and uuid, applied part by part in one transaction.

Memory is bounded by a part, not by the change. Nothing needs undoing after a failure at
any step: the mirror is at its base until step 4 commits, and staged chunks stay for the
next try (staged parts are dropped by the next commit or when staging expires).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import blake3

from mountfs import schema as S
from mountfs import snapshots as snaps
from mountfs.store import Store, StoreError
from mountfs.units import counted

from . import changeset, transfer
from .mirror import (MirrorError, SnapshotRef, check_newer, not_a_mirror, not_newer,
                     overwrites)
from .verify import reconcile


COMMITTING = "committing on the mirror"    # from here the mirror may hold the snapshot


@dataclass
class CycleResult:
    snapshot: str
    base: str | None
    entries: int                   # directory entries (names) written or removed on the mirror
    inodes: int                    # inode records written or removed (the receiver logs both)
    chunks_sent: int
    bytes_sent: int
    bytes_skipped: int
    seconds: float
    diff_seconds: float = 0.0      # of ``seconds``, finding the changes (not in the summary)
    executors: dict = field(default_factory=dict)   # per executor: tasks, bytes, bytes/s
    already_on_mirror: bool = False  # the mirror held the snapshot: nothing was sent
    reconciled: bool = False       # no base: the mirror's live tree compared by buckets
    # The source snapshot to hold as this mirror's base: the one sent, or, when the mirror
    # held it already, the newest one the mirror shares with the source (never an older).
    hold: str | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        del out["diff_seconds"], out["hold"]
        return out

    def summary(self) -> str:
        if self.already_on_mirror:
            return (f"{self.snapshot} is already on the mirror: nothing sent, its base "
                    f"stays {self.hold} ({self.seconds:.2f} s)")
        base = f"from {self.base}" if self.base else \
            "reconciled by hash buckets" if self.reconciled else "full copy"
        return (f"replicated {self.snapshot} ({base}): {counted(self.entries, 'name')} and "
                f"{counted(self.inodes, 'inode')} changed, "
                f"{counted(self.chunks_sent, 'chunk')} sent "
                f"({counted(self.bytes_sent, 'byte')}), "
                f"{counted(self.bytes_skipped, 'byte')} not sent (already on the mirror), "
                f"{self.seconds:.2f} s")


def replicate(source_path: str, mirror, snapshot: str, force: bool = False,
              master: str | None = None, batch_bytes: int = transfer.DEFAULT_BATCH_BYTES,
              stall_seconds: float = transfer.DEFAULT_STALL_SECONDS,
              progress=None, inline_bytes: int = 0, phase=None,
              part_records: int = changeset.PART_RECORDS) -> CycleResult:
    """Send snapshot ``snapshot`` of the store at ``source_path`` to ``mirror`` (an
    endpoint from replicator.endpoints). Transfers of at most ``inline_bytes`` skip Spark
    (starting its JVM costs seconds; a few changed chunks take milliseconds).
    ``phase(text)`` hears what the cycle is doing before the transfer's ``progress``.
    The changeset travels in parts of at most ``part_records`` records."""
    phase = phase or (lambda text: None)
    started = time.monotonic()
    transfer.check_reachable(master, mirror.sink)
    # Without readahead: the diff reads random B-tree pages (see _for_chunks).
    source = Store.open(source_path, readonly=True, lock=False, readahead=False)
    try:
        with source.read() as txn:
            snap = snaps.get(txn, source.db, snapshot)
            every = snaps.list_all(txn, source.db)
            older = [s for s in every if s.epoch < snap.epoch]
        ref = SnapshotRef(snap.name, snap.uuid.hex(), snap.created_ns)
        info = mirror.info()
        _check_compatible(source, info)
        overwrite = overwrites(info["mirror_of"], info["empty"])
        if overwrite and not force:
            raise not_a_mirror(mirror.url)
        if overwrite and info.get("rights") == "replicate":
            raise MirrorError(f"{mirror.url} is a mountfs store with files of its own, and "
                              f"this token may only add snapshots: --force, which replaces "
                              f"those files, needs the admin token (--token-file)")
        held = {s["uuid"]: s for s in info["snapshots"]}
        if snap.uuid.hex() in held:       # sent before (a re-run): nothing to do, and the
            newest = [s for s in every if s.uuid.hex() in held][-1]     # base stays newest
            return CycleResult(snap.name, None, 0, 0, 0, 0, 0, time.monotonic() - started,
                               already_on_mirror=True, hold=newest.name)
        ours = info["mirror_of"] == source.uuid.hex()     # its snapshots are this source's
        ahead = [s for s in every if s.uuid.hex() in held and s.epoch > snap.epoch]
        if ours and ahead:                # as zfs recv: never back to an older snapshot
            raise not_newer(snap.name, ahead[-1].name)
        base = next((s for s in reversed(older) if s.uuid.hex() in held), None)
        newest = info["snapshots"][-1] if info["snapshots"] else None
        if base is not None and newest["uuid"] != base.uuid.hex():
            # The mirror went on past the base with snapshots this source no longer has
            # (deleted with --force): the diff from the base would not fit its tree, and
            # the receiver takes increments only from its newest snapshot. Reconcile.
            if newest["changed_since"]:
                if not force:
                    raise changed_since(newest["name"])
                mirror.rollback_to(newest["uuid"])
            base = None
        elif base is not None and held[base.uuid.hex()]["changed_since"]:
            if not force:
                raise changed_since(base.name)
            mirror.rollback_to(base.uuid.hex())
        reconciling = base is None and not info["empty"]
        if reconciling and ours:
            check_newer([(s["name"], s["created_ns"]) for s in info["snapshots"]], ref)
        phase(f"finding what changed since {base.name}" if base else
              "comparing the mirror's buckets" if reconciling else
              "listing the snapshot for a full copy")
        diff_started = time.monotonic()
        if reconciling and info["buckets"] != source.bucket_count:
            raise MirrorError("the mirror shares no snapshot with this source and keeps "
                              "another number of buckets; replicate into an empty mirror")
        sender = _Sender(source, mirror, batch_bytes, inline_bytes, progress, phase)
        with source.read() as txn:
            parts = changeset.split(reconcile(source, mirror, snap), part_records) \
                if reconciling else changeset.parts(txn, source.db, source.chunk_size,
                                                    base.epoch if base else None,
                                                    snap.epoch, part_records)
            diff_seconds = time.monotonic() - diff_started
            parts = iter(parts)
            while True:           # the diff's time is the parts' building, not their sending
                diff_started = time.monotonic()
                part = next(parts, None)
                diff_seconds += time.monotonic() - diff_started
                if part is None:
                    break
                sender.part(part)
        if sender.pending:
            phase(f"starting Spark to send {len(sender.pending)} chunks "
                  f"({sum(sender.pending.values())} bytes)")
            source = _for_chunks(source, sender.pending.values())
            sender.add(transfer.send(source, mirror.sink,
                                     transfer.batches(list(sender.pending.items()),
                                                      batch_bytes),
                                     master=master, stall_seconds=stall_seconds,
                                     progress=progress))
        phase(COMMITTING)
        mirror.commit_parts(source.uuid, base.uuid.hex() if base else None, ref,
                            sender.transfer, sender.digests, reconcile=reconciling,
                            force=overwrite)
        sent = sender.sent
        return CycleResult(snap.name, base.name if base else None, sender.entries,
                           sender.inodes, sent.chunks, sent.bytes,
                           max(sender.wanted_bytes - sent.bytes, 0),
                           time.monotonic() - started, diff_seconds, sent.executors,
                           reconciled=reconciling, hold=snap.name)
    finally:
        source.close()


def _for_chunks(source: Store, lengths) -> Store:
    """The source store opened the way its chunks read fastest: with readahead when they
    are large on average (one chunk's read pulls in the next), else as it is (small
    chunks are random pages, which readahead would inflate ~30x). The snapshot is
    immutable, so reopening changes nothing of what is read."""
    lengths = list(lengths)
    if not transfer.readahead_suits(lengths):
        return source
    path = source.path
    source.close()
    return Store.open(path, readonly=True, lock=False)


class _Sender:
    """Sends a changeset part by part as it is built: for each part, the chunks it names
    that the mirror lacks, then the part itself, staged under this transfer's id. Chunks go
    from this process while they total at most ``inline_bytes``; beyond that they are kept
    (digest and length only) for one Spark job after the last part."""

    def __init__(self, source: Store, mirror, batch_bytes: int, inline_bytes: int, progress,
                 phase):
        self.source, self.mirror, self.phase = source, mirror, phase
        self.batch_bytes, self.inline_left, self.progress = batch_bytes, inline_bytes, progress
        self.transfer = os.urandom(16)
        self.digests: list[bytes] = []
        self.pending: dict[bytes, int] = {}
        self.sent = transfer.Sent()
        self.entries = self.inodes = self.wanted_bytes = 0

    def part(self, part: changeset.Changeset) -> None:
        wanted = part.digests()
        self.wanted_bytes += sum(wanted.values())
        if wanted:
            later = f" (part {len(self.digests) + 1})" if self.digests else ""
            self.phase(f"asking the mirror which of {len(wanted)} chunks it lacks{later}")
        todo = [(d, wanted[d]) for d in self.mirror.missing(list(wanted))
                if d not in self.pending] if wanted else []
        nbytes = sum(n for _, n in todo)
        if not self.pending and nbytes <= self.inline_left:
            self.inline_left -= nbytes
            self.add(transfer.send_inline(self.source, self.mirror.stage,
                                          transfer.batches(todo, self.batch_bytes),
                                          self.progress))
        else:
            self.pending.update(todo)
        raw = json.dumps(part.to_json()).encode()
        self.mirror.stage_part(self.transfer, len(self.digests), raw)
        self.digests.append(blake3.blake3(raw).digest())
        self.entries += len(part.entries)
        self.inodes += len(part.inodes)

    def add(self, sent: transfer.Sent) -> None:
        self.sent.chunks += sent.chunks
        self.sent.bytes += sent.bytes
        self.sent.executors.update(sent.executors)


def changed_since(name: str) -> MirrorError:
    return MirrorError(f"the mirror has changed since its copy of {name!r}; pass --force to "
                       f"roll it back to {name!r}")


def _check_compatible(source: Store, info: dict) -> None:
    if info["format"] not in S.MIRROR_FORMATS:
        raise MirrorError(f"the mirror's store format is {info['format']}, this source's is "
                          f"{S.FORMAT_VERSION}")
    if info["chunk_size"] != source.chunk_size:
        raise MirrorError(f"the mirror's chunk size is {info['chunk_size']}, the source's "
                          f"{source.chunk_size}; mirrors need the same chunk size")
    if info["mirror_of"] not in (None, source.uuid.hex()):
        raise MirrorError(f"the mirror holds another store ({info['mirror_of']})")


__all__ = ["CycleResult", "replicate", "StoreError"]
