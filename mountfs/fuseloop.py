"""Serving FUSE requests with one task switch each instead of two: the task that answered a
request reads the next one itself, unless its handler had to wait.

Why: pyfuse3's loop (``pyfuse3.main``) keeps a second worker task waiting for ``/dev/fuse``
behind a lock while the first one answers a request; when the next request comes, the lock
passes back, so every request wakes two tasks, one of which only goes back to waiting. With
one worker, a do-nothing filesystem makes 14-20% more creates and 13-22% more deletes per
second on this project's test machine (docs/benchmarks.md, fortieth round), but then a
handler that waits (for the writer, a worker thread, a lock) would stop every other request,
or deadlock when what it waits for needs a request of its own.

How: every worker runs pyfuse3's own request loop (``_session_loop``), which asks
``_wait_fuse_readable`` before each read of ``/dev/fuse``; that module function is replaced
by ``Readers.wait``. One worker at a time, the *reader*, waits for the device; it keeps that
role while it answers the request it read, and if the handler returns without waiting it
goes straight back to the device. If the handler waits (its task yields before it asks for
the next request: ``after_task_step``, a trio instrument), the role passes to a spare worker
at once, so requests keep being read while it waits, as pyfuse3's own loop does; a new spare
is started whenever none is left, up to pyfuse3's own limit of workers. Each worker still
waits for the device through trio (``wait_readable``), so every request passes through the
run loop and the mount's other tasks run between requests as before.

pyfuse3 gives neither the device's descriptor nor a hook for its loop: the descriptor is the
one ``/dev/fuse`` this process holds, and the loop is reached through pyfuse3's module
namespace (pyfuse3 3.5). If either is not as expected, ``main`` serves with
``pyfuse3.main`` instead, and says so in the log.
"""

from __future__ import annotations

import contextlib
import logging
import os

import pyfuse3
import trio

log = logging.getLogger(__name__)

MAX_WORKERS = 99        # pyfuse3.main's own limit (max_tasks)
DEVICE = "/dev/fuse"


def device_fd() -> int | None:
    """The descriptor of ``/dev/fuse`` this process holds (pyfuse3's session), or None if it
    holds none or several."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed meanwhile
            if os.readlink(f"/proc/self/fd/{name}") == DEVICE:
                found.append(int(name))
    return found[0] if len(found) == 1 else None


class Readers(trio.abc.Instrument):
    """Which worker reads the next request, and the spare workers (see the module's
    docstring). Also a trio instrument: it sees a worker yield in the middle of a request
    (``after_task_step``) and one leave the loop (``task_exited``)."""

    def __init__(self, fd: int, nursery: trio.Nursery):
        self.fd = fd
        self.nursery = nursery
        self.reader: trio.lowlevel.Task | None = None   # waits for, or answers, a request
        self.answering = False          # the reader has read a request and not yet asked
                                        # for the next one
        self.spares = trio.lowlevel.ParkingLot()
        self.workers: set[trio.lowlevel.Task] = set()  # those that have asked for a request
        self.started = 0                # spares started here (they run until the loop ends)
        self.closed = False

    async def wait(self) -> bool:
        """pyfuse3's ``_wait_fuse_readable``: True once the device has a request for this
        worker to read, False when the loop is to end (the device closed)."""
        task = trio.lowlevel.current_task()
        if task is self.reader:
            self.answering = False
        self.workers.add(task)
        while not self.closed:
            if self.reader is None:
                self.reader = task
                # pyfuse3.main's own worker and the spares, counted as started: a spare
                # not yet run is neither parked nor among ``workers``
                if not self.spares and 1 + self.started < MAX_WORKERS:
                    self._start_spare()
            if self.reader is task:
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:    # pyfuse3.terminate()
                    self.close()
                    return False
                self.answering = True
                return True
            await self.spares.park()
        return False

    def _start_spare(self) -> None:
        self.started += 1
        self.nursery.start_soon(pyfuse3._session_loop, self.nursery, 1, 1,
                                name=f"pyfuse-spare-{self.started:02d}")

    def close(self) -> None:
        """The loop ends: every waiting worker returns from ``wait`` with False, the reader
        too. ``pyfuse3.terminate()`` wakes only a reader already waiting for the device:
        one a handler handed over to later (terminate() from within a handler, or run
        between the hand-over and the new reader's first wait) is woken here, once a
        worker has left the loop."""
        self.closed = True
        self.spares.unpark_all()
        trio.lowlevel.notify_closing(self.fd)

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.reader and self.answering:      # its handler waits: hand over
            self.reader = None
            self.answering = False
            self.spares.unpark()

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        # A worker leaves the loop only when the session ends: the kernel's end of the
        # device went away (an unmount from outside), or terminate() with no reader waiting.
        if task in self.workers:
            self.workers.discard(task)
            self.close()


async def main() -> None:
    """Serve requests until the session ends, as ``pyfuse3.main()`` does (after
    ``pyfuse3.init``), with one task switch per request (see the module's docstring)."""
    fd = device_fd()
    wait = getattr(pyfuse3, "_wait_fuse_readable", None)
    if fd is None or wait is None or not hasattr(pyfuse3, "_session_loop"):
        log.info("serving with pyfuse3's own loop (its device or loop is not as expected)")
        await pyfuse3.main()
        return
    async with trio.open_nursery() as nursery:
        readers = Readers(fd, nursery)
        pyfuse3._wait_fuse_readable = readers.wait
        trio.lowlevel.add_instrument(readers)
        try:
            await pyfuse3.main(1, 1)    # its first worker; never more of its own
        finally:
            readers.close()
            trio.lowlevel.remove_instrument(readers)
            pyfuse3._wait_fuse_readable = wait
