"""What a mirror must change to go from snapshot FROM to snapshot TO: the records themselves.

A mirror keeps the source's inode numbers, so a change is described by identity, not by
path: the TO value of every directory entry (parent, name) and of every inode record, xattr
set and chunk-map leaf that changed in (FROM, TO]. Applied in one transaction these make the
mirror's tree equal to TO, renames included, without moving a byte of file data.

Which records changed comes from the epoch-pruned diff (``mountfs.diff.Differ`` records what
its descent touched), plus a walk of the subtrees of directories created after FROM (the
diff implies their contents; a mirror needs them). Nothing unchanged is visited. With no
FROM (a first, full copy) the whole tree at TO is the change.
"""

from __future__ import annotations

import base64
import binascii
import stat
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from mountfs import schema as S
from mountfs.diff import CREATE, Differ
from mountfs.namespace import View

ChunkValue = tuple[bytes, int] | None        # (digest, length), or None for a hole


@dataclass
class Changeset:
    """The TO values of every changed record, keyed by identity (None: gone at TO)."""

    entries: dict[tuple[int, bytes], int | None] = field(default_factory=dict)
    inodes: dict[int, S.Inode | None] = field(default_factory=dict)
    xattrs: dict[int, dict[bytes, bytes]] = field(default_factory=dict)
    chunks: dict[int, dict[int, ChunkValue]] = field(default_factory=dict)
    report: Counter = field(default_factory=Counter)   # diff entries per op (for people)

    def digests(self) -> dict[bytes, int]:
        """Every chunk the TO state references through a changed leaf, with its length."""
        out = {}
        for leaves in self.chunks.values():
            for value in leaves.values():
                if value is not None:
                    out[value[0]] = value[1]
        return out

    def records(self) -> int:
        return (len(self.entries) + len(self.inodes) + len(self.xattrs)
                + sum(len(leaves) for leaves in self.chunks.values()))

    def merge(self, other: "Changeset") -> None:
        """Add ``other``'s records (a later part) to this one."""
        self.entries.update(other.entries)
        self.inodes.update(other.inodes)
        self.xattrs.update(other.xattrs)
        for x, leaves in other.chunks.items():
            self.chunks.setdefault(x, {}).update(leaves)
        self.report.update(other.report)

    # ---- the wire form (JSON-safe) ---------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "entries": [[d, _b64(n), c] for (d, n), c in self.entries.items()],
            "inodes": [[x, _b64(r.pack()) if r else None] for x, r in self.inodes.items()],
            "xattrs": [[x, {_b64(k): _b64(v) for k, v in xs.items()}]
                       for x, xs in self.xattrs.items()],
            "chunks": [[x, [[i, v[0].hex(), v[1]] if v else [i, None, 0]
                            for i, v in leaves.items()]] for x, leaves in self.chunks.items()],
            "report": dict(self.report),
        }

    @classmethod
    def from_json(cls, d) -> "Changeset":
        """Parse the wire form from a peer that is not trusted: every number an integer
        0..2**64-1 (bools and floats refused), every field the type it should be; anything
        else is a ValueError with one line that says which field (the receiver's 400)."""
        _expect(isinstance(d, dict), "the changeset is not an object")
        report = d.get("report", {})
        _expect(isinstance(report, dict) and all(type(v) is int for v in report.values()),
                "report is not an object of counts")
        cs = cls(report=Counter(report))
        for parent, name, child in _rows(d, "entries", 3):
            cs.entries[(_u64(parent, "entries"), _unb64(name, "entries"))] = \
                None if child is None else _u64(child, "entries")
        for x, rec in _rows(d, "inodes", 2):
            cs.inodes[_u64(x, "inodes")] = _inode(rec) if rec is not None else None
        for x, xs in _rows(d, "xattrs", 2):
            _expect(isinstance(xs, dict), "xattrs: a set of xattrs is not an object")
            cs.xattrs[_u64(x, "xattrs")] = {_unb64(k, "xattrs"): _unb64(v, "xattrs")
                                            for k, v in xs.items()}
        for x, leaves in _rows(d, "chunks", 2):
            _expect(isinstance(leaves, list), "chunks: a chunk map is not a list")
            cs.chunks[_u64(x, "chunks")] = dict(_leaf_from_json(leaf) for leaf in leaves)
        return cs


