"""The mounted filesystem's engine: one open store, the rule for who may write when, the
file cache, snapshots, and the background tasks (syncer, garbage collector).

Concurrency rule (see docs/architecture.md): LMDB transactions are short and run on the trio
thread, except large ones (restore, GC batches) which run in a worker thread. Every writer,
inline or threaded, holds ``Engine.lock``, a trio lock, so the trio thread never blocks on
LMDB's own writer mutex. Reads are inline and take microseconds.
"""

from __future__ import annotations

import errno
import logging
from collections import OrderedDict
from contextlib import contextmanager

import blake3
import trio

from . import gc, snapshots
from . import schema as S
from .filecache import FileCache
from .namespace import FsError, Live, View
from .store import Store, StoreFull

log = logging.getLogger(__name__)

SYNC_INTERVAL = 1.0


class Engine:
    def __init__(self, store: Store):
        self.store = store
        self.db = store.db
        self.chunk_size = store.chunk_size
        self.lock = trio.Lock()
        self.files = FileCache(self)
        with store.read() as txn:
            self.live = store.live_epoch(txn)
        self._unsynced = False
        self._gc_wakeup = trio.Event()
        self._verified: OrderedDict[bytes, None] = OrderedDict()   # digests checked once

    # ---- chunk verification ----------------------------------------------------------------

    VERIFIED_CACHE = 1 << 16

    def unverified(self, view: View, ino: int, off: int, size: int) -> list[bytes]:
        """Digests of the stored chunks under [off, off + size) not yet checked."""
        cs, out = self.chunk_size, []
        for idx in range(off // cs, (off + max(size, 1) - 1) // cs + 1):
            c = view.chunk(ino, idx)
            if c is not None and bytes(c[0]) not in self._verified:
                out.append(bytes(c[0]))
        return out

    async def verify(self, epoch: int | None, ino: int, off: int, size: int) -> None:
        """Check the chunks under [off, off + size) of ``ino`` as of ``epoch`` against their
        digests before they are first served (hashing in a worker thread); a mismatch is EIO,
        never wrong data. Checked digests are remembered. The chunk map and the data are read
        in one transaction: a chunk rewritten meanwhile is checked as it is now, so a blob
        missing here is missing from a map that names it, which only corruption does."""
        def check():
            with self.view(epoch) as v:
                digests = self.unverified(v, ino, off, size)
                for digest in digests:
                    data = v.txn.get(digest, db=self.db["blobs"])
                    if data is None or blake3.blake3(data).digest() != digest:
                        return digest, digests
            return None, digests
        bad, digests = await trio.to_thread.run_sync(check)
        if bad is not None:
            log.error("chunk %s is corrupt or missing in the store; run 'mountfs fsck'",
                      bad.hex())
            raise FsError(errno.EIO, f"chunk {bad.hex()} is corrupt")
        for digest in digests:
            self._verified[digest] = None
            self._verified.move_to_end(digest)
        while len(self._verified) > self.VERIFIED_CACHE:
            self._verified.popitem(last=False)

    # ---- transactions ----------------------------------------------------------------------

    @contextmanager
    def view(self, epoch: int | None = None):
        with self.store.read() as txn:
            if epoch is None:
                # a read-only mount follows a store another process writes (a mirror)
                epoch = self.store.live_epoch(txn) if self.store.readonly else self.live
            elif txn.get(S.u64(epoch), db=self.db["snapepochs"]) is None:
                # A snapshot deleted while the kernel still holds its inodes (an open file,
                # a cwd): GC is reclaiming its versions, so what is left would read as holes
                # or other epochs' data. Checked in the reading transaction: no race with GC.
                raise FsError(errno.ESTALE)
            yield View(txn, self.db, epoch, self.chunk_size)

    def _run_write(self, fn, *args):
        try:
            with self.store.write() as txn:
                live = Live(txn, self.db, self.live, self.chunk_size)
                return fn(live, *args)
        except StoreFull as e:
            raise FsError(errno.ENOSPC, str(e)) from e

    async def mutate(self, fn, *args):
        """Run ``fn(live, *args)`` in one write transaction on the trio thread. Only for
        work bounded to microseconds or a few milliseconds."""
        async with self.lock:
            result = self._run_write(fn, *args)
        self._unsynced = True
        return result

    async def mutate_in_thread(self, fn, *args):
        """Run ``fn(txn, *args)`` in one write transaction in a worker thread."""
        def work():
            try:
                with self.store.write() as txn:
                    return fn(txn, *args)
            except StoreFull as e:
                raise FsError(errno.ENOSPC, str(e)) from e

        async with self.lock:
            result = await trio.to_thread.run_sync(work)
        self._unsynced = True
        return result

    async def sync(self) -> None:
        """Make everything committed durable, off the trio thread."""
        self._unsynced = False
        await trio.to_thread.run_sync(self.store.sync)

    async def remove_orphans(self) -> int:
        """Delete inodes left unlinked-but-open by a process that died."""
        def work(live):
            orphans = [S.from_u64(k) for k, _ in live.txn.cursor(db=self.db["orphans"])]
            for ino in orphans:
                live.destroy(ino)
            return len(orphans)
        return await self.mutate(work)

    # ---- snapshots -------------------------------------------------------------------------

    async def create_snapshot(self, name: str) -> S.Snapshot:
        snapshots.validate_name(name)
        await self.files.freeze()
        try:
            async with self.lock:
                with self.store.write() as txn:
                    snap = snapshots.create(txn, self.db, name)
                self.live = snap.epoch + 1
        finally:
            self.files.thaw()
        await self.sync()
        return snap

    def changed_since_snapshot(self) -> bool:
        """Whether anything was committed since the newest snapshot: O(1), the root's
        mepoch (buffered writes not yet committed are counted in ``files.dirty_bytes``)."""
        with self.store.read() as txn:
            root = View(txn, self.db, self.live, self.chunk_size).get(S.ROOT_INO)
        return root.mepoch >= self.live

    def list_snapshots(self) -> list[S.Snapshot]:
        with self.store.read() as txn:
            return snapshots.list_all(txn, self.db)

    def snapshot(self, name: str) -> S.Snapshot:
        with self.store.read() as txn:
            return snapshots.get(txn, self.db, name)

    async def delete_snapshot(self, name: str, force: bool = False) -> S.Snapshot:
        async with self.lock:
            with self.store.write() as txn:
                snap = snapshots.delete(txn, self.db, name, force)
        self._unsynced = True
        self._gc_wakeup.set()
        return snap

    async def hold(self, mirror_uuid: bytes, name: str, label: str) -> None:
        async with self.lock:
            with self.store.write() as txn:
                snapshots.set_hold(txn, self.db, mirror_uuid, name, label)
        self._unsynced = True

    async def forget_mirror(self, label: str) -> int:
        async with self.lock:
            with self.store.write() as txn:
                dropped = snapshots.drop_holds(txn, self.db, label)
        self._unsynced = True
        return dropped

    async def rollback(self, name: str, force: bool) -> snapshots.Rollback:
        snap = self.snapshot(name)
        await self.files.flush_all()
        done = await self.mutate_in_thread(snapshots.rollback, self.db, self.chunk_size, snap,
                                           force)
        for ino in done.inodes:
            self.files.forget_dirty(ino)
        await self.sync()
        self._gc_wakeup.set()
        return done

    async def restore_path(self, name: str, path: str, dest: str, force: bool, is_open):
        snap = self.snapshot(name)
        await self.files.flush_all()
        result = await self.mutate_in_thread(snapshots.restore_path, self.db, self.chunk_size,
                                             snap, path, dest, force, is_open)
        await self.sync()
        self._gc_wakeup.set()
        return result

    # ---- background tasks ------------------------------------------------------------------

    def wake_gc(self) -> None:
        self._gc_wakeup.set()

    async def syncer(self) -> None:
        """Bound what a power loss can take to about SYNC_INTERVAL of metadata."""
        while True:
            await trio.sleep(SYNC_INTERVAL)
            if self._unsynced:
                await self.sync()

    async def collector(self) -> None:
        """Reclaim deleted snapshots' versions and purge deleted files, in short batches."""
        while True:
            with self.store.read() as txn:
                busy = gc.pending(txn, self.db)
                token = gc.reclaim_token(txn, self.db)
            if not busy:
                await self._gc_wakeup.wait()
                self._gc_wakeup = trio.Event()
                continue
            try:
                await self._collect(token)
            except FsError as e:
                log.warning("garbage collection paused: %s", e)
                await trio.sleep(10)

    async def _collect(self, token: bytes | None) -> None:
        while not await self.mutate_in_thread(gc.purge_batch, self.db, self.chunk_size):
            await trio.sleep(0)
        if token is None:
            return
        for dbname in gc.RECLAIMED:
            start = None
            while True:
                start = await self.mutate_in_thread(gc.batch, self.db, self.chunk_size,
                                                    dbname, start)
                if start is None:
                    break
                await trio.sleep(0)
        await self.mutate_in_thread(gc.finish_reclaim, self.db, token)
