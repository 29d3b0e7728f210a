"""The mounted filesystem's engine: one open store, the rule for who may write when, the
file cache, snapshots, and the background tasks (syncer, garbage collector).

Concurrency rule (see docs/architecture.md): every change is a step for the committer
(mountfs.committer), the one thread that writes the store, in the writer process
(mountfs.writer): a step is applied to the open write transaction and answered at once;
the transaction is committed within COMMIT_DELAY, and at once for fsync, a snapshot or
unmount. Reads are short LMDB read transactions on the trio thread (microseconds); a read of
what an uncommitted change wrote (its marks) is done by the writer (a file's data:
``read_uncommitted``) or after it commits (``look``), so a caller always reads what the calls
answered before it made. Steps are data (a module-level
function and plain arguments): they run in another process.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
from collections import OrderedDict

import blake3
import trio

from . import chunkfile, gc, snapshots
from . import schema as S
from .committer import COMMIT, LIVE, LOOK, SYNC, TXN, Step, mispredicted
from .filecache import INLINE_HASH, FileCache
from .mapread import resident
from .namespace import FsError, Live, View
from .newdirs import NewDirs
from .store import Store
from .writer import RAW_BYTES, WriterProcess

log = logging.getLogger(__name__)

SYNC_INTERVAL = 1.0
KNOWN_EMPTY_ENTRIES = 256  # Engine.known_empty looks at most at this many committed entries
KNOWN_EMPTY_MARKS = 4096   # and at most at this many uncommitted marks
INO_BLOCK = 1024    # inode numbers reserved at once for posted creates (a remount leaves
                    # the rest of a block unused: 2^40 numbers make that harmless)
POSTED_BYTES = 32 << 20     # chunk data posted and not yet applied, at most: past it a
                            # flush waits for its step, so a fast writer is held back by the
                            # store (and buffered data stays within filecache's bound). Four
                            # of filecache's 8 MiB steps: at 8 MiB a second step waited for
                            # the first to run, and a 1 GiB write made 788 MB/s, not 848
                            # (docs/benchmarks.md, thirty-third round); half the ring
GC_GATHER = 1.0     # s: the collector waits this long after a wake-up, so that the deletes
                    # of a second share its batches (each batch is a commit of its own)


_IN_A_THREAD = object()     # Engine.verify: the chunks are to be checked in a worker thread


def _in_memory(blobs: list) -> bool:
    """Whether every page of these blobs is in the page cache (a missing blob needs no
    reading to be reported)."""
    return all(resident(blob) for blob in blobs if blob is not None)


class Engine:
    def __init__(self, store: Store):
        self.store = store
        self.db = store.db
        self.chunk_size = store.chunk_size
        self._uncommitted = 0                       # live steps sent, not yet committed
        self._dirty: dict = {}                      # mark -> transaction that changed it last
        self._dirty_in: dict[int, list] = {}        # transaction -> marks of its steps
        self._records: dict = {}                    # what the last change of a dirty mark
                                                    # wrote (see Step.records; an inode's
                                                    # record packed as the writer told it,
                                                    # or unpacked: ``known_inode``)
        self._posted: dict = {}                     # mark -> posted steps not yet run
        self._inflight = 0                          # awaited changes sent, not answered
        self._posted_bytes = 0                      # chunk data of posted steps not yet run
        self._inos = range(0)                       # reserved numbers for posted creates
        self._last_post: tuple | None = None        # (step, fn, marks) of the last change
                                                    # posted (``post``)
        self.changes = 0                            # live changes and TXN steps sent, and
                                                    # awaited ones answered, so far
        self._absent: tuple | None = None           # (parent, name, changes): note_absent
        self.new_dirs = NewDirs()                   # negative lookups answered from memory
        with store.read() as txn:
            self.live = store.live_epoch(txn)       # a TXN step's reply moves it on
        self._committer = None if store.readonly else \
            WriterProcess(store, self._committed, self._ran, relay=self._relay)
        self._token: trio.lowlevel.TrioToken | None = None
        self.files = FileCache(self)
        self._rolling = trio.Lock()                 # one rollback at a time
        self._unsynced = False
        self._gc_wakeup = trio.Event()
        self._verified: OrderedDict[bytes, None] = OrderedDict()   # digests checked once

    # ---- chunk verification ----------------------------------------------------------------

    VERIFIED_CACHE = 1 << 16

    def unverified(self, view: View, ino: int, off: int, size: int) -> list[tuple[bytes, int]]:
        """(digest, length) of the stored chunks under [off, off + size) not yet checked."""
        cs, out = self.chunk_size, []
        for idx in range(off // cs, (off + max(size, 1) - 1) // cs + 1):
            c = view.chunk(ino, idx)
            if c is not None and c[0] not in self._verified:
                out.append(c)
        return out

    async def verify(self, epoch: int | None, ino: int, off: int, size: int) -> None:
        """Check the chunks under [off, off + size) of ``ino`` as of ``epoch`` against their
        digests before they are first served; a mismatch is EIO, never wrong data. Checked
        digests are remembered. The chunk map and the data are read in one transaction: a
        chunk rewritten meanwhile is checked as it is now, so a blob missing here is missing
        from a map that names it, which only corruption does.

        Where: on this thread when the chunks are small (INLINE_HASH, by the lengths the
        chunk map records) and in memory (``mapread.resident``), else in a worker thread,
        which may wait for the disk. This thread then waits at most for a small blob's first
        page, as for any metadata read (LMDB reads it to learn the value's length; the page
        cache reads around it). A first read of a small file (git's loose objects, a source
        tree) so costs no thread hop: a git checkout made 838 such round trips
        (docs/benchmarks.md, eighth round)."""
        def check(v, inline: bool):
            pending = self.unverified(v, ino, off, size)
            digests = [digest for digest, _ in pending]
            if inline and sum(length for _, length in pending) > INLINE_HASH:
                return _IN_A_THREAD, digests
            blobs = [chunkfile.get(v.txn, v.db, digest) for digest in digests]
            if inline and not _in_memory(blobs):
                return _IN_A_THREAD, digests
            return _first_corrupt(digests, blobs), digests
        bad, digests = await self.look(lambda v: check(v, True), epoch, marks=(ino,))
        if bad is _IN_A_THREAD:
            bad, digests = await self.look(lambda v: check(v, False), epoch, io=True,
                                           marks=(ino,))
        _refuse_corrupt(bad)
        self._remember_verified(digests)

    def _remember_verified(self, digests: list[bytes]) -> None:
        for digest in digests:
            self._verified[digest] = None
            self._verified.move_to_end(digest)
        while len(self._verified) > self.VERIFIED_CACHE:
            self._verified.popitem(last=False)

    # ---- transactions ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer process (in trio: its replies are delivered to this loop). A
        read-only mount has none."""
        self._token = trio.lowlevel.current_trio_token()
        if self._committer is not None:
            self._committer.start()

    def close(self) -> None:
        """Commit what is open and stop the writer (idempotent); after trio has ended, or
        outside it."""
        if self._committer is not None:
            self._committer.stop()

    def _view(self, txn, epoch: int | None) -> View:
        if epoch is None:
            # a read-only mount follows a store another process writes (a mirror)
            epoch = snapshots.readable_live_epoch(txn, self.db) if self.store.readonly \
                else self.live
        elif txn.get(S.u64(epoch), db=self.db["snapepochs"]) is None:
            # A snapshot deleted while the kernel still holds its inodes (an open file,
            # a cwd): GC is reclaiming its versions, so what is left would read as holes
            # or other epochs' data. Checked in the reading transaction: no race with GC.
            raise FsError(errno.ESTALE)
        return View(txn, self.db, epoch, self.chunk_size)

    def uncommitted(self, mark) -> bool:
        """Whether an answered change not yet committed wrote ``mark``."""
        return bool(self._uncommitted) and self.dirty(mark)

    def dirty(self, mark) -> bool:
        """Whether an answered, uncommitted change wrote ``mark`` (committer.marks_of)."""
        return mark in self._dirty or mark in self._posted

    async def inode(self, ino: int) -> S.Inode:
        """The live record of ``ino`` (ENOENT if none): the one an uncommitted step wrote
        last, if it did, without going through the committer."""
        rec = self.known_inode(ino)
        if rec is not None:
            return rec
        return await self.look(lambda v: v.get(ino), marks=(ino,))

    def known_inode(self, ino: int) -> S.Inode | None:
        """The live record of ``ino`` if it is known without asking the committer: the
        committed one, or the one the last uncommitted change wrote (or, posted, will
        write); None if only the committer knows it."""
        if self._uncommitted and (ino in self._dirty or ino in self._posted):    # dirty()
            rec = self._records.get(ino)
            if type(rec) is bytes:          # as the writer told it (``_note``): once
                rec = self._records[ino] = S.Inode.unpack(rec)
            return rec
        return self._look_now(lambda v: v.get(ino), None)

    async def look(self, fn, epoch: int | None = None, io: bool = False, marks=None):
        """``fn(view)`` of the tree at ``epoch`` (None: live), as the calls answered so far
        left it. ``marks``: everything ``fn`` reads of the live tree (None: unknown). If an
        uncommitted change wrote any of it, the writer commits first (its open transaction
        is its own: LMDB's readers see committed ones only); it is rare, since what a change
        wrote is mostly answered from its records (``known_inode``, ``known_entry``). Then
        ``fn`` runs here on the committed tree, or in a worker thread with ``io`` (reads
        that may wait for the disk, such as whole chunks). ``fn`` must not touch trio
        state."""
        if epoch is None and self._uncommitted and self._committer.failed is None and (
                marks is None or any(map(self.dirty, marks))):
            await self._submit(Step(COMMIT))
        if io:
            return await trio.to_thread.run_sync(self._look_now, fn, epoch)
        return self._look_now(fn, epoch)

    def _look_now(self, fn, epoch: int | None):
        with self.store.read() as txn:
            return fn(self._view(txn, epoch))

    async def read_uncommitted(self, ino: int, off: int, end: int, size: int) -> bytes:
        """Bytes [off, end) of live file ``ino`` (of ``size``) as stored, read by the writer
        in its open transaction (for a file an uncommitted change wrote: a read right after
        a write would otherwise cost a synced commit). The writer checks each chunk's digest
        there, so what it sends back counts as checked (``verify``)."""
        bad, data, digests = await self._submit(Step(LOOK, _checked_read, (ino, off, end, size)))
        _refuse_corrupt(bad)
        self._remember_verified(digests)
        return data

    async def mutate(self, fn, *args, nbytes: int = 0):
        """Run ``fn(live, *args)`` as a step of the open transaction (in the committer's
        thread); returns its result once applied: committed within COMMIT_DELAY, durable
        once synced. ``nbytes``: chunk data it writes (bounds a transaction). A step that
        raises leaves no trace (it runs in a nested transaction)."""
        return await self._submit(Step(LIVE, fn, args, nbytes))

    def note_absent(self, parent: int, name: bytes, since: int) -> None:
        """A lookup found no live ``parent``/``name`` in a tree read when ``changes`` was
        ``since``: until it moves on (a change sent, or an awaited one answered: one sent
        before the read may have reached the tree only after it), ``known_entry`` answers
        so without reading it again (a create follows the kernel's lookup of its name)."""
        self._absent = (parent, name, since)

    def known_entry(self, parent: int, name: bytes) -> tuple[bool, int | None]:
        """``(True, child)`` (None: no such name) if the live entry parent/name is known
        without asking the committer, else ``(False, None)``."""
        if self._absent == (parent, name, self.changes):
            return True, None
        if self._uncommitted and self.dirty((parent, name)):
            child = self._records.get((parent, name))
            return (False, None) if child is None else (True, child or None)
        return True, self._look_now(lambda v: v.lookup(parent, name), None)

    def known_empty(self, ino: int) -> bool | None:
        """Whether directory ``ino`` has no entries, if that is known without asking the
        committer (None if not): it has one if an uncommitted change added one, or if a
        committed entry is one no such change touched; it has none if every committed
        entry was removed by such a change, and none added one. Bounded: past
        KNOWN_EMPTY_MARKS uncommitted marks or KNOWN_EMPTY_ENTRIES committed entries
        removed, it is not known."""
        changed = {}                # name -> the inode an uncommitted change left (0: none)
        if self._uncommitted and self.dirty(("ls", ino)):
            if len(self._dirty) + len(self._posted) > KNOWN_EMPTY_MARKS:
                return None
            for mark in itertools.chain(self._dirty, self._posted):
                if type(mark) is tuple and mark[0] == ino:
                    changed[mark[1]] = self._records.get(mark)
            if any(changed.values()):
                return False
            if None in changed.values():
                return None

        def committed_entry_left(view) -> bool | None:
            names = (name for name, _ in view.listdir(ino))
            for name in itertools.islice(names, KNOWN_EMPTY_ENTRIES):
                if name not in changed:
                    return True
            return None if next(names, None) is not None else False
        left = self._look_now(committed_entry_left, None)
        return None if left is None else not left

    def take_ino(self) -> int | None:
        """An unused inode number for a posted create; None when the reserved block is
        used up (``reserve_inos``)."""
        if not self._inos:
            return None
        ino, self._inos = self._inos[0], self._inos[1:]
        return ino

    async def reserve_inos(self) -> None:
        """Reserve the next block of inode numbers (one awaited step per INO_BLOCK)."""
        self._inos = await self.mutate(Live.reserve_inos, INO_BLOCK)

    def can_post(self, nbytes: int = 0) -> bool:
        """Whether a change (writing ``nbytes`` of chunk data) may be answered before it is
        even applied (``post``): no awaited change is on its way, so what the trio thread
        knows of the tree is what the committer will have when it reaches the posted
        step; the committer answers before commits (enough free disk, no failed commit);
        and the posted steps' data stays within POSTED_BYTES."""
        return not self._inflight and self._committer is not None and \
            self._committer.answers_early() and \
            (not nbytes or self._posted_bytes + nbytes <= POSTED_BYTES)

    def post(self, fn, *args, marks, records: dict | None = None, nbytes: int = 0,
             merge=None) -> None:
        """Queue ``fn(live, *args)`` as a step and return at once: for changes whose
        outcome the caller already knows (creates, unlinks, attributes, a closed file's
        chunks), so the call is answered without a round trip to the committer. Only when
        ``can_post()``.

        ``marks``: every mark of what the step changes that a read may consult (see
        ``committer.marks_of``; the mepoch of ancestors excepted: ``changed_since_snapshot``
        counts posted steps). Reads of them go through the committer, which runs them
        after the step, until it has run. ``records``: what the step will write, as
        ``known_inode`` and ``known_entry`` answer meanwhile: inode -> its record,
        (directory, name) -> the inode it names (0: none). A mark without one is read
        through the committer. A posted step that fails is a change lost after its
        answer, like a failed commit: the committer then refuses every later change.

        ``merge(args, later)``: the arguments of one change doing what ``fn`` with ``args``
        then with ``later`` do, or None. With it, a change posted right after another of
        ``fn`` with the same marks becomes one with it (tar's three SETATTRs of a file
        become one).

        A change posted while the step posted last is not yet sent joins that step
        (``_joined``), unless its chunk data travels raw: one step per batch, not per
        change, to frame, run, tell and note (a created file's create and its data were
        two). The writer runs a step in a nested transaction of its own, so a change
        that fails there takes those it joined with it: both are lost changes after their
        answers, and the mount refuses every later change either way."""
        records = records or {}
        if merge is not None and self._merged(fn, args, marks, records, merge):
            return
        step = self._committer.held()
        if step is not None and nbytes < RAW_BYTES:
            _join(step, fn, args, marks, nbytes)
            step.predicted.update(records)
        else:
            step = Step(LIVE, fn, args, nbytes, posted=marks)
            step.predicted = dict(records)
            self._committer.post(step)  # first: a step that is not data goes no further
                                        # (or, framed later, fails as a lost change)
            self._uncommitted += 1
        self._last_post = (step, fn, marks)
        self.changes += 1
        self._posted_bytes += nbytes
        for mark in marks:
            self._posted[mark] = self._posted.get(mark, 0) + 1
            self._records.pop(mark, None)
        self._records.update(records)

    def _last_held(self) -> tuple | None:
        """(step, fn, marks) of the change posted last, if its step is not yet sent."""
        last = self._last_post
        if last is None or self._committer is None or last[0] is not self._committer.held():
            return None
        return last

    def _merged(self, fn, args, marks, records, merge) -> bool:
        """Make the change one with the change posted last if that is ``fn``'s, with the
        same marks, and not yet sent (see ``post``)."""
        last = self._last_held()
        if last is None or last[1] is not fn or last[2] != marks:
            return False
        step = last[0]
        joined = merge(_last_args(step), args)
        if joined is None:
            return False
        _set_last_args(step, joined)
        step.predicted.update(records)
        self.changes += 1
        self._records.update(records)
        return True

    def amend_held(self, fn, mark, change) -> bool:
        """Have the change posted last do more while it is not yet sent: if it is ``fn``'s
        with ``mark`` its first mark, its arguments become ``change(args)`` (None: leave
        it). The record it was answered with for ``mark`` goes, so that reads of ``mark``
        wait for its step. No name changes (``changes`` stays). Whether it changed."""
        last = self._last_held()
        if last is None or last[1] is not fn or not last[2] or last[2][0] != mark:
            return False
        step = last[0]
        args = change(_last_args(step))
        if args is None:
            return False
        _set_last_args(step, args)
        step.predicted.pop(mark, None)
        self._records.pop(mark, None)
        return True

    async def mutate_in_thread(self, fn, *args):
        """Run ``fn(txn, dbs, *args)`` in a transaction of its own, committed before it
        returns (for big work: snapshots, rollback, restore, GC batches)."""
        return await self._submit(Step(TXN, fn, args))

    async def commit(self) -> None:
        """Commit every answered change now (another process is about to read the store)."""
        if not self.store.readonly:
            await self._submit(Step(COMMIT))

    async def sync(self) -> None:
        """Make every answered change durable: commit, and sync LMDB's meta page (with
        ``metasync`` off a commit leaves it unsynced). A read-only mount has nothing of its
        own to make durable and never writes the store: a no-op."""
        if not self.store.readonly:
            await self._submit(Step(SYNC))
            self._unsynced = False

    async def _submit(self, step: Step):
        finished = trio.Event()
        step.done = lambda _step: self._replied(step, finished)
        self._committer.put(step)      # first: a step that is not data goes no further
        if step.kind in (LIVE, TXN):
            self.changes += 1
        if step.kind != LOOK:
            self._inflight += 1
        if step.kind == LIVE:
            self._uncommitted += 1
        await finished.wait()
        if step.error is not None:
            raise step.error
        return step.result

    def _replied(self, step: Step, finished: trio.Event) -> None:
        """On the trio thread, before the caller sees the reply: remember what the step
        wrote until its transaction commits. A change is counted again now: a lookup made
        while it was on its way read the tree without it (``note_absent``)."""
        if step.kind in (LIVE, TXN):
            self.changes += 1
        if step.kind != LOOK:
            self._inflight -= 1
        if step.kind == TXN and step.error is None:
            self.live = step.live       # before any later change is answered
        self._note(step)
        finished.set()

    def _relay(self, fn, *args) -> None:
        """How the writer's callbacks reach the trio thread from elsewhere (its reader
        thread outside trio, steps failed on their way): ``fn(*args)`` there, soon."""
        _post(self._token, fn, *args)

    def _ran(self, steps: list[Step], committed: int) -> None:
        """On the trio thread once posted steps have run (``committed``: the transaction
        whose commit is told right after, 0: none): their marks are now the ones
        they reported, and their records the ones they wrote (unless a later posted step
        will write them again). Steps of transaction ``committed`` are committed already
        (told in the same frame, mostly all of them): nothing of theirs is left to note.
        Then the records a step was answered with that no mark holds any more go (a step
        that failed wrote nothing, so noting it keeps none of them)."""
        for step in steps:
            self._posted_bytes -= step.nbytes
            for mark in step.posted:
                left = self._posted[mark] - 1
                if left:
                    self._posted[mark] = left
                else:
                    del self._posted[mark]
        for step in steps:
            if not (committed and step.txn_no == committed):
                self._note(step)
            self._forget_records(step)      # after _note: only what nothing holds
            wrong = mispredicted(step)
            if wrong and step.error is None:
                log.error("a posted change answered records that differ from what it wrote "
                          "(%s): a bug; its callers may have seen wrong attributes", wrong)

    def _note(self, step: Step) -> None:
        """Remember what a step wrote until its transaction commits. Records that a step
        still queued will write keep that step's version."""
        if not step.marks:
            return
        for mark in step.marks:
            self._dirty[mark] = step.txn_no
            if mark not in self._posted:
                self._records.pop(mark, None)
        self._dirty_in.setdefault(step.txn_no, []).extend(step.marks)
        self._records.update((ino, raw) for ino, raw in step.records.items()
                             if raw is not None and ino not in self._posted)

    def _forget_records(self, step: Step) -> None:
        """Forget the records of ``step``'s marks (written or posted) that neither an
        uncommitted change (dirty) nor a posted step holds: what noting and committing the
        step would leave of them."""
        for mark in itertools.chain(step.posted, step.marks):
            if mark not in self._posted and mark not in self._dirty:
                self._records.pop(mark, None)

    def _committed(self, steps: int, txn_no: int) -> None:
        """On the trio thread, after each commit (or a refused live step)."""
        if not steps:
            return
        self._uncommitted -= steps
        self._unsynced = True
        for mark in self._dirty_in.pop(txn_no, ()):
            if self._dirty.get(mark) == txn_no:
                del self._dirty[mark]
                if mark not in self._posted:
                    self._records.pop(mark, None)

    async def remove_orphans(self) -> int:
        """Delete inodes left unlinked-but-open by a process that died."""
        return await self.mutate(_destroy_all_orphans)

    # ---- snapshots -------------------------------------------------------------------------

    async def create_snapshot(self, name: str) -> S.Snapshot:
        snapshots.validate_name(name)
        await self.files.freeze()
        try:
            snap = await self.mutate_in_thread(_create_snapshot, self.chunk_size, name)
        finally:
            self.files.thaw()
        await self.sync()
        return snap

    async def changed_since_snapshot(self) -> bool:
        """Whether anything changed since the newest snapshot there is: O(1), the root's
        mepoch against that snapshot's epoch (not the live epoch's start: after the newest
        snapshot is deleted, what only it held counts as changed again). Buffered writes
        not yet committed are counted in ``files.dirty_bytes``; a posted step, which raises
        the mepoch of ancestors it does not mark, is a change."""
        if self._posted:
            return True

        def root_and_newest(v):
            return v.get(S.ROOT_INO).mepoch, snapshots.newest_epoch(v.txn, self.db)
        mepoch, newest = await self.look(root_and_newest, marks=(S.ROOT_INO,))
        return mepoch >= self.live if newest is None else mepoch > newest

    def list_snapshots(self) -> list[S.Snapshot]:
        with self.store.read() as txn:
            return snapshots.list_all(txn, self.db)

    def snapshot(self, name: str) -> S.Snapshot:
        with self.store.read() as txn:
            return snapshots.get(txn, self.db, name)

    async def delete_snapshot(self, name: str, force: bool = False) -> S.Snapshot:
        snap = await self.mutate_in_thread(snapshots.delete, name, force)
        self._gc_wakeup.set()
        return snap

    async def hold(self, mirror_uuid: bytes, name: str, label: str) -> None:
        await self.mutate_in_thread(snapshots.set_hold, mirror_uuid, name, label)

    async def forget_mirror(self, label: str) -> int:
        return await self.mutate_in_thread(snapshots.drop_holds, label)

    async def rollback(self, name: str, force: bool, tell_kernel=None) -> snapshots.Rollback:
        """Roll the live tree back to snapshot ``name``, the open files with it, and have
        ``tell_kernel(inodes, entries)`` (Operations.invalidate) tell the kernel what
        changed behind its back before this returns. Writes are held and every open file's
        commit lock taken across the rollback, so that no write, commit or truncation of
        an open file crosses it; then each open file takes its rolled-back record, its
        buffered writes dropped (``FileCache.rolled_back``). Without ``force``, everything
        buffered is committed first, so that the rollback refuses to lose it. Until the
        kernel holds the new size of an open file the rollback changed, it places writes
        to the file by the old one: they are dropped, as made before the rollback
        (``FileCache.behind``, which ``tell_kernel`` empties)."""
        snap = self.snapshot(name)
        files = self.files
        async with self._rolling, self._behind_the_kernel():
            await files.hold()
            try:
                if not force:
                    await files.flush_all()
                locked: set = set()
                async with contextlib.AsyncExitStack() as stack:
                    await files.lock_all(stack, locked)
                    done = await self.mutate_in_thread(snapshots.rollback, self.chunk_size,
                                                       snap, force)
                    await files.lock_all(stack, locked)        # files opened meanwhile
                    inos = [of.ino for of in locked]
                    records = await self.look(lambda v: {ino: v.inode(ino) for ino in inos},
                                              marks=inos)
                    done.inodes |= files.rolled_back(locked, records)
                files.behind = {of.ino for of in locked} & done.inodes
            finally:
                files.thaw()
            try:
                if tell_kernel is not None:
                    await tell_kernel(done.inodes, done.entries)
            finally:
                files.behind.clear()
        await self.sync()
        self._gc_wakeup.set()
        return done

    @contextlib.asynccontextmanager
    async def _behind_the_kernel(self):
        """Around a change of live names that no call of the mount's makes (rollback,
        restore): the names known in memory (``new_dirs``) are dropped before and after,
        and none are taken up meanwhile."""
        self.new_dirs.behind(starting=True)
        try:
            yield
        finally:
            self.new_dirs.behind(starting=False)

    async def restore_path(self, name: str, path: str, dest: str, force: bool):
        """``snapshots.restore_path`` on the mount: the inodes it replaced stay orphans
        (in the result) for the caller to delete once the kernel does not hold them."""
        snap = self.snapshot(name)
        await self.files.flush_all()
        async with self._behind_the_kernel():
            result = await self.mutate_in_thread(snapshots.restore_path, self.chunk_size,
                                                 snap, path, dest, force, True)
        await self.sync()
        self._gc_wakeup.set()
        return result

    # ---- background tasks ------------------------------------------------------------------

    def wake_gc(self) -> None:
        self._gc_wakeup.set()

    async def syncer(self) -> None:
        """Bound what a power loss can take to about SYNC_INTERVAL of metadata. A sync that
        fails (a commit failed: the disk) is logged once per reason, never the mount's end:
        reads go on, and each call that needs the writer gets the error itself. Once the
        writer process is gone (logged then), there is nothing left to sync."""
        reported = None
        while self._committer.failed is None:
            await trio.sleep(SYNC_INTERVAL)
            if not self._unsynced:
                continue
            try:
                await self.sync()
            except FsError as e:
                if self._committer.failed is None and str(e) != reported:
                    log.error("could not sync the store: %s", e)
                    reported = str(e)

    async def collector(self) -> None:
        """Reclaim deleted snapshots' versions and purge deleted files, in short batches."""
        while True:
            busy, token = await self.look(
                lambda v: (gc.pending(v.txn, self.db), gc.reclaim_token(v.txn, self.db)))
            if not busy:
                await self._gc_wakeup.wait()
                self._gc_wakeup = trio.Event()
                await trio.sleep(GC_GATHER)
                continue
            try:
                await self._collect(token)
            except FsError as e:
                if self._committer.failed is not None:      # logged when it failed
                    return
                log.warning("garbage collection paused: %s", e)
                await trio.sleep(10)

    async def _collect(self, token: bytes | None) -> None:
        while not await self.mutate_in_thread(gc.purge_batch, self.chunk_size):
            await trio.sleep(0)
        if token is None:
            return
        for dbname in gc.RECLAIMED:
            start = None
            while True:
                start = await self.mutate_in_thread(gc.batch, self.chunk_size,
                                                    dbname, start)
                if start is None:
                    break
                await trio.sleep(0)
        await self.mutate_in_thread(gc.finish_reclaim, token)


