"""The writer process: the committer (mountfs.committer) run in a process of its own.

Why: a workload that sends one request at a time (git checkout, creating files) waits for
the trio thread's Python on every request. With the committer as a thread of the mount
process, its Python (about 70 µs per change) took turns with the trio thread's on one GIL,
so it ran in series with every request (docs/benchmarks.md, eighth and ninth rounds).
In a process of its own it runs beside them, on the machine's other core.

How:
* the mount starts ``python -P -m mountfs.writer STORE`` (``children``) with a pipe each
  way, the ring that carries chunk data (``mountfs.ring``) and the store's lock file open:
  the child opens the store without taking the lock (the mount holds it; the child holds
  the same open file, so the store stays locked until both are gone);
* the child outlives a mount that dies: the end of its input (the mount's end of the
  pipe closes with the mount) is a stop without the STOP frame, and it commits every step
  it has read, then exits, releasing the store lock (a frame cut short by the death is
  dropped). So a kill -9 of the mount takes back only the posted changes not yet sent
  (``POST_DELAY``), however long ``COMMIT_DELAY`` is; until the writer has committed,
  the lock names it, and a remount waits for it (``store.LOCK_PATIENCE``). If the child dies
  alone, every later change fails (EIO) and the mount must be remounted, as after a failed
  commit;
* steps travel as data (``committer.Step``: a module-level function and plain arguments),
  pickled; the trio thread never waits for the pipe: what does not fit, and every step
  carrying chunk data (placed in the ring by that thread, waiting for room there), is kept
  in order and written by a worker thread as the writer reads
  (during a 1 GiB write, blocking writes had held the trio loop up to 0.19 s at a time);
  what a step wrote (marks, records) and its result come back, read on the trio thread
  (a system task waiting for the pipe), which calls the engine's callbacks in the
  committer's order. A reader thread did that until the twenty-fourth round: each reply
  then woke a second thread of the mount, which took the GIL from the trio thread and
  woke the trio loop again (docs/benchmarks.md). Outside trio (tools, tests) a thread
  still reads them;
* the mount reads the committed tree through its own LMDB environment (LMDB's readers are
  multi-process); a file's data an uncommitted change wrote is read by the writer (a LOOK
  step, ``Engine.read_uncommitted``), anything else such a change wrote after a commit
  (``Engine.look``).

Frames, mount -> writer: their length (``LENGTH``), a header (``HEADER``: PUT, POST or STOP,
the step's number, the length of what is pickled), the pickled ``(kind, fn, args, nbytes)``;
with RING added to PUT or POST, then the place of the step's chunk data in the ring
(``RING_PLACE``). Posted steps go together as one BATCH frame: the header
holds the first step's number and how many follow (their numbers are consecutive), the
body one pickle of their ``(fn, args, nbytes, predicted)`` (a function named once for
the batch, not once per step). A step carrying data pickles each large ``bytes`` as a
reference to its place in the step's region of the ring (``_DataPickler``): a 1 MiB chunk is
copied neither into the pickle by the mount nor out of it by the writer, and a worker
thread, not the trio thread, copies it into the ring (copies on the trio thread, which
serves every request, took it from 0.35 to 0.63 s per GiB written: docs/benchmarks.md,
eleventh round); the writer hands LMDB views of the ring, and gives a region back after
the commit of the step that read it. A frame the writer cannot read fails that step
alone, as a step that raised would.

Writer -> mount, frames of their length (``LENGTH``) then a pickle: ``("reply", outcome, ok)``,
``("ran", [outcome, ...], ok)``, ``("committed", n, txn_no, [outcome or seq, ...], ok)``,
where ``outcome`` is ``(seq, result, error, marks, records, txn_no, live)`` and ``ok`` is
whether changes are still answered before their commit (``Committer.answers_early``).
Posted steps that ran are told with the next commit, which follows within COMMIT_DELAY
(their transaction's), or before the next reply: one frame per batch instead of two, and
the mount need not note as uncommitted what the same frame says is committed. So a posted
step committed in that frame, which wrote the records it was answered with (checked
here, against its ``predicted``), is told by its number alone: nothing of what it wrote
is left for the mount to note.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import itertools
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from collections import deque

import trio

from . import children
from .committer import LIVE, Committer, Step, mispredicted
from .memory import keep_freed_buffers
from .prealloc import Preallocator
from .namespace import FsError
from .ring import Ring
from .store import ORPHANED_WRITER, Store, relabel_lock, release_lock

log = logging.getLogger(__name__)

PIPE_BYTES = 1 << 20        # each pipe's capacity: batches of posted steps and replies of
                            # read-back data (LOOK) in few writes (chunk data: the ring)
NICE = 10                   # the writer's niceness: a thread of the request chain (the trio
                            # thread, the caller) woken on the core it runs on takes the core
                            # at once; at 0 the chain waited for it, and 10,000 creates took
                            # 3.96-4.36 s instead of 3.53-3.74 (docs/benchmarks.md, tenth
                            # round). Under full load it still gets about a tenth of a core.
LENGTH = struct.Struct(">I")      # of what follows in a frame to the writer
HEADER = struct.Struct(">BQI")    # PUT, POST or STOP; the step's number; the pickle's length
                                  # (BATCH: the first step's number; how many steps)
_HEAD = struct.Struct(">IBQI")    # LENGTH and HEADER in one, for small frames
PUT, POST, STOP, BATCH = 0, 1, 2, 3
RING = 0x80                 # with PUT or POST: the step's data is in the ring (``mountfs.ring``)
RING_PLACE = struct.Struct(">QQ")     # then, after the pickle: the region's position, length
_F_SETPIPE_SZ = 1031
RAW_BYTES = 64 << 10        # a step's data (bytes) at least this long goes through the ring
POST_DELAY = 0.002          # posted steps wait this long to go to the writer together: one
                            # pipe write and one wake-up of the writer for several of them.
                            # 10,000 creates took 3.18-3.27 s instead of 3.40-3.45 (a wake-up
                            # of the writer costs the request chain its core for a moment on
                            # a 2-core machine; docs/benchmarks.md, eleventh round). Nothing
                            # waits for a posted step: a step sent with ``put`` takes them all
                            # along at once, and commits wait COMMIT_DELAY anyway.
_IOV_MAX = 64               # pieces written by one writev
REPLY_READ = 64 << 10       # read from the writer at once at least (a frame: a few hundred
                            # bytes; more when the frame still being read needs more)
MAX_REPLY = 1 << 30         # a longer reply frame is a bug: the writer is stopped
CHECKED_EVERY = 64          # one posted step in this many goes with the records its caller
                            # was answered with, which the writer checks against what it
                            # wrote (a difference is a bug, logged): pickling them for
                            # every step cost the trio thread 2 µs per created file.
                            # MOUNTFS_CHECK_ANSWERS=1 sends them with every step (the
                            # test suite sets it)


class WriterProcess:
    """The mount's side: the committer's interface (``start``, ``put``, ``post``,
    ``answers_early``, ``stop``, ``failed``), served by the writer process. ``put`` and
    ``post`` are called from the trio thread only; the callbacks (each step's ``done``,
    ``committed(n, txn_no)``, ``ran(steps, committed)``) are called in the committer's
    order, by the task that reads the writer's replies on the trio thread (started in
    trio) or else by a reader thread. ``ran``'s ``committed`` is the transaction
    whose commit ``committed`` tells right after (0: none): the steps of it among
    ``steps`` are committed already. That task calls them directly; elsewhere (the
    reader thread, steps failed on their way) they go through ``relay(callback, *args)``
    (by default: called as they are)."""

    def __init__(self, store: Store, committed, ran, relay=None):
        self.store = store
        self._committed = committed
        self._on_ran = ran
        self._relay = relay or _call
        self._checked_every = 1 if os.environ.get("MOUNTFS_CHECK_ANSWERS") == "1" \
            else CHECKED_EVERY
        self._steps: dict[int, Step] = {}       # sent, not yet answered, by sequence number
        self._seq = 0
        self._answers_early = True
        self.failed: BaseException | None = None
        self._proc: subprocess.Popen | None = None
        self._ring: Ring | None = None      # carries the steps' chunk data (``start``)
        self._out_fd = -1
        self._unsent: deque = deque()       # pieces of frames waiting for _flush_unsent
        self._batch: list[Step] = []        # posted steps not yet framed, in order (``held``)
        self._raw_unsent = 0                # frames with chunk data among them
        self._in_trio = False               # started in trio: the pipe is non-blocking
        self._flushing = False              # _flush_unsent is writing (in a worker thread)
        self._room = trio.Event()           # set when there are some (the trio flusher waits)
        self._replies_fd = -1
        self._replies = _Replies()          # what has come of them, whoever reads them
        self._reader: threading.Thread | None = None    # outside trio: reads the replies
        self._gone = False                  # the writer's exit is handled (_writer_gone)

    def start(self) -> None:
        """Start the writer: in trio (the mount), its pipes are served by system tasks of
        the trio thread; outside it, by blocking writes and a reader thread."""
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        for fd in (to_child_w, to_parent_w):
            _widen(fd)
        lockfd = self.store.lockfd if self.store.lockfd is not None else -1
        self._ring = Ring.create(self.store.chunk_size)
        keep = [to_child_r, to_parent_w, *self._ring.fds] + ([lockfd] if lockfd >= 0 else [])
        try:
            self._proc = subprocess.Popen(
                children.module_command("mountfs.writer", os.path.abspath(self.store.path),
                                        str(to_child_r), str(to_parent_w), str(lockfd),
                                        *map(str, self._ring.fds)),
                pass_fds=keep, preexec_fn=_in_child, stdin=subprocess.DEVNULL,
                env=children.module_env(), cwd=children.CWD)
        finally:
            os.close(to_child_r)
            os.close(to_parent_w)
        self._out_fd, self._replies_fd = to_child_w, to_parent_r
        # In trio, never wait for a pipe (_flush_unsent, _receive); outside it (tools,
        # tests) the writes block and a thread reads the replies.
        with contextlib.suppress(RuntimeError):
            trio.lowlevel.spawn_system_task(self._flush_unsent)
            os.set_blocking(to_child_w, False)
            os.set_blocking(to_parent_r, False)
            trio.lowlevel.spawn_system_task(self._receive)
            self._in_trio = True
        if not self._in_trio:
            self._start_reader()

    def _start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read, name="mountfs-writer-replies",
                                        daemon=True)
        self._reader.start()

    def put(self, step: Step) -> None:
        """Send a step whose caller waits for it: written now if the pipe has room."""
        self._frame_batch()
        self._send(PUT, step, now=True)

    def post(self, step: Step) -> None:
        """Send a posted step: written by ``_flush_unsent`` within POST_DELAY, after the
        call that posted it is answered, with the others posted meanwhile (or at once
        with the next ``put``). Writing to the pipe took about 9 µs of the trio thread per
        step (two per created file) and woke the writer each time; nothing waits for a
        posted step. In trio the posted steps are framed together (``_frame_batch``),
        when the next step is sent or the posted steps go, but for one whose chunk data
        travels raw."""
        if not self._in_trio or step.nbytes >= RAW_BYTES:
            self._frame_batch()
            self._send(POST, step, now=False)
            return
        self._seq += 1
        step.seq = self._seq
        self._steps[step.seq] = step
        self._batch.append(step)
        self._room.set()

    def held(self) -> Step | None:
        """The last posted step if it is not yet framed: the caller may still change its
        arguments (``Engine.post``'s ``merge``). Nothing was sent after it."""
        return self._batch[-1] if self._batch else None

    def _frame_batch(self) -> None:
        """Frame the posted steps not yet framed (``post``), after everything sent before
        them, as one BATCH frame. One that is not data (a bug) was answered already, and
        whoever frames it is not its caller: it is a change lost after its answer, as
        when a posted step fails in the writer, so it and every later change fail until
        a remount; those before it go."""
        steps, self._batch = self._batch, []
        if not steps:
            return
        if self.failed is None:
            try:
                self._write(_batch_frame(steps, self._checked_every), now=False)
                return
            except Exception:       # pickle's errors vary: find the step that is not data
                steps = self._frame_data_prefix(steps)
        # the writer died (_writer_gone failed these already), or they come after a step
        # that is not data
        self._fail([step for step in steps if self._steps.pop(step.seq, None) is not None])

    def _frame_data_prefix(self, steps: list[Step]) -> list[Step]:
        """Frame the steps before the first that cannot be pickled; mark the mount failed
        by that one; return it and those after it."""
        for i, step in enumerate(steps):
            try:
                pickle.dumps(_batched(step, 1), protocol=5)
            except Exception as e:
                problem = f"a {step.kind} step is not data: {step.fn!r}: {e}"
                break
        else:
            problem = "posted steps that could not be pickled together"
            i = len(steps)
        if i:
            self._write(_batch_frame(steps[:i], self._checked_every), now=False)
        log.critical("%s: an answered change is lost; the filesystem refuses changes until "
                     "it is remounted", problem)
        if self.failed is None:
            self.failed = FsError(errno.EIO, f"a change could not be sent to the writer "
                                             f"process ({problem}); remount the filesystem")
        return steps[i:]

    def answers_early(self) -> bool:
        return self._answers_early and self.failed is None

    def stop(self) -> None:
        """Have the writer commit what is open and exit; wait for it (idempotent). Outside
        trio, or once it has ended: its task no longer reads the replies, so a thread does,
        as the writer sends them (the writer would wait for room in a full pipe, and
        this for the writer, forever)."""
        if self._proc is None:
            return
        if _trio_running():
            raise RuntimeError("WriterProcess.stop() on the trio thread would wait for the "
                               "writer that the trio loop answers: call it after trio ends")
        if self._reader is None and not self._gone:
            os.set_blocking(self._replies_fd, True)
            self._start_reader()
        self._frame_batch()     # after everything unsent, with it
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):     # it died: its replies' reader has said so
                os.set_blocking(self._out_fd, True)
                self._in_trio = False
                self._unsent.extend(_frame(STOP, 0))
                _write_all(self._out_fd, self._unsent)
        self._proc.wait()
        if self._reader is not None:
            self._reader.join()
        os.close(self._out_fd)      # trio has ended: its epoll, which watched them, too
        os.close(self._replies_fd)
        self._ring.close()
        self._proc = None

    def _send(self, op: int, step: Step, now: bool) -> None:
        """Send a step; if the writer is gone, fail it (at once, or through the reader
        thread, which fails every step it finds waiting when the writer's pipe ends: the
        ``_steps.pop`` that finds it answers it, once)."""
        self._seq += 1
        step.seq = self._seq
        body = (step.kind, step.fn, step.args, step.nbytes) if op != POST else \
            (step.kind, *_batched(step, self._checked_every))
        try:
            frame = _frame(op, step.seq, body,
                           ring=self._ring if step.nbytes >= RAW_BYTES else None)
        except Exception as e:          # not data (committer.Step): this call fails
            raise TypeError(f"a {step.kind} step is not data: {step.fn!r}: {e}") from None
        self._steps[step.seq] = step
        if self.failed is None:
            try:
                self._write(frame, now)
                return
            except OSError:             # the writer died: its pipe's end is near
                if self._reader is None:    # the replies task fails the step with the rest
                    return
                self._reader.join()
        if self._steps.pop(step.seq, None) is not None:
            self._fail([step])

    def _write(self, frame: list[memoryview], now: bool) -> None:
        """Write ``frame`` (its pieces) after those not yet written: ``now`` if it can be
        (outside trio, always). In trio, the rest waits in order for ``_flush_unsent``."""
        if not self._in_trio:
            _write_all(self._out_fd, deque(frame))
            return
        self._unsent.extend(frame)
        self._raw_unsent += type(frame[-1]) is _RingFrame
        if now and not self._raw_unsent and not self._flushing:
            self._write_small()
            if not self._unsent:
                return
        self._room.set()

    def _write_small(self) -> None:
        """On the trio thread, write what the pipe has room for of ``_unsent`` (no chunk
        data among it)."""
        with contextlib.suppress(BlockingIOError):
            while self._unsent:
                _written(self._unsent,
                         os.writev(self._out_fd, list(itertools.islice(self._unsent, _IOV_MAX))))

    async def _flush_unsent(self) -> None:
        """A trio system task: write what waits in ``_unsent``: posted steps after
        POST_DELAY; chunk data, or whatever finds the pipe full, in a worker thread (copying
        a 1 MiB chunk into the pipe takes the writing thread about 0.15 ms, during which
        the trio thread would serve no request: docs/benchmarks.md, eleventh round)."""
        while True:
            await self._room.wait()
            if not self._raw_unsent:
                await trio.sleep(POST_DELAY)
            self._room = trio.Event()
            self._frame_batch()
            if not self._raw_unsent:
                try:
                    self._write_small()
                except OSError:         # the writer died: _receive fails the steps
                    self._unsent.clear()
            while self._unsent:
                pieces, self._unsent, self._raw_unsent = self._unsent, deque(), 0
                self._flushing = True
                # Shielded: once out of _unsent, the pieces are written, all of them, or
                # the writer is gone (a frame cut short would garble every later one; one
                # dropped would lose an answered change). Trio ending waits for it.
                try:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(_write_all, self._out_fd, pieces)
                except OSError:         # the writer died: _receive fails the steps
                    self._unsent.clear()
                    break
                finally:
                    self._flushing = False

    # ---- the writer's replies -----------------------------------------------------------------

    async def _receive(self) -> None:
        """A trio system task: deliver the writer's replies as they come, until its pipe
        ends (it exited: ``_writer_gone``) or trio does (``stop`` reads the rest)."""
        while True:
            await trio.lowlevel.wait_readable(self._replies_fd)
            if not self._take_replies(_call):
                break
        await trio.to_thread.run_sync(self._proc.wait)     # it has closed its end: exiting
        self._writer_gone()

    def _read(self) -> None:
        """The reader thread (outside trio)."""
        try:
            self._take_replies(self._relay)
        finally:
            self._writer_gone()

    def _take_replies(self, call) -> bool:
        """Read and deliver what the writer sent, calling the callbacks through ``call``:
        until the pipe is empty (if it does not block) or ends. False: it ended, or sent
        what cannot be read or applied (a bug: nothing more from it can be trusted, so it
        is stopped)."""
        replies = self._replies
        while True:
            try:
                data = os.read(self._replies_fd, max(REPLY_READ, replies.wanted))
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            replies.add(data)
            while True:
                try:
                    frame = replies.next()
                except Exception:
                    log.exception("unreadable reply from the writer process; stopping it")
                    self._proc.kill()
                    return False
                if frame is None:
                    break
                try:
                    self._deliver(frame, call)
                except Exception:
                    log.exception("a reply from the writer process could not be applied "
                                  "(a bug); stopping it")
                    self._proc.kill()
                    return False

    def _deliver(self, frame: tuple, call) -> None:
        kind, *rest = frame
        self._answers_early = rest[-1]
        if kind == "reply":
            step = self._answered(rest[0])
            call(step.done, step)
        elif kind == "ran":
            call(self._on_ran, [self._answered(outcome) for outcome in rest[0]], 0)
        elif kind == "committed":
            n, txn_no, ran = rest[0], rest[1], rest[2]
            if ran:
                call(self._on_ran, [self._settled(item, txn_no) if type(item) is int
                                    else self._answered(item) for item in ran], txn_no)
            call(self._committed, n, txn_no)

    def _answered(self, outcome: tuple) -> Step:
        seq, result, error, marks, records, txn_no, live = outcome
        step = self._steps.pop(seq)
        step.result, step.error, step.marks, step.records = result, error, marks, records
        step.txn_no, step.live, step.replied = txn_no, live, True
        return step

    def _settled(self, seq: int, txn_no: int) -> Step:
        """A posted step told by its number: it ran without error in transaction
        ``txn_no``, which is committed, and wrote what it was answered with."""
        step = self._steps.pop(seq)
        step.txn_no, step.replied = txn_no, True
        return step

    def _writer_gone(self) -> None:
        """The writer exited: at our request (nothing is left waiting), or it died. Then
        what it had not committed is lost, as in a crash: every step still waiting fails,
        and so does every later one (``failed``)."""
        self._gone = True
        code = self._proc.wait()
        reason = _exit_reason(code)
        self.failed = FsError(errno.EIO, f"the writer process exited ({reason}); remount "
                                         f"the filesystem")
        left = [self._steps.pop(seq, None) for seq in sorted(self._steps)]
        left = [step for step in left if step is not None]
        if code == 0 and not left:
            return
        log.critical("the writer process of %s exited (%s): changes not yet committed are "
                     "lost (as in a crash); the filesystem refuses changes until it is "
                     "remounted", self.store.path, reason)
        self._fail(left)

    def _fail(self, steps: list[Step]) -> None:
        """Answer ``steps`` with ``failed``, as the committer answers steps it refuses
        (through ``relay``: the caller may be on its way to sending one of them)."""
        posted = []
        for step in steps:       # an error each: one raised again and again keeps every
            step.error = FsError(*self.failed.args)     # traceback it was raised through
            step.replied = True
            if step.posted is not None:
                posted.append(step)
            else:
                self._relay(step.done, step)
        if posted:
            self._relay(self._on_ran, posted, 0)
        live = sum(1 for step in steps if step.kind == LIVE)
        if live:
            self._relay(self._committed, live, 0)   # counted as pending: never will be


