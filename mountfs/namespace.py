"""Filesystem semantics on one LMDB transaction: reading the tree at any epoch (``View``) and
changing it in the live epoch (``Live``), with link counts, parent tracking, reference
counted chunk data and ``mepoch`` propagation to the root.

Nothing here knows about FUSE or trio: the FUSE operations, restore, fsck and the offline
command-line tools all go through these two classes, so there is one implementation of what a
link, an unlink or a rename means. Errors are ``FsError(errno)``.
"""

from __future__ import annotations

import errno
import stat
import time

from . import chunkfile
from . import schema as S
from .store import delete_live, get_at, iter_visible, put_live


class FsError(Exception):
    def __init__(self, err: int, msg: str = ""):
        super().__init__(err, msg or errno.errorcode.get(err, str(err)))
        self.errno = err


def make_root(txn, dbs, uid: int, gid: int) -> None:
    now = time.time_ns()
    root = S.Inode(stat.S_IFDIR | 0o755, uid, gid, 2, 0, now, now, now, 0, 1)
    put_live(txn, dbs["inodes"], S.inode_key(S.ROOT_INO), root.pack(), 1)


class View:
    """The filesystem as it was at the end of ``epoch`` (a snapshot), or as it is (live)."""

    def __init__(self, txn, dbs, epoch: int, chunk_size: int):
        self.txn = txn
        self.db = dbs
        self.epoch = epoch
        self.chunk_size = chunk_size

    # ---- inodes and names ------------------------------------------------------------------

    def inode(self, ino: int) -> S.Inode | None:
        raw = get_at(self.txn, self.db["inodes"], S.inode_key(ino), self.epoch)
        return S.Inode.unpack(raw) if raw is not None else None

    def get(self, ino: int) -> S.Inode:
        rec = self.inode(ino)
        if rec is None:
            raise FsError(errno.ENOENT)
        return rec

    def lookup(self, parent: int, name: bytes) -> int | None:
        raw = get_at(self.txn, self.db["dirents"], S.dirent_key(parent, name), self.epoch)
        return S.from_u64(raw) if raw is not None else None

    def listdir(self, parent: int, after: bytes | None = None):
        """Yield (name, child ino) in name order, starting after name ``after``."""
        start = S.dirent_key(parent, after) + b"\xff" * 8 if after is not None else None
        for base, value in iter_visible(self.txn, self.db["dirents"], S.dirent_prefix(parent),
                                        self.epoch, start):
            yield S.name_of_dirent_key(base), S.from_u64(value)

    def is_empty_dir(self, ino: int) -> bool:
        return next(self.listdir(ino), None) is None

    def resolve(self, path: str | bytes) -> int:
        """The inode at a path relative to the root (components separated by '/')."""
        if isinstance(path, str):
            path = path.encode("utf-8", "surrogateescape")
        ino = S.ROOT_INO
        for part in path.split(b"/"):
            if part in (b"", b"."):
                continue
            if not stat.S_ISDIR(self.get(ino).mode):
                raise FsError(errno.ENOTDIR)
            child = self.lookup(ino, part)
            if child is None:
                raise FsError(errno.ENOENT)
            ino = child
        return ino

    def links(self, ino: int) -> list[tuple[int, bytes]]:
        """Every live (parent, name) of ``ino`` (the parents table tracks the live tree)."""
        cur = self.txn.cursor(self.db["parents"])
        prefix = S.u64(ino)
        out = []
        if cur.set_range(prefix):
            for key in cur.iternext(values=False):
                key = bytes(key)
                if key[:8] != prefix:
                    break
                out.append((S.from_u64(key[8:16]), key[16:]))
        return out

    def parents(self, ino: int) -> list[int]:
        """The distinct live parent directories of ``ino``."""
        return list(dict.fromkeys(p for p, _ in self.links(ino)))

    # ---- data ------------------------------------------------------------------------------

    def chunk(self, ino: int, index: int) -> tuple[bytes, int] | None:
        raw = get_at(self.txn, self.db["chunks"], S.chunk_key(ino, index), self.epoch)
        return S.unpack_chunk(raw) if raw is not None else None

    def chunk_indices(self, ino: int, first: int = 0):
        """Indices of the chunks present (not holes) at or after ``first``."""
        prefix = S.u64(ino)
        for base, _ in iter_visible(self.txn, self.db["chunks"], prefix, self.epoch,
                                    S.chunk_key(ino, first)):
            yield S.from_u64(base[8:16])

    def blob(self, digest: bytes):
        data = chunkfile.get(self.txn, self.db, digest)
        if data is None:
            raise FsError(errno.EIO, f"chunk {digest.hex()} is missing from the store")
        return data

    def chunk_data(self, ino: int, index: int) -> bytes:
        """The bytes of one chunk as stored (may be shorter than the chunk size; a hole
        gives b'')."""
        c = self.chunk(ino, index)
        return bytes(self.blob(c[0])) if c is not None else b""

    def read(self, ino: int, off: int, size: int, file_size: int) -> bytes:
        if off >= file_size or size <= 0:
            return b""
        end = min(off + size, file_size)
        cs = self.chunk_size
        pieces = []
        pos = off
        while pos < end:
            idx, within = divmod(pos, cs)
            take = min(cs - within, end - pos)
            c = self.chunk(ino, idx)
            if c is None:
                pieces.append(bytes(take))
            else:
                piece = chunkfile.get_range(self.txn, self.db, c[0], within, take)
                if piece is None:
                    raise FsError(errno.EIO, f"chunk {c[0].hex()} is missing from the store")
                pieces.append(piece)
                if len(piece) < take:
                    pieces.append(bytes(take - len(piece)))
            pos += take
        if len(pieces) == 1 and type(pieces[0]) is bytes:
            return pieces[0]        # as read: a 1 MiB READ copied twice more cost 15% of a
                                    # sequential read's serving thread (benchmarks.md)
        return b"".join(pieces)     # also copies out what a buffers=True txn lent

    # ---- xattrs ----------------------------------------------------------------------------

    def xattr(self, ino: int, name: bytes) -> bytes | None:
        raw = get_at(self.txn, self.db["xattrs"], S.xattr_key(ino, name), self.epoch)
        return bytes(raw[1:]) if raw is not None else None

    def xattr_names(self, ino: int) -> list[bytes]:
        return [bytes(base[8:-1]) for base, _ in
                iter_visible(self.txn, self.db["xattrs"], S.u64(ino), self.epoch)]

    def xattrs(self, ino: int) -> dict[bytes, bytes]:
        return {bytes(base[8:-1]): bytes(v[1:]) for base, v in
                iter_visible(self.txn, self.db["xattrs"], S.u64(ino), self.epoch)}


