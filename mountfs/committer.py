"""The one thread that writes a mounted store: group commit on a short timer. It runs in the
writer process (mountfs.writer), which the mount feeds with steps.

Why a thread of its own: a change that waits for its synced commit before its reply costs a
serial workload (tar, git, cp: one call after another, nothing to group) an fdatasync per
call. Here a change is applied to a write transaction kept open across calls and answered
at once; the transaction is committed (synced: LMDB's data pages reach the disk before the
meta page that points at them, so a power loss never breaks the store) at most
COMMIT_DELAY after it began, and at once when a caller needs durability (fsync, a snapshot,
unmount). LMDB ties a write transaction to the thread that began it, hence one thread.

Rules (the engine keeps them):
* changes run in submission order, so a crash keeps a prefix of the calls that returned;
* a change not yet committed is seen only inside the open transaction: each live step
  reports what it wrote as *marks* (an inode's records, a directory entry, a directory's
  listing), and the mount reads anything marked by an uncommitted step through a LOOK
  step (a file's data) or once it is committed (``Engine.look``), the rest from the
  committed tree at once;
* below DEFER_MARGIN of free disk every step waits for its commit, so a full disk fails
  the call that caused it (ENOSPC) instead of a commit after the reply; such a commit is
  tried once more after finishing the purge of deleted files and
  ``Store.release_freed_pages`` (the pages a delete just freed are LMDB's to reuse only a
  transaction later; ``_make_room``). A commit that still
  fails after replies went out loses those changes (as a crash would): the committer then
  refuses every later step, and the mount must be remounted;
* the bucket hashes of what the open transaction wrote are folded in once, just before it
  commits (buckets.Deferred): an item written five times costs one pair of hashes. Inside
  the open transaction they are stale; nothing reads them there (snapshots, verify and
  fsck read committed epochs);
* a *posted* step (Engine.post) is answered before it runs, by a caller that knows its
  outcome; if it fails all the same, that too is an answered change lost: the committer
  refuses every later step;
* posted steps wait in a batch that does not wake this thread (``Committer.post``): they
  run together COMMIT_DELAY after the first, before the next step somebody waits for, or
  once BATCH_STEPS wait, and commit by that deadline. Waking the thread per step cost the
  two threads a GIL hand-off each time (futex wake-ups, context switches): on a git
  checkout the serving thread's CPU fell by a fifth and the committer's by a third
  without them.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import queue
import threading
import time

import lmdb

from . import buckets, gc
from . import schema as S
from .namespace import FsError, Live, View
from .store import Store, StoreError, StoreFull
from .units import env_duration

log = logging.getLogger(__name__)

# s: the longest a returned change waits for its commit (tests set an hour: then only
# fsync, snapshots and unmount commit, and every read of an answered change must find it
# through its marks)
COMMIT_DELAY = env_duration("MOUNTFS_COMMIT_DELAY", "0.005", zero=True)
TXN_BYTES = 32 << 20        # chunk data that makes a transaction commit early
TXN_STEPS = 5000            # steps that make a transaction commit early
BATCH_STEPS = 256           # posted steps that make their batch run early (Committer.post)
DEFER_MARGIN = 256 << 20    # less free disk than this: every step waits for its commit
PURGE_CHUNKS = 64           # chunks a purge batch drops when a full disk waits for it: small
                            # transactions, which find room where a large one would not

LIVE, TXN, COMMIT, SYNC, LOOK = "live", "txn", "commit", "sync", "look"


class Step:
    """One item for the committer and, once ``done`` is called, its result or error.

    LIVE: ``fn(live, *args)`` in the open transaction (a nested one, so a step that raises
    leaves no trace); TXN: ``fn(txn, dbs, *args)`` in a transaction of its own (snapshots,
    GC, rollback: cursors over the tables they change), committed before the reply; COMMIT
    and SYNC: commit what is open (SYNC also syncs LMDB's meta page); LOOK: ``fn(view,
    *args)`` on the live tree as the open transaction has it (a ``namespace.View``).

    Steps are data, since they go to another process (mountfs.writer): a module-level
    function and plain arguments, with plain results and errors; never a closure over the
    caller's state."""
    __slots__ = ("kind", "fn", "args", "nbytes", "posted", "result", "error", "replied",
                 "done", "marks", "records", "writes", "predicted", "txn_no", "live", "seq")

    def __init__(self, kind: str, fn=None, args=(), nbytes: int = 0, posted=None,
                 done=None):
        self.kind, self.fn, self.args, self.nbytes = kind, fn, args, nbytes
        self.posted = posted        # a live step nobody waits for (Engine.post): its marks
        self.result = None
        self.error: BaseException | None = None
        self.replied = False
        self.done = done            # called in the committer thread: must be thread-safe
        self.marks: set = set()     # what a live step wrote (see marks_of)
        self.records: dict = {}     # what it wrote last: inode -> its record (packed;
                                    # None: gone); (directory, name) -> the inode (0: none)
        self.writes: list | None = None     # (db, key, value) written, until marks and
                                            # records are made of them (Committer.noted)
        self.txn_no = 0             # the transaction a live step ran in
        self.predicted: dict = {}   # a posted step: the records its caller answered with
                                    # (inode -> S.Inode, its mepoch aside; entries as in
                                    # ``records``): see ``mispredicted``
        self.live = 0               # a TXN step: the live epoch it left; a LIVE step: the
                                    # live epoch it ran in
        self.seq = 0                # its number between the mount and the writer process


