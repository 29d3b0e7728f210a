#!/usr/bin/env python3
"""The writer process of scripts/durable_floor.py: it imports nothing but LMDB, so that it
costs the measured runs no start-up. Not part of the package.

    python scripts/floor_writer.py STOREDIR     # frames on stdin, answers on stdout
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import struct
import sys
import threading
import time

import lmdb

COMMIT_DELAY = 0.005        # as mountfs.committer.COMMIT_DELAY's default
FRAME = struct.Struct("<IQ?")   # the pickle's length, the frame's number, commit at once
ACK = struct.Struct("<Q")       # the writer's answer: every frame up to this one committed


def _read_frames(fd: int, frames: queue.SimpleQueue) -> None:
    """The pipe's frames, decoded, onto ``frames``; None at its end."""
    buf = bytearray()
    while data := os.read(fd, 1 << 20):
        buf += data
        while len(buf) >= FRAME.size:
            size, number, urgent = FRAME.unpack_from(buf)
            end = FRAME.size + size
            if len(buf) < end:
                break
            frames.put((number, urgent, pickle.loads(bytes(buf[FRAME.size:end]))))
            del buf[:end]
    frames.put(None)


def writer(store: str) -> None:
    """Put every frame's changes into the store; commit (synced) once the oldest uncommitted
    change is COMMIT_DELAY old, at once for a frame that asks (fsync), and at the end of the
    pipe. After each commit, answer the number of the last frame it holds."""
    env = lmdb.open(store, map_size=1 << 40, sync=True, metasync=False)
    frames: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_frames, args=(0, frames), daemon=True).start()
    txn, deadline, last = None, None, 0

    def commit():
        txn.commit()
        with contextlib.suppress(BrokenPipeError):      # the floor is gone: nobody waits
            os.write(1, ACK.pack(last))
    while True:
        try:
            frame = frames.get(timeout=None if txn is None
                               else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            commit()
            txn = None
            continue
        if frame is None:
            break
        last, urgent, changes = frame
        if txn is None:
            txn, deadline = env.begin(write=True), time.monotonic() + COMMIT_DELAY
        for key, value in changes.items():
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
        if urgent:
            commit()
            txn = None
    if txn is not None:
        commit()
    env.sync(True)
    env.close()


if __name__ == "__main__":
    try:
        writer(sys.argv[1])
    except lmdb.Error as e:             # a full disk, a store it cannot open: one line
        sys.exit(f"floor_writer.py: {sys.argv[1]}: {e}; the floor's fsyncs now fail (EIO)")
