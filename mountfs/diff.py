"""The epoch-pruned snapshot diff: what changed between epoch FROM and epoch TO, found in time
proportional to the changes (times the depth), never by walking the tree.

How: starting at the root, a directory is entered only if its ``mepoch`` at TO is newer than
FROM, and inside it only the names its ``changelog`` lists for epochs (FROM, TO] are looked
at (an entry that changed, or whose inode or subtree changed). A regular file's changed chunks
come from its ``chunklog`` the same way. Nothing here lists a directory or a chunk map.

The report follows HDFS snapshot diffs (HDFS-7535, HDFS-8828, DistCp -diff):

* DELETE and RENAME sources are FROM paths; RENAME targets, CREATE and MODIFY are TO paths;
* a created directory's contents are implied by its CREATE, and a deleted one's by its DELETE;
* a rename is recognised by inode identity: each inode record names one of its locations,
  so where an inode went is O(depth) to find, at any depth and across directories;
* a new name for an inode that existed at FROM (a hard link) is a CREATE with ``link``, the
  TO path of a name it already had; an inode created in the interval with several names is
  a CREATE at the location its record names and a CREATE with ``link`` to that for each
  other name the report lists.

Entries stream out one by one (a directory's own entry before its children's), so memory is
bounded by the depth of the tree, whatever the size of the diff.
"""

from __future__ import annotations

import stat
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Iterator

from . import schema as S
from .namespace import View

CREATE, DELETE, RENAME, MODIFY = "create", "delete", "rename", "modify"
SYMBOL = {CREATE: "+", DELETE: "-", RENAME: "R", MODIFY: "M"}


