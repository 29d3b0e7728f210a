"""One replication cycle:

1. base: the newest source snapshot older than the one being sent whose uuid the mirror
   holds (none: a full first copy into an empty mirror);
2. the mirror must not have changed since its copy of the base (O(1): its root's mepoch);
   ``force`` rolls it back to the base first. Without a common snapshot, a mirror that is
   not empty (a lost base, seeded another way) is reconciled by bucket hashes instead;
3. the changeset base -> snapshot, from the epoch-pruned diff;
4. the mirror says which chunk digests it lacks; only those travel (Spark);
5. one commit on the mirror: the changeset and the snapshot of the same name and uuid.

Nothing needs undoing after a failure at any step: the mirror is at its base until step 5
commits, and step 4's chunks stay staged for the next try.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from mountfs import schema as S
from mountfs import snapshots as snaps
from mountfs.store import Store, StoreError

from . import changeset, transfer
from .mirror import MirrorError, SnapshotRef
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

    def to_json(self) -> dict:
        out = asdict(self)
        del out["diff_seconds"]
        return out

    def summary(self) -> str:
        base = f"from {self.base}" if self.base else "full copy"
        return (f"replicated {self.snapshot} ({base}): {self.entries} names and "
                f"{self.inodes} inodes changed, "
                f"{self.chunks_sent} chunks sent ({self.bytes_sent} bytes), "
                f"{self.bytes_skipped} bytes not sent (already on the mirror), "
                f"{self.seconds:.2f} s")


def replicate(source_path: str, mirror, snapshot: str, force: bool = False,
              master: str | None = None, batch_bytes: int = transfer.DEFAULT_BATCH_BYTES,
              stall_seconds: float = transfer.DEFAULT_STALL_SECONDS,
              progress=None, inline_bytes: int = 0, phase=None) -> CycleResult:
    """Send snapshot ``snapshot`` of the store at ``source_path`` to ``mirror`` (an
    endpoint from replicator.endpoints). Transfers of at most ``inline_bytes`` skip Spark
    (starting its JVM costs seconds; a few changed chunks take milliseconds).
    ``phase(text)`` hears what the cycle is doing before the transfer's ``progress``."""
    phase = phase or (lambda text: None)
    started = time.monotonic()
    transfer.check_reachable(master, mirror.sink)
    source = Store.open(source_path, readonly=True, lock=False)
    try:
        with source.read() as txn:
            snap = snaps.get(txn, source.db, snapshot)
            older = [s for s in snaps.list_all(txn, source.db) if s.epoch < snap.epoch]
        info = mirror.info()
        _check_compatible(source, info)
        held = {s["uuid"]: s for s in info["snapshots"]}
        if snap.uuid.hex() in held:
            return CycleResult(snap.name, None, 0, 0, 0, 0, 0, time.monotonic() - started)
        base = next((s for s in reversed(older) if s.uuid.hex() in held), None)
        if base is not None and held[base.uuid.hex()]["changed_since"]:
            if not force:
                raise MirrorError(f"the mirror has changed since its copy of {base.name!r}; "
                                  f"pass --force to roll it back to {base.name!r}")
            mirror.rollback_to(base.uuid.hex())
        phase(f"finding what changed since {base.name}" if base else
              "listing the snapshot for a full copy")
        diff_started = time.monotonic()
        reconciling = base is None and not info["empty"]
        if reconciling:
            if info["buckets"] != source.bucket_count:
                raise MirrorError("the mirror shares no snapshot with this source and keeps "
                                  "another number of buckets; replicate into an empty mirror")
            cs = reconcile(source, mirror, snap)
        else:
            with source.read() as txn:
                cs = changeset.build(txn, source.db, source.chunk_size,
                                     base.epoch if base else None, snap.epoch)
        diff_seconds = time.monotonic() - diff_started
        wanted = cs.digests()
        phase(f"asking the mirror which of {len(wanted)} chunks it lacks")
        lacking = mirror.missing(list(wanted))
        todo = [(d, wanted[d]) for d in lacking]
        chunk_batches = transfer.batches(todo, batch_bytes)
        todo_bytes = sum(n for _, n in todo)
        if todo_bytes <= inline_bytes:
            sent = transfer.send_inline(source, mirror.stage, chunk_batches, progress)
        else:
            phase(f"starting Spark to send {len(todo)} chunks ({todo_bytes} bytes)")
            sent = transfer.send(source, mirror.sink, chunk_batches, master=master,
                                 stall_seconds=stall_seconds, progress=progress)
        phase(COMMITTING)
        mirror.commit(source.uuid, base.uuid.hex() if base else None,
                      SnapshotRef(snap.name, snap.uuid.hex(), snap.created_ns), cs,
                      reconcile=reconciling)
        return CycleResult(snap.name, base.name if base else None, len(cs.entries),
                           len(cs.inodes), sent.chunks,
                           sent.bytes, sum(wanted.values()) - sent.bytes,
                           time.monotonic() - started, diff_seconds, sent.executors)
    finally:
        source.close()


def _check_compatible(source: Store, info: dict) -> None:
    if info["format"] != S.FORMAT_VERSION:
        raise MirrorError(f"the mirror's store format is {info['format']}, this source's is "
                          f"{S.FORMAT_VERSION}")
    if info["chunk_size"] != source.chunk_size:
        raise MirrorError(f"the mirror's chunk size is {info['chunk_size']}, the source's "
                          f"{source.chunk_size}; mirrors need the same chunk size")
    if info["mirror_of"] not in (None, source.uuid.hex()):
        raise MirrorError(f"the mirror holds another store ({info['mirror_of']})")


__all__ = ["CycleResult", "replicate", "StoreError"]