def mispredicted(step: Step) -> list:
    """The keys of the records a posted step was answered with (``predicted``) that it
    wrote otherwise (one it did not write, or deleted, is no difference): none, unless a
    bug made the trio thread answer with records the step does not write."""
    records, live = step.records, step.live
    if not records:
        return []
    return [key for key, value in step.predicted.items()
            if records.get(key) not in (None, value.pack_at(live) if type(value) is S.Inode
                                        else value)]


_WAKE = Step("wake")            # a posted step is waiting (Committer.post)
_RUN_NOW = Step("run posted")   # BATCH_STEPS of them are

INO_TABLES = ("inodes", "chunks", "xattrs", "parents", "orphans")   # keys begin with an inode


def marks_of(table: str, key: bytes):
    """What a write of ``key`` in ``table`` changes for a reader: an inode number (its
    record, chunks, xattrs, names, orphan mark), a (directory, name) entry and the
    directory's listing ("ls", directory). Tables no live read consults give none."""
    if table in INO_TABLES:
        yield S.from_u64(key[:8])
    elif table == "dirents":
        parent = S.from_u64(key[:8])
        yield parent, bytes(key[8:-9])     # dirent_key(parent, name) + the epoch suffix
        yield "ls", parent


class _Recorder:
    """A write transaction that remembers which (table, key, value) a step wrote (value
    None: deleted), and whose bucket-hash updates wait for the open transaction's commit
    (``deferred_buckets``, read by store.put_live and delete_live)."""
    __slots__ = ("txn", "writes", "deferred_buckets")

    def __init__(self, txn, deferred_buckets: buckets.Deferred):
        self.txn, self.writes, self.deferred_buckets = txn, [], deferred_buckets

    def get(self, key, default=None, db=None):
        return self.txn.get(key, default, db)

    def cursor(self, db=None):
        return self.txn.cursor(db)

    def put(self, key, value, dupdata=True, overwrite=True, append=False, db=None):
        self.writes.append((db, key, value))
        return self.txn.put(key, value, dupdata, overwrite, append, db)

    def delete(self, key, value=b"", db=None):
        self.writes.append((db, key, None))
        return self.txn.delete(key, value, db)

    def __getattr__(self, name):
        return getattr(self.txn, name)


