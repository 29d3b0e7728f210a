"""The engine's memory of uncommitted changes (dirty marks, the records answered from, the
posted steps' counts) is emptied by the commits that end those changes. A record left
behind would be memory held for every created file for as long as the mount lives; a mark
left dirty would send every later read of it through the committer. Posted steps that ran
are told to the mount together with the commit that follows them (mountfs.writer), and
the mount then forgets their records without noting them first: this checks that the
shortcut leaves exactly what noting and committing left.

Driven through mountfs's FUSE operations in process (a real store and its writer process;
no kernel: the engine's dictionaries are what is checked)."""

from __future__ import annotations

import errno
import os
import types

import pytest
import trio

from conftest import cli
from mountfs.engine import Engine, posted_calls
from mountfs.namespace import FsError, View
from mountfs.ops import Operations, _destroy_orphans, _setattr
from mountfs.store import Store
from mountfs.writer import _unreadable


async def _write_file(ops: Operations, parent: int, name: bytes, data: bytes, ctx) -> int:
    info, attrs = await ops.create(parent, name, 0o644, os.O_WRONLY, ctx)
    await ops.write(info.fh, 0, data)
    await ops.flush(info.fh)
    await ops.release(info.fh)
    await ops.forget([(attrs.st_ino, 1)])
    return attrs.st_ino


async def _workload(ops: Operations, engine: Engine, ctx) -> None:
    """Creates, writes, renames, unlinks and rmdirs, posted and awaited, some of them
    across commits (the pauses) and some racing them."""
    for round_no in range(6):
        d = (await ops.mkdir(1, f"d{round_no}".encode(), 0o755, ctx)).st_ino
        for i in range(150):
            await _write_file(ops, d, b"f%d" % i, os.urandom(100 + i * 37), ctx)
            if i % 40 == 0:
                await trio.sleep(0.012)         # past COMMIT_DELAY: a commit in between
        for i in range(0, 150, 3):
            await ops.rename(d, b"f%d" % i, 1, b"r%d-%d" % (round_no, i), 0, ctx)
        for i in range(1, 150, 3):
            await ops.unlink(d, b"f%d" % i, ctx)
        if round_no % 2:
            for i in range(2, 150, 3):
                await ops.unlink(d, b"f%d" % i, ctx)
            await ops.rmdir(1, f"d{round_no}".encode(), ctx)


def _memory(engine: Engine) -> dict:
    return {"records": dict(engine._records), "dirty": dict(engine._dirty),
            "dirty_in": dict(engine._dirty_in), "posted": dict(engine._posted),
            "uncommitted": engine._uncommitted, "posted_bytes": engine._posted_bytes}


EMPTY = {"records": {}, "dirty": {}, "dirty_in": {}, "posted": {}, "uncommitted": 0,
         "posted_bytes": 0}


def _run_engine(path, body) -> None:
    """``await body(engine, ops, ctx)`` on a mounted-like engine of the store at ``path``."""
    store = Store.open(path, readonly=False, lock=True, holder="test")
    engine = Engine(store)
    ops = Operations(engine, read_only=False)
    ctx = types.SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(),
                                umask=0o022)

    async def main() -> None:
        engine.start()
        async with trio.open_nursery() as nursery:
            engine.files.nursery = nursery
            nursery.start_soon(engine.syncer)
            await body(engine, ops, ctx)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        engine.close()
        store.close()


def test_commits_leave_nothing_of_the_changes_they_end(tmp_path):
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    left, told_with_commit = {}, []

    async def body(engine: Engine, ops: Operations, ctx) -> None:
        ran = engine._ran

        def counted(steps, committed):      # the shortcut must be what is tested
            told_with_commit.extend(call for s in steps if committed and s.txn_no == committed
                                    for call in posted_calls(s))
            ran(steps, committed)
        engine._committer._on_ran = counted     # what the writer's replies call
        await _workload(ops, engine, ctx)
        await engine.files.flush_all()
        await engine.sync()             # its reply comes after every commit's news
        left.update(_memory(engine))
        left["renamed size"] = (await ops.lookup(1, b"r3-30", ctx)).st_size

    _run_engine(path, body)
    assert len(told_with_commit) > 100, "posted steps were not told with their commit"
    assert left.pop("renamed size") == 100 + 30 * 37
    assert left == EMPTY
    cli("mountfs", "fsck", path)


