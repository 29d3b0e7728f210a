"""The writer process (mountfs.writer): the committer in a process of its own. It dies with
the mount; if it dies alone, changes fail at once (EIO) instead of hanging, the log says
why, and a remount finds everything committed before; a step that is not data is refused
where it is sent."""

from __future__ import annotations

import errno
import os
import queue
import signal
import stat
import time
from pathlib import Path

import pytest

from conftest import cli, fsck_clean
from mountfs import schema as S
from mountfs.committer import LIVE, Step
from mountfs.namespace import FsError, Live, View
from mountfs.store import Store
from mountfs.writer import WriterProcess


def writer_pid(mount_pid: int) -> int:
    """The mount process's writer (its child running ``mountfs.writer``)."""
    for tid in os.listdir(f"/proc/{mount_pid}/task"):
        for child in Path(f"/proc/{mount_pid}/task/{tid}/children").read_text().split():
            if b"mountfs.writer" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"mount process {mount_pid} has no writer process")


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_the_writer_dies_with_the_mount_and_the_store_mounts_again(make_mount):
    m = make_mount()
    with open(m.mnt / "kept", "wb") as f:
        f.write(b"fsynced")
        f.flush()
        os.fsync(f.fileno())
    writer = writer_pid(m.pid)
    m.kill9()
    assert gone(writer), "the writer outlived the mount process"
    m.mount()
    assert (m.mnt / "kept").read_bytes() == b"fsynced"


def test_a_writer_killed_alone_fails_changes_and_the_log_says_why(make_mount):
    m = make_mount()
    (m.mnt / "d").mkdir()
    with open(m.mnt / "d" / "kept", "wb") as f:
        f.write(b"fsynced")
        f.flush()
        os.fsync(f.fileno())
    writer = writer_pid(m.pid)
    os.kill(writer, signal.SIGKILL)
    assert gone(writer)
    deadline = time.monotonic() + 30
    while "writer process" not in m.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(OSError) as err:     # refused, not hung
        (m.mnt / "d" / "new").mkdir()
    assert err.value.errno == errno.EIO
    assert "exited (killed by signal 9)" in m.log() and "remount" in m.log()
    assert (m.mnt / "d" / "kept").read_bytes() == b"fsynced"    # reads go on
    m.umount()
    m.mount()
    assert (m.mnt / "d" / "kept").read_bytes() == b"fsynced"
    (m.mnt / "d" / "new").mkdir()                               # a remount writes again
    m.umount()
    fsck_clean(m.store)


def _known_only_here(live) -> None:
    """A function the writer process cannot import (it is in the tests)."""


def test_a_step_that_is_not_data_is_refused_where_it_is_sent(tmp_path):
    """Steps go to another process as data (committer.Step): a closure over the caller's
    state cannot, and the call that sends one fails; a step the writer cannot read fails
    alone (EIO); the writer goes on."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    store = Store.open(path)
    with store.read() as txn:
        live = store.live_epoch(txn)
    writer = WriterProcess(store, lambda n, txn_no: None, lambda steps: None)
    writer.start()
    try:
        replies: queue.SimpleQueue = queue.SimpleQueue()
        name = b"closure"
        with pytest.raises(TypeError, match="not data"):
            writer.put(Step(LIVE, lambda live: live.create(S.ROOT_INO, name, stat.S_IFREG,
                                                           0, 0), done=replies.put))
        writer.put(Step(LIVE, _known_only_here, done=replies.put))
        step = replies.get(timeout=60)
        assert isinstance(step.error, FsError) and step.error.errno == errno.EIO
        assert "could not read a step" in str(step.error)
        writer.put(Step(LIVE, Live.create, (S.ROOT_INO, b"data", stat.S_IFREG | 0o644, 0, 0),
                        done=replies.put))
        step = replies.get(timeout=60)
        assert step.error is None and step.result[0] > S.ROOT_INO
        assert replies.empty() and writer.failed is None
    finally:
        writer.stop()
    with store.read() as txn:
        view = View(txn, store.db, live, store.chunk_size)
        assert view.lookup(S.ROOT_INO, b"data") and view.lookup(S.ROOT_INO, name) is None
    store.close()
    fsck_clean(path)