class _Replies:
    """The writer's frames (LENGTH, then a pickle) out of the pieces the pipe gives
    (``add``), one at a time (``next``): those before one that cannot be read are
    delivered."""

    def __init__(self):
        self._buffer = bytearray()
        self._at = 0            # where the next frame begins in _buffer

    def add(self, data: bytes) -> None:
        del self._buffer[:self._at]
        self._at = 0
        self._buffer += data

    def next(self) -> tuple | None:
        """The next whole frame, unpickled; None until more comes. ValueError and what
        unpickling raises: it cannot be read."""
        length = self._length()
        if length is None or self._at + LENGTH.size + length > len(self._buffer):
            return None
        start, self._at = self._at + LENGTH.size, self._at + LENGTH.size + length
        return pickle.loads(self._buffer[start:self._at])

    @property
    def wanted(self) -> int:
        """Bytes the frame begun still needs (0: none begun, or its length unread)."""
        length = self._length()
        return 0 if length is None else \
            max(0, self._at + LENGTH.size + length - len(self._buffer))

    def _length(self) -> int | None:
        if len(self._buffer) - self._at < LENGTH.size:
            return None
        length, = LENGTH.unpack_from(self._buffer, self._at)
        if length > MAX_REPLY:
            raise ValueError(f"a reply frame of {length} bytes")
        return length


