"""The writer process (mountfs.writer): the committer in a process of its own. It outlives
a mount that dies only to commit what it was sent; if it dies alone, changes fail at once
(EIO) instead of hanging, the log says why, and a remount finds everything committed
before; a step that is not data is refused where it is sent; a writer faster than the store
is held back, and the buffers reused."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import queue
import random
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cli, fsck_clean, gone
from mountfs import schema as S
from mountfs import writer as writer_frames
from mountfs.committer import BATCH_STEPS, COMMIT, LIVE, LOOK, Step
from mountfs.engine import SYNC_INTERVAL, _checked_read
from mountfs.filecache import READ_BACK, STEP_BYTES, _commit_chunks, chunk_digest
from mountfs.namespace import FsError, Live, View
from mountfs.ring import RING_BYTES, Ring
from mountfs.store import Store
from mountfs.writer import RAW_BYTES, WriterProcess


def writer_pid(mount_pid: int) -> int:
    """The mount process's writer (its child running ``mountfs.writer``)."""
    for tid in os.listdir(f"/proc/{mount_pid}/task"):
        for child in Path(f"/proc/{mount_pid}/task/{tid}/children").read_text().split():
            if b"mountfs.writer" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"mount process {mount_pid} has no writer process")


def test_the_writer_ends_with_the_mount_and_the_store_mounts_again(make_mount):
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


def test_a_killed_mount_keeps_every_change_its_writer_was_sent(make_mount, monkeypatch):
    """README: kill -9 of the mount takes back only the changes not yet sent to the writer
    (within POST_DELAY, 2 ms), however long commits wait. Here they wait an hour: the
    writer commits what it was sent when the mount's end of the pipe closes. (Killed with
    the mount, it lost all of them.)"""
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", "3600")      # read by the writer process
    m = make_mount()
    (m.mnt / "d").mkdir()
    for i in range(300):
        (m.mnt / "d" / f"f{i}").write_bytes(b"%d" % i * 1000)
    os.rename(m.mnt / "d", m.mnt / "renamed")
    os.chmod(m.mnt / "renamed" / "f7", 0o600)
    time.sleep(0.2)                 # many POST_DELAYs: every change has gone to the writer
    writer = writer_pid(m.pid)
    m.kill9()
    assert gone(writer), "the writer of a dead mount never exited"
    m.mount()
    assert not (m.mnt / "d").exists() and (m.mnt / "renamed").is_dir()
    for i in range(300):
        assert (m.mnt / "renamed" / f"f{i}").read_bytes() == b"%d" % i * 1000
    assert stat.S_IMODE((m.mnt / "renamed" / "f7").stat().st_mode) == 0o600
    m.umount()
    fsck_clean(m.store)


def test_terminal_and_stop_signals_end_the_mount_not_its_writer(make_mount):
    """Ctrl-C in the terminal of a foreground mount, a closed session, or systemd's stop
    signal every process of the mount's group, the writer too. The writer must live on to
    commit what the unmounting mount sends it: a KeyboardInterrupt raised in it ended it
    with a traceback, and every later change failed with EIO."""
    m = make_mount()
    writer = writer_pid(m.pid)
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        os.kill(writer, signum)
    assert not gone(writer, within=0.5), "a signal meant for the mount ended its writer"
    (m.mnt / "after").write_bytes(b"still written")
    with open(m.mnt / "after", "rb") as f:
        os.fsync(f.fileno())            # an awaited step: the writer answers it
    os.kill(m.pid, signal.SIGINT)        # the mount's answer: unmount, stopping the writer
    assert gone(m.pid) and gone(writer)
    m.mount()
    assert (m.mnt / "after").read_bytes() == b"still written"
    log = m.log()
    assert "KeyboardInterrupt" not in log and "the writer process of" not in log, log


def test_a_frame_cut_short_by_the_mounts_death_is_dropped():
    """The mount killed while writing a frame (a chunk's data, say) leaves part of it in the
    pipe: the writer must take that as the end, never as a shorter step."""
    body = writer_frames.HEADER.pack(writer_frames.PUT, 7, 10) + b"x" * 100
    whole = writer_frames.LENGTH.pack(len(body)) + body
    for cut in (0, 2, writer_frames.LENGTH.size, writer_frames.LENGTH.size + 5, len(whole) - 1):
        assert writer_frames._read_frame(io.BytesIO(whole[:cut])) is None, cut
    assert writer_frames._read_frame(io.BytesIO(whole)) == body


