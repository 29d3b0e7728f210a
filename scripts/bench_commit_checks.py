#!/usr/bin/env python3
"""Benchmark of issue 10: what the receiver's checks (mountfs.invariants on every inode a
commit touches) cost a mirror commit, without Spark, HTTP or a mount in the way.

A source store with FILES files of 4 KiB in one directory is built through the namespace;
its full copy is committed to a mirror store (timed), then ROUNDS incremental commits each
change CHANGED files (``--mode write``: rewrite a chunk; ``create``: new files in the big
directory), each timed. Run it from two checkouts (before and after a change) in the same
session, alternating, and compare the medians:

    .venv/bin/python scripts/bench_commit_checks.py --files 20000 --changed 100
"""

from __future__ import annotations

import argparse
import shutil
import stat
import statistics
import tempfile
import time
from pathlib import Path

import blake3

from mountfs import chunkfile
from mountfs import schema as S
from mountfs import snapshots as snaps
from mountfs.namespace import Live
from mountfs.store import Store
from replicator import changeset, mirror

CHUNK = 64 << 10


def live(store: Store, txn) -> Live:
    return Live(txn, store.db, snaps.live_epoch(txn, store.db), CHUNK)


def write(lv: Live, ino: int, data: bytes) -> None:
    lv.put_chunk(ino, 0, blake3.blake3(data).digest(), data)
    lv.setattr(ino, size=len(data))


def send(src: Store, dst: Store, base: S.Snapshot | None, snap: S.Snapshot) -> float:
    """Build the changeset base -> snap, stage its chunks, time the commit alone."""
    with src.read() as txn:
        cs = changeset.build(txn, src.db, CHUNK, base.epoch if base else None, snap.epoch)
        blobs = [(d, bytes(chunkfile.get(txn, src.db, d))) for d in cs.digests()]
    with dst.write() as txn:
        mirror.stage(txn, dst.db, blobs)
    t = time.perf_counter()
    with dst.write() as txn:
        mirror.commit(txn, dst.db, CHUNK, src.uuid, base.uuid.hex() if base else None,
                      mirror.SnapshotRef(snap.name, snap.uuid.hex(), snap.created_ns), cs)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--changed", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--mode", choices=("write", "create"), default="write")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-commit-"))
    try:
        Store.mkfs(tmp / "src", CHUNK)
        Store.mkfs(tmp / "dst", CHUNK)
        src, dst = Store.open(tmp / "src"), Store.open(tmp / "dst")
        with src.write() as txn:
            lv = live(src, txn)
            d, _ = lv.create(S.ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
            files = []
            for i in range(args.files):
                f, _ = lv.create(d, b"f%d" % i, stat.S_IFREG | 0o644, 0, 0)
                write(lv, f, b"x" * 4096)
                files.append(f)
            last = snaps.create(txn, src.db, "s0")
        full = send(src, dst, None, last)
        times = []
        for r in range(args.rounds):
            with src.write() as txn:
                lv = live(src, txn)
                for k in range(args.changed):
                    if args.mode == "create":
                        f, _ = lv.create(d, b"new%d.%d" % (r, k), stat.S_IFREG | 0o644, 0, 0)
                    else:
                        f = files[(r * args.changed + k) * 7 % args.files]
                    write(lv, f, bytes([r % 256]) * 4096)
                snap = snaps.create(txn, src.db, f"s{r + 1}")
            times.append(send(src, dst, last, snap))
            last = snap
        src.close()
        dst.close()
        print(f"{args.mode}: {args.files} files in one directory, {args.changed} changed per "
              f"commit; full-copy commit {full:.3f} s; incremental commit median "
              f"{statistics.median(times) * 1000:.2f} ms (min {min(times) * 1000:.2f})")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