def _trio_running() -> bool:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def _batched(step: Step, checked_every: int) -> tuple:
    """What a frame holds of a posted step: its records to check, one step in
    ``checked_every`` (CHECKED_EVERY)."""
    return step.fn, step.args, step.nbytes, \
        step.predicted if step.seq % checked_every == 0 else None


def _batch_frame(steps: list[Step], checked_every: int) -> list[memoryview]:
    """One frame of posted steps with consecutive numbers (``post``)."""
    pickled = pickle.dumps([_batched(step, checked_every) for step in steps], protocol=5)
    return [memoryview(_HEAD.pack(HEADER.size + len(pickled), BATCH, steps[0].seq,
                                  len(steps)) + pickled)]


def _call(fn, *args) -> None:
    fn(*args)


def _frame(op: int, seq: int, body=None, ring: Ring | None = None) -> list:
    """A frame to the writer: one piece, LENGTH, HEADER and the pickled ``body``; with a
    ``ring``, each large ``bytes`` in ``body`` is left out of the pickle, to go through
    the ring: the frame is then a ``_RingFrame``, which the thread that writes it places
    there (``_write_all``)."""
    if ring is None:            # most steps: one piece, built the quickest way
        pickled = pickle.dumps(body, protocol=5) if body is not None else b""
        return [memoryview(_HEAD.pack(HEADER.size + len(pickled), op, seq, len(pickled))
                           + pickled)]
    out = io.BytesIO()
    out.write(bytes(LENGTH.size + HEADER.size))
    pieces: list[bytes] = []
    _DataPickler(out, pieces).dump(body)
    head = out.getbuffer()
    HEADER.pack_into(head, LENGTH.size, op | RING, seq, len(head) - LENGTH.size - HEADER.size)
    return [_RingFrame(ring, head, pieces)]