def _new_writer(tmp_path) -> tuple[Path, Store, WriterProcess, list[Step]]:
    """A new store, opened, and a WriterProcess of it (not started) whose told posted
    steps collect in the list returned with them."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    store = Store.open(path)
    ran: list[Step] = []
    writer = WriterProcess(store, lambda n, txn_no: None,
                           lambda steps, committed: ran.extend(steps))
    return path, store, writer, ran


def _with_writer(tmp_path, posting):
    """Run ``await posting(writer, ran)`` in trio with a WriterProcess of a new store;
    ``ran`` collects the posted steps it tells. Returns what ``posting`` returned and
    ``ran``."""
    _, store, writer, ran = _new_writer(tmp_path)

    async def main():
        writer.start()
        return await posting(writer, ran)

    try:
        result = trio.run(main)
    finally:
        writer.stop()
        store.close()
    return result, ran


def test_posted_steps_go_to_the_writer_by_themselves(tmp_path):
    """Posted steps wait in the mount a moment (POST_DELAY) to go to the writer together;
    they must then go by themselves, not only along with a later awaited step."""
    async def post_and_wait(writer: WriterProcess, ran: list[Step]) -> int:
        for name in (b"a", b"b", b"c"):
            writer.post(_create_step(name, posted=((S.ROOT_INO, name),)))
        with trio.move_on_after(30):
            while len(ran) < 3:
                await trio.sleep(0.01)
        return len(ran)         # before stop(), which sends whatever is left

    arrived, ran = _with_writer(tmp_path, post_and_wait)
    assert arrived == 3, "posted steps never reached the writer"
    assert [step.error for step in ran] == [None] * 3


def test_a_posted_step_is_told_by_its_number_only_if_it_wrote_what_it_answered(tmp_path):
    """Posted steps go in one frame and come back with their commit: one that wrote the
    records its caller answered with (``predicted``) is told by its number alone, nothing
    of what it wrote unpickled on the trio thread; one that wrote others comes back whole,
    so that the mount can log the difference (``Engine._ran``). (One that failed is told
    whole, at once: ``test_a_failed_posted_step_is_told_at_once``.)"""
    async def post_and_wait(writer: WriterProcess, ran: list[Step]) -> None:
        steps = [_create_step(name, posted=((S.ROOT_INO, name),)) for name in (b"a", b"b")]
        steps[1].predicted = {(S.ROOT_INO, b"b"): S.MAX_INO}     # not the inode it makes
        for step in steps:
            writer.post(step)
        with trio.fail_after(30):
            while len(ran) < 2:
                await trio.sleep(0.01)

    _, ran = _with_writer(tmp_path, post_and_wait)
    settled, wrong = ran
    assert settled.error is None and settled.records == {} and settled.marks == set()
    assert wrong.error is None and wrong.records[S.ROOT_INO, b"b"] > S.ROOT_INO


def test_a_failed_posted_step_is_told_at_once(tmp_path, monkeypatch):
    """A posted step that fails is a change lost after its answer: from then on nothing may
    be answered before it runs. The mount hears of it when it happens, not with the next
    commit, which a long MOUNTFS_COMMIT_DELAY puts off (here an hour). The failing step
    is the last of a full batch, so no refused step after it sends anything either."""
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", "3600")      # read by the writer process

    async def post_and_wait(writer: WriterProcess, ran: list[Step]) -> bool:
        for i in range(BATCH_STEPS - 1):
            writer.post(_create_step(b"f%d" % i, posted=()))
        writer.post(Step(LIVE, writer_frames._unreadable, ("a test",), posted=()))
        with trio.move_on_after(20):
            while writer.answers_early():
                await trio.sleep(0.01)
        return writer.answers_early()

    still_answering, ran = _with_writer(tmp_path, post_and_wait)
    assert not still_answering, "the mount still answers changes before they run"
    assert len(ran) == BATCH_STEPS and ran[-1].error is not None
    assert [step.error for step in ran[:-1]] == [None] * (BATCH_STEPS - 1)


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
    res = m.snapctl("create", "k", check=False)   # said only "Input/output error"
    assert res.returncode == 1 and res.stderr.strip() == (
        "snapctl: Input/output error: the writer process exited (killed by signal 9); "
        "remount the filesystem"), res.stderr
    time.sleep(2.5 * SYNC_INTERVAL)         # the background tasks meet the failure too
    assert (m.mnt / "d" / "kept").read_bytes() == b"fsynced"    # reads go on
    m.umount()
    assert "Traceback" not in m.log()
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
    writer = WriterProcess(store, lambda n, txn_no: None, lambda steps, committed: None)
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


def test_a_posted_step_that_is_not_data_fails_itself_not_the_mount(tmp_path):
    """In trio a posted step is framed only when the next step goes, or by the task that
    sends posted steps (it may still join a later change). One that is not data (a bug)
    was answered already: it must be told as a failed posted step, and later changes fail
    with EIO; it must not break the task that found it (which would end the mount) or
    raise in another caller."""
    name = b"closure"

    async def post_and_wait(writer: WriterProcess, ran: list[Step]):
        writer.post(Step(LIVE, lambda live: live.create(S.ROOT_INO, name, stat.S_IFREG,
                                                        0, 0), posted=()))
        with trio.fail_after(30):
            while not ran:
                await trio.sleep(0.01)
        later: list[Step] = []
        writer.put(Step(COMMIT, done=later.append))
        return writer.answers_early(), later

    (answers_early, later), ran = _with_writer(tmp_path, post_and_wait)
    assert len(ran) == 1 and isinstance(ran[0].error, FsError)
    assert ran[0].error.errno == errno.EIO and "not data" in str(ran[0].error)
    assert not answers_early
    assert [step.error.errno for step in later] == [errno.EIO], "a later change went on"


def test_a_step_that_is_not_data_amid_posted_ones_loses_it_and_those_after(tmp_path):
    """Posted steps go to the writer in one frame. If one of them is not data, those
    posted before it still go and run; it and those after it were answered too, but
    cannot follow it: each is told failed, and the mount answers no change early."""
    async def post_and_wait(writer: WriterProcess, ran: list[Step]) -> bool:
        writer.post(_create_step(b"before", posted=()))
        writer.post(Step(LIVE, lambda live: None, posted=()))
        writer.post(_create_step(b"after", posted=()))
        with trio.fail_after(30):
            while len(ran) < 3:
                await trio.sleep(0.01)
        return writer.answers_early()

    answers_early, ran = _with_writer(tmp_path, post_and_wait)
    by_name = {step.args[1] if step.fn is Live.create else None: step for step in ran}
    assert by_name[b"before"].error is None
    assert by_name[None].error.errno == by_name[b"after"].error.errno == errno.EIO
    assert "not data" in str(by_name[None].error)
    assert not answers_early


def _chunk_step(ino: int, chunks: list[bytes], done, first: int = 0) -> Step:
    """A step committing ``chunks`` as ``ino``'s data from chunk ``first`` on."""
    size = (first + len(chunks)) * len(chunks[0])
    return Step(LIVE, _commit_chunks,
                (ino, [(idx, chunk_digest(data), data)
                       for idx, data in enumerate(chunks, first)], size, size, 1, True),
                nbytes=sum(map(len, chunks)), done=done)


