"""A filesystem whose lookups can be made to wait, served by mountfs's request loop
(mountfs/fuseloop.py), for tests/test_fuseloop.py (run as its own process):

    python tests/gatefs.py MOUNTPOINT [--pyfuse3-loop]

The root holds directories ``d0``, ``d1``...; each is empty. A lookup of a name starting
with ``wait`` waits until the gate opens; a lookup of ``open`` opens it; one of ``stop`` ends the session from inside its
handler, which then waits a little before it answers. Every other lookup
answers "no such name" (a negative entry that is not cached, so each one is a request). The
kernel lets a directory have one lookup at a time, so handlers that are to wait together
wait in different directories (``dK/wait``). SIGTERM ends the session with
``pyfuse3.terminate()``, as the mount does. At exit it prints one JSON line: the LOOKUPs
served and the steps trio ran of the tasks that serve requests (a worker that only went
back to waiting for the device is a step too). ``--pyfuse3-loop`` serves with pyfuse3's own
loop instead, for comparison.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

from mountfs import fuseloop

WORKER_TASKS = ("pyfuse", "_session_loop")      # how the serving tasks' names begin
DIRS = 1000                                     # the inode of d0


class GateFS(pyfuse3.Operations):
    def __init__(self):
        super().__init__()
        self.gate = trio.Event()
        self.lookups = 0

    async def getattr(self, inode, ctx=None):
        e = pyfuse3.EntryAttributes()
        e.st_ino = inode
        e.st_mode = stat.S_IFDIR | 0o755
        e.st_nlink = 2
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = time.time_ns()
        e.attr_timeout = 0
        return e

    async def lookup(self, parent_inode, name, ctx=None):
        self.lookups += 1
        if parent_inode == pyfuse3.ROOT_INODE and name[:1] == b"d" and name[1:].isdigit():
            e = await self.getattr(DIRS + int(name[1:]))
            e.entry_timeout = 300
            return e
        if name == b"open":
            self.gate.set()
        elif name == b"stop":         # the session ends while this handler still runs
            pyfuse3.terminate()
            await trio.sleep(0.2)
        elif name.startswith(b"wait"):
            await self.gate.wait()
        raise pyfuse3.FUSEError(2)      # ENOENT, not cached


class StepCounter(trio.abc.Instrument):
    def __init__(self):
        self.steps = 0

    def before_task_step(self, task):
        if task.name.split(".")[-1].startswith(WORKER_TASKS):
            self.steps += 1


async def serve(fs: GateFS, counter: StepCounter, pyfuse3_loop: bool) -> None:
    async def on_sigterm():
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                pyfuse3.terminate()
    trio.lowlevel.add_instrument(counter)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_sigterm)
        await (pyfuse3.main() if pyfuse3_loop else fuseloop.main())
        nursery.cancel_scope.cancel()


def main() -> None:
    mountpoint = os.path.realpath(sys.argv[1])
    fs, counter = GateFS(), StepCounter()
    pyfuse3.init(fs, mountpoint, ["fsname=gatefs"])
    try:
        trio.run(serve, fs, counter, "--pyfuse3-loop" in sys.argv[2:])
    finally:
        pyfuse3.close(unmount=True)
    print(json.dumps({"lookups": fs.lookups, "worker_steps": counter.steps}), flush=True)


if __name__ == "__main__":
    main()
