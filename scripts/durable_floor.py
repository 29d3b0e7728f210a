#!/usr/bin/env python3
"""The durable floor of scripts/bench_io.py: nullfs.py plus the least durability costs.

A second floor: the least a filesystem must do to keep what it answered, in this stack.
Not part of the package.

    python scripts/durable_floor.py MOUNTPOINT STOREDIR [--timeout S] [--writeback]

It answers every request from memory exactly as nullfs.py does, and also records each change
(an inode's attributes, a directory entry, the data of a file closed or fsynced) as a key
and value. Every 2 ms the changes of those milliseconds go, as one pickled frame, down a
pipe to a writer process (scripts/floor_writer.py) that puts them into an LMDB environment
opened as mountfs opens its store (``sync=True, metasync=False``) and commits once the
oldest uncommitted change is 5 ms old: mountfs's posted steps, group commit and commit
delay, without anything else mountfs does (no versions per epoch, no mepoch, no bucket
hashes, no chunk digests, no reads of the store). fsync sends at once and waits for the
commit that holds it (EIO once the writer is gone). The writer reads the pipe in one
thread and puts and commits in another, as mountfs's does, so that a commit's sync does
not stop the pipe.

What it measures: the distance between this floor and nullfs.py is the cost of durability
itself on this machine (a second busy process on the same cores, the pipe, the puts and the
syncs); the distance between it and the mount is what mountfs does beyond that.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pyfuse3
import trio

from floor_writer import ACK as _ACK, FRAME as _FRAME
from nullfs import NullFS, Node, parse_args, run_mount, serve as serve_floor

POST_DELAY = 0.002          # as mountfs.writer.POST_DELAY
CHUNK = 1 << 20             # as mountfs's default chunk size
WRITER_NICE = 10            # as mountfs.writer.NICE
PIPE_BYTES = 1 << 20        # as mountfs.writer.PIPE_BYTES
_F_SETPIPE_SZ = 1031
_INODE = struct.Struct("<QIIIIQQqqq")
_U64 = struct.Struct(">Q")


def inode_key(ino: int) -> bytes:
    return b"i" + _U64.pack(ino)


def entry_key(parent: int, name: bytes) -> bytes:
    return b"d" + _U64.pack(parent) + name


def chunk_key(ino: int, index: int) -> bytes:
    return b"c" + _U64.pack(ino) + _U64.pack(index)


class DurableNullFS(NullFS):
    """NullFS whose every change is also recorded (``changes``: key -> value, None to
    delete) and sent to the writer process in batches (``sender``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.changes: dict[bytes, bytes | None] = {}
        self.written: set[int] = set()
        self.stored_chunks: dict[int, int] = {}
        self.wake = trio.Event()
        self.pipe: trio.lowlevel.FdStream | None = None
        self.sending = trio.Lock()
        self.sent = self.committed = 0      # frame numbers
        self.acked = trio.Event()
        self.writer_gone = False

    def _changed(self, key: bytes, value: bytes | None) -> None:
        if not self.changes:
            self.wake.set()
        self.changes[key] = value

    def _record(self, n: Node) -> None:
        self._changed(inode_key(n.ino), _INODE.pack(n.ino, n.mode, n.uid, n.gid, n.nlink,
                                                     n.rdev, n.size, n.atime, n.mtime,
                                                     n.ctime) + n.target)

    def _gone(self, n: Node) -> None:
        self._changed(inode_key(n.ino), None)
        for index in range(self.stored_chunks.pop(n.ino, 0)):
            self._changed(chunk_key(n.ino, index), None)

    async def setattr(self, inode, attr, fields, fh, ctx):
        attrs = await super().setattr(inode, attr, fields, fh, ctx)
        if fields.update_size:
            self.written.add(inode)
        self._record(self.nodes[inode])
        return attrs

    def _make(self, parent_inode, name, mode, ctx, rdev=0, target=b""):
        attrs = super()._make(parent_inode, name, mode, ctx, rdev, target)
        self._record(self.nodes[attrs.st_ino])
        self._record(self.nodes[parent_inode])
        self._changed(entry_key(parent_inode, name), _U64.pack(attrs.st_ino))
        return attrs

    async def link(self, inode, new_parent_inode, new_name, ctx):
        attrs = await super().link(inode, new_parent_inode, new_name, ctx)
        self._record(self.nodes[inode])
        self._changed(entry_key(new_parent_inode, new_name), _U64.pack(inode))
        return attrs

    def _drop(self, parent: Node, name: bytes) -> None:
        n = self.nodes[parent.children[name]]
        super()._drop(parent, name)
        self._changed(entry_key(parent.ino, name), None)
        self._record(parent)
        if n.ino in self.nodes:
            self._record(n)
        else:
            self._gone(n)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        ino = self._node(parent_inode_old).children.get(name_old)    # None: ENOENT below
        await super().rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx)
        self._changed(entry_key(parent_inode_old, name_old), None)
        self._changed(entry_key(parent_inode_new, name_new), _U64.pack(ino))
        self._record(self.nodes[parent_inode_old])
        self._record(self.nodes[parent_inode_new])

    async def open(self, inode, flags, ctx):
        info = await super().open(inode, flags, ctx)
        if flags & os.O_TRUNC:
            self.written.add(inode)
        return info

    async def write(self, fh, off, buf):
        self.written.add(fh)
        return await super().write(fh, off, buf)

    async def flush(self, fh):
        """A closed file's data is recorded, as mountfs commits it at close."""
        self._record_written(fh)

    def _record_written(self, fh) -> None:
        """The data of file ``fh``, if written since it was last recorded, as changes."""
        if fh in self.written and fh in self.nodes:
            self.written.discard(fh)
            n = self.nodes[fh]
            chunks = (n.size + CHUNK - 1) // CHUNK
            data = memoryview(n.data)
            for index in range(chunks):       # one copy: the file may change before it is sent
                self._changed(chunk_key(n.ino, index),
                              bytes(data[index * CHUNK:(index + 1) * CHUNK]))
            for index in range(chunks, self.stored_chunks.get(n.ino, 0)):
                self._changed(chunk_key(n.ino, index), None)
            self.stored_chunks[n.ino] = chunks
            self._record(n)

    async def setxattr(self, inode, name, value, ctx):
        await super().setxattr(inode, name, value, ctx)
        self._changed(b"x" + _U64.pack(inode) + name, value)

    async def removexattr(self, inode, name, ctx):
        await super().removexattr(inode, name, ctx)
        self._changed(b"x" + _U64.pack(inode) + name, None)

    async def fsync(self, fh, datasync):
        """The file's data written so far is recorded first, as mountfs commits it at
        fsync: an fsync promises it, whether the file is closed yet or not."""
        self._record_written(fh)
        await self.durable()

    async def fsyncdir(self, fh, datasync):
        await self.durable()

    async def durable(self) -> None:
        """Every change made so far committed and synced."""
        await self.send(urgent=True)
        number = self.sent
        while self.committed < number and not self.writer_gone:
            await self.acked.wait()
        if self.writer_gone:        # what was sent may be lost, what was not is (stderr)
            raise pyfuse3.FUSEError(errno.EIO)

    async def sender(self) -> None:
        """Every POST_DELAY, the changes made since go to the writer as one frame."""
        while True:
            await self.wake.wait()
            await trio.sleep(POST_DELAY)
            with trio.CancelScope(shield=True):    # a frame cut short would be lost
                await self.send()

    async def send(self, urgent: bool = False) -> None:
        async with self.sending:
            changes, self.changes = self.changes, {}
            self.wake = trio.Event()
            if (changes or urgent) and not self.writer_gone:
                self.sent += 1
                frame = pickle.dumps(changes, protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    await self.pipe.send_all(_FRAME.pack(len(frame), self.sent, urgent))
                    await self.pipe.send_all(frame)
                except trio.BrokenResourceError:
                    self._lost_writer()

    def _lost_writer(self) -> None:
        """The writer is gone: changes are kept in memory only, and fsync fails (EIO)."""
        if not self.writer_gone:
            print("durable_floor.py: its writer process is gone; fsync now fails (EIO)",
                  file=sys.stderr)
        self.writer_gone = True
        self.acked.set()

    async def acks(self, answers: trio.lowlevel.FdStream) -> None:
        """The writer's answers: the frames committed so far."""
        buf = b""
        while data := await answers.receive_some():
            buf += data
            while len(buf) >= _ACK.size:
                (self.committed,) = _ACK.unpack_from(buf)
                buf = buf[_ACK.size:]
            self.acked.set()
            self.acked = trio.Event()
        self._lost_writer()


async def serve(fs: DurableNullFS, mountpoint: str, pipe_fd: int, answers_fd: int) -> None:
    """nullfs.py's serve, with the sender and the writer's answers beside it; what is left
    is sent at the end."""
    fs.pipe = trio.lowlevel.FdStream(os.dup(pipe_fd))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.sender)
        nursery.start_soon(fs.acks, trio.lowlevel.FdStream(os.dup(answers_fd)))
        await serve_floor(fs, mountpoint)
        nursery.cancel_scope.cancel()
    await fs.send()
    await fs.pipe.aclose()


def main() -> None:
    args = parse_args(__doc__, durable=True)
    os.makedirs(args.store, exist_ok=True)
    child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("floor_writer.py")),
                              args.store],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             preexec_fn=lambda: os.nice(WRITER_NICE))
    fcntl.fcntl(child.stdin.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
    fs = DurableNullFS(args.timeout, args.writeback, False)
    try:
        run_mount(fs, args.mountpoint, "durable_floor",
                  lambda mnt: serve(fs, mnt, child.stdin.fileno(), child.stdout.fileno()),
                  args.idle_poll)
    finally:
        child.stdin.close()
        child.wait()


if __name__ == "__main__":
    main()