def _more_than_the_ring(chunk_size: int) -> list[bytes]:
    """Chunks of more data than the ring holds (``_chunk_steps`` sends them)."""
    return [os.urandom(chunk_size) for _ in range(RING_BYTES // chunk_size + 3)]


def _chunk_steps(ino: int, chunks: list[bytes], done) -> list[Step]:
    """Steps committing ``chunks`` as ``ino``'s data, as the mount sends them: at most
    ``filecache.STEP_BYTES`` each."""
    per_step = STEP_BYTES // len(chunks[0])
    return [_chunk_step(ino, chunks[first:first + per_step], done, first)
            for first in range(0, len(chunks), per_step)]


def _answers(replies: queue.SimpleQueue, n: int, within: float = 60.0) -> list[Step]:
    """The next ``n`` answered steps, all within ``within`` seconds."""
    deadline = time.monotonic() + within
    return [replies.get(timeout=max(0.0, deadline - time.monotonic())) for _ in range(n)]


def _create_step(name: bytes, done=None, posted=None) -> Step:
    return Step(LIVE, Live.create, (S.ROOT_INO, name, stat.S_IFREG | 0o644, 0, 0),
                posted=posted, done=done)


@pytest.mark.parametrize("in_trio", [False, True], ids=["blocking", "trio"])
def test_chunk_data_crosses_to_the_writer_intact_and_in_order(tmp_path, in_trio):
    """Steps' chunk data travels through the ring, uncopied until placed. In trio a worker
    thread places it, waiting for the writer to give room back (the steps carry more than
    the ring holds), and the small steps sent meanwhile wait behind it: one of them sent
    before a step whose data is not yet placed would run first, and one placed over data
    the writer has not committed yet would store the wrong bytes."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    store = Store.open(path)
    with store.read() as txn:
        live = store.live_epoch(txn)
    chunks = _more_than_the_ring(store.chunk_size)
    names = [b"after%d" % n for n in range(20)]
    replies: queue.SimpleQueue = queue.SimpleQueue()
    writer = WriterProcess(store, lambda n, txn_no: None, lambda steps, committed: None)

    def create_big_file() -> None:
        writer.start()
        writer.put(_create_step(b"big", replies.put))

    def blocking() -> int:
        create_big_file()
        ino = replies.get(timeout=60).result[0]
        for step in _chunk_steps(ino, chunks, replies.put):
            writer.put(step)
        for name in names:
            writer.put(_create_step(name, replies.put))
        return ino

    async def from_trio() -> tuple[int, list[Step]]:
        create_big_file()       # answered on this thread: waited for without blocking it
        ino = (await trio.to_thread.run_sync(_answers, replies, 1))[0].result[0]
        steps = _chunk_steps(ino, chunks, replies.put)
        for step in steps:
            writer.put(step)
        for name in names:
            await trio.sleep(0)         # the flusher's thread is placing the data meanwhile
            writer.put(_create_step(name, replies.put))
        return ino, await trio.to_thread.run_sync(_answers, replies, len(steps) + len(names))

    try:
        if in_trio:
            ino, answered = trio.run(from_trio)
        else:
            ino = blocking()
            answered = _answers(replies, len(_chunk_steps(ino, chunks, None)) + len(names))
    except BaseException:
        writer._proc.kill()         # a garbled frame leaves it waiting for bytes never sent
        raise
    finally:
        writer.stop()
    assert [step.error for step in answered] == [None] * len(answered)
    assert [step.seq for step in answered] == sorted(step.seq for step in answered)
    with store.read() as txn:
        view = View(txn, store.db, live, store.chunk_size)
        assert [view.chunk_data(ino, idx) for idx in range(len(chunks))] == chunks
        assert view.inode(ino).size == len(chunks) * store.chunk_size
        assert all(view.lookup(S.ROOT_INO, name) for name in names)
    store.close()
    fsck_clean(path)


@pytest.mark.parametrize("in_trio", [False, True], ids=["thread", "trio"])
def test_a_reply_larger_than_the_pipe_arrives_whole(tmp_path, in_trio):
    """The writer's replies are read on the trio thread (or by a thread outside trio), as
    the pipe gives them: a file's uncommitted data read back (a LOOK step) is a reply of
    3 MiB, three times what the pipe holds, so it arrives in many reads."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    store = Store.open(path)
    chunks = [os.urandom(store.chunk_size) for _ in range(3)]
    size = 3 * store.chunk_size
    replies: queue.SimpleQueue = queue.SimpleQueue()
    writer = WriterProcess(store, lambda n, txn_no: None, lambda steps, committed: None)

    def steps():
        """The steps, each sent once the one before is answered (sent back in)."""
        created = yield _create_step(b"big", replies.put)
        yield _chunk_step(created.result[0], chunks, replies.put)
        yield Step(LOOK, _checked_read, (created.result[0], 0, size, size), done=replies.put)

    def answered() -> list[Step]:
        writer.start()
        sent, out = steps(), []
        with contextlib.suppress(StopIteration):
            step = next(sent)
            while True:
                writer.put(step)
                out.append(_answers(replies, 1)[0])
                step = sent.send(out[-1])
        return out

    async def from_trio() -> list[Step]:
        writer.start()
        sent, out = steps(), []
        with contextlib.suppress(StopIteration):
            step = next(sent)
            while True:
                writer.put(step)    # answered on this thread: waited for without blocking it
                out.append((await trio.to_thread.run_sync(_answers, replies, 1))[0])
                step = sent.send(out[-1])
        return out

    try:
        out = trio.run(from_trio) if in_trio else answered()
    finally:
        writer.stop()
        store.close()
    assert [step.error for step in out] == [None] * 3
    bad, data, _ = out[-1].result
    assert bad is None and data == b"".join(chunks)


@given(st.lists(st.integers(0, 300) | st.integers(70_000, 200_000), min_size=1, max_size=6),
       st.lists(st.integers(min_value=1, max_value=90_000), max_size=40))
@settings(max_examples=60, deadline=None)
def test_reply_frames_are_taken_whole_however_the_pipe_cuts_them(sizes, cuts):
    """Whatever pieces the pipe hands over, each frame comes out once, whole and in order,
    and ``wanted`` says how much of the frame begun is still to come (replies of a few
    hundred bytes, and LOOK replies larger than one read)."""
    frames = [("reply", random.Random(size).randbytes(size), True) for size in sizes]
    pickles = [pickle.dumps(frame, protocol=5) for frame in frames]
    wire = b"".join(writer_frames.LENGTH.pack(len(p)) + p for p in pickles)
    starts = [sum(4 + len(p) for p in pickles[:n]) for n in range(len(pickles))]
    replies, taken, fed = writer_frames._Replies(), [], 0
    for cut in [*cuts, len(wire)]:
        replies.add(wire[fed:fed + cut])
        taken += iter(replies.next, None)
        fed = min(fed + cut, len(wire))
        begun = max([s for s in starts if s <= fed])
        whole = starts.index(begun) + (fed - begun == 4 + len(pickles[starts.index(begun)]))
        assert taken == frames[:whole]
        partial = 4 <= fed - begun < 4 + len(pickles[starts.index(begun)])
        assert replies.wanted == (begun + 4 + len(pickles[starts.index(begun)]) - fed
                                  if partial else 0)
        if fed == len(wire):
            break
    assert taken == frames


def test_a_reply_that_cannot_be_read_comes_after_those_before_it():
    """A length no reply can have (a bug in the writer) is an error, not a 4 GiB wait; a
    frame that does not unpickle is one too. The frames before either, read in the same
    piece, are still taken: their steps were answered."""
    good = pickle.dumps(("reply", 1, True))
    for bad, error in ((writer_frames.LENGTH.pack(writer_frames.MAX_REPLY + 1), ValueError),
                       (writer_frames.LENGTH.pack(3) + b"zzz", pickle.UnpicklingError)):
        replies = writer_frames._Replies()
        replies.add(writer_frames.LENGTH.pack(len(good)) + good + bad)
        assert replies.next() == ("reply", 1, True)
        with pytest.raises(error):
            replies.next()


def _stopped_within(writer: WriterProcess, seconds: float) -> None:
    """``writer.stop()``, or the writer killed and the test failed if it takes longer."""
    stopper = threading.Thread(target=writer.stop)
    stopper.start()
    stopper.join(seconds)
    if stopper.is_alive():
        os.kill(writer._proc.pid, signal.SIGKILL)
        stopper.join()
        pytest.fail(f"WriterProcess.stop() still waited after {seconds} s")


def test_trio_ending_with_replies_in_flight_loses_nothing(tmp_path):
    """Trio ends (an error ends the mount's loop) with 5,000 answered creates not yet run:
    their outcomes, about 1.7 MB, are more than the pipe back holds. stop() must read them
    while it waits for the writer, which otherwise waits for room in the pipe forever;
    every create is then in the store."""
    path, store, writer, ran = _new_writer(tmp_path)
    names = [b"f%05d" % n for n in range(5000)]

    async def post_all() -> None:
        writer.start()
        for name in names:
            writer.post(_create_step(name, posted=((S.ROOT_INO, name),)))

    trio.run(post_all)
    _stopped_within(writer, 60)
    assert len(ran) == len(names) and all(step.error is None for step in ran)
    with store.read() as txn:
        view = View(txn, store.db, store.live_epoch(txn), store.chunk_size)
        assert all(view.lookup(S.ROOT_INO, name) for name in names)
    store.close()
    fsck_clean(path)


def test_trio_ending_while_chunk_data_is_written_loses_no_later_step(tmp_path):
    """Trio ends while the flusher's worker thread waits to place steps' chunk data in a
    full ring (the writer stopped a moment) and two posted creates wait behind it: they
    must reach the writer after the data, whole, not be dropped with the cancelled task."""
    path, store, writer, ran = _new_writer(tmp_path)
    chunks = _more_than_the_ring(store.chunk_size)
    replies: queue.SimpleQueue = queue.SimpleQueue()

    async def end_while_writing() -> None:
        writer.start()
        writer.put(_create_step(b"big", replies.put))
        ino = (await trio.to_thread.run_sync(_answers, replies, 1))[0].result[0]
        os.kill(writer._proc.pid, signal.SIGSTOP)
        for step in _chunk_steps(ino, chunks, replies.put):
            writer.put(step)
        with trio.fail_after(30):
            while not writer._flushing:         # its thread waits for room in the ring
                await trio.sleep(0.001)
        for name in (b"posted", b"posted2"):    # the second frames the first
            writer.post(_create_step(name, posted=((S.ROOT_INO, name),)))
        threading.Timer(0.5, os.kill, (writer._proc.pid, signal.SIGCONT)).start()

    try:
        trio.run(end_while_writing)
    finally:
        os.kill(writer._proc.pid, signal.SIGCONT)
        _stopped_within(writer, 60)
    assert [step.error for step in ran] == [None, None]
    with store.read() as txn:
        view = View(txn, store.db, store.live_epoch(txn), store.chunk_size)
        assert all(view.lookup(S.ROOT_INO, name) for name in (b"big", b"posted", b"posted2"))
        ino = view.lookup(S.ROOT_INO, b"big")
        assert [view.chunk_data(ino, idx) for idx in range(len(chunks))] == chunks
    store.close()
    fsck_clean(path)


def test_a_frames_data_goes_through_the_ring_uncopied_until_placed():
    """The mount's side leaves a chunk's own bytes out of the pickle; the thread that
    writes the frame copies them into the ring and sends the region's place; the writer's
    side reads them as a view of that region; a reference outside the region, or a region
    outside the ring, is refused."""
    data, small = os.urandom(RAW_BYTES), os.urandom(RAW_BYTES - 1)
    ring = Ring.create(1 << 20)
    r, w = os.pipe()
    try:
        pieces = writer_frames._frame(0, 7, ("x", "f", ([(0, b"d", data)], small), 1), ring=ring)
        assert len(pieces) == 1 and pieces[0].pieces == [data]
        assert pieces[0].pieces[0] is data
        frame = bytes(pieces[0].placed(w))[writer_frames.LENGTH.size:]
    finally:
        os.close(r)
        os.close(w)
    op, seq, pickled = writer_frames.HEADER.unpack_from(frame)
    assert (op, seq) == (writer_frames.RING | 0, 7)
    body = memoryview(frame)[writer_frames.HEADER.size:]
    position, length = writer_frames.RING_PLACE.unpack_from(body, pickled)
    assert length == len(data) and len(body) == pickled + writer_frames.RING_PLACE.size
    region = ring.region(position, length)
    (_, _, ((chunks, got_small)), _) = writer_frames._body(body, pickled, region)
    assert isinstance(chunks[0][2], memoryview) and bytes(chunks[0][2]) == data
    assert got_small == small
    with pytest.raises(pickle.UnpicklingError, match="outside its region"):
        writer_frames._body(body, pickled, region[:-1])
    for outside in ((ring.size - 10, 20), (0, ring.size + 1), (-1, 1)):
        with pytest.raises(ValueError, match="outside the ring"):
            ring.region(*outside)
    ring.close()


def _small_ring(size: int) -> Ring:
    memfd = os.memfd_create("test-ring")
    os.ftruncate(memfd, size)
    return Ring(memfd, os.eventfd(0, os.EFD_NONBLOCK), size)


def test_the_ring_waits_for_room_and_reuses_only_what_is_given_back():
    """Regions go in order, each contiguous (the end skipped when a frame does not fit
    there); a frame that finds no room waits until the writer gives back what it would
    overwrite (the writer counts a skipped end with the region after it, which never
    waits for it), and ends with BrokenPipeError when the writer is gone."""
    ring = _small_ring(1000)
    r, w = os.pipe()

    def place_later(*pieces) -> tuple[threading.Thread, list]:
        out = []

        def place():
            try:
                out.append(ring.place(list(pieces), w))
            except BrokenPipeError as e:
                out.append(e)

        thread = threading.Thread(target=place)
        thread.start()
        thread.join(0.3)
        assert thread.is_alive() and not out, "placed over data not given back"
        return thread, out

    try:
        assert ring.place([b"a" * 300, b"b" * 300], w) == (0, 600)
        assert bytes(ring.region(0, 600)) == b"a" * 300 + b"b" * 300
        late, placed = place_later(b"c" * 500)      # the end skipped, then [0, 500) in use
        ring.give_back(400)
        late.join(0.3)
        assert late.is_alive() and not placed
        assert bytes(ring.region(400, 200)) == b"b" * 200, "overwritten unfreed"
        ring.give_back(200)
        late.join(5)
        assert placed == [(1000, 500)] and bytes(ring.region(1000, 500)) == b"c" * 500
        late, placed = place_later(b"d" * 600)      # skips [1500, 2000) too
        ring.give_back(900)         # c's region and the end skipped before it
        late.join(5)
        assert placed == [(2000, 600)] and bytes(ring.region(2000, 600)) == b"d" * 600
        stuck, failed = place_later(b"e" * 600)
        os.close(r)                 # the writer's end of the pipe: it is gone
        r = -1
        stuck.join(5)
        assert not stuck.is_alive() and type(failed[0]) is BrokenPipeError
        with pytest.raises(ValueError, match="more than the ring"):
            ring.place([b"f" * 1001], w)
    finally:
        os.close(w)
        if r >= 0:
            os.close(r)
        ring.close()


def test_files_written_at_once_go_through_the_ring_whole(make_mount):
    """Several files written at once through the mount, three laps of the ring: every
    chunk is stored with its own bytes (fsck checks every digest) and reads back after a
    remount, from the store. (A region given back before its step ran is caught by
    ``test_trio_ending_while_chunk_data_is_written_loses_no_later_step``, whose writer is
    stopped while the ring fills.)"""
    m = make_mount()
    files = 4
    mib = 3 * RING_BYTES // (files << 20)       # three times what the ring holds
    blocks = [os.urandom(1 << 20) for _ in range(files)]

    def write(n):
        with open(m.mnt / f"f{n}", "wb") as f:
            for i in range(mib):
                f.write(i.to_bytes(4, "little") + blocks[n][4:])

    threads = [threading.Thread(target=write, args=(n,)) for n in range(files)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    m.umount()
    fsck_clean(m.store)
    m.mount()
    for n in range(files):
        with open(m.mnt / f"f{n}", "rb") as f:
            for i in range(mib):
                assert f.read(1 << 20) == i.to_bytes(4, "little") + blocks[n][4:], (n, i)


def test_snapctl_says_when_the_writer_process_is_stopped(make_mount):
    """A stopped writer process answers no change, so 'snapctl create' would wait out its
    600 s: it says which process is stopped and how to resume it, as for a stopped mount;
    resumed, the same command works."""
    m = make_mount()
    (m.mnt / "f").write_text("kept")
    writer = writer_pid(m.pid)
    os.kill(writer, signal.SIGSTOP)
    try:
        snap = cli("snapctl", "-m", m.mnt, "create", "s", check=False, timeout=60)
    finally:
        os.kill(writer, signal.SIGCONT)
    assert (snap.returncode, snap.stderr) == (
        1, f"snapctl: the writer process {writer} of the mount process {m.pid} serving "
           f"{m.store} is stopped (SIGSTOP): resume it with 'kill -CONT {writer}'\n")
    m.snapctl("create", "s")
    assert (m.mnt / ".snapshot" / "s" / "f").read_text() == "kept"


def _proc_figure(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"/proc/{pid}/status has no {field}")


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_a_sequential_writer_is_held_back_and_its_buffers_reused(make_mount):
    """A file written faster than the store takes it (here: its writer process stopped):
    the mount holds at most filecache.FLUSH_AHEAD of its complete chunks, then its writes
    wait; once the writer runs again, it reuses the ring (regions given back; full chunks go
    from there to the chunk file, mountfs/chunkfile.py). Before, the mount held the whole
    file (960 MB of a 1 GiB write, measured) and sent it in 64 MiB steps, each a fresh
    mapping in the writer faulted in page by page (about 500 faults per MiB): on a VM each
    fault of a fresh page costs the host's fault too, and sequential writes ran at half the
    speed (docs/benchmarks.md, fourteenth round)."""
    m = make_mount()
    writer = writer_pid(m.pid)
    block = os.urandom(1 << 20)
    with open(m.mnt / "warm", "wb") as f:       # the heaps' first growth is not measured
        f.write(block * 32)
        os.fsync(f.fileno())
    Path(f"/proc/{m.pid}/clear_refs").write_text("5")     # VmHWM := VmRSS
    rss = _proc_figure(m.pid, "VmRSS")
    mib, written, failed = 256, [], []

    def write_big():
        try:
            with open(m.mnt / "big", "wb") as f:
                for i in range(mib):
                    f.write(i.to_bytes(8, "little") + block[8:])
                    written.append(i)
                os.fsync(f.fileno())
        except OSError as e:
            failed.append(e)

    os.kill(writer, signal.SIGSTOP)
    thread = threading.Thread(target=write_big)
    try:
        thread.start()
        seen, still = -1, 0
        while still < 8:                        # until no write returned for 2 s
            time.sleep(0.25)
            still = still + 1 if len(written) == seen else 0
            seen = len(written)
        held = _proc_figure(m.pid, "VmHWM") - rss
        faults = _minor_faults(writer)
    finally:
        os.kill(writer, signal.SIGCONT)
    thread.join(timeout=120)
    per_mib = (_minor_faults(writer) - faults) / mib
    assert not failed and not thread.is_alive()
    assert 0 < seen < mib // 2, f"{seen} of {mib} MiB were taken while the store took none"
    assert held < 128 << 20, f"the mount grew by {held >> 20} MiB while the store took none"
    assert per_mib < 64, f"the writer took {per_mib:.0f} page faults per MiB written"
    with open(m.mnt / "big", "rb") as f:
        for i in (0, seen, mib - 1):
            f.seek(i << 20)
            assert f.read(1 << 20) == i.to_bytes(8, "little") + block[8:]


def _committed_chunks(store_path: Path, name: bytes, count: int) -> list[bytes]:
    """The first ``count`` chunks of root's ``name`` as the store has committed them."""
    store = Store.open(store_path, readonly=True, lock=False)
    try:
        with store.read() as txn:
            view = View(txn, store.db, store.live_epoch(txn), store.chunk_size)
            ino = view.lookup(S.ROOT_INO, name)
            return [view.chunk_data(ino, idx) if ino else b"" for idx in range(count)]
    finally:
        store.close()


def test_an_open_files_complete_chunks_are_committed_while_it_stays_open(make_mount):
    """Chunks completed one by one, while a background flush of the file is under way or
    waiting, are committed without a close or an fsync: at most one flush of a file
    waits at a time (``FileCache._flush_later``), and it takes every chunk complete by
    the time it starts; one complete after that starts the next. Within seconds, not at
    the 30 s expiry of dirty data."""
    m = make_mount()
    count, cs = 12, 1 << 20
    fd = os.open(m.mnt / "open", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for i in range(count):
            os.write(fd, bytes([i + 1]) * cs)
            time.sleep(0.002 * (i % 3))     # some complete during a flush, some not
        deadline = time.monotonic() + 10
        while (chunks := _committed_chunks(m.store, b"open", count)) \
                != [bytes([i + 1]) * cs for i in range(count)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [chunk[:1] for chunk in chunks] == [bytes([i + 1]) for i in range(count)]
    finally:
        os.close(fd)


@pytest.mark.parametrize("cs", [1 << 20, 64 << 10])
def test_small_writes_into_many_stored_chunks_read_back_in_batches(make_mount, tmp_path, cs):
    """A 4 KiB write into each of many stored chunks buffers only the written ranges; a read
    of the open file and its fsync read the stored chunks back, a batch at a time (ahead of
    the commits), and merge them: every byte, written or not, reads back as it should,
    before the fsync, after it and after a remount. With 64 KiB chunks a commit group (128
    chunks) is larger than READ_BACK."""
    store = tmp_path / f"store-{cs}"
    cli("mountfs", "mkfs", "--chunk-size", str(cs), store)
    m = make_mount(store)
    path, n = m.mnt / "big", 4 * max(READ_BACK, STEP_BYTES // cs)
    data = bytearray(os.urandom(n * cs))
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDWR)
    try:
        for idx in range(n):
            piece = os.urandom(4096)
            at = idx * cs + random.randrange(cs // 4096) * 4096
            os.pwrite(fd, piece, at)
            data[at:at + 4096] = piece
        first = 3 * READ_BACK // 2          # a read across a batch's end merges those
        assert os.pread(fd, 4 * cs, first * cs) == data[first * cs:(first + 4) * cs]
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    m.umount()
    m.mount()
    assert path.read_bytes() == data