class Live(View):
    """The live tree, writable. Every change is made in the live epoch and marks the changed
    inode and all its ancestors (through every parent) with ``mepoch = live``."""

    def __init__(self, txn, dbs, live: int, chunk_size: int):
        super().__init__(txn, dbs, live, chunk_size)
        self.live = live
        self.now = time.time_ns()

    # ---- mepoch propagation ----------------------------------------------------------------

    def save(self, ino: int, rec: S.Inode) -> S.Inode:
        """Store a new live version of an inode and propagate its change to the root.
        ``rec`` is evolved from the inode's current record. When that already carries the
        live epoch, its change was propagated when it got it, and whatever changed since
        propagated itself (a new link logs its name and saves its new parent): a file saved
        five times in an epoch walks to the root once. Writers that give a record the live
        epoch without propagating (rollback, a mirror's apply) propagate afterwards."""
        if rec.mepoch == self.live:
            put_live(self.txn, self.db["inodes"], S.inode_key(ino), rec.pack(), self.live)
            return rec
        rec = rec.evolve(mepoch=self.live)
        put_live(self.txn, self.db["inodes"], S.inode_key(ino), rec.pack(), self.live)
        self.propagate(ino)
        return rec

    def touch(self, ino: int) -> None:
        """Mark ``ino`` changed in the live epoch (its data, entries or xattrs changed)."""
        rec = self.get(ino)
        if rec.mepoch != self.live:
            self.save(ino, rec)
        else:
            self.propagate(ino)

    def propagate(self, ino: int) -> None:
        """Raise ``mepoch`` of every ancestor to the live epoch, stopping at ancestors that
        have it already (so the cost is amortised to almost nothing), and log every name
        on the way in its directory's changelog (what the diff descends by)."""
        todo = [ino]
        while todo:
            for parent, name in self.links(todo.pop()):
                self.log_change(parent, name)
                rec = self.get(parent)
                if rec.mepoch < self.live:
                    put_live(self.txn, self.db["inodes"], S.inode_key(parent),
                             rec.pack_at(self.live), self.live)
                    todo.append(parent)

    def log_change(self, parent: int, name: bytes) -> None:
        self.txn.put(S.changelog_key(parent, self.live, name), b"", db=self.db["changelog"])

    def put_dirent(self, parent: int, name: bytes, child: int) -> None:
        """Point parent/name at ``child`` in the live epoch (entries and links tables)."""
        old = self.lookup(parent, name)
        if old is not None:
            self.txn.delete(S.parents_key(old, parent, name), db=self.db["parents"])
        self._name(parent, name, child)

    def _name(self, parent: int, name: bytes, child: int) -> None:
        """``put_dirent`` of a name known to be free."""
        put_live(self.txn, self.db["dirents"], S.dirent_key(parent, name), S.u64(child),
                 self.live)
        self.txn.put(S.parents_key(child, parent, name), b"", db=self.db["parents"])
        self.log_change(parent, name)

    def delete_dirent(self, parent: int, name: bytes, old: int | None = None) -> None:
        """Remove parent/name in the live epoch; ``old``: the inode it names, when the caller
        has looked it up already."""
        old = self.lookup(parent, name) if old is None else old
        if old is not None:
            self.txn.delete(S.parents_key(old, parent, name), db=self.db["parents"])
        delete_live(self.txn, self.db["dirents"], S.dirent_key(parent, name), self.live)
        self.log_change(parent, name)

    # ---- creating and linking --------------------------------------------------------------

    def reserve_inos(self, n: int) -> range:
        """Take up to ``n`` unused inode numbers (at least one, else ENOSPC)."""
        meta = self.db["meta"]
        first = S.from_u64(self.txn.get(b"next_ino", db=meta))
        end = min(first + n, S.MAX_INO + 1)
        if end <= first:
            raise FsError(errno.ENOSPC, f"every inode number up to {S.MAX_INO} is used")
        self.txn.put(b"next_ino", S.u64(end), db=meta)
        return range(first, end)

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
               rdev: int = 0, target: bytes = b"", ino: int | None = None
               ) -> tuple[int, S.Inode]:
        """Create a new inode of any type and link it at parent/name. ``ino``: a number
        taken by ``reserve_inos`` (default: the next one)."""
        check_name(name)
        prec = self.get(parent)
        if not stat.S_ISDIR(prec.mode):
            raise FsError(errno.ENOTDIR)
        if self.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        rec, new_prec = created(prec, parent, name, mode, uid, gid, rdev, target, self.now)
        ino = self.reserve_inos(1)[0] if ino is None else ino
        # What add_entry would leave, written once: the name is free and the new inode
        # needs no propagation (its name is logged, its parent saved).
        rec = rec.evolve(mepoch=self.live)
        put_live(self.txn, self.db["inodes"], S.inode_key(ino), rec.pack(), self.live)
        self._name(parent, name, ino)
        self.save(parent, new_prec)
        return ino, rec

    def clone(self, rec: S.Inode) -> int:
        """A new, unlinked inode with the attributes of ``rec`` (restore copies)."""
        ino = self.reserve_inos(1)[0]
        put_live(self.txn, self.db["inodes"], S.inode_key(ino),
                 rec.evolve(nlink=0, mepoch=self.live).pack(), self.live)
        return ino

    def add_entry(self, parent: int, name: bytes, child: int) -> None:
        """Link ``child`` at parent/name (the name must be free)."""
        crec = self.get(child)
        is_dir = stat.S_ISDIR(crec.mode)
        self.put_dirent(parent, name, child)
        self.save(child, crec.evolve(nlink=crec.nlink + (2 if is_dir else 1), ctime_ns=self.now,
                                     parent=parent, name=name))
        prec = self.get(parent)
        self.save(parent, prec.evolve(nlink=prec.nlink + (1 if is_dir else 0),
                                      mtime_ns=self.now, ctime_ns=self.now))

    def remove_entry(self, parent: int, name: bytes) -> tuple[int, S.Inode]:
        """Unlink parent/name; returns the child and its record after the unlink (the caller
        destroys it when its nlink is 0 and the kernel holds no reference)."""
        child, crec = self._entry(parent, name)
        return self._remove_entry(parent, name, child, crec)

    def _entry(self, parent: int, name: bytes) -> tuple[int, S.Inode]:
        """The inode parent/name names and its record; ENOENT if none."""
        child = self.lookup(parent, name)
        if child is None:
            raise FsError(errno.ENOENT)
        return child, self.get(child)

    def _remove_entry(self, parent: int, name: bytes, child: int, crec: S.Inode
                      ) -> tuple[int, S.Inode]:
        """``remove_entry`` of the entry ``_entry`` gave."""
        is_dir = stat.S_ISDIR(crec.mode)
        self.delete_dirent(parent, name, child)
        prec = self.get(parent)
        self.save(parent, prec.evolve(nlink=prec.nlink - (1 if is_dir else 0),
                                      mtime_ns=self.now, ctime_ns=self.now))
        location = {"parent": crec.parent, "name": crec.name}
        if (crec.parent, crec.name) == (parent, name):     # it was the recorded location
            other = self.links(child)
            location = {"parent": other[0][0], "name": other[0][1]} if other else \
                {"parent": 0, "name": b""}
        crec = self.save(child, crec.evolve(nlink=crec.nlink - (2 if is_dir else 1),
                                            ctime_ns=self.now, **location))
        return child, crec

    def link(self, ino: int, parent: int, name: bytes) -> S.Inode:
        check_name(name)
        if stat.S_ISDIR(self.get(ino).mode):
            raise FsError(errno.EPERM)
        if not stat.S_ISDIR(self.get(parent).mode):
            raise FsError(errno.ENOTDIR)
        if self.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        self.add_entry(parent, name, ino)
        return self.get(ino)

    def unlink(self, parent: int, name: bytes) -> tuple[int, S.Inode]:
        child, crec = self._entry(parent, name)
        if stat.S_ISDIR(crec.mode):
            raise FsError(errno.EISDIR)
        return self._remove_entry(parent, name, child, crec)

    def rmdir(self, parent: int, name: bytes) -> tuple[int, S.Inode]:
        child, crec = self._entry(parent, name)
        if not stat.S_ISDIR(crec.mode):
            raise FsError(errno.ENOTDIR)
        if not self.is_empty_dir(child):
            raise FsError(errno.ENOTEMPTY)
        return self._remove_entry(parent, name, child, crec)

    def is_ancestor(self, maybe_ancestor: int, ino: int) -> bool:
        """Whether ``maybe_ancestor`` is ``ino`` or above it (directories have one parent)."""
        while True:
            if ino == maybe_ancestor:
                return True
            ps = self.parents(ino)
            if not ps:
                return False
            ino = ps[0]

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               noreplace: bool = False, exchange: bool = False) -> list[tuple[int, S.Inode]]:
        """POSIX rename, with RENAME_NOREPLACE and RENAME_EXCHANGE. Returns the inodes whose
        last link went away (a replaced target), for the caller to destroy."""
        check_name(new_name)
        src = self.lookup(old_parent, old_name)
        if src is None:
            raise FsError(errno.ENOENT)
        if not stat.S_ISDIR(self.get(new_parent).mode):
            raise FsError(errno.ENOTDIR)
        dst = self.lookup(new_parent, new_name)
        src_dir = stat.S_ISDIR(self.get(src).mode)
        if src_dir and self.is_ancestor(src, new_parent):
            raise FsError(errno.EINVAL)
        if exchange:
            if dst is None:
                raise FsError(errno.ENOENT)
            if stat.S_ISDIR(self.get(dst).mode) and self.is_ancestor(dst, old_parent):
                raise FsError(errno.EINVAL)
            if src == dst:
                return []
            self.remove_entry(old_parent, old_name)
            self.remove_entry(new_parent, new_name)
            self.add_entry(new_parent, new_name, src)
            self.add_entry(old_parent, old_name, dst)
            return []
        if dst is not None:
            if noreplace:
                raise FsError(errno.EEXIST)
            if dst == src:                  # hard links to one inode: POSIX says do nothing
                return []
            dst_dir = stat.S_ISDIR(self.get(dst).mode)
            if src_dir and not dst_dir:
                raise FsError(errno.ENOTDIR)
            if dst_dir and not src_dir:
                raise FsError(errno.EISDIR)
            if dst_dir and not self.is_empty_dir(dst):
                raise FsError(errno.ENOTEMPTY)
        freed = []
        if dst is not None:
            freed.append(self.remove_entry(new_parent, new_name))
        self.remove_entry(old_parent, old_name)
        self.add_entry(new_parent, new_name, src)
        return [f for f in freed if f[1].nlink == 0]

    # ---- attributes ------------------------------------------------------------------------

    def setattr(self, ino: int, **changes) -> S.Inode:
        rec = self.get(ino)
        changes.setdefault("ctime_ns", self.now)
        return self.save(ino, rec.evolve(**changes))

    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        put_live(self.txn, self.db["xattrs"], S.xattr_key(ino, name), b"\x01" + value,
                 self.live)
        self.setattr(ino)

    def remove_xattr(self, ino: int, name: bytes) -> None:
        existed, _ = delete_live(self.txn, self.db["xattrs"], S.xattr_key(ino, name), self.live)
        if not existed:
            raise FsError(errno.ENODATA)
        self.setattr(ino)

    # ---- chunk data ------------------------------------------------------------------------

    def put_chunk(self, ino: int, index: int, digest: bytes, data) -> None:
        """Make ``data`` (whose blake3 is ``digest``) the live content of one chunk. The data
        is stored once per digest; the chunk map names it by digest."""
        self._incref(digest, data)
        old = put_live(self.txn, self.db["chunks"], S.chunk_key(ino, index),
                       S.pack_chunk(digest, len(data)), self.live)
        self.txn.put(S.chunklog_key(ino, self.live, index), b"", db=self.db["chunklog"])
        add_written(self.txn, self.db, self.live, len(data))
        if old:
            self.decref(S.unpack_chunk(old)[0])

    def drop_chunk(self, ino: int, index: int) -> None:
        """Make chunk ``index`` a hole in the live epoch."""
        existed, old = delete_live(self.txn, self.db["chunks"], S.chunk_key(ino, index),
                                   self.live)
        if existed:
            self.txn.put(S.chunklog_key(ino, self.live, index), b"", db=self.db["chunklog"])
        if old:
            self.decref(S.unpack_chunk(old)[0])

    def drop_chunks_from(self, ino: int, first: int, limit: int | None = None) -> bool:
        """Drop every chunk at or after ``first``; with ``limit``, at most that many.
        Returns True when none is left."""
        todo = list(self.chunk_indices(ino, first))
        for n, idx in enumerate(todo):
            if limit is not None and n >= limit:
                return False
            self.drop_chunk(ino, idx)
        return True

    def _incref(self, digest: bytes, data) -> None:
        raw = self.txn.get(digest, db=self.db["refs"])
        if raw is None:
            chunkfile.put(self.txn, self.db, digest, data)
            n = 1
        else:
            n = S.from_u64(raw) + 1
        self.txn.put(digest, S.u64(n), db=self.db["refs"])

    def incref(self, digest: bytes) -> None:
        """Add a reference to a chunk already stored (restore, copies)."""
        raw = self.txn.get(digest, db=self.db["refs"])
        if raw is None:
            raise FsError(errno.EIO, f"chunk {digest.hex()} is not in the store")
        self.txn.put(digest, S.u64(S.from_u64(raw) + 1), db=self.db["refs"])

    def decref(self, digest: bytes) -> None:
        raw = self.txn.get(digest, db=self.db["refs"])
        n = S.from_u64(raw) - 1
        if n > 0:
            self.txn.put(digest, S.u64(n), db=self.db["refs"])
        else:
            self.txn.delete(digest, db=self.db["refs"])
            chunkfile.delete(self.txn, self.db, digest)

    # ---- removal of unlinked inodes ----------------------------------------------------------

    def add_orphan(self, ino: int) -> None:
        self.txn.put(S.u64(ino), b"", db=self.db["orphans"])

    def destroy(self, ino: int, inline_chunks: int = 64) -> None:
        """Delete an inode whose last link is gone and that no one has open. Chunks beyond
        ``inline_chunks`` are left to the background purge (``purge`` table)."""
        delete_live(self.txn, self.db["inodes"], S.inode_key(ino), self.live)
        for name in self.xattr_names(ino):
            delete_live(self.txn, self.db["xattrs"], S.xattr_key(ino, name), self.live)
        self.txn.delete(S.u64(ino), db=self.db["orphans"])
        if not self.drop_chunks_from(ino, 0, limit=inline_chunks):
            self.txn.put(S.u64(ino), b"", db=self.db["purge"])


