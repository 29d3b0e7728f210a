"""Garbage collection: reclaiming what no retained epoch can see any more.

Two kinds of work, both done in small batches (one short write transaction each) so that a
mount is never stalled for long:

* **Version reclamation** after a snapshot is deleted (meta ``gc_pending``). A version made in
  epoch ``e`` whose next newer version was made in epoch ``n`` is visible at epochs [e, n). It
  is kept only if a retained epoch (a snapshot's, or the live one) lies in that range. A
  tombstone with nothing older left is dropped too. Dropping a chunk-map version releases its
  reference on the chunk data; data with no reference left is deleted.
* **Purge** of deleted files whose chunk maps were too large to drop inline (``purge``).

Both resume after a crash: the flags and queues live in the store.
"""

from __future__ import annotations

import bisect

from . import schema as S
from .namespace import Live
from .snapshots import live_epoch, retained_epochs

BATCH_KEYS = 2000


def needed(epoch: int, next_epoch: int | None, retained: list[int]) -> bool:
    """Whether a version visible in [epoch, next_epoch) is seen by a retained epoch."""
    i = bisect.bisect_left(retained, epoch)
    return i < len(retained) and (next_epoch is None or retained[i] < next_epoch)


def reclaim_batch(txn, dbs, chunk_size: int, dbname: str, start: bytes | None,
                  max_keys: int = BATCH_KEYS) -> bytes | None:
    """Reclaim unneeded versions in ``dbname`` from base key ``start`` on, looking at about
    ``max_keys`` keys. Returns where to continue, or None when the table is done."""
    db = dbs[dbname]
    retained = retained_epochs(txn, dbs)
    live = Live(txn, dbs, live_epoch(txn, dbs), chunk_size)
    cur = txn.cursor(db)
    if not (cur.set_range(start) if start else cur.first()):
        return None
    seen = 0
    while seen < max_keys:
        base = bytes(cur.key())[:-8]
        versions = []
        for key, value in cur:
            key = bytes(key)
            if key[:-8] != base:
                break
            versions.append((S.epoch_of_key(key), bytes(value)))
        else:                      # the table ends with this group
            _reclaim_group(live, dbname, base, versions, retained)
            return None
        seen += len(versions)
        _reclaim_group(live, dbname, base, versions, retained)
        nxt = base + b"\xff" * 8
        if not cur.set_range(nxt):
            return None
    return bytes(cur.key())[:-8]


def _reclaim_group(live: Live, dbname: str, base: bytes, versions, retained) -> None:
    """``versions`` newest first."""
    keep = []
    newer = None
    for epoch, value in versions:
        if needed(epoch, newer, retained):
            keep.append((epoch, value))
        else:
            _drop(live, dbname, base, epoch, value)
        newer = epoch
    while keep and not keep[-1][1]:                 # oldest left is a tombstone: hides nothing
        epoch, value = keep.pop()
        _drop(live, dbname, base, epoch, value)


def _drop(live: Live, dbname: str, base: bytes, epoch: int, value: bytes) -> None:
    live.txn.delete(base + S.inv(epoch), db=live.db[dbname])
    if dbname == "chunks":
        live.txn.delete(base[:8] + S.u64(epoch) + base[8:16], db=live.db["chunklog"])
        if value:
            live.decref(S.unpack_chunk(value)[0])


LOGS = ("changelog", "chunklog")
RECLAIMED = S.VERSIONED_DBS + ("buckets",) + LOGS      # every table with per-epoch records


def trim_logs_batch(txn, dbs, dbname: str, start: bytes | None,
                    max_keys: int = BATCH_KEYS) -> bytes | None:
    """Drop change-log entries no diff can ask for: a diff starts at a snapshot, so it never
    needs entries at or before the oldest snapshot's epoch (or the live one, without
    snapshots). Keys are (owner:u64, epoch:u64, ...): per owner, one range from the start.
    Returns where to continue, or None when the log is done."""
    upto = min(retained_epochs(txn, dbs))
    db = dbs[dbname]
    cur = txn.cursor(db)
    if not (cur.set_range(start) if start else cur.first()):
        return None
    seen = 0
    while seen < max_keys:
        key = bytes(cur.key())
        owner = key[:8]
        if S.from_u64(key[8:16]) <= upto:
            cur.delete()
            seen += 1
            if not cur.key() and not cur.set_range(key):
                return None
            continue
        seen += 1
        nxt = S.from_u64(owner) + 1
        if nxt >= 1 << 64 or not cur.set_range(S.u64(nxt)):
            return None
    return bytes(cur.key())


def purge_batch(txn, dbs, chunk_size: int, max_chunks: int = BATCH_KEYS) -> bool:
    """Drop the chunk maps of deleted files, at most ``max_chunks`` chunks. Returns True when
    the purge queue is empty."""
    live = Live(txn, dbs, live_epoch(txn, dbs), chunk_size)
    for key, _ in list(txn.cursor(db=dbs["purge"]))[:64]:
        if not live.drop_chunks_from(S.from_u64(key), 0, limit=max_chunks):
            return False
        txn.delete(bytes(key), db=dbs["purge"])
    return txn.stat(dbs["purge"])["entries"] == 0


def settle_purges(txn, dbs, chunk_size: int) -> None:
    """Finish purging deleted files' chunk maps, in the transaction that takes a snapshot.
    A purge left pending across a snapshot would write its tombstones in the next epoch,
    so the snapshot would still see (and keep) the chunk data of a file it does not hold,
    until that snapshot itself is deleted."""
    while not purge_batch(txn, dbs, chunk_size):
        pass


def pending(txn, dbs) -> bool:
    return txn.get(b"gc_pending", db=dbs["meta"]) is not None or \
        txn.stat(dbs["purge"])["entries"] > 0


def reclaim_token(txn, dbs) -> bytes | None:
    """The pending-reclamation token; a snapshot deletion changes it."""
    token = txn.get(b"gc_pending", db=dbs["meta"])
    return bytes(token) if token is not None else None


def finish_reclaim(txn, dbs, token: bytes) -> None:
    """Clear the pending flag, unless a snapshot was deleted while we worked."""
    if reclaim_token(txn, dbs) == token:
        txn.delete(b"gc_pending", db=dbs["meta"])


def run_to_completion(store) -> None:
    """Do all pending GC work now (snapctl on an unmounted store)."""
    while True:
        with store.write() as txn:
            if purge_batch(txn, store.db, store.chunk_size):
                break
    with store.read() as txn:
        token = reclaim_token(txn, store.db)
    if token is None:
        return
    for dbname in RECLAIMED:
        start = None
        while True:
            with store.write() as txn:
                start = batch(txn, store.db, store.chunk_size, dbname, start)
            if start is None:
                break
    with store.write() as txn:
        finish_reclaim(txn, store.db, token)


def batch(txn, dbs, chunk_size: int, dbname: str, start: bytes | None) -> bytes | None:
    """One batch of reclamation work on ``dbname``: versions, or log entries."""
    if dbname in LOGS:
        return trim_logs_batch(txn, dbs, dbname, start)
    return reclaim_batch(txn, dbs, chunk_size, dbname, start)