class _RingFrame:
    """A frame whose chunk data goes through the ring: its head (LENGTH, HEADER, the pickle)
    and the data, until ``placed`` copies the data into the ring (waiting for room, so
    never on the trio thread) and gives the frame's bytes: the head, then the region."""
    __slots__ = ("ring", "head", "pieces")

    def __init__(self, ring: Ring, head: memoryview, pieces: list[bytes]):
        self.ring, self.head, self.pieces = ring, head, pieces

    def placed(self, gone_fd: int) -> memoryview:
        place = RING_PLACE.pack(*self.ring.place(self.pieces, gone_fd))
        LENGTH.pack_into(self.head, 0, len(self.head) + len(place) - LENGTH.size)
        return memoryview(bytes(self.head) + place)


class _DataPickler(pickle.Pickler):
    """Pickles each ``bytes`` of at least RAW_BYTES as ``(offset, length)`` of its place
    among the step's pieces of data (appended to ``pieces``, placed in the ring together)."""

    def __init__(self, out, pieces: list):
        super().__init__(out, protocol=5)
        self.pieces = pieces
        self.offset = 0

    def persistent_id(self, obj):
        if type(obj) is not bytes or len(obj) < RAW_BYTES:
            return None
        self.pieces.append(obj)
        self.offset += len(obj)
        return self.offset - len(obj), len(obj)


