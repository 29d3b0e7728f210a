"""A recording passthrough filesystem for the power-loss test (run as its own process):

    python tests/recordfs.py BACKING MOUNTPOINT LOG

A flat directory (no subdirectories) whose files live in BACKING. Every write that reaches it
(offset and bytes), every truncation and every fsync/fdatasync is appended to LOG *before*
the request is answered, so a reader of LOG that saw a call return also sees its record.

Record: ``<B kind><Q ino><Q offset><I length>`` then ``length`` bytes; kinds:
``N`` name of an inode (the bytes), ``W`` write, ``T`` truncate to offset, ``S`` fsync.

The kernel's page cache sits above this layer; LMDB (without writemap) writes with
pwrite(2) and syncs with fdatasync(2), both of which reach us as WRITE and FSYNC requests, in
the order the kernel sends them. What reached us before a FSYNC was answered is what a disk
would hold after that sync; what came after it may be on the disk in any subset.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import sys

import pyfuse3
import trio

HEADER = struct.Struct("<BQQI")
ROOT = pyfuse3.ROOT_INODE


class RecordFS(pyfuse3.Operations):
    def __init__(self, backing: str, log: str):
        super().__init__()
        self.backing = backing
        self.log = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        self.names: dict[bytes, int] = {}
        self.inos: dict[int, bytes] = {}
        self.next_ino = ROOT + 1
        self.fds: dict[int, int] = {}

    def record(self, kind: bytes, ino: int, off: int = 0, data: bytes = b"") -> None:
        os.write(self.log, HEADER.pack(kind[0], ino, off, len(data)) + data)

    def _path(self, ino: int) -> str:
        return os.path.join(self.backing, os.fsdecode(self.inos[ino]))

    def _ino(self, name: bytes) -> int:
        ino = self.names.get(name)
        if ino is None:
            ino = self.names[name] = self.next_ino
            self.inos[ino] = name
            self.next_ino += 1
            self.record(b"N", ino, 0, name)
        return ino

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        path = self.backing if ino == ROOT else self._path(ino)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        e = pyfuse3.EntryAttributes()
        for f in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                  "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(e, f, getattr(st, f))
        e.st_ino = ino
        e.st_blksize = 4096
        e.st_blocks = st.st_blocks
        e.entry_timeout = e.attr_timeout = 0
        return e

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != ROOT or not os.path.lexists(os.path.join(self.backing,
                                                                    os.fsdecode(name))):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(self._ino(name))

    async def getattr(self, inode, ctx=None):
        return self._attrs(inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        path = self.backing if inode == ROOT else self._path(inode)
        if fields.update_size:
            os.truncate(path, attr.st_size)
            self.record(b"T", inode, attr.st_size)
        if fields.update_mode:
            os.chmod(path, stat.S_IMODE(attr.st_mode))
        return self._attrs(inode)

    async def create(self, parent_inode, name, mode, flags, ctx):
        path = os.path.join(self.backing, os.fsdecode(name))
        fd = os.open(path, (flags & ~os.O_APPEND) | os.O_CREAT, mode)
        ino = self._ino(name)
        self.fds[fd] = ino
        return pyfuse3.FileInfo(fh=fd), self._attrs(ino)

    async def open(self, inode, flags, ctx):
        fd = os.open(self._path(inode), flags & ~(os.O_APPEND | os.O_CREAT | os.O_EXCL))
        if flags & os.O_TRUNC:
            self.record(b"T", inode, 0)
        self.fds[fd] = inode
        return pyfuse3.FileInfo(fh=fd, keep_cache=True)

    async def read(self, fh, off, size):
        return os.pread(fh, size, off)

    async def write(self, fh, off, buf):
        self.record(b"W", self.fds[fh], off, bytes(buf))
        return os.pwrite(fh, buf, off)

    async def fsync(self, fh, datasync):
        self.record(b"S", self.fds[fh])

    async def flush(self, fh):
        pass

    async def release(self, fh):
        self.fds.pop(fh, None)
        os.close(fh)

    async def unlink(self, parent_inode, name, ctx):
        os.unlink(os.path.join(self.backing, os.fsdecode(name)))
        ino = self.names.pop(name, None)
        if ino is not None:
            self.record(b"T", ino, 0)      # a later file of that name starts empty

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        names = sorted(os.listdir(self.backing))
        for i, name in enumerate(names[start_id:], start_id + 1):
            ino = self._ino(os.fsencode(name))
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attrs(ino), i):
                break

    async def releasedir(self, fh):
        pass

    async def statfs(self, ctx):
        st = os.statvfs(self.backing)
        out = pyfuse3.StatvfsData()
        for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                  "f_ffree", "f_favail", "f_namemax"):
            setattr(out, f, getattr(st, f))
        return out


def main() -> None:
    backing, mountpoint, log = sys.argv[1:4]
    fs = RecordFS(backing, log)
    pyfuse3.init(fs, mountpoint, ["fsname=recordfs", "default_permissions"])
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
