"""The mounted filesystem's engine: one open store, the rule for who may write when, the
file cache, snapshots, and the background tasks (syncer, garbage collector).

Concurrency rule (see docs/architecture.md): reads are short LMDB read transactions on the
trio thread (microseconds). Every change is a step of a group commit: steps queue while a
commit runs, and the next commit takes them all into one write transaction in one worker
thread call (a synced commit costs an fdatasync, which must never block the trio thread).
Step functions run in that worker thread: they may read trio-side state but must not change
it.
"""

from __future__ import annotations

import errno
import logging
from collections import OrderedDict
from contextlib import contextmanager

import blake3
import lmdb
import trio

from . import gc, snapshots
from . import schema as S
from .filecache import FileCache
from .namespace import FsError, Live, View
from .store import Store, StoreFull

log = logging.getLogger(__name__)

SYNC_INTERVAL = 1.0


class _Step:
    """One operation of a group commit and, once ``done``, its result or error."""
    __slots__ = ("fn", "args", "live", "durable", "done", "result", "error")

    def __init__(self, fn, args, live: bool, durable: bool = False):
        self.fn, self.args, self.live, self.durable = fn, args, live, durable
        self.done = False
        self.result = None
        self.error: BaseException | None = None


class Engine:
    def __init__(self, store: Store):
        self.store = store
        self.db = store.db
        self.chunk_size = store.chunk_size
        self._pending: list[_Step] = []             # steps waiting for the next commit
        self._committing: trio.Event | None = None  # set when the running commit ends
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
                epoch = snapshots.readable_live_epoch(txn, self.db) if self.store.readonly \
                    else self.live
            elif txn.get(S.u64(epoch), db=self.db["snapepochs"]) is None:
                # A snapshot deleted while the kernel still holds its inodes (an open file,
                # a cwd): GC is reclaiming its versions, so what is left would read as holes
                # or other epochs' data. Checked in the reading transaction: no race with GC.
                raise FsError(errno.ESTALE)
            yield View(txn, self.db, epoch, self.chunk_size)

    async def mutate(self, fn, *args):
        """Run ``fn(live, *args)`` as one step of the next group commit (in a worker
        thread); returns its result once the step is committed. A step that raises leaves
        no trace (it runs in a nested transaction)."""
        return await self._submit(_Step(fn, args, live=True))

    async def mutate_in_thread(self, fn, *args):
        """Run ``fn(txn, *args)`` as one step of the next group commit (for big work:
        rollback, restore, GC batches)."""
        return await self._submit(_Step(fn, args, live=False))

    async def sync(self) -> None:
        """Make everything committed durable: a commit that also syncs LMDB's meta page
        (with ``metasync`` off, a commit leaves its meta page unsynced). A read-only mount
        has nothing of its own to make durable and never writes the store: a no-op."""
        if self.store.readonly:
            return
        await self._submit(_Step(None, (), live=False, durable=True))

    async def _submit(self, step: "_Step"):
        """Group commit: steps queue while a batch commits; the first waiting caller then
        commits everything queued in one LMDB transaction, one fdatasync, in a worker thread
        (the transaction begins and ends in that one call, as LMDB requires)."""
        self._pending.append(step)
        while not step.done:
            if self._committing is None:
                self._committing = trio.Event()
                try:
                    batch, self._pending = self._pending, []
                    await trio.to_thread.run_sync(self._commit_batch, batch)
                finally:
                    committing, self._committing = self._committing, None
                    committing.set()
            else:
                await self._committing.wait()
        if step.error is not None:
            raise step.error
        return step.result

    def _commit_batch(self, batch: list["_Step"]) -> None:
        """Synced commits for every step of ``batch``, in order: consecutive ``mutate``
        steps share one write transaction (each in a nested one); a ``mutate_in_thread``
        step (GC batches, snapshots, rollback: cursors walking tables they change) gets a
        transaction of its own. A durable step also syncs the meta page."""
        try:
            group: list[_Step] = []
            for step in batch:
                if step.fn is None:
                    continue
                if step.live:
                    group.append(step)
                    continue
                self._commit_group(group)
                group = []
                try:
                    with self.store.write() as txn:
                        step.result = step.fn(txn, *step.args)
                except StoreFull as e:
                    step.error = FsError(errno.ENOSPC, str(e))
                except Exception as e:
                    step.error = e
            self._commit_group(group)
            if any(step.durable for step in batch):
                self.store.sync()
            self._unsynced = not any(step.durable for step in batch)
        except StoreFull as e:
            for step in batch:
                step.error = step.error or FsError(errno.ENOSPC, str(e))
        except BaseException as e:
            for step in batch:
                step.error = step.error or e
        for step in batch:
            step.done = True

    def _commit_group(self, group: list["_Step"]) -> None:
        if group:
            with self.store.write() as txn:
                for step in group:
                    self._run_step(txn, step)

    def _run_step(self, txn, step: "_Step") -> None:
        try:
            with self.store.env.begin(write=True, parent=txn, buffers=True) as child:
                step.result = step.fn(Live(child, self.db, self.live, self.chunk_size),
                                      *step.args)
        except lmdb.MapFullError as e:
            step.error = FsError(errno.ENOSPC, f"store map is full: {e}")
        except Exception as e:
            step.error = e

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
            snap = await self.mutate_in_thread(self._create_snapshot, name)
        finally:
            self.files.thaw()
        await self.sync()
        return snap

    def _create_snapshot(self, txn, name: str) -> S.Snapshot:
        """A step of a group commit: steps after it in the batch write the new live epoch."""
        gc.settle_purges(txn, self.db, self.chunk_size)
        snap = snapshots.create(txn, self.db, name)
        self.live = snap.epoch + 1
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
        snap = await self.mutate_in_thread(snapshots.delete, self.db, name, force)
        self._gc_wakeup.set()
        return snap

    async def hold(self, mirror_uuid: bytes, name: str, label: str) -> None:
        await self.mutate_in_thread(snapshots.set_hold, self.db, mirror_uuid, name, label)

    async def forget_mirror(self, label: str) -> int:
        return await self.mutate_in_thread(snapshots.drop_holds, self.db, label)

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