class _DataUnpickler(pickle.Unpickler):
    """The writer's side of _DataPickler: each reference becomes a view of ``data`` (its
    region of the ring)."""

    def __init__(self, pickled, data: memoryview):
        super().__init__(io.BytesIO(pickled))
        self.data = data

    def persistent_load(self, pid):
        offset, length = pid
        if not (0 <= offset and 0 <= length and offset + length <= len(self.data)):
            raise pickle.UnpicklingError(f"data reference {pid} outside its region")
        return self.data[offset:offset + length]


def _written(pieces: deque, done: int) -> None:
    """Drop the first ``done`` bytes of ``pieces``."""
    while done:
        first = pieces[0]
        if done < len(first):
            pieces[0] = first[done:]
            return
        done -= len(first)
        pieces.popleft()


def _write_all(fd: int, pieces: deque) -> None:
    """Write ``pieces`` to ``fd`` (blocking or not: then waiting for room as the writer
    reads, in a worker thread), placing the data of each ``_RingFrame`` in the ring first;
    what is written leaves ``pieces``. A frame's data is placed only once everything
    before it is written: the room it waits for may be what the writer gives back after
    running the frames before it."""
    room = select.poll()
    room.register(fd, select.POLLOUT)
    while pieces:
        if type(pieces[0]) is _RingFrame:
            pieces[0] = pieces[0].placed(fd)
        ready = itertools.takewhile(lambda piece: type(piece) is not _RingFrame,
                                    itertools.islice(pieces, _IOV_MAX))
        try:
            _written(pieces, os.writev(fd, list(ready)))
        except BlockingIOError:
            room.poll()