def _post(token: trio.lowlevel.TrioToken, fn, *args) -> None:
    """Run ``fn`` on the trio thread; once trio has ended (the committer's last commit at
    close, after an error) there is nobody left to tell."""
    try:
        token.run_sync_soon(fn, *args)
    except trio.RunFinishedError:
        pass


def _joined(live: Live, calls: list) -> None:
    """A posted step made of several changes posted one after the other (``Engine.post``):
    ``calls``, (function, arguments) each, in order."""
    for fn, args in calls:
        fn(live, *args)


def posted_calls(step: Step) -> list:
    """The changes a posted step makes, (function, arguments) each, in order."""
    return step.args[0] if step.fn is _joined else [(step.fn, step.args)]


def _join(step: Step, fn, args: tuple, marks, nbytes: int) -> None:
    """Have ``step``, posted and not yet sent, make the change ``fn(live, *args)`` too,
    after its own."""
    if step.fn is not _joined:
        step.fn, step.args = _joined, ([(step.fn, step.args)],)
        step.posted = list(step.posted)
    step.args[0].append((fn, args))
    step.posted.extend(marks)
    step.nbytes += nbytes


def _last_args(step: Step) -> tuple:
    return step.args[0][-1][1] if step.fn is _joined else step.args


def _set_last_args(step: Step, args: tuple) -> None:
    if step.fn is _joined:
        calls = step.args[0]
        calls[-1] = (calls[-1][0], args)
    else:
        step.args = args