def test_a_failed_posted_step_leaves_nothing_either(tmp_path):
    """A posted step that fails wrote nothing: the records it was answered with must go
    too (it is told at once, before any commit), and the engine then refuses changes."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    left = {}

    async def body(engine: Engine, ops: Operations, ctx) -> None:
        engine.post(_unreadable, "a test", marks=((1, b"never"), ("ls", 1)),
                    records={(1, b"never"): 0})
        with trio.fail_after(30):
            while engine.can_post():
                await trio.sleep(0.01)
        with pytest.raises(FsError):
            await engine.sync()
        left.update(_memory(engine))

    _run_engine(path, body)
    assert left == EMPTY


def _fields(**set_) -> types.SimpleNamespace:
    """The fields of a SETATTR request (pyfuse3.SetattrFields), those named set."""
    names = ("size", "mode", "uid", "gid", "atime", "mtime", "ctime")
    return types.SimpleNamespace(**{f"update_{n}": n in set_ for n in names})


async def _tar_attributes(ops: Operations, ino: int, fh: int, mtime: int, mode: int,
                          ctx) -> None:
    """What tar sends for each file it extracts, before the close: futimens, fchown,
    fchmod."""
    await ops.setattr(ino, types.SimpleNamespace(st_mtime_ns=mtime), _fields(mtime=1), fh,
                      ctx)
    await ops.setattr(ino, types.SimpleNamespace(st_uid=ctx.uid, st_gid=ctx.gid),
                      _fields(uid=1, gid=1), fh, ctx)
    await ops.setattr(ino, types.SimpleNamespace(st_mode=mode), _fields(mode=1), fh, ctx)


def _count_steps(engine: Engine, fn, into: list) -> None:
    """Append to ``into`` the arguments of every posted change of ``fn`` as the writer
    reports it run (changes posted one after the other share a step: ``posted_calls``)."""
    ran = engine._ran

    def counted(steps, committed):
        into.extend(args for step in steps for call, args in posted_calls(step) if call is fn)
        ran(steps, committed)
    engine._committer._on_ran = counted     # what the writer's replies call


def test_consecutive_attribute_changes_of_a_file_are_one_step(tmp_path):
    """tar's three attribute calls per file are posted one after the other: they join in
    one step while it waits to go to the writer, so the writer runs one step per file,
    not three (docs/benchmarks.md, twenty-first round). A change of another inode in
    between keeps them apart; of two modes in a row the later one stays. What the store
    holds is what each call answered, and the engine keeps nothing of them once
    committed."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    setattrs, answered, left = [], {}, {}

    async def body(engine: Engine, ops: Operations, ctx) -> None:
        _count_steps(engine, _setattr, setattrs)
        for i in range(40):
            info, attrs = await ops.create(1, b"f%d" % i, 0o600, os.O_WRONLY, ctx)
            await ops.write(info.fh, 0, b"x" * (100 + i))
            await _tar_attributes(ops, attrs.st_ino, info.fh, 1_000_000_007 * (i + 1),
                                  0o640 + i % 8, ctx)
            await ops.flush(info.fh)
            await ops.release(info.fh)
        a, b = (await ops.lookup(1, b"f0", ctx)).st_ino, (await ops.lookup(1, b"f1", ctx)).st_ino
        for ino, mode in ((a, 0o600), (b, 0o604), (a, 0o602), (a, 0o606)):  # three steps
            await ops.setattr(ino, types.SimpleNamespace(st_mode=mode), _fields(mode=1),
                              None, ctx)
        for i in range(40):
            attrs = await ops.lookup(1, b"f%d" % i, ctx)
            answered[i] = (attrs.st_mode, attrs.st_mtime_ns, attrs.st_size,
                           attrs.st_ctime_ns)
        await engine.sync()
        left.update(_memory(engine))

    _run_engine(path, body)
    assert len(setattrs) == 40 + 3, f"{len(setattrs)} attribute steps ran for 40 files' " \
        f"three calls each and three calls apart"
    assert left == EMPTY
    expected = {i: (0o100000 | (0o640 + i % 8), 1_000_000_007 * (i + 1), 100 + i)
                for i in range(40)}
    expected[0] = (0o100606,) + expected[0][1:]
    expected[1] = (0o100604,) + expected[1][1:]
    assert {i: a[:3] for i, a in answered.items()} == expected
    store = Store.open(path, readonly=True)
    try:
        with store.read() as txn:
            view = View(txn, store.db, store.live_epoch(txn), store.chunk_size)
            stored = {}
            for i in range(40):
                rec = view.get(view.lookup(1, b"f%d" % i))
                stored[i] = (rec.mode, rec.mtime_ns, rec.size, rec.ctime_ns)
    finally:
        store.close()
    assert stored == answered
    cli("mountfs", "fsck", path)


