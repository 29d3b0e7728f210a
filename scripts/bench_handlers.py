#!/usr/bin/env python3
"""What mountfs's own code costs per created file, without the kernel in the way.

Creating a small file (open O_CREAT|O_EXCL, write 1 KiB, close) sends the filesystem seven
requests, as the kernel's fuse tracepoints show: GETATTR of the directory (a create
invalidates its attributes, and default_permissions needs its mode for the next path
walk), LOOKUP (negative), CREATE, GETXATTR security.capability (the first write), WRITE,
FLUSH and RELEASE. This calls those seven handlers directly, in one trio loop, on
mountfs's Operations (a real store, its writer process and committer, the mount's malloc
policy and GIL switch interval) and on the benchmarks' floor (scripts/nullfs.py), and
prints the trio thread's CPU per file for each and their difference. Without FUSE's
run-to-run noise, a change of a few microseconds shows here.

The difference is a lower bound of what the mount's trio thread spends beyond the floor's
in a FUSE run (bench_io.py --only small): pyfuse3's request loop, trio's scheduler and the
kernel cost both the same and are not here, but neither are what a real mount adds around
its handlers (GIL hand-offs with its reply reader between requests, caches cooled by the
kernel's work).

    python scripts/bench_handlers.py [--files 20000] [--repeat 3] [--workdir /var/tmp]

Each figure is the median of ``--repeat`` rounds of ``--files`` creates, after one round
of warm-up; mountfs and the floor alternate, and a mount round ends with a sync, so the
writer's backlog and its replies are charged to the mount. Not part of the package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import pyfuse3
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nullfs import NullFS                           # noqa: E402

from mountfs.engine import Engine                   # noqa: E402
from mountfs.memory import keep_freed_buffers       # noqa: E402
from mountfs.mount import GIL_SWITCH                # noqa: E402
from mountfs.ops import CAPABILITY, Operations      # noqa: E402
from mountfs.store import Store                     # noqa: E402

DATA = b"x" * 1024


async def create_files(ops, parent: int, prefix: str, count: int, ctx,
                       engine: Engine | None = None) -> float:
    """The seven requests of ``count`` created files; the trio thread's CPU per file.
    With ``engine`` (mountfs), up to the sync of all of them."""
    start = time.thread_time()
    for i in range(count):
        name = f"{prefix}{i}".encode()
        await ops.getattr(parent, ctx)
        entry = await ops.lookup(parent, name, ctx)
        if entry.st_ino:
            raise RuntimeError(f"{name!r} exists before its create")
        info, attrs = await ops.create(parent, name, 0o644, os.O_WRONLY, ctx)
        try:
            await ops.getxattr(attrs.st_ino, CAPABILITY, ctx)
        except pyfuse3.FUSEError as e:      # what the kernel hears for a new file
            if e.errno != pyfuse3.ENOATTR:
                raise
        else:
            raise RuntimeError(f"{name!r} has {CAPABILITY!r} as soon as it is created")
        await ops.write(info.fh, 0, DATA)
        await ops.flush(info.fh)
        await ops.release(info.fh)
        await trio.lowlevel.checkpoint()        # as between two requests: background work runs
    if engine is not None:
        await engine.sync()
    return (time.thread_time() - start) / count


async def run_rounds(mount_ops: Operations, engine: Engine, floor_ops: NullFS,
                     files: int, repeat: int) -> dict[str, list[float]]:
    """Per-file CPU of each round, by side. The engine's background tasks run as in a
    mount (the periodic sync, the expiry of dirty data; ``files.nursery`` lets a write
    start a background flush), and the sides alternate so that drift hits both alike."""
    ctx = types.SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(),
                                umask=0o022)
    out = {"mount": [], "floor": []}
    engine.start()
    async with trio.open_nursery() as nursery:
        engine.files.nursery = nursery
        nursery.start_soon(engine.syncer)
        nursery.start_soon(engine.files.expirer)
        dirs = {"mount": (await mount_ops.mkdir(1, b"d", 0o755, ctx)).st_ino,
                "floor": (await floor_ops.mkdir(1, b"d", 0o755, ctx)).st_ino}
        for rnd in range(repeat + 1):           # round 0 warms up
            for side, ops in (("mount", mount_ops), ("floor", floor_ops)):
                per_file = await create_files(ops, dirs[side], f"r{rnd}-", files, ctx,
                                              engine if side == "mount" else None)
                if rnd:
                    out[side].append(per_file)
                    print(f"  round {rnd} {side}: {per_file * 1e6:.1f} µs per file",
                          flush=True)
        await engine.files.flush_all()
        await engine.sync()
        nursery.cancel_scope.cancel()
    return out


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main() -> int:
    """Set the process up as a mount does, make a store, run the rounds, print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=_at_least_one, default=20000,
                    help="files created per round (default: 20000)")
    ap.add_argument("--repeat", type=_at_least_one, default=3,
                    help="rounds measured, after one of warm-up; figures are medians "
                         "(default: 3)")
    ap.add_argument("--workdir", default="/var/tmp",
                    help="directory where the store is made and removed (default: /var/tmp)")
    args = ap.parse_args()
    keep_freed_buffers()
    sys.setswitchinterval(GIL_SWITCH)
    load = os.getloadavg()
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} "
          f"CPUs; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    path = tempfile.mkdtemp(prefix="bench-handlers-", dir=args.workdir)
    try:
        Store.mkfs(path)
        store = Store.open(path, readonly=False, lock=True, holder="bench_handlers")
        try:
            engine = Engine(store)
            try:
                figures = trio.run(run_rounds, Operations(engine, read_only=False), engine,
                                   NullFS(timeout=300.0, writeback=True, discard=False),
                                   args.files, args.repeat)
            finally:
                engine.close()
        finally:
            store.close()
    finally:
        shutil.rmtree(path)
    mount, floor = (statistics.median(figures[s]) * 1e6 for s in ("mount", "floor"))
    print(f"\ntrio thread CPU per created file (7 handlers, no FUSE), median of "
          f"{args.repeat}: mount {mount:.1f} µs, floor {floor:.1f} µs, difference "
          f"{mount - floor:.1f} µs ({mount / floor:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