def _read_frame(incoming) -> bytes | None:
    """The next frame from the mount (without its length), None at the pipe's end. A frame
    the end cuts short (the mount died writing it) is None too: never half a step."""
    head = incoming.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    length, = LENGTH.unpack(head)
    frame = incoming.read(length)
    return frame if len(frame) == length >= HEADER.size else None


def _body(frame: memoryview, pickled: int, data: memoryview | None = None):
    """The step a frame's body (after HEADER) holds: ``pickled`` bytes of pickle; ``data``:
    the region of the ring its chunk data is in."""
    if data is None:
        return pickle.loads(frame[:pickled])
    return _DataUnpickler(frame[:pickled], data).load()


def _widen(fd: int) -> None:
    with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: the default stays
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)


def _in_child() -> None:
    """In the child before exec (a signal ignored stays ignored across it): NICE, and
    SIGINT, SIGHUP and SIGTERM ignored. Ctrl-C in a terminal, a closed session and systemd's
    stop signal every process of the mount's group; the mount's answer is to unmount, and
    the writer must live on to commit what it sends (it stops at STOP or at the end of its
    input). A KeyboardInterrupt raised in the writer by the same Ctrl-C could end it
    first, and every change still open was lost."""
    os.nice(NICE)
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def _exit_reason(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


# ---- the writer process ------------------------------------------------------------------------

class _Writer:
    """The child's side: a Committer fed from the mount's frames, its callbacks (all in the
    committer's thread) sent back."""

    def __init__(self, store: Store, out: int, lockfd: int = -1, ring: Ring | None = None):
        self.out = out          # the pipe to the mount (blocking); -1 once the mount is gone
        self.lockfd = lockfd    # the store lock's open file, shared with the mount (-1: none)
        self.ring = ring
        self.regions: deque = deque()   # (step number, end) of the ring's regions in use
        self.given = 0          # the ring's position up to which all is given back
        self.last_run = 0       # the number of the last step that ran (or was answered)
        with store.read() as txn:
            live = store.live_epoch(txn)
        self.committer = Committer(store, live, self._committed, self._ran)
        self.prealloc = Preallocator(store)
        self.ran: list[Step] = []       # posted steps that ran, not yet told (see _ran)

    def serve(self, incoming) -> bool:
        """Run the steps the mount sends until it says STOP (True) or its end of the pipe
        closes without it (False: the mount died); commit what ran either way."""
        self.committer.start()
        try:
            self.prealloc.start()
            try:
                stopped = self._take_frames(incoming)
            finally:
                self.prealloc.stop()
            if not stopped:
                self._orphaned()
        finally:
            self.committer.stop()
            self._tell_ran()
        if not stopped and self.lockfd >= 0:
            release_lock(self.lockfd)       # the mount is gone: nobody else clears its name
        return stopped

    def _orphaned(self) -> None:
        """The mount died: the lock now names this process until it has committed."""
        log.warning("the mount process ended without stopping its writer: committing the "
                    "changes it sent, then exiting")
        if self.lockfd >= 0:
            with contextlib.suppress(OSError):      # a full disk: the name is for messages
                relabel_lock(self.lockfd, ORPHANED_WRITER)

    def _take_frames(self, incoming) -> bool:
        while True:
            frame = _read_frame(incoming)
            if frame is None:           # the mount is gone: it died
                return False
            op, seq, pickled = HEADER.unpack_from(frame)
            if op == STOP:
                return True
            if op == BATCH:
                self._submit_batch(seq, pickled, memoryview(frame)[HEADER.size:])
            elif op & RING:
                self._submit_placed(op & ~RING, seq, memoryview(frame)[HEADER.size:], pickled)
            else:
                self._submit(op, seq, memoryview(frame)[HEADER.size:], pickled)

    def _submit_placed(self, op: int, seq: int, body: memoryview, pickled: int) -> None:
        """A step whose data is in the ring: its region is in use until the step's
        transaction has committed (``_give_back``)."""
        try:
            position, length = RING_PLACE.unpack_from(body, pickled)
            data = self.ring.region(position, length)
        except Exception as e:          # a bug: this step fails, as if it had raised
            self._submit(op, seq, body, pickled, f"{type(e).__name__}: {e}")
            return
        self.regions.append((seq, position + length))
        self._submit(op, seq, body, pickled, data)

    def _submit_batch(self, first: int, count: int, body: memoryview) -> None:
        """Post the ``count`` steps of a BATCH frame, numbered from ``first``. One that
        cannot be read (a bug) fails them all, as if each had raised."""
        try:
            steps = pickle.loads(body)
            if len(steps) != count:
                raise ValueError(f"{len(steps)} steps in a batch of {count}")
        except Exception as e:
            steps = [(_unreadable, (f"{type(e).__name__}: {e}",), 0, {})] * count
        for seq, (fn, args, nbytes, predicted) in enumerate(steps, first):
            self._post(seq, fn, args, nbytes, predicted)

    def _post(self, seq: int, fn, args: tuple, nbytes: int, predicted: dict) -> None:
        step = Step(LIVE, fn, args, nbytes, posted=())
        step.seq, step.predicted = seq, predicted or {}
        self.committer.post(step)

    def _submit(self, op: int, seq: int, body: memoryview, pickled: int,
                data: memoryview | str | None = None) -> None:
        """Run or post one step. ``data``: its region of the ring, or why it is unreadable."""
        predicted = {}
        try:
            if type(data) is str:
                raise ValueError(data)
            kind, fn, args, nbytes, *rest = _body(body, pickled, data)
            if op == POST:
                predicted, = rest
        except Exception as e:          # a bug: this step fails, as if it had raised
            kind, fn, args, nbytes = LIVE, _unreadable, (f"{type(e).__name__}: {e}",), 0
        if op == POST:
            self._post(seq, fn, args, nbytes, predicted)
        else:
            step = Step(kind, fn, args, nbytes, done=self._reply)
            step.seq = seq
            self.committer.put(step)

    def _reply(self, step: Step) -> None:
        self.last_run = step.seq
        self._tell_ran()                # the committer's order: what ran before, first
        self._send("reply", self._outcome(step))

    def _ran(self, steps: list[Step]) -> None:
        """Posted steps ran: told with the commit that follows (``_committed``), or before
        a reply, or when the writer stops; nobody waits for them meanwhile. One that failed
        is told at once: an answered change is lost, and the mount must stop answering
        changes before they run now, not at a commit a long COMMIT_DELAY puts off."""
        self.ran.extend(steps)
        self.last_run = steps[-1].seq
        if any(step.error is not None for step in steps):
            self._tell_ran()

    def _tell_ran(self) -> None:
        if self.ran:
            ran, self.ran = self.ran, []
            self._send("ran", [self._outcome(step) for step in ran])

    def _committed(self, n: int, txn_no: int) -> None:
        """Told with the commit of transaction ``txn_no``: the posted steps that ran since
        the last telling, each by its number alone if it is settled (``_settled``)."""
        self._give_back()
        ran, self.ran = self.ran, []
        self._send("committed", n, txn_no,
                   [step.seq if self._settled(step, txn_no) else self._outcome(step)
                    for step in ran])
        self.prealloc.wake()

    def _give_back(self) -> None:
        """After a commit: the ring's regions of the steps that ran (all of them in a
        committed transaction now, steps running in order) may be reused. Before the
        mount is told, so that it never waits for room on a telling it has not read."""
        end = self.given
        while self.regions and self.regions[0][0] <= self.last_run:
            end = self.regions.popleft()[1]
        if end > self.given:
            self.ring.give_back(end - self.given)
            self.given = end

    def _settled(self, step: Step, txn_no: int) -> bool:
        """Whether a posted step ran without error in transaction ``txn_no`` (being told
        committed) and wrote the records it was answered with (checked when it came with
        them: ``committer.mispredicted``): the mount has nothing left to note of it, and
        nothing to check (it logs the difference of one that did not)."""
        if step.error is not None or step.txn_no != txn_no:
            return False
        return not step.predicted or not mispredicted(self.committer.noted(step))

    def _outcome(self, step: Step) -> tuple:
        step = self.committer.noted(step)
        return (step.seq, step.result, step.error, step.marks, step.records, step.txn_no,
                step.live)

    def _send(self, kind: str, *body) -> None:
        """Tell the mount; nothing once it is gone (its steps are still committed)."""
        if self.out < 0:
            return
        frame = (kind, *body, self.committer.answers_early())
        try:
            pickled = pickle.dumps(frame, protocol=5)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            pickled = pickle.dumps(_portable(frame, e), protocol=5)
        try:
            _write_all(self.out,
                       deque([memoryview(LENGTH.pack(len(pickled))), memoryview(pickled)]))
        except BrokenPipeError:
            self.out = -1


def _unreadable(live, problem: str) -> None:
    """The step of a frame the writer could not read."""
    raise FsError(errno.EIO, f"the writer process could not read a step ({problem})")


def _portable(frame: tuple, problem: Exception) -> tuple:
    """``frame`` with every result or error that cannot be sent replaced by EIO."""
    def fix(outcome):
        try:
            pickle.dumps(outcome)
            return outcome
        except Exception:
            seq, _, error, marks, records, txn_no, live = outcome
            error = FsError(errno.EIO, f"{error or problem}")
            return seq, None, error, marks, records, txn_no, live
    kind, *body = frame
    if kind == "reply":
        body[0] = fix(body[0])
    elif kind == "ran":
        body[0] = [fix(outcome) for outcome in body[0]]
    elif kind == "committed":
        body[2] = [fix(outcome) for outcome in body[2]]
    return (kind, *body)


def main(argv: list[str]) -> int:
    path, incoming_fd, out_fd, lockfd = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    ring = Ring.attach(int(argv[4]), int(argv[5]))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s mountfs-writer %(levelname)s %(message)s")
    from . import engine, ops        # noqa: F401  the steps' modules, before the first step
    keep_freed_buffers()             # each frame and each commit's overflow pages: 1 MiB
    store = Store.open(path, lock=False)
    try:
        with open(incoming_fd, "rb", buffering=PIPE_BYTES) as incoming:
            _Writer(store, out_fd, lockfd, ring).serve(incoming)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