def test_a_file_forgotten_right_after_its_unlink_is_deleted_by_the_unlinks_step(tmp_path):
    """The kernel forgets an inode as soon as an unlink took its last name (or, for a file
    open then, once it is closed). When nothing was posted in between, the unlink's step,
    not yet sent, deletes the inode itself: one step per deleted file instead of two
    (docs/benchmarks.md, twenty-third round). A forget or a last close that comes after
    another change keeps a step of its own. Either way nothing of the files is left in
    the store."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    destroys, inos, left = [], [], {}

    async def body(engine: Engine, ops: Operations, ctx) -> None:
        _count_steps(engine, _destroy_orphans, destroys)
        for i in range(35):
            inos.append(await _write_file(ops, 1, b"f%d" % i, b"data %d" % i, ctx))
            await ops.lookup(1, b"f%d" % i, ctx)        # the kernel holds each one again
        await engine.sync()
        destroys.clear()        # _write_file's forgets of the new files, each a step
        for i in range(30):                             # forgotten right after: joined
            await ops.unlink(1, b"f%d" % i, ctx)
            await ops.forget([(inos[i], 1)])
        await ops.unlink(1, b"f30", ctx)                # another unlink in between: the
        await ops.unlink(1, b"f31", ctx)                # forget of f30 has a step, and
        await ops.forget([(inos[30], 1)])               # then so has f31's
        await ops.forget([(inos[31], 1)])
        info = await ops.open(inos[32], os.O_RDONLY, ctx)   # open at its unlink, closed
        await ops.unlink(1, b"f32", ctx)                    # right after its forget:
        await ops.forget([(inos[32], 1)])                   # joined at the close
        await ops.release(info.fh)
        info = await ops.open(inos[33], os.O_RDONLY, ctx)   # another unlink before the
        await ops.unlink(1, b"f33", ctx)                    # close: steps of their own
        await ops.forget([(inos[33], 1)])
        await ops.unlink(1, b"f34", ctx)
        await ops.release(info.fh)
        await ops.forget([(inos[34], 1)])
        await engine.sync()
        left.update(_memory(engine))

    _run_engine(path, body)
    deleted_apart = sorted(ino for args in destroys for ino in args[0])
    assert deleted_apart == sorted(inos[i] for i in (30, 31, 33, 34)), \
        f"the inodes deleted by steps of their own: {deleted_apart}, of {inos}"
    assert left == EMPTY
    store = Store.open(path, readonly=True)
    try:
        with store.read() as txn:
            view = View(txn, store.db, store.live_epoch(txn), store.chunk_size)
            assert [ino for ino in inos if view.inode(ino) is not None] == []
            assert txn.stat(store.db["orphans"])["entries"] == 0
    finally:
        store.close()
    cli("mountfs", "fsck", path)


def _reads(engine: Engine) -> list:
    """Every read the engine makes of the committed tree, appended to the list returned."""
    reads, look_now = [], engine._look_now

    def counted(fn, epoch):
        reads.append(epoch)
        return look_now(fn, epoch)
    engine._look_now = counted
    return reads


def test_a_create_reuses_the_lookup_of_its_name(tmp_path):
    """The kernel looks a new name up before it creates it: the create then knows the name
    is free without reading the store again, unless a change came in between, posted (a
    mkdir) or awaited (a hard link, a rename): then it reads, and refuses the name."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    seen = {}

    async def body(engine: Engine, ops: Operations, ctx) -> None:
        d = (await ops.mkdir(1, b"d", 0o755, ctx)).st_ino
        reads = _reads(engine)
        for name, looked_up in ((b"unasked", False), (b"asked", True)):
            await engine.sync()
            if looked_up:
                assert (await ops.lookup(d, name, ctx)).st_ino == 0
            before = len(reads)
            await ops.create(d, name, 0o644, os.O_WRONLY, ctx)
            seen[name] = len(reads) - before

        target = await _write_file(ops, d, b"target", b"x", ctx)
        await engine.sync()
        for name, change in (
                (b"made", ops.mkdir(d, b"made", 0o755, ctx)),                     # posted
                (b"linked", ops.link(target, d, b"linked", ctx)),                 # awaited
                (b"moved", ops.rename(d, b"target", d, b"moved", 0, ctx))):       # awaited
            assert (await ops.lookup(d, name, ctx)).st_ino == 0
            await change
            await trio.sleep(0.05)      # committed: the name is no longer a dirty mark
            with pytest.raises(Exception) as refused:
                await ops.create(d, name, 0o644, os.O_WRONLY, ctx)
            seen[name] = getattr(refused.value, "errno", refused.value)

    _run_engine(path, body)
    assert seen.pop(b"asked") == seen.pop(b"unasked") - 1
    assert seen == {b"made": errno.EEXIST,
                    b"linked": errno.EEXIST, b"moved": errno.EEXIST}
    cli("mountfs", "fsck", path)


def test_a_lookup_racing_a_rollback_is_not_reused(tmp_path):
    """A change counts from when it is sent, but a rollback reaches the committed tree only
    when it replies: a lookup in between reads the tree before it, and the name it found
    free there must not stay "known free" once the rollback brought it back (an unlink of
    it would fail ENOENT, a create be answered and then lost). Found by review."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    seen = {}

    async def body(engine: Engine, ops: Operations, ctx) -> None:
        d = (await ops.mkdir(1, b"d", 0o755, ctx)).st_ino
        await _write_file(ops, d, b"x", b"back", ctx)
        await engine.create_snapshot("s")
        await ops.unlink(d, b"x", ctx)
        await engine.sync()
        sent = engine.changes
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.rollback, "s", True)
            while engine.changes == sent:
                await trio.sleep(0)
            seen["during"] = (await ops.lookup(d, b"x", ctx)).st_ino
        seen["known after"] = engine.known_entry(d, b"x")
        await ops.unlink(d, b"x", ctx)

    _run_engine(path, body)
    assert seen["during"] == 0, "the lookup did not race the rollback: nothing was tested"
    assert seen["known after"] != (True, None)
    cli("mountfs", "fsck", path)
