"""The shared memory that carries chunk data from the mount to its writer process.

Why: through the pipe, every chunk was copied by the kernel twice (into the pipe and out of
it, 64 KiB at a time, each read waking the writer's main thread), 0.47-0.65 CPU-seconds per
GiB written on two cores that the writing program, the mount and the writer share
(docs/benchmarks.md, thirty-first round). Here the mount copies a frame's chunk data once,
into memory both processes map, and the writer hands views of it to LMDB, which copies it
into its pages: no copy out, no system call per 64 KiB.

How:
* a memfd of ``capacity`` bytes, mapped by both, and an eventfd; the mount creates them and
  the writer inherits both (``WriterProcess.start``);
* the mount takes regions in order (positions count bytes since the start, so ``position %
  capacity`` is the offset): a frame's data goes in one contiguous region, the end of the
  ring skipped when it would not fit there. It waits, in the thread that copies (never the
  trio thread), while the ring has no room, or until the writer is gone;
* the writer gives regions back in the order they were taken, once the transaction of the
  step that read them has committed (LMDB has copied the data, and a step run again after a
  full disk reads it again before that): it adds the bytes given back to the eventfd's
  counter, which the kernel adds up atomically and which wakes a mount waiting for room.
  Nothing else is shared, so no torn value can make the mount overwrite data in use.

Progress: a frame holds at most ``max(STEP_BYTES, chunk size)`` of data and the ring is at
least twice that, and the writer commits by itself (``COMMIT_DELAY``), so a frame waiting for
room always gets it. Both sides are the same user's processes, parent and child: the writer
still checks that each place it is told lies inside the ring (a bug there fails one step).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import threading

RING_BYTES = 64 << 20       # the ring, at least (two transactions' worth: TXN_BYTES is 32 MiB)


def capacity(chunk_size: int) -> int:
    """The ring's size for a store of ``chunk_size``: room for two of its largest frames
    (one step holds at least one whole chunk)."""
    return max(RING_BYTES, 2 * chunk_size)


class Ring:
    """One side's mapping of the ring: ``fds`` go to the writer, which ``attach``es them."""

    def __init__(self, memfd: int, eventfd: int, size: int):
        self.memfd, self.eventfd, self.size = memfd, eventfd, size
        self._map = mmap.mmap(memfd, size)
        self._view = memoryview(self._map)
        self._head = 0              # the mount's: where the next region starts
        self._freed = 0             # the mount's: everything before this is given back
        self._lock = threading.Lock()

    @classmethod
    def create(cls, chunk_size: int) -> Ring:
        size = capacity(chunk_size)
        memfd = os.memfd_create("mountfs-chunk-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(memfd, size)
            eventfd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except BaseException:
            os.close(memfd)
            raise
        return cls(memfd, eventfd, size)

    @classmethod
    def attach(cls, memfd: int, eventfd: int) -> Ring:
        """The writer's side, from the descriptors it inherited."""
        return cls(memfd, eventfd, os.fstat(memfd).st_size)

    @property
    def fds(self) -> list[int]:
        return [self.memfd, self.eventfd]

    # ---- the mount's side -----------------------------------------------------------------

    def place(self, pieces: list, gone_fd: int) -> tuple[int, int]:
        """Copy ``pieces`` one after the other into the next region, waiting for room;
        its (position, length). ``gone_fd``: the pipe to the writer, whose end (the writer
        gone) ends the wait with BrokenPipeError, as a write to it would."""
        total = sum(map(len, pieces))
        if total > self.size:
            raise ValueError(f"{total} bytes of chunk data in one frame: more than the "
                             f"ring's {self.size}")
        with self._lock:
            start = self._head
            if start % self.size + total > self.size:
                start += self.size - start % self.size      # the end is skipped
            # The data a lap ago where the region goes, and no later than the last region's
            # end (a skipped end holds none) must be given back.
            self._wait_for(min(start + total - self.size, self._head), gone_fd)
            at = start % self.size
            for piece in pieces:
                self._view[at:at + len(piece)] = piece
                at += len(piece)
            self._head = start + total
        return start, total

    def _wait_for(self, freed: int, gone_fd: int) -> None:
        """Until everything before position ``freed`` is given back."""
        waiting = None
        while self._freed < freed:
            given = self._given_back()
            if given:
                self._freed += given
                continue
            if waiting is None:
                waiting = select.poll()
                waiting.register(self.eventfd, select.POLLIN)
                waiting.register(gone_fd, 0)        # POLLERR: the reading end is closed
            for fd, events in waiting.poll():
                if fd == gone_fd and events & (select.POLLERR | select.POLLHUP):
                    raise BrokenPipeError("the writer process is gone")

    def _given_back(self) -> int:
        """The bytes the writer gave back since the last look (0: none yet)."""
        try:
            return os.eventfd_read(self.eventfd)
        except BlockingIOError:
            return 0

    # ---- the writer's side ----------------------------------------------------------------

    def region(self, position: int, length: int) -> memoryview:
        """The data the mount placed at ``position``: a view, valid until given back."""
        offset = position % self.size if position >= 0 else -1
        if not (0 <= offset and 0 <= length and offset + length <= self.size):
            raise ValueError(f"a region ({position}, {length}) outside the ring")
        return self._view[offset:offset + length]

    def give_back(self, nbytes: int) -> None:
        """Tell the mount the oldest ``nbytes`` of what it placed (skipped ends included)
        may be reused."""
        if nbytes > 0:
            os.eventfd_write(self.eventfd, nbytes)

    def close(self) -> None:
        """Unmap (unless a view is still held: then the process's end does it) and close."""
        self._view.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.memfd)
        os.close(self.eventfd)
