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

def build(txn, dbs, chunk_size: int, from_epoch: int | None, to_epoch: int) -> Changeset:
    """The changeset FROM -> TO (FROM None: everything at TO) over one read transaction."""
    new = View(txn, dbs, to_epoch, chunk_size)
    cs = Changeset()
    if from_epoch is None:
        cs.inodes[S.ROOT_INO] = new.get(S.ROOT_INO)
        _add_subtree(new, None, S.ROOT_INO, cs)
        _fill_records(new, None, cs, all_chunks=True)
        return cs
    differ = Differ(txn, dbs, chunk_size, from_epoch, to_epoch)
    created_dirs = []
    for entry in differ.entries():
        cs.report[entry.op] += 1
        if entry.op == CREATE and entry.type == "dir" and entry.link is None:
            created_dirs.append(entry.ino)
    for d, name in differ.touched_entries:
        cs.entries[(d, name)] = new.lookup(d, name)
    for x in differ.touched_inodes:
        cs.inodes[x] = None
    old = View(txn, dbs, from_epoch, chunk_size)
    for top in created_dirs:
        _add_subtree(new, old, top, cs)
    _fill_records(new, differ, cs, all_chunks=False)
    return cs


def _add_subtree(new: View, old: View | None, top: int, cs: Changeset) -> None:
    """Every entry below ``top`` at TO, and every inode there that did not exist at FROM
    (inodes that did are the diff's business: it walks them from where they came)."""
    todo = [top]
    while todo:
        d = todo.pop()
        for name, child in new.listdir(d):
            cs.entries[(d, bytes(name))] = child
            if old is not None and old.inode(child) is not None:
                continue
            cs.inodes[child] = None
            if stat.S_ISDIR(new.get(child).mode):
                todo.append(child)


def _fill_records(new: View, differ: Differ | None, cs: Changeset, all_chunks: bool) -> None:
    """TO records, xattr sets and changed chunk leaves of every inode in the changeset. An
    inode without a name at TO (gone, or unlinked while open) is None: the mirror drops it."""
    for x in list(cs.inodes):
        rec = new.inode(x)
        if rec is None or (rec.nlink == 0 and x != S.ROOT_INO):
            cs.inodes[x] = None
            continue
        cs.inodes[x] = rec
        cs.xattrs[x] = new.xattrs(x)
        if stat.S_ISREG(rec.mode):
            indices = new.chunk_indices(x) if all_chunks or differ is None \
                else differ.changed_chunk_indices(x)
            cs.chunks[x] = {i: _leaf(new, x, i) for i in indices}


def _leaf(view: View, x: int, index: int) -> ChunkValue:
    value = view.chunk(x, index)
    return (bytes(value[0]), value[1]) if value else None