class Committer:
    def __init__(self, store: Store, live_epoch: int, committed, ran):
        """``live_epoch``: the epoch live steps write (a TXN step may move it on; the new
        one is the step's ``live``). ``committed(n, txn_no)``: called (in this thread)
        after each commit with the number of live steps in it and the transaction's
        number. ``ran(steps)``: posted steps that have run, told in batches (nobody waits
        for them) but always before any later reply or commit is."""
        self.store = store
        self._tables = {handle: name for name, handle in store.db.items()}
        self._txn_no = 0
        self._live_epoch = live_epoch
        self._committed = committed
        self._on_ran = ran
        self._ran: list[Step] = []
        self._posted: collections.deque = collections.deque()     # appended by the trio thread
        self._woken = False         # a _WAKE is queued or the batch's clock runs
        self._run_now_sent = False  # a _RUN_NOW is queued
        self._batch_deadline: float | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._txn: lmdb.Transaction | None = None
        self._deferred_buckets = buckets.Deferred()      # the open transaction's
        self._steps: list[Step] = []
        self._bytes = 0
        self._deadline = 0.0
        self._defer = True
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mountfs-committer",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, step: Step) -> None:
        self._queue.put(step)

    def post(self, step: Step) -> None:
        """Queue a posted step (nobody waits for it) without waking the committer for it:
        posted steps run in a batch when the batch's time is up, before the next step
        somebody waits for, or once BATCH_STEPS wait. Only the first of a batch wakes the
        thread (to start the batch's clock)."""
        self._posted.append(step)
        if not self._woken:
            self._woken = True
            self._queue.put(_WAKE)
        elif len(self._posted) >= BATCH_STEPS and not self._run_now_sent:
            self._run_now_sent = True       # bounds what waits in memory, whatever the delay
            self._queue.put(_RUN_NOW)

    def answers_early(self) -> bool:
        """Whether live steps are answered before their commit: enough free disk when the
        open (or last) transaction began, and no commit has failed. Read from the trio
        thread: a stale answer only matters within a transaction of the margin's edge."""
        return self._defer and self.failed is None

    def stop(self) -> None:
        """Commit what is open and end the thread (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._ran and self._queue.empty():
                self._tell_ran()
            deadlines = [d for d in (self._deadline if self._txn is not None else None,
                                     self._batch_deadline) if d is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            try:
                step = self._queue.get(timeout=timeout)
            except queue.Empty:             # a batch's or the transaction's time is up
                self._run_posted()
                self._commit()
                continue
            if step is _WAKE:
                if self._batch_deadline is None:
                    self._batch_deadline = time.monotonic() + COMMIT_DELAY
                continue
            self._run_posted()
            if step is _RUN_NOW:
                continue
            if step is None:
                self._commit()
                self._tell_ran()
                return
            self._serve_safely(step)

    def _run_posted(self) -> None:
        """Run the posted steps queued so far, in the order they were posted; they commit
        by the batch's deadline (5 ms after its first step woke the thread)."""
        deadline, self._batch_deadline = self._batch_deadline, None
        self._woken = self._run_now_sent = False    # before draining: a step posted from
        while self._posted:                         # now on is drained or wakes the thread
            self._serve_safely(self._posted.popleft())
        if deadline is not None and self._txn is not None and deadline < self._deadline:
            self._deadline = deadline

    def _serve_safely(self, step: Step) -> None:
        try:
            self._serve(step)
        except BaseException as e:        # a bug here must not hang the callers
            log.exception("the committer failed serving a %s step", step.kind)
            step.error = step.error or e
            if step.posted is not None:
                self._lose(1, e)
            self._reply(step)
            if step.kind == LIVE and step not in self._steps:
                self._tell_ran()
                self._committed(1, 0)       # counted as pending: never will be

    def _serve(self, step: Step) -> None:
        if step.kind == LOOK:
            self._look(step)
        elif self.failed is not None:
            step.error = FsError(errno.EIO, f"an earlier commit failed ({self.failed}); "
                                            f"remount the filesystem")
            self._reply(step)
            if step.kind == LIVE:
                self._tell_ran()
                self._committed(1, 0)   # counted as pending by the engine: never will be
        elif step.kind == LIVE:
            self._live(step)
        else:
            self._commit()
            if step.kind == TXN:
                self._own_transaction(step)
            elif step.kind == SYNC and self.failed is None:
                self.store.sync()
            self._reply(step)

    def _look(self, step: Step) -> None:
        """Read the open transaction (LMDB's readers see committed ones only), or, with
        none open, a read transaction."""
        try:
            if self._txn is not None:
                step.result = self._read(self._txn, step)
            else:
                with self.store.read() as txn:
                    step.result = self._read(txn, step)
        except Exception as e:
            step.error = e
        self._reply(step)

    def _read(self, txn, step: Step):
        return step.fn(View(txn, self.store.db, self._live_epoch, self.store.chunk_size),
                       *step.args)

    def _live(self, step: Step) -> None:
        if self._txn is None:
            self._begin()
        self._run_nested(step)
        if step.posted is not None and step.error is not None:
            self._lose(1, step.error)
        self._steps.append(step)
        self._bytes += step.nbytes
        if self._defer or step.error is not None:
            self._reply(step)
        if not self._defer or self._bytes >= TXN_BYTES or len(self._steps) >= TXN_STEPS \
                or time.monotonic() >= self._deadline:
            self._commit()

    def _begin(self) -> None:
        self._txn_no += 1
        self._defer = self.store.free_bytes() >= DEFER_MARGIN
        self._txn = self.store.env.begin(write=True, buffers=True)
        self._deadline = time.monotonic() + COMMIT_DELAY

    def _run_nested(self, step: Step) -> None:
        step.txn_no, step.live = self._txn_no, self._live_epoch
        try:
            with self.store.env.begin(write=True, parent=self._txn, buffers=True) as child:
                recorder = _Recorder(child, self._deferred_buckets)
                step.result = step.fn(Live(recorder, self.store.db, self._live_epoch,
                                           self.store.chunk_size), *step.args)
            step.writes = recorder.writes       # ``noted`` when they are asked for
        except lmdb.MapFullError as e:
            step.error = FsError(errno.ENOSPC, f"store map is full: {e}")
        except Exception as e:
            step.error = e

    def noted(self, step: Step) -> Step:
        """``step`` with the marks and records of what it wrote (``marks_of``), made of its
        writes when first asked for: a posted step told by its number alone (most) never
        needs them (a third of the writer's work per step went into making them)."""
        writes, step.writes = step.writes, None
        if not writes:
            return step
        inodes, dirents = self.store.db["inodes"], self.store.db["dirents"]
        for db, key, value in writes:
            step.marks.update(marks_of(self._tables[db], key))
            if db is inodes:        # a version key: the record as of the live epoch
                step.records[S.from_u64(key[:8])] = bytes(value) if value else None
            elif db is dirents:     # a version key; an empty value or none: no entry
                step.records[S.from_u64(key[:8]), bytes(key[8:-9])] = \
                    S.from_u64(value) if value else 0
        return step

    def _own_transaction(self, step: Step) -> None:
        try:
            with self.store.write() as txn:
                step.result = step.fn(txn, self.store.db, *step.args)
                step.live = self._live_epoch = self.store.live_epoch(txn)
        except StoreFull as e:
            step.error = FsError(errno.ENOSPC, str(e))
        except Exception as e:
            step.error = e

    def _make_room(self) -> bool:
        """Before a full disk is final: let the next transaction reuse the pages just freed
        (``Store.release_freed_pages``), then finish purging deleted files in small
        batches (one of more than ``Live.destroy``'s inline chunks is purged in the
        background, so a write right after deleting it found the disk still full) as far as
        the room allows, and release again. False if not even the first release found
        room (the steps then fail with ENOSPC as they are)."""
        if not self.store.release_freed_pages():
            return False
        with contextlib.suppress(StoreFull):
            while True:
                with self.store.write() as txn:
                    if gc.purge_batch(txn, self.store.db, self.store.chunk_size,
                                      max_chunks=PURGE_CHUNKS):
                        break
        self.store.release_freed_pages()        # what the purge freed, for the rerun
        return True

    def _commit(self) -> None:
        """Commit the open transaction; reply to the steps still waiting for it."""
        if self._txn is None:
            return
        txn, steps, txn_no = self._txn, self._steps, self._txn_no
        self._txn, self._steps, self._bytes = None, [], 0
        try:
            try:
                self.store.commit(txn, self._fold_buckets)
            except StoreFull:
                txn.abort()         # ended already, unless the bucket hashes' fold failed
                if any(s.replied or s.posted is not None for s in steps) \
                        or not self._make_room():
                    raise
                txn, txn_no = self._rerun(steps)      # once: a second failure stands
                self.store.commit(txn, self._fold_buckets)
        except BaseException as e:
            error = FsError(errno.ENOSPC, str(e)) if isinstance(e, StoreFull) else e
            lost = [s for s in steps
                    if (s.replied or s.posted is not None) and s.error is None]
            if lost:
                self._lose(len(lost), error)
            for s in steps:
                if not s.replied:
                    s.error = s.error or (error if isinstance(error, (FsError, StoreError))
                                          else FsError(errno.EIO, str(error)))
                    s.marks, s.records, s.writes = set(), {}, None  # nothing committed
        for s in steps:
            if not s.replied:
                self._reply(s)
        self._tell_ran()
        self._committed(len(steps), txn_no)

    def _rerun(self, steps: list[Step]) -> tuple[lmdb.Transaction, int]:
        """Run ``steps`` again in a new transaction (their first one could not commit: a
        full disk, with nobody answered yet); the transaction and its number. What a step
        reported the first time goes: if it fails now, it wrote nothing."""
        self._begin()
        for step in steps:
            step.marks, step.records, step.result, step.error = set(), {}, None, None
            step.writes = None
            self._run_nested(step)
        txn, self._txn = self._txn, None
        return txn, self._txn_no

    def _fold_buckets(self, txn) -> None:
        self._deferred_buckets.fold(txn, self._live_epoch)

    def _lose(self, answered: int, error: BaseException) -> None:
        """Changes already answered could not be made: from now on refuse every change."""
        if self.failed is None:
            self.failed = error
        log.critical("%d changes already answered are lost (as in a crash): %s; the "
                     "filesystem refuses changes until it is remounted", answered, error)

    def _reply(self, step: Step) -> None:
        step.replied = True
        if step.posted is not None:
            self._ran.append(step)
            return
        self._tell_ran()
        step.done(self.noted(step))

    def _tell_ran(self) -> None:
        if self._ran:
            ran, self._ran = self._ran, []
            self._on_ran(ran)
