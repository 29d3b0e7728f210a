"""The rules every inode of a mountfs tree obeys, at every epoch: ONE list, used by ``mountfs
fsck`` (which walks the whole tree) and by a mirror's receiver (which checks only what a
commit touched, and refuses the commit on the first broken rule), so that the two cannot
drift and a commit a mirror accepts is one fsck accepts.

Numbers that arrive from outside (a commit, a request) are bounded here too: inode numbers
stay below ``schema.MAX_INO`` (far below the mount's virtual range), chunk indexes at or
below ``MAX_CHUNK_INDEX``, file sizes at or below ``max_file_size``: the mount refuses a
larger file (EFBIG), so that whatever it accepts a mirror accepts too.
"""

from __future__ import annotations

import stat

from . import schema as S
from .namespace import View

MAX_CHUNK_INDEX = (1 << 40) - 1
MAX_OFFSET = (1 << 63) - 1           # the kernel's loff_t: no file offset reaches beyond it
FILE_TYPES = {stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFCHR, stat.S_IFBLK,
              stat.S_IFIFO, stat.S_IFSOCK}


def ino_in_range(ino: int) -> bool:
    return isinstance(ino, int) and 1 <= ino <= S.MAX_INO


def max_file_size(chunk_size: int) -> int:
    """The largest file a store with ``chunk_size`` holds: its last byte still falls in
    chunk ``MAX_CHUNK_INDEX`` (2**60 bytes with 1 MiB chunks, 2**52 with 4 KiB ones)."""
    return min(chunk_size * (MAX_CHUNK_INDEX + 1), MAX_OFFSET)


def xattr_name_ok(name: bytes) -> bool:
    return 0 < len(name) <= S.NAME_MAX and b"\0" not in name


def newest_epoch(txn, db, prefix: bytes, upto: int) -> int:
    """The newest version epoch at or below ``upto`` among records under ``prefix``."""
    best = 0
    cur = txn.cursor(db)
    if not cur.set_range(prefix):
        return 0
    for key in cur.iternext(values=False):
        key = bytes(key)
        if key[:len(prefix)] != prefix:
            break
        e = S.epoch_of_key(key)
        if best < e <= upto:
            best = e
    return best


def subdir_count(view: View, d: int) -> int:
    return sum(1 for _, c in view.listdir(d)
               if (rec := view.inode(c)) is not None and stat.S_ISDIR(rec.mode))


def inode_problems(view: View, ino: int, rec: S.Inode, names: int,
                   subdirs: int | None = None, chunks=None) -> list[str]:
    """Every rule ``ino`` (record ``rec``, with ``names`` names in the tree and, for a
    directory, ``subdirs`` subdirectories) breaks, one line each. ``chunks``: the chunk
    leaves whose length to check (None: all; a receiver checked the ones it got)."""
    out = []
    if not ino_in_range(ino):
        out.append(f"inode {ino} lies outside the store's range 1..{S.MAX_INO}")
    if stat.S_IFMT(rec.mode) not in FILE_TYPES:
        out.append(f"inode {ino} has mode {rec.mode:o}, of no known file type")
    if ino == S.ROOT_INO and not stat.S_ISDIR(rec.mode):
        out.append("the root is not a directory")
    if ino == S.ROOT_INO and names:
        out.append("the root is named in a directory (a cycle)")
    out += _epoch_problems(view, ino, rec)
    if stat.S_ISDIR(rec.mode):
        subdirs = subdir_count(view, ino) if subdirs is None else subdirs
        if rec.nlink != 2 + subdirs:
            out.append(f"directory {ino} has nlink {rec.nlink}, expected {2 + subdirs}")
    else:
        if rec.nlink != names:
            out.append(f"inode {ino} has nlink {rec.nlink} but {names} name(s)")
        if not view.is_empty_dir(ino):
            out.append(f"inode {ino} is not a directory but has entries under it")
    if ino != S.ROOT_INO and names and view.lookup(rec.parent, rec.name) != ino:
        out.append(f"inode {ino} records its location as {rec.parent}/{rec.name!r}, which "
                   f"does not name it")
    out += _content_problems(view, ino, rec, chunks)
    return out


def _epoch_problems(view: View, ino: int, rec: S.Inode) -> list[str]:
    """mepoch is what a diff prunes by: no inode is older than a version of its records."""
    txn, dbs, epoch = view.txn, view.db, view.epoch
    if rec.mepoch >= epoch:
        return []                     # nothing visible at this epoch can be newer
    newest = max(newest_epoch(txn, dbs["inodes"], S.inode_key(ino), epoch),
                 newest_epoch(txn, dbs["xattrs"], S.u64(ino), epoch),
                 newest_epoch(txn, dbs["chunks"], S.u64(ino), epoch))
    if stat.S_ISDIR(rec.mode):
        newest = max(newest, newest_epoch(txn, dbs["dirents"], S.dirent_prefix(ino), epoch))
    if rec.mepoch < newest:
        return [f"inode {ino} has mepoch {rec.mepoch} but changed in epoch {newest}"]
    return []


def _content_problems(view: View, ino: int, rec: S.Inode, chunks=None) -> list[str]:
    """Chunks only in regular files and only below their size (one seek each), each no
    longer than the chunk size (the leaves ``chunks`` names; None: every leaf)."""
    out = []
    if stat.S_ISREG(rec.mode):
        if rec.size > max_file_size(view.chunk_size):
            out.append(f"inode {ino} has size {rec.size}, over the store's maximum file "
                       f"size {max_file_size(view.chunk_size)}")
        first_beyond = min(-(-rec.size // view.chunk_size), MAX_CHUNK_INDEX + 1)
        beyond = next(view.chunk_indices(ino, first_beyond), None)
        if beyond is not None:
            out.append(f"inode {ino} has chunk {beyond}, beyond its size {rec.size}")
        for idx in view.chunk_indices(ino) if chunks is None else chunks:
            value = view.chunk(ino, idx)
            if value is not None and value[1] > view.chunk_size:
                out.append(f"inode {ino} chunk {idx} holds {value[1]} bytes, more than the "
                           f"chunk size {view.chunk_size}")
    elif next(view.chunk_indices(ino), None) is not None:
        out.append(f"inode {ino} is not a regular file but has chunks")
    if stat.S_ISLNK(rec.mode) and not rec.target:
        out.append(f"symlink {ino} has no target")
    for name in view.xattr_names(ino):
        if not xattr_name_ok(name):
            out.append(f"inode {ino} has an xattr with an invalid name {name!r}")
    return out
