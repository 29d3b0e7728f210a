"""Bucket hashes (the hbr paper): a summary of a store's state that two stores can compare
in K hashes, however large they are.

Every *item* (an inode record, a directory entry, a chunk-map leaf, an xattr) is hashed with
blake3 over its identity and value, and XOR-combined into bucket ``ino % K`` (the inode it
belongs to; a directory's entries belong to the directory). XOR makes the combination
order-free and incremental: changing an item XORs out its old hash and XORs in the new one.

The buckets are versioned records like the items (one version per epoch), so every snapshot
has its bucket hashes for free and a snapshot stays O(1). ``store.put_live`` and
``store.delete_live`` (the only writers of versioned items) keep them current through
``changed``, at once or, in a transaction that defers them (the mount's open
transaction), through ``Deferred`` when it commits; ``compute`` recomputes them from the
items themselves (fsck, verify --full).

An item's hash leaves out what legitimately differs between a source and its mirror: the
``mepoch`` of an inode record (each store counts its own epochs).
"""

from __future__ import annotations

import blake3

from . import schema as S

DEFAULT_COUNT = 1024
ZERO = bytes(32)
KINDS = {"inodes": b"i", "dirents": b"d", "chunks": b"c", "xattrs": b"x"}
_MEPOCH = slice(56, 64)          # the mepoch field in a packed inode record (schema._INODE)

# lmdb database handle -> (item kind, the buckets database, bucket count), per open store
_tracked: dict = {}


def track(dbs: dict, count: int) -> None:
    """Make put_live/delete_live maintain the buckets of the store whose tables are ``dbs``."""
    for name, kind in KINDS.items():
        _tracked[dbs[name]] = (kind, dbs["buckets"], count)


def is_tracked(db) -> bool:
    return db in _tracked


def item_hash(kind: bytes, base: bytes, value: bytes) -> bytes:
    value = bytes(value)
    if kind == b"i":
        value = value[:_MEPOCH.start] + bytes(8) + value[_MEPOCH.stop:]
    return blake3.blake3(kind + bytes(base) + b"\0" + value).digest()


def bucket_of(base: bytes, count: int) -> int:
    return S.from_u64(bytes(base[:8])) % count


def xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(32, "little")


def changed(txn, db, base: bytes, old, new, live: int) -> None:
    """Item ``base`` of table ``db`` went from ``old`` to ``new`` (None: absent) in the live
    epoch: fold the difference into its bucket."""
    kind, bdb, count = _tracked[db]
    delta = _delta(kind, base, old, new)
    if delta:
        _xor_into(txn, bdb, bucket_key(bucket_of(base, count)), delta, live)


def _delta(kind: bytes, base: bytes, old, new) -> int:
    """What an item going from ``old`` to ``new`` (None: absent) XORs into its bucket."""
    delta = 0
    if old is not None:
        delta = int.from_bytes(item_hash(kind, base, old), "little")
    if new is not None:
        delta ^= int.from_bytes(item_hash(kind, base, new), "little")
    return delta


def _xor_into(txn, bdb, key: bytes, delta: int, live: int) -> None:
    """Fold ``delta`` into bucket ``key``'s live version."""
    txn.put(key + S.inv(live), xor(read(txn, bdb, key, live), delta.to_bytes(32, "little")),
            db=bdb)


class Deferred:
    """The bucket updates of one write transaction, folded in once at its end: an item
    written many times in the transaction (a file's record: created, linked, three
    attribute changes, its size) then costs one pair of hashes and one bucket write instead
    of one per write. Remembers each item's visible value as the transaction first found it;
    ``fold`` hashes that against the value at the end. Correct also when a nested
    transaction that wrote an item is aborted (its item simply did not change)."""
    __slots__ = ("before",)

    def __init__(self):
        self.before: dict = {}          # (table handle, base) -> value at first write

    def note(self, db, base: bytes, old_of) -> None:
        """Item ``base`` of ``db`` is about to be written; ``old_of()``: its visible value
        (None: absent), asked only for the item's first write in the transaction."""
        if (db, base) not in self.before:
            self.before[db, base] = old_of()

    def fold(self, txn, live: int) -> None:
        """Fold every remembered item's change into its bucket, in ``txn`` (the
        transaction itself, before it commits)."""
        from .store import get_at
        before, self.before = self.before, {}
        deltas: dict = {}                   # (buckets db, bucket key) -> XOR of its changes
        for (db, base), old in before.items():
            new = get_at(txn, db, base, live)
            new = bytes(new) if new is not None else None
            if new == old:
                continue
            kind, bdb, count = _tracked[db]
            where = (bdb, bucket_key(bucket_of(base, count)))
            deltas[where] = deltas.get(where, 0) ^ _delta(kind, base, old, new)
        for (bdb, key), delta in deltas.items():
            if delta:
                _xor_into(txn, bdb, key, delta, live)


def bucket_key(bucket: int) -> bytes:
    return S.U32.pack(bucket)


def read(txn, bdb, key: bytes, epoch: int) -> bytes:
    """A bucket's hash at ``epoch`` (the newest version at or below it)."""
    cur = txn.cursor(bdb)
    if cur.set_range(key + S.inv(epoch)):
        k = bytes(cur.key())
        if k[:4] == key and len(k) == 12:
            return bytes(cur.value())
    return ZERO


def at(txn, dbs, epoch: int, count: int) -> list[bytes]:
    """Every bucket's hash at ``epoch`` (K point reads)."""
    return [read(txn, dbs["buckets"], bucket_key(b), epoch) for b in range(count)]


def count_of(txn, dbs) -> int:
    raw = txn.get(b"bucket_count", db=dbs["meta"])
    return S.U32.unpack(bytes(raw))[0] if raw is not None else DEFAULT_COUNT


def compute(txn, dbs, epoch: int, count: int) -> list[bytes]:
    """The buckets at ``epoch`` recomputed from every item visible then: O(store), the
    check that the incremental ones are true."""
    from .store import iter_visible
    out = [ZERO] * count
    for name, kind in KINDS.items():
        for base, value in iter_visible(txn, dbs[name], b"", epoch, start=b"\0"):
            b = bucket_of(base, count)
            out[b] = xor(out[b], item_hash(kind, base, value))
    return out


def items(txn, dbs, epoch: int, count: int, bucket: int, top_ino: int) -> dict[bytes, bytes]:
    """Every item of one bucket at ``epoch``: identity (kind + key) -> item hash. Visits the
    inodes ``bucket``, ``bucket + K``, ... below ``top_ino`` (the inode counter) that have
    records, by cursor seeks: the work is bounded by the records stored, not by the counter
    (which a mirror takes from its peer)."""
    from .store import iter_visible
    out = {}
    for name, kind in KINDS.items():
        cur = txn.cursor(dbs[name])
        ino = bucket or count
        while ino < top_ino and cur.set_range(S.u64(ino)):
            found = S.from_u64(bytes(cur.key())[:8])
            if found >= top_ino:
                break
            if found % count != bucket % count:
                ino = found + (bucket - found) % count
                continue
            for base, value in iter_visible(txn, dbs[name], S.u64(found), epoch):
                out[kind + bytes(base)] = item_hash(kind, base, value)
            ino = found + count
    return out
