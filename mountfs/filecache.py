"""Write buffering for open files: dirty chunks live in memory until they fill, or until
flush, fsync, release, a snapshot, or memory pressure; then they are hashed in a worker thread
(a commit of at most INLINE_HASH: by its step, in the writer process) and committed with the
file's new size. A file whose complete chunks wait for their commit
past FLUSH_AHEAD holds its writers back until the store has taken them.

Ownership rule: every structure here is touched only on the trio thread. A chunk is hashed
from an immutable ``bytes`` copy; commits of one file are serialised by ``OpenFile.lock`` so
that two versions of one chunk can never commit out of order.
"""

from __future__ import annotations

import contextlib
import os
import time

import blake3
import trio

from . import schema as S
from .namespace import FsError
from .units import env_duration

def _dirty_limit() -> int:
    """Bytes of dirty chunks before writers wait for flushes: a tenth of the machine's
    memory, at least 256 MiB and at most 4 GiB (the bound ZFS puts on its dirty data). A
    random writer over a file that fits pays the 1 MiB read-modify-write of a chunk once,
    not at every write."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(max(256 << 20, memory // 10), 4 << 30)


DIRTY_LIMIT = _dirty_limit()
# A dirty chunk older than this is committed even if its file stays open and is never
# fsynced (Linux writes back dirty pages after 30 s too): what a crash of the mount can take
# from an open file is bounded in time, not only in size.
DIRTY_EXPIRE = env_duration("MOUNTFS_DIRTY_EXPIRE", "30")
HASH_THREADS = trio.CapacityLimiter(2)
INLINE_HASH = 64 << 10          # hashing this much takes microseconds: less than a thread hop
                                # (a first read in Engine.verify); a commit of no more than
                                # this is hashed by the writer process, beside the trio thread
                                # (a tar member of 24 KiB cost it 6 µs)
STEP_BYTES = 8 << 20            # chunk data committed in one step at most: a step's frame
                                # stays below glibc's mmap threshold, so the writer process
                                # reuses its buffers (64 MiB steps were each a fresh mapping,
                                # faulted in page by page: docs/benchmarks.md, fourteenth round)
READ_BACK = 64                  # stored chunks read back in one worker-thread call
FLUSH_AHEAD = 32 << 20          # a file's complete chunks waiting for their commit, at most:
                                # past it, its writes wait (as the kernel holds back a writer
                                # past its dirty limit), so a fast sequential writer's buffers
                                # are reused instead of holding the whole file in fresh memory


def chunk_digest(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


class DirtyChunk:
    """A chunk's buffered writes. ``ranges`` is None when ``data`` is the chunk's whole
    content; otherwise the stored chunk has not been read yet and ``data`` holds only the
    written [start, end) ranges (zeros elsewhere): a small write into a stored chunk costs
    no read of the chunk until it is read back or committed (``FileCache._merge``).
    ``data`` is the WRITE's own ``bytes`` when one write covered the whole chunk, or began
    it with nothing stored after (no copy to buffer it, none to commit it), made a
    bytearray by the next write into it."""
    __slots__ = ("data", "gen", "since", "ranges", "queued")

    def __init__(self, data: bytearray, ranges: list[tuple[int, int]] | None = None):
        self.data = data
        self.gen = 0
        self.since = time.monotonic()
        self.ranges = ranges
        self.queued = False     # complete, its commit started: counted in OpenFile.queued

    def complete(self, size: int) -> bool:
        """Whether every byte of the chunk (``size`` bytes) is buffered: it can be committed
        without reading anything back."""
        if self.ranges is None:
            return len(self.data) == size
        self._normalise()
        return self.ranges == [(0, size)]

    def wrote(self, start: int, end: int) -> None:
        """Note [start, end) as written (only ranges of the chunk are buffered): appended
        (a write costs O(1)), merged into sorted, disjoint ranges when they are looked at
        or grow many."""
        self.ranges.append((start, end))
        if len(self.ranges) > 1024:     # at most 1 MiB / 4 KiB distinct ones
            self._normalise()

    def _normalise(self) -> None:
        merged: list[tuple[int, int]] = []
        for start, end in sorted(self.ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        self.ranges = merged


class ReadAhead:
    """A read-back running beside a flush: ``wait`` returns once it is done and raises
    what it raised (run inline at the wait where there is no nursery to run it in)."""
    __slots__ = ("done", "error", "inline")

    def __init__(self):
        self.done = trio.Event()
        self.error: Exception | None = None
        self.inline = None          # what ``wait`` runs itself, with no nursery to run it

    async def run(self, read, *args) -> None:
        try:
            await read(*args)
        except Exception as e:      # the flush that waits for it raises it
            self.error = e
        finally:
            self.done.set()

    async def wait(self) -> None:
        if self.inline is not None:
            inline, self.inline = self.inline, None
            await self.run(*inline)
        await self.done.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class CommitLock:
    """Serialises the commits of one file. Unlike trio.Lock, taking it when free costs no
    checkpoint and no parking-lot bookkeeping: it is taken on every close and attribute
    change of a written file (a trio.Lock was a tenth of the trio thread's time in a git
    checkout). A release wakes every waiter; each tries again (barging is fine: all that
    matters is that two commits of one file never overlap)."""
    __slots__ = ("held", "waiters")

    def __init__(self):
        self.held = False
        self.waiters: list[trio.Event] = []

    async def __aenter__(self) -> None:
        while self.held:
            woken = trio.Event()
            self.waiters.append(woken)
            await woken.wait()
        self.held = True

    async def __aexit__(self, *exc) -> None:
        self.held = False
        waiters, self.waiters = self.waiters, []
        for woken in waiters:
            woken.set()


class OpenFile:
    """Per-inode write state, shared by every handle open on the inode."""
    __slots__ = ("ino", "size", "mtime_ns", "dirty", "queued", "flushing", "flush_pending",
                 "flush_also", "opens", "lock", "error", "dropped")

    def __init__(self, ino: int, size: int):
        self.ino = ino
        self.size = size                      # size including unflushed writes
        self.mtime_ns: int | None = None      # set when a write changed the file
        self.dirty: dict[int, DirtyChunk] = {}
        self.queued = 0                       # bytes of dirty chunks that are queued
        self.flushing = 0                     # background flushes started, not ended
        self.flush_pending = False            # the newest of them has not yet looked for
                                              # complete chunks (``_flush_later``)
        self.flush_also: set[int] = set()     # and it is to take these too
        self.opens = 0
        self.lock = CommitLock()
        self.error: int | None = None         # a failed background flush, reported once
        self.dropped = False                  # the last close dropped uncommitted writes


class FileCache:
    def __init__(self, engine):
        self.engine = engine
        self.files: dict[int, OpenFile] = {}
        self.dirty_bytes = 0
        self.flushed = trio.Event()
        self.nursery: trio.Nursery | None = None   # set by the mount for background flushes
        self.thawed: trio.Event | None = None      # while held, new writes wait for it
        self.holds = 0                             # holds (``hold``) not yet thawed
        self.writers = 0                           # writes past the gate, not yet returned
        self.no_writers = trio.Event()
        self.behind: set[int] = set()              # open files whose size the kernel may
                                                   # hold from before a rollback (``write``)

    # ---- open files ----------------------------------------------------------------------

    def open(self, ino: int, size: int) -> OpenFile:
        of = self.files.get(ino)
        if of is None:
            of = self.files[ino] = OpenFile(ino, size)
        of.opens += 1
        return of

    async def release(self, of: OpenFile) -> None:
        """Last close of a handle. If the data cannot be committed (ENOSPC), the writer was
        told by close(2) (flush runs first); with no handle left, the buffer is dropped,
        and with it the size it gave the file: ``of.dropped`` then tells the caller that
        what the kernel was shown (size, pages read) is no longer the file."""
        try:
            await self.flush(of)
        finally:
            of.opens -= 1
            if of.opens == 0:
                of.dropped = bool(of.dirty) or of.mtime_ns is not None
                self.forget_dirty(of.ino)
                self.files.pop(of.ino, None)

    def get(self, ino: int) -> OpenFile | None:
        return self.files.get(ino)

    # ---- writing ---------------------------------------------------------------------------

    async def write(self, of: OpenFile, off: int, buf: bytes) -> int:
        while self.thawed is not None:            # a snapshot or a rollback is being taken
            await self.thawed.wait()
        if of.ino in self.behind:
            # The kernel placed this write (an append: at the size it holds) by the file as
            # it was before a rollback, which it has not been given yet: a write made
            # before the rollback, which discards it with the file's other writes since the
            # snapshot. Answered at once: the kernel gives up a write's inode lock and pages
            # only with the answer, and telling it needs both (Operations.invalidate).
            return len(buf)
        if of.error is not None:
            err, of.error = of.error, None
            raise FsError(err)
        self.writers += 1
        try:
            self._buffer(of, off, buf)
            while self.dirty_bytes > DIRTY_LIMIT and of.error is None:
                self._flush_later(of, sorted(of.dirty))
                await self._wait_flushed()
            if of.queued > FLUSH_AHEAD:
                await self._hold_back(of)
            return len(buf)
        finally:
            self.writers -= 1
            if self.writers == 0 and self.thawed is not None:   # ``hold`` waits for it
                self.no_writers.set()

    async def hold(self) -> None:
        """Hold new writes and let those in progress return, until ``thaw`` (one per
        hold: a snapshot and a rollback may hold at once)."""
        self.holds += 1
        if self.thawed is None:
            self.thawed = trio.Event()
        try:
            while self.writers:
                self.no_writers = trio.Event()
                await self.no_writers.wait()
        except BaseException:
            self.thaw()
            raise

    async def freeze(self) -> None:
        """Hold new writes, let those in progress return, and commit everything buffered: a
        snapshot taken before ``thaw`` then holds exactly the writes that have returned.
        Thawed again if the commit fails."""
        await self.hold()
        try:
            await self.flush_all()
        except BaseException:
            self.thaw()
            raise

    def thaw(self) -> None:
        self.holds -= 1
        if self.holds == 0:
            thawed, self.thawed = self.thawed, None
            if thawed is not None:
                thawed.set()

    async def lock_all(self, stack: contextlib.AsyncExitStack, locked: set[OpenFile]) -> None:
        """Take the commit lock of every open file not in ``locked`` (adding it there) until
        ``stack`` closes: no commit or truncation of theirs runs meanwhile, nor starts."""
        while todo := [of for of in self.files.values() if of not in locked]:
            for of in todo:
                await stack.enter_async_context(of.lock)
                locked.add(of)

    def rolled_back(self, files: set[OpenFile], records: dict[int, S.Inode | None]
                    ) -> set[int]:
        """After a rollback of the store, for ``files``, whose locks were held across it
        with writes held (``records``: theirs, read after it): each becomes what the store
        holds. Its buffered writes go unwritten: they were all made after the newest
        snapshot (taking one commits them), so after the one rolled back to, whose rollback
        discards them with the rest. Its size and mtime are the rolled-back record's (0 for
        a file the rollback deleted). Returns the files whose size, mtime or content the
        kernel may have been shown otherwise (pages filled from the buffers, attributes)."""
        changed = set()
        for of in files:
            rec = records.get(of.ino)
            size = rec.size if rec is not None else 0
            if of.dirty or of.mtime_ns is not None or of.size != size:
                changed.add(of.ino)
            for idx in list(of.dirty):
                self._drop_dirty(of, idx)
            of.size, of.mtime_ns, of.error = size, None, None
        return changed

    def _buffer(self, of: OpenFile, off: int, buf: bytes) -> None:
        """Buffer a write; the commits of the chunks it completes start."""
        cs, n = self.engine.chunk_size, len(buf)
        idx, within = divmod(off, cs)
        if within + n <= cs:                    # the usual write: within one chunk
            if self._write_chunk(of, idx, within, buf):
                self._queue_full(of, idx)
        else:
            view = memoryview(buf)
            pos = 0
            while pos < n:
                idx, within = divmod(off + pos, cs)
                take = min(cs - within, n - pos)
                if self._write_chunk(of, idx, within, view[pos:pos + take]):
                    self._queue_full(of, idx)
                pos += take
        if off + n > of.size:
            of.size = off + n
        of.mtime_ns = time.time_ns()

    def _write_chunk(self, of: OpenFile, idx: int, within: int, piece) -> bool:
        """Buffer ``piece`` (bytes or a view of the write) at ``within`` in chunk ``idx``;
        whether the chunk is now complete (it can be committed without reading back)."""
        cs = self.engine.chunk_size
        dc = of.dirty.get(idx)
        if dc is None and within == 0 and (len(piece) == cs or idx * cs >= of.size):
            # buffered as it came: the whole chunk, or all of it there is (a new file's
            # first write: nothing stored past the size)
            self._add_dirty(of, idx, DirtyChunk(piece if type(piece) is bytes
                                                else bytes(piece)))
            return len(piece) == cs
        if dc is None:      # nothing stored past the size: nothing to read back
            dc = self._add_dirty(of, idx, DirtyChunk(
                bytearray(), None if idx * cs >= of.size else []))
        data = dc.data
        if type(data) is not bytearray:
            data = dc.data = bytearray(data)
        end = within + len(piece)
        if len(data) < within:
            data.extend(bytes(within - len(data)))
        data[within:end] = piece
        if dc.ranges is not None:
            dc.wrote(within, end)
        dc.gen += 1
        return end == cs and dc.complete(cs)

    def _queue_full(self, of: OpenFile, idx: int) -> None:
        """Chunk ``idx`` of ``of`` is complete: its commit starts in the background."""
        self._queue(of, of.dirty[idx])
        self._flush_later(of, [idx])

    async def _hold_back(self, of: OpenFile) -> None:
        """Past FLUSH_AHEAD of ``of``'s complete chunks waiting for their commit, wait until
        the store has taken them, with a flush under way (the one that failed, or found its
        chunks rewritten meanwhile, has ended). An error ends the wait: the next call on
        the file reports it."""
        while of.queued > FLUSH_AHEAD and of.error is None and self.nursery is not None:
            if not of.flushing:
                self._flush_later(of, [])
            await self._wait_flushed()

    async def _wait_flushed(self) -> None:
        """Until a commit of buffered chunks ends (or fails)."""
        self.flushed = trio.Event() if self.flushed.is_set() else self.flushed
        await self.flushed.wait()

    def _add_dirty(self, of: OpenFile, idx: int, dc: DirtyChunk) -> DirtyChunk:
        of.dirty[idx] = dc
        self.dirty_bytes += self.engine.chunk_size
        return dc

    def _queue(self, of: OpenFile, dc: DirtyChunk) -> None:
        if not dc.queued:
            dc.queued = True
            of.queued += self.engine.chunk_size

    def _drop_dirty(self, of: OpenFile, idx: int) -> None:
        """``of``'s chunk ``idx`` is no longer buffered (committed, or cut off)."""
        dc = of.dirty.pop(idx)
        self.dirty_bytes -= self.engine.chunk_size
        if dc.queued:
            of.queued -= self.engine.chunk_size
        self.flushed.set()

    async def _read_back(self, of: OpenFile, idxs) -> None:
        """Merge each of the chunks ``idxs`` of which only ranges were written with its
        stored chunk (``_merge``), READ_BACK of them read in one worker-thread call (a
        flush reads the next READ_BACK ahead while it commits these: ``_read_ahead``). One
        chunk at a time, between the commits of the groups before it, the fsync at the end
        of 10 s of random 4 KiB writes on 1 GiB took 3.8-4.6 s; in batches, 2.7-3.0 s
        (docs/benchmarks.md, thirty-fourth round)."""
        cs, ino = self.engine.chunk_size, of.ino
        todo = [i for i in idxs if (dc := of.dirty.get(i)) is not None and dc.ranges is not None]
        for first in range(0, len(todo), READ_BACK):
            batch, size = todo[first:first + READ_BACK], of.size
            stored = await self.engine.look(
                lambda v: [v.chunk_data(ino, i)[:max(0, size - i * cs)] if i * cs < size
                           else b"" for i in batch], io=True, marks=(ino,))
            for idx, data in zip(batch, stored):
                dc = of.dirty.get(idx)
                if dc is not None and dc.ranges is not None:    # not merged meanwhile
                    self._merge(dc, data)

    def _read_ahead(self, of: OpenFile, idxs: list[int]) -> "ReadAhead":
        """``_read_back(of, idxs)`` in the background, while the chunks before them are
        hashed and committed: the read-back waits for the disk and LMDB's map, the commits
        for the hashing threads and the writer. In the file cache's nursery, not one of the
        flush's own: an error of the flush stays itself, not an exception group."""
        ahead = ReadAhead()
        if idxs and self.nursery is not None:
            self.nursery.start_soon(ahead.run, self._read_back, of, idxs)
        elif idxs:
            ahead.inline = (self._read_back, of, idxs)
        else:
            ahead.done.set()
        return ahead

    async def contents(self, of: OpenFile, first: int, last: int) -> dict[int, bytes]:
        """The buffered content of the dirty chunks among ``first``..``last``, each merged
        with its stored chunk where only ranges of it were written."""
        idxs = sorted(i for i in of.dirty if first <= i <= last)
        await self._read_back(of, idxs)
        return {idx: bytes(dc.data) for idx in idxs if (dc := of.dirty.get(idx)) is not None}

    @staticmethod
    def _merge(dc: DirtyChunk, stored: bytes) -> None:
        """Lay the written ranges over the stored chunk: ``dc.data`` becomes the content.
        The bytearray is made here, on the trio thread, though the worker thread that read
        ``stored`` could have made it without this copy: glibc gives each thread's
        allocations an arena of its own, and a gigabyte of chunks kept from the workers'
        arenas was fresh memory, faulted in page by page (the end of 1 GiB of random 4 KiB
        writes took 5.7-5.8 s instead of 3.9: thirty-fourth round)."""
        base = bytearray(stored)
        for start, end in dc.ranges:
            if len(base) < start:
                base.extend(bytes(start - len(base)))
            base[start:end] = dc.data[start:end]
        dc.data, dc.ranges = base, None

    # ---- flushing --------------------------------------------------------------------------

    async def expirer(self) -> None:
        """Commit, in the background, chunks dirty for longer than DIRTY_EXPIRE."""
        while True:
            await trio.sleep(min(5.0, DIRTY_EXPIRE))
            now = time.monotonic()
            for of in list(self.files.values()):
                old = [idx for idx, dc in of.dirty.items() if now - dc.since >= DIRTY_EXPIRE]
                if old:
                    self._flush_later(of, old)

    def _flush_later(self, of: OpenFile, idxs: list[int]) -> None:
        """Commit ``idxs`` and the file's other complete chunks in the background, unless a
        background flush that has not yet looked for them will: it takes these too. With
        one task per complete chunk, all waiting for the file's lock and all woken by each
        release, a seventh of the trio thread's samples in a sequential write were those
        wake-ups (py-spy; docs/benchmarks.md, thirty-second round)."""
        if of.flush_pending:
            of.flush_also.update(idxs)      # chunks not complete: expired, or over the limit
        elif self.nursery is not None:
            of.flushing += 1
            of.flush_pending = True
            self.nursery.start_soon(self._flush_background, of, idxs)

    async def _flush_background(self, of: OpenFile, idxs: list[int]) -> None:
        try:
            await self.flush_chunks(of, idxs, final=False)
        except FsError as e:
            of.error = e.errno
        finally:
            of.flushing -= 1
            of.flush_pending = False    # (it looked, or never will: the next one must)
            self.flushed.set()          # a writer held back hears of it, whatever happened

    async def flush(self, of: OpenFile) -> None:
        """Commit every dirty chunk and the file's size and mtime. Nothing dirty and no
        mtime to save (tar's second and third SETATTR, the FLUSH and RELEASE after them):
        nothing to wait for either, since chunks being committed stay dirty until saved."""
        if of.dirty and self._post_whole(of):
            if not of.opens:
                self.files.pop(of.ino, None)
        elif of.dirty or of.mtime_ns is not None or not of.opens:
            await self.flush_chunks(of, sorted(of.dirty), final=True)
        if of.error is not None:
            err, of.error = of.error, None
            raise FsError(err)

    def _post_whole(self, of: OpenFile) -> bool:
        """Commit all of ``of``'s buffered writes, and its size and mtime, as one posted
        step, without awaiting anything: when no commit of the file is under way (its
        lock is free), every dirty chunk is whole in memory and all of them fit
        INLINE_HASH (the step hashes them), and the engine may post. The close of a small
        file written anew (most of an untar or a checkout) costs no more: through
        ``flush_chunks`` it took five coroutines and a dozen lists (33 µs of the trio
        thread per file in an untar). False: ``flush_chunks`` must do it."""
        if of.lock.held:
            return False
        nbytes = 0
        for dc in of.dirty.values():
            if dc.ranges is not None:
                return False
            nbytes += len(dc.data)
        engine = self.engine
        if nbytes > INLINE_HASH or not engine.can_post(nbytes):
            return False        # before copying: a big file's chunks go by flush_chunks
        try:
            rec = engine.known_inode(of.ino)
        except FsError:
            return False
        if rec is None:
            return False
        chunks = [(idx, None, bytes(dc.data)) for idx, dc in of.dirty.items()]
        size, mtime, idxs = of.size, of.mtime_ns, list(of.dirty)
        engine.post(_commit_chunks, of.ino, chunks, size, size, mtime, True,
                    marks=(of.ino,), nbytes=nbytes,
                    records={of.ino: grown(rec, engine.chunk_size, idxs, size, size, mtime,
                                           True)})
        for idx in idxs:
            self._drop_dirty(of, idx)
        of.mtime_ns = None
        return True

    async def flush_all(self) -> None:
        for of in list(self.files.values()):
            await self.flush(of)

    async def flush_chunks(self, of: OpenFile, idxs: list[int], final: bool) -> None:
        """Commit the chunks ``idxs`` (and, in the background, every other full dirty chunk
        of the file) in as few steps as memory allows: one commit costs an fdatasync, so
        chunks of one file go together, never one commit per chunk."""
        cs = self.engine.chunk_size
        async with of.lock:
            of.flush_pending = False    # chunks complete from now on need a flush of theirs
            if not final:
                idxs = sorted(set(idxs) | of.flush_also | {i for i, dc in of.dirty.items()
                                                           if dc.complete(cs)})
                of.flush_also.clear()
            todo = [idx for idx in idxs if idx in of.dirty]
            per_step = max(1, STEP_BYTES // cs)
            batch = per_step * max(1, READ_BACK // per_step)    # whole groups (small chunks)
            ahead = self._read_ahead(of, todo[:batch])
            for first in range(0, len(todo), per_step):
                if first % batch == 0:          # this batch read back, the next one started
                    await ahead.wait()
                    ahead = self._read_ahead(of, todo[first + batch:first + 2 * batch])
                group = [(idx, of.dirty[idx]) for idx in todo[first:first + per_step]
                         if idx in of.dirty]
                last = first + per_step >= len(todo)
                await self._commit_group(of, group, final and last)
            await ahead.wait()
            if final and of.mtime_ns is not None and not of.dirty:
                mtime = of.mtime_ns
                await self._save(of, _commit_attrs, (of.ino, of.size, of.size, mtime),
                                 ([], of.size, mtime, True))
                if of.mtime_ns == mtime:        # no write came while committing
                    of.mtime_ns = None
            if of.opens == 0 and not of.dirty:
                self.files.pop(of.ino, None)

    async def _commit_group(self, of: OpenFile, group: list[tuple[int, DirtyChunk]],
                            whole: bool) -> None:
        """``whole``: the group holds every dirty chunk, so the step also commits the file's
        size and mtime (a close costs one commit, not two)."""
        await self._read_back(of, [idx for idx, _ in group])    # those no read-ahead merged
        copies = [(idx, dc, dc.gen, bytes(dc.data)) for idx, dc in group]
        size, mtime = of.size, of.mtime_ns
        datas = [data for _, _, _, data in copies]
        if sum(map(len, datas)) <= INLINE_HASH:
            digests = [None] * len(datas)       # the step hashes them, in the writer
        else:
            digests = await trio.to_thread.run_sync(
                lambda: [chunk_digest(d) for d in datas], limiter=HASH_THREADS)
        chunks = [(idx, digest, data) for (idx, _, _, data), digest in zip(copies, digests)]
        whole = whole and len(copies) == len(of.dirty)
        await self._save(of, _commit_chunks, (of.ino, chunks, size, of.size, mtime, whole),
                         ([idx for idx, _, _ in chunks], size, mtime, whole),
                         nbytes=sum(map(len, datas)))
        for idx, dc, gen, _ in copies:
            if of.dirty.get(idx) is dc and dc.gen == gen:
                self._drop_dirty(of, idx)
        if whole and not of.dirty and of.mtime_ns == mtime:
            of.mtime_ns = None                  # size and mtime went with the chunks

    async def _save(self, of: OpenFile, step, args: tuple, growth: tuple,
                    nbytes: int = 0) -> None:
        """Run ``step(live, *args)``, which commits (part of) ``of`` and writes the record
        ``grown(rec, cs, *growth)`` (with the file's size now): posted (no round trip to the committer) when the engine
        allows it and the file's record is known, so a close usually costs no wait."""
        engine = self.engine
        if engine.can_post(nbytes):
            try:
                rec = engine.known_inode(of.ino)
            except FsError:
                rec = None
            if rec is not None:
                idxs, size, mtime, whole = growth
                engine.post(step, *args, marks=(of.ino,), nbytes=nbytes,
                            records={of.ino: grown(rec, engine.chunk_size, idxs, size,
                                                   of.size, mtime, whole)})
                return
        await engine.mutate(step, *args, nbytes=nbytes)

    def cut(self, of: OpenFile, size: int) -> None:
        """Truncate ``of``'s buffered writes to ``size`` and make it the file's size (a
        truncation, under ``of.lock``: no commit of them is in flight)."""
        cs = self.engine.chunk_size
        last, keep = divmod(size, cs)
        for idx in [i for i in of.dirty if i > last or (i == last and not keep)]:
            self._drop_dirty(of, idx)
        dc = of.dirty.get(last)
        if dc is not None:
            if dc.queued:                       # no longer complete
                dc.queued = False
                of.queued -= cs
            dc.data = bytearray(dc.data[:keep])
            if dc.ranges is not None:
                dc.ranges = [(start, min(end, keep)) for start, end in dc.ranges
                             if start < keep]
            dc.gen += 1
        of.size = size

    def forget_dirty(self, ino: int) -> None:
        """Drop buffered data of an inode that no longer exists."""
        of = self.files.get(ino)
        if of is not None:
            for idx in list(of.dirty):
                self._drop_dirty(of, idx)


# ---- the steps that commit a file's buffers (run by the committer: data in, data out) ----

def _commit_chunks(live, ino: int, chunks: list[tuple[int, bytes | None, bytes]], size: int,
                   now_size: int, mtime: int | None, whole: bool) -> None:
    """A step: store ``chunks`` (index, digest, data; a digest of None is computed here)
    of ``ino`` and grow its record.
    ``size`` and ``mtime`` are the file's when the chunks were copied: writes that came
    while waiting for the commit are not in the data and must not be in the committed size
    (a snapshot would show zeros there). ``now_size``: the file's size when the step was
    sent, lower after a truncation (under the file's lock, so none comes between the
    copy and the step)."""
    rec = live.inode(ino)
    if rec is None:                 # deleted meanwhile (a rollback): drop the data
        return
    for idx, digest, data in chunks:
        live.put_chunk(ino, idx, digest or chunk_digest(data), data)
    live.save(ino, grown(rec, live.chunk_size, [idx for idx, _, _ in chunks], size,
                         now_size, mtime, whole))


def _commit_attrs(live, ino: int, size: int, now_size: int, mtime: int) -> None:
    """A step: the size and mtime of a file with nothing dirty (see _commit_chunks)."""
    rec = live.inode(ino)
    if rec is None:
        return
    live.save(ino, grown(rec, live.chunk_size, [], size, now_size, mtime, True))


def grown(rec: S.Inode, cs: int, idxs: list[int], size: int, now_size: int,
          mtime: int | None, whole: bool) -> S.Inode:
    """The record of a file once chunks ``idxs`` of it are committed: ``size`` and
    ``mtime`` as when they were copied, ``now_size`` the file's size now (lower after a
    truncation meanwhile); ``whole``: nothing else is dirty, so all of ``size`` is
    written."""
    new_size = rec.size
    for idx in idxs:
        new_size = max(new_size, min(size, now_size, (idx + 1) * cs))
    if whole:
        new_size = max(rec.size, min(size, now_size))
    return rec.evolve(size=new_size, mtime_ns=mtime or rec.mtime_ns,
                      ctime_ns=mtime or rec.ctime_ns)
