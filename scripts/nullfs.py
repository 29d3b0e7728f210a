#!/usr/bin/env python3
"""The floor for scripts/bench_io.py: a filesystem on pyfuse3 and trio that does nothing but
keep names in dicts and data in memory, served by mountfs's request loop and idle polling
(mountfs/fuseloop.py, mountfs/idlepoll.py) as the mount is. Whatever it costs, every
filesystem on pyfuse3 and trio served that way pays; mountfs cannot be faster than this with
the same kernel options. Not part of the package.

    python scripts/nullfs.py MOUNTPOINT [--timeout 300] [--writeback] [--discard]

Runs in the foreground until unmounted (fusermount3 -u MOUNTPOINT). The kernel-side options
are the same knobs mountfs uses (entry/attribute timeouts, writeback cache, and the 1 MiB
readahead a mount sets once the kernel's INIT is answered, through mountfs's own
``mount.set_readahead``) so that a change to them can be measured on both.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
import time

import pyfuse3
import trio

from mountfs.errors import StoreError

try:        # importing these reads the $MOUNTFS_* tuning variables, as the mount does
    from mountfs import fuseloop, idlepoll
    from mountfs.mount import set_readahead
    from mountfs.ops import ACL_XATTRS
except StoreError as e:
    raise SystemExit(f"{os.path.basename(sys.argv[0]).removesuffix('.py')}: {e}") from None


class Node:
    __slots__ = ("ino", "mode", "uid", "gid", "rdev", "nlink", "size", "data", "target",
                 "children", "xattrs", "atime", "mtime", "ctime")

    def __init__(self, ino: int, mode: int, uid: int, gid: int, rdev: int = 0):
        now = time.time_ns()
        self.ino, self.mode, self.uid, self.gid, self.rdev = ino, mode, uid, gid, rdev
        self.nlink = 2 if stat.S_ISDIR(mode) else 1
        self.size = 0
        self.data = bytearray()
        self.target = b""
        self.children: dict[bytes, int] = {}
        self.xattrs: dict[bytes, bytes] = {}
        self.atime = self.mtime = self.ctime = now


class NullFS(pyfuse3.Operations):
    def __init__(self, timeout: float, writeback: bool, discard: bool):
        super().__init__()
        self.timeout = timeout
        self.discard = discard
        type(self).enable_writeback_cache = writeback
        self.nodes = {pyfuse3.ROOT_INODE: Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755,
                                               os.getuid(), os.getgid())}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.initialized = trio.Event()

    def init(self) -> None:
        self.initialized.set()      # the INIT answer is sent: the readahead may be raised

    def _node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def _attrs(self, n: Node) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino, e.st_mode, e.st_nlink = n.ino, n.mode, n.nlink
        e.st_uid, e.st_gid, e.st_rdev, e.st_size = n.uid, n.gid, n.rdev, n.size
        e.st_blksize = 128 << 10
        e.st_blocks = (n.size + 511) // 512
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = n.atime, n.mtime, n.ctime
        e.entry_timeout = e.attr_timeout = self.timeout
        return e

    async def lookup(self, parent_inode, name, ctx=None):
        parent = self._node(parent_inode)
        ino = parent.children.get(name)
        if ino is None:
            e = pyfuse3.EntryAttributes()
            e.st_ino = 0
            e.entry_timeout = self.timeout        # a negative entry, cached as long
            return e
        return self._attrs(self.nodes[ino])

    async def getattr(self, inode, ctx=None):
        return self._attrs(self._node(inode))

    async def setattr(self, inode, attr, fields, fh, ctx):
        n = self._node(inode)
        if fields.update_size:
            n.size = attr.st_size
            if not self.discard:
                del n.data[attr.st_size:]
        if fields.update_mode:
            n.mode = stat.S_IFMT(n.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            n.uid = attr.st_uid
        if fields.update_gid:
            n.gid = attr.st_gid
        if fields.update_atime:
            n.atime = attr.st_atime_ns
        if fields.update_mtime:
            n.mtime = attr.st_mtime_ns
        n.ctime = time.time_ns()
        return self._attrs(n)

    def _make(self, parent_inode, name, mode, ctx, rdev=0, target=b""):
        parent = self._node(parent_inode)
        if name in parent.children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        n = Node(self.next_ino, mode, ctx.uid, ctx.gid, rdev)
        n.target = target
        n.size = len(target)
        self.next_ino += 1
        self.nodes[n.ino] = n
        parent.children[name] = n.ino
        if stat.S_ISDIR(mode):
            parent.nlink += 1
        parent.mtime = parent.ctime = time.time_ns()
        return self._attrs(n)

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._make(parent_inode, name, mode, ctx, rdev)

    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._make(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx)

    async def symlink(self, parent_inode, name, target, ctx):
        return self._make(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target=target)

    async def readlink(self, inode, ctx):
        return self._node(inode).target

    async def create(self, parent_inode, name, mode, flags, ctx):
        attrs = self._make(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        return pyfuse3.FileInfo(fh=attrs.st_ino), attrs

    async def link(self, inode, new_parent_inode, new_name, ctx):
        n = self._node(inode)
        self._node(new_parent_inode).children[new_name] = inode
        n.nlink += 1
        return self._attrs(n)

    def _drop(self, parent: Node, name: bytes) -> None:
        ino = parent.children.pop(name)
        n = self.nodes[ino]
        if stat.S_ISDIR(n.mode):
            parent.nlink -= 1
            del self.nodes[ino]
        else:
            n.nlink -= 1
            if n.nlink == 0:
                del self.nodes[ino]
        parent.mtime = parent.ctime = time.time_ns()

    async def unlink(self, parent_inode, name, ctx):
        parent = self._node(parent_inode)
        if name not in parent.children:
            raise pyfuse3.FUSEError(errno.ENOENT)
        self._drop(parent, name)

    async def rmdir(self, parent_inode, name, ctx):
        parent = self._node(parent_inode)
        ino = parent.children.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if self.nodes[ino].children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        self._drop(parent, name)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        old, new = self._node(parent_inode_old), self._node(parent_inode_new)
        ino = old.children.get(name_old)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name_new in new.children:
            self._drop(new, name_new)
        del old.children[name_old]
        new.children[name_new] = ino
        if stat.S_ISDIR(self.nodes[ino].mode) and old is not new:
            old.nlink -= 1
            new.nlink += 1

    async def open(self, inode, flags, ctx):
        n = self._node(inode)
        if flags & os.O_TRUNC:
            n.size = 0
            n.data = bytearray()
        return pyfuse3.FileInfo(fh=inode)

    async def read(self, fh, off, size):
        n = self.nodes[fh]
        end = min(off + size, n.size)
        if off >= end:
            return b""
        if self.discard:
            return bytes(end - off)
        return bytes(n.data[off:end]).ljust(end - off, b"\0")

    async def write(self, fh, off, buf):
        n = self.nodes[fh]
        if not self.discard:
            if len(n.data) < off:
                n.data.extend(bytes(off - len(n.data)))
            n.data[off:off + len(buf)] = buf
        n.size = max(n.size, off + len(buf))
        n.mtime = n.ctime = time.time_ns()
        return len(buf)

    async def flush(self, fh):
        pass

    async def release(self, fh):
        pass

    async def fsync(self, fh, datasync):
        pass

    async def opendir(self, inode, ctx):
        self._node(inode)
        return inode

    async def readdir(self, fh, start_id, token):
        entries = list(self.nodes[fh].children.items())
        for i in range(start_id, len(entries)):
            name, ino = entries[i]
            if not pyfuse3.readdir_reply(token, name, self._attrs(self.nodes[ino]), i + 1):
                break

    async def releasedir(self, fh):
        pass

    async def fsyncdir(self, fh, datasync):
        pass

    async def getxattr(self, inode, name, ctx):
        try:
            return self._node(inode).xattrs[name]
        except KeyError:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None

    async def setxattr(self, inode, name, value, ctx):
        if name in ACL_XATTRS:                 # as mountfs: no ACLs (cp -a then chmods)
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        self._node(inode).xattrs[name] = value

    async def listxattr(self, inode, ctx):
        return list(self._node(inode).xattrs)

    async def removexattr(self, inode, name, ctx):
        if self._node(inode).xattrs.pop(name, None) is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def statfs(self, ctx):
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 4096
        st.f_blocks = st.f_bfree = st.f_bavail = 1 << 30
        st.f_files = st.f_ffree = st.f_favail = 1 << 30
        st.f_namemax = 255
        return st


async def serve(fs: NullFS, mountpoint: str) -> None:
    async def raise_readahead():
        await fs.initialized.wait()     # stat in a thread: this loop answers its GETATTR
        dev = (await trio.to_thread.run_sync(os.stat, mountpoint)).st_dev
        set_readahead(f"{os.major(dev)}:{os.minor(dev)}", mountpoint)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(raise_readahead)
        await fuseloop.main()       # mountfs's request loop


def parse_args(doc: str, durable: bool = False) -> argparse.Namespace:
    """The floors' command line (scripts/durable_floor.py adds its store directory)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("mountpoint")
    if durable:
        ap.add_argument("store", help="directory of the LMDB environment it writes")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="entry, attribute and negative-entry timeout in seconds")
    ap.add_argument("--writeback", action="store_true", help="enable the writeback cache")
    ap.add_argument("--idle-poll", type=idlepoll.parse_window, default=idlepoll.POLL,
                    metavar="SECONDS",
                    help="poll for the next request this long before sleeping, while "
                         "requests come in bursts, as mountfs does (default: mountfs's, "
                         "$MOUNTFS_IDLE_POLL or %(default)s; 0: off)")
    if not durable:                 # the durable floor keeps what it is given
        ap.add_argument("--discard", action="store_true",
                        help="discard data (reads give zeros)")
    args = ap.parse_args()
    if not os.path.isdir(args.mountpoint):
        sys.exit(f"{ap.prog}: {args.mountpoint} is not a directory: make it first "
                 f"(mkdir -p {args.mountpoint})")
    return args


def run_mount(fs: NullFS, mountpoint: str, fsname: str, serving, idle_poll: float) -> None:
    """Mount ``fs`` and run ``serving(mountpoint)`` in trio until it is unmounted, polling
    ``idle_poll`` seconds before sleeping as mountfs does (``mountfs.idlepoll``)."""
    mountpoint = os.path.realpath(mountpoint)   # before mounting: later it would wait for us
    idlepoll.install(idle_poll)
    try:
        pyfuse3.init(fs, mountpoint, [f"fsname={fsname}", "default_permissions"])
    except RuntimeError as e:       # pyfuse3 says only "fuse_session_mount failed"
        sys.exit(f"{fsname}: could not mount at {mountpoint} ({e}): run as root with "
                 f"/dev/fuse present, on a directory nothing is mounted on")
    try:
        trio.run(serving, mountpoint)
    finally:
        pyfuse3.close(unmount=True)


def main() -> None:
    args = parse_args(__doc__)
    fs = NullFS(args.timeout, args.writeback, args.discard)
    run_mount(fs, args.mountpoint, "nullfs", lambda mnt: serve(fs, mnt), args.idle_poll)


if __name__ == "__main__":
    main()