def type_name(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "chardev"),
                       (stat.S_ISBLK, "blockdev"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "unknown"


@dataclass(frozen=True)
class ChunkChange:
    index: int
    offset: int
    length: int           # bytes of data in the chunk at TO (0: a hole now)
    digest: str | None    # blake3 hex at TO, None for a hole


@dataclass(frozen=True)
class Entry:
    op: str
    path: str                         # FROM path (delete, rename) or TO path (create, modify)
    type: str
    ino: int
    to: str | None = None             # rename target (a TO path)
    link: str | None = None           # create of another name of an existing inode
    size: int | None = None           # a file's size: TO (create, modify), FROM (delete)
    chunks: tuple[ChunkChange, ...] | None = None

    def sort_key(self) -> list[str]:
        """Order for people: by the path the entry names first, parents before children."""
        return self.path.split("/")

    def text(self, show) -> str:
        """The report's line, each path passed through ``show`` (the command line's
        escaping: a name may hold a newline or a terminal's escape sequence)."""
        if self.op == RENAME:
            return f"R {show(self.path)} -> {show(self.to)}"
        if self.link is not None:
            return f"+ {show(self.path)} (hard link to {show(self.link)})"
        return f"{SYMBOL[self.op]} {show(self.path)}"

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        if self.chunks is not None:
            d["chunks"] = [asdict(c) for c in self.chunks]
        return d


def _reported(inode: S.Inode) -> tuple:
    """The attributes whose change is a MODIFY. Not ctime (every rename, link and chmod moves
    it, and no copy can set it) nor nlink (a link's CREATE or DELETE already says it)."""
    a = inode
    return (a.mode, a.uid, a.gid, a.size, a.atime_ns, a.mtime_ns, a.rdev, a.target)


def _file_size(inode: S.Inode) -> int | None:
    return inode.size if stat.S_ISREG(inode.mode) else None


def _join(parent: str, name: bytes) -> str:
    return f"{parent}/{name.decode('utf-8', 'surrogateescape')}"


class Differ:
    """diff(FROM, TO) over one read transaction."""

    def __init__(self, txn, dbs, chunk_size: int, from_epoch: int, to_epoch: int,
                 with_chunks: bool = False, track: bool = True):
        if from_epoch > to_epoch:
            raise ValueError("FROM is newer than TO")
        self.old = View(txn, dbs, from_epoch, chunk_size)
        self.new = View(txn, dbs, to_epoch, chunk_size)
        self.txn, self.db = txn, dbs
        self.lo, self.hi = from_epoch, to_epoch
        self.with_chunks = with_chunks
        self.old_path = lru_cache(maxsize=1 << 16)(lambda d: self._path(self.old, d))
        self.new_path = lru_cache(maxsize=1 << 16)(lambda d: self._path(self.new, d))
        self._modified_links: set[int] = set()   # hard-linked files reported once
        # Every directory entry and inode the descent found changed (or possibly changed):
        # the records a mirror needs, found without walking anything unchanged. They grow
        # with the diff: without ``track`` (a plain report) they stay empty.
        kind = set if track else _Untracked
        self.touched_entries: set[tuple[int, bytes]] = kind()
        self.touched_inodes: set[int] = kind()

    # ---- entry point -----------------------------------------------------------------------

    def entries(self) -> Iterator[Entry]:
        if self.lo == self.hi:
            return
        root_new = self.new.get(S.ROOT_INO)
        if root_new.mepoch <= self.lo:
            return
        self.touched_inodes.add(S.ROOT_INO)
        if self._own_change(S.ROOT_INO, self.old.get(S.ROOT_INO), root_new):
            yield Entry(MODIFY, ".", "dir", S.ROOT_INO)
        yield from self._walk(S.ROOT_INO, ".")

    # ---- the descent -----------------------------------------------------------------------
    #
    # Who reports what, so that every change is reported exactly once:
    # * a rename is reported from its source (the FROM side), which is always visited: live
    #   directories are walked, and deleted directories are walked for what left them;
    # * the renamed inode's modification, and for a directory the walk of its subtree, happen
    #   right there, with its TO path; its arriving end reports nothing;
    # * created directories are not entered (their contents are implied by the CREATE), nor
    #   are deleted ones reported below their DELETE.

    def _walk(self, d: int, path: str) -> Iterator[Entry]:
        """Changes under directory ``d``, which is the same inode at FROM and TO."""
        for name in self._changed_names(d):
            self.touched_entries.add((d, name))
            x_old = self.old.lookup(d, name)
            x_new = self.new.lookup(d, name)
            if x_old is not None and x_old != x_new:
                yield from self._removed(d, name, x_old, implied=False)
            if x_new is None:
                continue
            if x_new == x_old:
                yield from self._same(x_new, _join(path, name))
            else:
                yield from self._added(d, name, x_new, _join(path, name))

    def _walk_deleted(self, d: int) -> Iterator[Entry]:
        """What left directory ``d``, deleted by TO: renames out of it (its deletes are
        implied by its own DELETE)."""
        for name in self._changed_names(d):
            self.touched_entries.add((d, name))
            x_old = self.old.lookup(d, name)
            if x_old is not None:
                yield from self._removed(d, name, x_old, implied=True)

    def _changed_names(self, d: int) -> list[bytes]:
        """Names in ``d`` logged as changed in epochs (FROM, TO], sorted, each once."""
        cur = self.txn.cursor(self.db["changelog"])
        prefix = S.u64(d)
        names = set()
        if cur.set_range(S.changelog_key(d, self.lo + 1, b"")):
            for key in cur.iternext(values=False):
                key = bytes(key)
                if key[:8] != prefix or S.from_u64(key[8:16]) > self.hi:
                    break
                names.add(key[16:])
        return sorted(names)

    def _same(self, x: int, path: str) -> Iterator[Entry]:
        """The same inode under the same name at FROM and TO: modified, or something
        below it changed."""
        new = self.new.get(x)
        if new.mepoch <= self.lo:
            return
        self.touched_inodes.add(x)
        yield from self._modify(x, self.old.get(x), new, path)
        if stat.S_ISDIR(new.mode):
            yield from self._walk(x, path)

    def _removed(self, d: int, name: bytes, x: int, implied: bool) -> Iterator[Entry]:
        """``x`` was at d/name at FROM and is not at TO."""
        old, new = self.old.get(x), self.new.inode(x)
        if new is not None and new.nlink == 0:
            new = None      # unlinked but still open at TO (an orphan): deleted, no location
        self.touched_inodes.add(x)
        src = _join(self.old_path(d), name)
        if new is not None and (old.parent, old.name) == (d, name) and self._moved(x, old, new):
            dst = _join(self.new_path(new.parent), new.name)
            yield Entry(RENAME, src, type_name(new.mode), x, to=dst)
            yield from self._modify(x, old, new, dst)
            if stat.S_ISDIR(new.mode):
                yield from self._walk(x, dst)
            return
        if not implied:
            yield Entry(DELETE, src, type_name(old.mode), x, size=_file_size(old))
        if new is None and stat.S_ISDIR(old.mode):
            yield from self._walk_deleted(x)

    def _added(self, d: int, name: bytes, x: int, path: str) -> Iterator[Entry]:
        """``x`` is at d/name at TO and was not at FROM."""
        old, new = self.old.inode(x), self.new.get(x)
        self.touched_inodes.add(x)
        if old is None:
            yield Entry(CREATE, path, type_name(new.mode), x, size=_file_size(new),
                        link=self._first_name(x, new, d, name))
        elif (new.parent, new.name) != (d, name) or not self._moved(x, old, new):
            yield Entry(CREATE, path, type_name(new.mode), x,
                        link=self._existing_name(x, old, new, d, name))
            yield from self._modify(x, old, new, path)
        # else: the arriving end of a rename, reported from its source

    def _first_name(self, x: int, new: S.Inode, d: int, name: bytes) -> str | None:
        """For a name of an inode created in the interval: None if d/name is where its
        record locates it (that name is created first), else that location's TO path."""
        if new.nlink <= 1 or stat.S_ISDIR(new.mode) or (new.parent, new.name) == (d, name):
            return None
        return _join(self.new_path(new.parent), new.name)

    def _moved(self, x: int, old: S.Inode, new: S.Inode) -> bool:
        """Whether the inode left its FROM location for a TO location it did not have."""
        return self.new.lookup(old.parent, old.name) != x and \
            self.old.lookup(new.parent, new.name) != x

    def _existing_name(self, x: int, old: S.Inode, new: S.Inode, d: int, name: bytes) -> str:
        """A TO path of ``x`` other than d/name that a copy of FROM has once renames and
        deletes are applied: its FROM location if it kept it, else its TO location."""
        if self.new.lookup(old.parent, old.name) == x:
            return _join(self.new_path(old.parent), old.name)
        return _join(self.new_path(new.parent), new.name)

    # ---- what changed about one inode ------------------------------------------------------

    def _modify(self, x: int, old: S.Inode, new: S.Inode, path: str) -> Iterator[Entry]:
        if new.mepoch <= self.lo or not self._own_change(x, old, new):
            return
        if new.nlink > 1 and not stat.S_ISDIR(new.mode):
            if x in self._modified_links:
                return
            self._modified_links.add(x)
        kind = type_name(new.mode)
        if self.with_chunks and stat.S_ISREG(new.mode):
            yield Entry(MODIFY, path, kind, x, size=new.size, chunks=tuple(self._chunks(x)))
        else:
            yield Entry(MODIFY, path, kind, x)

    def _own_change(self, x: int, old: S.Inode, new: S.Inode) -> bool:
        if _reported(old) != _reported(new):
            return True
        if stat.S_ISREG(new.mode) and next(self._chunks(x), None) is not None:
            return True
        return self.old.xattrs(x) != self.new.xattrs(x)

    def changed_chunk_indices(self, x: int) -> list[int]:
        """Chunks of ``x`` with a version made in (FROM, TO], from its chunklog."""
        cur = self.txn.cursor(self.db["chunklog"])
        prefix = S.u64(x)
        out = set()
        if cur.set_range(S.chunklog_key(x, self.lo + 1, 0)):
            for key in cur.iternext(values=False):
                key = bytes(key)
                if key[:8] != prefix or S.from_u64(key[8:16]) > self.hi:
                    break
                out.add(S.from_u64(key[16:24]))
        return sorted(out)

    def _chunks(self, x: int) -> Iterator[ChunkChange]:
        cs = self.new.chunk_size
        for idx in self.changed_chunk_indices(x):
            was, now = self.old.chunk(x, idx), self.new.chunk(x, idx)
            if was == now:
                continue
            yield ChunkChange(idx, idx * cs, now[1] if now else 0,
                              now[0].hex() if now else None)

    # ---- paths -----------------------------------------------------------------------------

    def _path(self, view: View, d: int) -> str:
        """The path of directory ``d`` at ``view``'s epoch, from the location its records
        name (directories have exactly one)."""
        parts = []
        while d != S.ROOT_INO:
            rec = view.get(d)
            parts.append(rec.name.decode("utf-8", "surrogateescape"))
            d = rec.parent
        return "/".join(["."] + parts[::-1])


class _Untracked(set):
    """A set that stays empty, so that a streamed report keeps memory bounded."""

    def add(self, item) -> None:
        pass


def diff(txn, dbs, chunk_size: int, from_epoch: int, to_epoch: int,
         with_chunks: bool = False) -> Iterator[Entry]:
    return Differ(txn, dbs, chunk_size, from_epoch, to_epoch, with_chunks,
                  track=False).entries()


# ---- applying a report --------------------------------------------------------------------

def application_order(entries) -> list[Entry]:
    """The order that turns a copy of FROM into TO (DistCp's snapshot-diff order):

    1. deletes and renames, by FROM path in reverse order, so descendants leave before their
       ancestors (each moves to a staging area; deletes never come back);
    2. renames out of the staging area, by TO path ascending, so parents arrive first;
    3. creates by TO path ascending (a created directory before its contents), then creates
       that link a name to one already there (its target may sort after it, or lie in a
       directory created in step 3), then modifies (every path they name exists by then).
    """
    entries = list(entries)
    phase1 = sorted((e for e in entries if e.op in (DELETE, RENAME)),
                    key=lambda e: e.path.split("/"), reverse=True)
    phase2 = sorted((e for e in entries if e.op == RENAME), key=lambda e: e.to.split("/"))
    phase3 = sorted((e for e in entries if e.op in (CREATE, MODIFY)),
                    key=lambda e: (e.op == MODIFY, e.link is not None, e.path.split("/")))
    return phase1 + phase2 + phase3
