"""The on-disk layout of a mountfs store: every LMDB sub-database, its keys and values.

This is the one place that says how bytes are laid out; the rest of the code calls the
helpers here rather than packing keys itself.

Versioned records
-----------------
Inodes, directory entries, chunk-map leaves and xattrs are *versioned by epoch*. A logical
record with base key ``B`` is stored as one LMDB key per version::

    B + inv(epoch)            inv(e) = 2**64 - 1 - e, big-endian

so the versions of one record sort newest first, and "the newest version at or below epoch
E" is a single ``set_range(B + inv(E))``. An empty value is a *tombstone*: the record does not
exist from that epoch on. Every base key is self-delimiting (fixed width, or a name ended by
NUL, which names never contain), so no base key is a prefix of another record's version key.

Sub-databases (``DB_*`` below)
------------------------------
meta      unversioned  b'format' -> u32 FORMAT_VERSION, b'chunk_size' -> u32,
                       b'live_epoch' -> u64, b'next_ino' -> u64, b'next_snap_id' -> u64,
                       b'uuid' -> 16 bytes (the store's identity),
                       b'written' + epoch:u64 -> u64 (chunk bytes written in that epoch),
                       b'bucket_count' -> u32 (K, the number of hash buckets),
                       b'hold:' + mirror uuid -> base snapshot uuid + mirror URL (the
                       snapshot each mirror was last replicated to; kept from deletion,
                       or deleted with --force: the hold stays until the next cycle)
                       on a mirror: b'mirror_of' -> the source store's uuid,
                       b'rolled_back_to' -> epoch:u64 + snapshot uuid (replicate --force),
                       b'undo_to' -> epoch:u64 + snapshot uuid or b'' while a change of the
                       live tree spanning transactions is unfinished (snapshots.begin_undoable)
                       b'staged_bytes' -> bytes staged:u64 + when the last batch was staged:u64 (s)
                       b'next_slot' -> u64 (the chunk file's first slot never used)
inodes    versioned    ino:u64 -> INODE struct + name + symlink target (the record names one
                       current location of the inode, parent + name: exact for directories,
                       the newest link for files, so any epoch's path is O(depth) to rebuild)
dirents   versioned    parent:u64 + name + NUL -> child ino:u64
changelog unversioned  parent:u64 + epoch:u64 + name -> b''   (the names under a directory
                       whose entry, or whose inode or anything below it, changed in that
                       epoch: the per-directory index an epoch-pruned diff descends by)
chunks    versioned    ino:u64 + index:u64 -> digest:32 + length:u32   (chunk-map leaves)
chunklog  unversioned  ino:u64 + epoch:u64 + index:u64 -> b''   (which chunks changed in
                       which epoch: the chunk map's epoch index, see below)
xattrs    versioned    ino:u64 + name + NUL -> b'\\x01' + value
parents   unversioned  child:u64 + parent:u64 + name -> b''   (live tree only: every name
                       of every inode, to propagate mepoch through all parents of hard links)
blobs     unversioned  digest:32 -> chunk bytes   (content-addressed, stored once)
slots     unversioned  digest:32 -> slot:u64   (a full chunk kept in the chunk file instead:
                       chunkfile.py, with its invariants and crash order; a digest is in
                       ``blobs`` or here, never both)
freeslots unversioned  freeing txn id:u64 + slot:u64 -> b''   (slots of the chunk file free
                       for reuse once that transaction is durable and no reader is older)
refs      unversioned  digest:32 -> count:u64    (number of chunk-map versions naming it)
snaps     unversioned  name -> SNAP struct
snapepochs unversioned epoch:u64 -> name
orphans   unversioned  ino:u64 -> b''   (live inodes with nlink 0 still open by the kernel;
                       deleted at the next mount if the process died)
purge     unversioned  ino:u64 -> b''   (deleted inodes whose chunk map still has live
                       versions to tombstone; worked off in the background)
buckets   versioned    bucket:u32 -> 32-byte XOR of the item hashes in that bucket (see
                       buckets.py: what two stores compare to find where they differ)
staged    unversioned  digest:32 -> b''   (a mirror's chunks received for a replication
                       cycle that has not committed yet: in ``blobs`` with no ``refs``; kept
                       so that a re-run does not re-send them, dropped by the next commit)

The chunk map's epoch index
---------------------------
DESIGN.md describes inner nodes of the chunk tree holding the newest epoch below them. We
keep the same information as a secondary index ordered by epoch (``chunklog``): the chunks of
a file changed in (FROM, TO] are one range scan ``ino + FROM+1 .. ino + TO``, whose cost is the
number of changes, not the file's size nor even its depth in a tree.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

FORMAT_VERSION = 3
UPGRADABLE = (2,)           # older versions a writable open brings to this one in place
# Mirrors keeping these formats take this one's replication (what changed between them is
# where a store keeps full chunks, not what goes over the wire).
MIRROR_FORMATS = (FORMAT_VERSION, *UPGRADABLE)
MAX_EPOCH = 2**64 - 1
ROOT_INO = 1
# Store inode numbers are below 2**40: far below the mount's virtual range (2**62 and up,
# where snapshot views are numbered), so every number that enters from outside (a mirror's
# commit, a promoted mirror's counter) can be checked against one bound.
MAX_INO = (1 << 40) - 1
# Snapshot ids (never reused by a store) number a snapshot's view in the mount's inode space
# (ops.py: 2**62 + (id << 40) + store inode), which holds this many below 2**64.
MAX_SNAP_ID = 3 * (1 << 22) - 1
DIGEST_SIZE = 32
NAME_MAX = 255

DB_NAMES = (
    "meta", "inodes", "dirents", "chunks", "chunklog", "changelog", "xattrs", "parents",
    "blobs", "slots", "freeslots", "refs", "snaps", "snapepochs", "orphans", "purge", "staged", "buckets",
)
VERSIONED_DBS = ("inodes", "dirents", "chunks", "xattrs")

U64 = struct.Struct(">Q")
U32 = struct.Struct(">I")
TOMBSTONE = b""


def written_key(epoch: int) -> bytes:
    return b"written" + u64(epoch)


def u64(n: int) -> bytes:
    return U64.pack(n)


def from_u64(b: bytes) -> int:
    return U64.unpack(bytes(b[:8]))[0]


def inv(epoch: int) -> bytes:
    """Epoch suffix of a version key; newer epochs sort first."""
    return U64.pack(MAX_EPOCH - epoch)


def epoch_of_key(key: bytes) -> int:
    return MAX_EPOCH - U64.unpack(bytes(key[-8:]))[0]


# ---- base keys of versioned records -------------------------------------------------------

def inode_key(ino: int) -> bytes:
    return U64.pack(ino)


def dirent_key(parent: int, name: bytes) -> bytes:
    return U64.pack(parent) + name + b"\0"


def dirent_prefix(parent: int) -> bytes:
    return U64.pack(parent)


def name_of_dirent_key(base: bytes) -> bytes:
    return bytes(base[8:-1])


def chunk_key(ino: int, index: int) -> bytes:
    return U64.pack(ino) + U64.pack(index)


def xattr_key(ino: int, name: bytes) -> bytes:
    return U64.pack(ino) + name + b"\0"


def base_of(db: str, key: bytes) -> bytes:
    """The base key of a version key of a versioned db."""
    return bytes(key[:-8])


# ---- unversioned keys ---------------------------------------------------------------------

def chunklog_key(ino: int, epoch: int, index: int) -> bytes:
    return U64.pack(ino) + U64.pack(epoch) + U64.pack(index)


def parents_key(child: int, parent: int, name: bytes) -> bytes:
    return U64.pack(child) + U64.pack(parent) + name


def changelog_key(parent: int, epoch: int, name: bytes) -> bytes:
    return U64.pack(parent) + U64.pack(epoch) + name


# ---- values -------------------------------------------------------------------------------

_INODE = struct.Struct("<IIIIQqqqQQQH")


class Inode(NamedTuple):
    """One version of an inode record. ``mepoch`` is the newest epoch in which this inode or
    anything below it changed; ``parent``/``name`` name one location of it (0/b'' when it
    has none); ``target`` is the symlink target (empty otherwise). A named tuple rather than
    a dataclass: records are unpacked and evolved several times per call on both of the
    mount's threads, and a tuple does that in a third of the time."""

    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int
    mepoch: int
    parent: int = 0
    name: bytes = b""
    target: bytes = b""

    # These run several times per created file on the mount's trio thread, so they build
    # the tuple directly (tuple.__new__ with all 13 fields) instead of through NamedTuple's
    # keyword machinery: 0.2-0.9 µs each saved (docs/benchmarks.md, fifteenth round).

    def pack(self) -> bytes:
        return _INODE.pack(*self[:11], len(self.name)) + self.name + self.target

    def pack_at(self, mepoch: int) -> bytes:
        """``self.evolve(mepoch=mepoch).pack()``, without the record in between."""
        name = self[11]
        return _INODE.pack(*self[:9], mepoch, self[10], len(name)) + name + self[12]

    @classmethod
    def unpack(cls, b: bytes) -> "Inode":
        b = bytes(b)
        fields = _INODE.unpack_from(b)
        start = _INODE.size
        end = start + fields[11]
        return _new_tuple(cls, (*fields[:11], b[start:end], b[end:]))

    def evolve(self, **kw) -> "Inode":
        values = list(self)
        for field, value in kw.items():
            values[_INODE_FIELD[field]] = value
        return _new_tuple(Inode, values)


_new_tuple = tuple.__new__
_INODE_FIELD = {field: i for i, field in enumerate(Inode._fields)}


def pack_chunk(digest: bytes, length: int) -> bytes:
    return bytes(digest) + U32.pack(length)


def unpack_chunk(b: bytes) -> tuple[bytes, int]:
    b = bytes(b)
    return b[:DIGEST_SIZE], U32.unpack_from(b, DIGEST_SIZE)[0]


_SNAP = struct.Struct("<QQQ16s")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A snapshot: the state at the end of ``epoch``. ``snap_id`` is a store-unique number,
    ``uuid`` identifies it across stores (a mirror keeps the same uuid)."""

    name: str
    epoch: int
    created_ns: int
    snap_id: int
    uuid: bytes
    written: int = 0    # chunk bytes written since the snapshot before (meta, not packed)

    def pack(self) -> bytes:
        return _SNAP.pack(self.epoch, self.created_ns, self.snap_id, self.uuid)

    @classmethod
    def unpack(cls, name: bytes, b: bytes) -> "Snapshot":
        epoch, created, snap_id, uid = _SNAP.unpack(bytes(b))
        return cls(bytes(name).decode("utf-8", "surrogateescape"), epoch, created, snap_id, uid)