def _expect(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _rows(d: dict, key: str, width: int) -> list:
    rows = d.get(key)
    _expect(isinstance(rows, list), f"{key} is missing or not a list")
    for row in rows:
        _expect(isinstance(row, list) and len(row) == width,
                f"{key}: a row is not a list of {width} values")
    return rows


def _u64(v, where: str) -> int:
    _expect(type(v) is int and 0 <= v < 1 << 64, f"{where}: {v!r:.40} is not an integer "
                                                  f"0..2**64-1")
    return v


def _inode(rec) -> S.Inode:
    raw = _unb64(rec, "inodes")
    try:
        return S.Inode.unpack(raw)
    except struct.error:
        raise ValueError(f"inodes: a record of {len(raw)} bytes is not an inode") from None


def _leaf_from_json(leaf) -> tuple[int, ChunkValue]:
    _expect(isinstance(leaf, list) and len(leaf) == 3, "chunks: a leaf is not "
                                                       "[index, digest, length]")
    index, digest, length = leaf
    if digest is None:
        return _u64(index, "chunks"), None
    _expect(isinstance(digest, str) and len(digest) == 2 * S.DIGEST_SIZE,
            f"chunks: a digest is not {2 * S.DIGEST_SIZE} hex digits")
    return _u64(index, "chunks"), (bytes.fromhex(digest), _u64(length, "chunks"))


def _b64(b: bytes) -> str:
    return base64.b64encode(bytes(b)).decode()


def _unb64(s, where: str = "value") -> bytes:
    _expect(isinstance(s, str), f"{where}: {s!r:.40} is not a base64 string")
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except (ValueError, binascii.Error):
        raise ValueError(f"{where}: {s[:40]!r} is not valid base64") from None


# ---- building one from a source store ---------------------------------------------------------

PART_RECORDS = 20_000         # records per part (a directory entry, an inode, an xattr set, a leaf)
PART_BYTES = 4 << 20          # about this many bytes of record data per part


def build(txn, dbs, chunk_size: int, from_epoch: int | None, to_epoch: int) -> Changeset:
    """The changeset FROM -> TO (FROM None: everything at TO) over one read transaction, whole
    (for callers that need it in memory; replication streams ``parts``)."""
    whole = Changeset()
    for part in parts(txn, dbs, chunk_size, from_epoch, to_epoch, part_records=None):
        whole.merge(part)
    return whole


def parts(txn, dbs, chunk_size: int, from_epoch: int | None, to_epoch: int,
          part_records: int | None = PART_RECORDS,
          part_bytes: int = PART_BYTES) -> Iterator[Changeset]:
    """The changeset FROM -> TO as a stream of parts of at most ``part_records`` records and
    about ``part_bytes`` bytes each (None: one part), built as the pruned diff is walked, so
    that memory holds one part, not the change. An inode's records may be split over parts;
    the mirror applies every part's deletes before any part's creates (mirror.apply_parts)."""
    new = View(txn, dbs, to_epoch, chunk_size)
    report: Counter = Counter()
    if from_epoch is None:
        records = _full(new)
    else:
        records = _incremental(txn, dbs, chunk_size, from_epoch, to_epoch, new, report)
    yield from _cut(records, report, part_records, part_bytes)


def split(cs: Changeset, part_records: int = PART_RECORDS,
          part_bytes: int = PART_BYTES) -> Iterator[Changeset]:
    """A changeset already in memory (a reconciliation's) as parts, for the same wire."""
    yield from _cut(_records_of(cs), cs.report, part_records, part_bytes)


def _cut(records, report: Counter, part_records: int | None,
         part_bytes: int) -> Iterator[Changeset]:
    """Group a stream of records into parts; the last part carries the diff's report (the
    report is complete only once the stream is)."""
    part, count, size = Changeset(), 0, 0
    for kind, key, value in records:
        if kind == "entry":
            part.entries[key] = value
            size += len(key[1]) + 24
        elif kind == "inode":
            part.inodes[key] = value
            size += 96 + (len(value.target) if value is not None else 0)
        elif kind == "xattrs":
            part.xattrs[key] = value
            size += 16 + sum(len(k) + len(v) for k, v in value.items())
        else:
            part.chunks.setdefault(key[0], {})[key[1]] = value
            size += 48
        count += 1
        if part_records is not None and (count >= part_records or size >= part_bytes):
            yield part
            part, count, size = Changeset(), 0, 0
    part.report = report
    yield part


def _records_of(cs: Changeset):
    for key, child in cs.entries.items():
        yield "entry", key, child
    for x, rec in cs.inodes.items():
        yield "inode", x, rec
    for x, xattrs in cs.xattrs.items():
        yield "xattrs", x, xattrs
    for x, leaves in cs.chunks.items():
        for index, value in leaves.items():
            yield "chunk", (x, index), value


def _full(new: View):
    """Every record at TO, directory by directory (the pending directories are the state)."""
    yield from _inode_records(new, S.ROOT_INO, None)
    linked: set[int] = set()          # inodes with several names already sent (hard links)
    todo = [S.ROOT_INO]
    while todo:
        d = todo.pop()
        for name, child in new.listdir(d):
            yield "entry", (d, bytes(name)), child
            rec = new.get(child)
            if rec.nlink > 1 and not stat.S_ISDIR(rec.mode):
                if child in linked:
                    continue
                linked.add(child)
            yield from _inode_records(new, child, None)
            if stat.S_ISDIR(rec.mode):
                todo.append(child)


def _incremental(txn, dbs, chunk_size: int, from_epoch: int, to_epoch: int, new: View,
                 report: Counter):
    """The records the pruned diff touched, then the subtrees of directories created after
    FROM (the diff implies their contents; a mirror needs them). The diff's own sets of
    touched names and inodes are what it holds: O(the change), never O(the tree)."""
    differ = Differ(txn, dbs, chunk_size, from_epoch, to_epoch)
    created_dirs = []
    for entry in differ.entries():
        report[entry.op] += 1
        if entry.op == CREATE and entry.type == "dir" and entry.link is None:
            created_dirs.append(entry.ino)
    for d, name in differ.touched_entries:
        yield "entry", (d, name), new.lookup(d, name)
    sent = set(differ.touched_inodes)
    for x in differ.touched_inodes:
        yield from _inode_records(new, x, differ)
    old = View(txn, dbs, from_epoch, chunk_size)
    for top in created_dirs:
        yield from _subtree(new, old, top, sent)


def _subtree(new: View, old: View, top: int, sent: set[int]):
    """Every entry below ``top`` at TO, and the records of every inode there that did not
    exist at FROM (inodes that did are the diff's business: it walks them from where they
    came)."""
    todo = [top]
    while todo:
        d = todo.pop()
        for name, child in new.listdir(d):
            yield "entry", (d, bytes(name)), child
            if old.inode(child) is not None or child in sent:
                continue
            sent.add(child)
            yield from _inode_records(new, child, None)
            if stat.S_ISDIR(new.get(child).mode):
                todo.append(child)


def _inode_records(new: View, x: int, differ: Differ | None):
    """The TO record, xattr set and changed chunk leaves of inode ``x`` (all its leaves
    without ``differ``). An inode without a name at TO (gone, or unlinked while open) is
    None: the mirror drops it."""
    rec = new.inode(x)
    if rec is None or (rec.nlink == 0 and x != S.ROOT_INO):
        yield "inode", x, None
        return
    yield "inode", x, rec
    yield "xattrs", x, new.xattrs(x)
    if stat.S_ISREG(rec.mode):
        indices = new.chunk_indices(x) if differ is None else differ.changed_chunk_indices(x)
        for i in indices:
            yield "chunk", (x, i), _leaf(new, x, i)


def _leaf(view: View, x: int, index: int) -> ChunkValue:
    value = view.chunk(x, index)
    return (bytes(value[0]), value[1]) if value else None