def _destroy_all_orphans(live: Live) -> int:
    """A step: delete every inode marked orphan; how many."""
    orphans = [S.from_u64(k) for k, _ in live.txn.cursor(db=live.db["orphans"])]
    for ino in orphans:
        live.destroy(ino)
    return len(orphans)


def _create_snapshot(txn, dbs, chunk_size: int, name: str) -> S.Snapshot:
    """A TXN step: settle the purges of deleted files, then take the snapshot (the steps
    after it write the new live epoch, the step's ``live``)."""
    gc.settle_purges(txn, dbs, chunk_size)
    return snapshots.create(txn, dbs, name)


def _checked_read(view: View, ino: int, off: int, end: int, size: int):
    """A LOOK step: ``(None, bytes [off, end) of ino, digests of the chunks under them)``
    with every such chunk checked against its digest, or ``(the digest of one that is
    corrupt or missing, None, None)``."""
    cs = view.chunk_size
    chunks = (view.chunk(ino, idx) for idx in range(off // cs, (end - 1) // cs + 1))
    digests = [c[0] for c in chunks if c is not None]
    bad = _first_corrupt(digests, [chunkfile.get(view.txn, view.db, d) for d in digests])
    if bad is not None:
        return bad, None, None
    return None, view.read(ino, off, end - off, size), digests


def _first_corrupt(digests: list[bytes], blobs: list) -> bytes | None:
    """The first of ``digests`` whose blob is missing (None) or does not hash to it."""
    for digest, data in zip(digests, blobs):
        if data is None or blake3.blake3(data).digest() != digest:
            return digest
    return None


def _refuse_corrupt(bad: bytes | None) -> None:
    """EIO (and a log line) for a chunk found corrupt or missing, never its data."""
    if bad is not None:
        log.error("chunk %s is corrupt or missing in the store; run 'mountfs fsck'",
                  bad.hex())
        raise FsError(errno.EIO, f"chunk {bad.hex()} is corrupt")