def written(txn, dbs, epoch: int) -> int:
    """Chunk bytes written in ``epoch`` (what a snapshot adds over the one before it)."""
    val = txn.get(S.written_key(epoch), db=dbs["meta"])
    return S.from_u64(val) if val else 0


def add_written(txn, dbs, epoch: int, nbytes: int) -> None:
    txn.put(S.written_key(epoch), S.u64(written(txn, dbs, epoch) + nbytes), db=dbs["meta"])


def created(prec: S.Inode, parent: int, name: bytes, mode: int, uid: int, gid: int,
            rdev: int, target: bytes, now: int) -> tuple[S.Inode, S.Inode]:
    """The records ``Live.create`` leaves (mepoch aside): the new inode's, linked at
    parent/name, and its parent's (record ``prec``). A setgid directory gives its group
    (and, to directories, its setgid bit): BSD group semantics."""
    if prec.mode & stat.S_ISGID:
        gid = prec.gid
        if stat.S_ISDIR(mode):
            mode |= stat.S_ISGID
    is_dir = stat.S_ISDIR(mode)
    size = len(target) if stat.S_ISLNK(mode) else 0
    rec = S.Inode(mode, uid, gid, 2 if is_dir else 1, size, now, now, now, rdev, 0,
                  parent=parent, name=name, target=target)
    return rec, prec.evolve(nlink=prec.nlink + (1 if is_dir else 0), mtime_ns=now,
                            ctime_ns=now)


def check_name(name: bytes) -> None:
    if len(name) > S.NAME_MAX:
        raise FsError(errno.ENAMETOOLONG)
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL)

