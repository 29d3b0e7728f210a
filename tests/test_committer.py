"""The committer thread on a real store (no mount): bucket hashes are folded in once per
transaction (buckets.Deferred), and must still equal those recomputed from the items after
many writes of the same items in one transaction, steps that fail half-way (their nested
transaction is aborted), and a transaction whose commit is followed by a snapshot; posted
steps wait in a batch and still run in order and commit on their own."""

from __future__ import annotations

import errno
import queue
import stat
import time

import pytest

from conftest import cli, fsck_clean
from mountfs import buckets, snapshots
from mountfs import schema as S
from mountfs.committer import BATCH_STEPS, LIVE, SYNC, TXN, Committer, Step
from mountfs.namespace import FsError, View
from mountfs.store import Store


def _run(committer: Committer, kind: str, fn=None, *args):
    """Submit one step and wait for its reply (the committer calls ``done`` in its thread)."""
    replies: queue.SimpleQueue = queue.SimpleQueue()
    committer.put(Step(kind, fn, args, done=replies.put))
    step = replies.get(timeout=60)
    if step.error is not None:
        raise step.error
    return step.result


def _half_done(live, parent: int, name: bytes) -> None:
    """A step that writes records and then fails: none of it may count."""
    live.create(parent, name, stat.S_IFREG | 0o644, 0, 0)
    raise FsError(errno.EIO, "failed half-way")


def test_buckets_folded_per_transaction_match_the_items(tmp_path, monkeypatch):
    monkeypatch.setattr("mountfs.committer.COMMIT_DELAY", 3600.0)   # one transaction
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    store = Store.open(path)
    live_epoch = [0]
    with store.read() as txn:
        live_epoch[0] = store.live_epoch(txn)
    committer = Committer(store, lambda: live_epoch[0], lambda n, txn_no: None,
                          lambda steps: None)
    committer.start()
    try:
        d, _ = _run(committer, LIVE, lambda live: live.create(S.ROOT_INO, b"d",
                                                              stat.S_IFDIR | 0o755, 0, 0))
        for i in range(30):
            ino, rec = _run(committer, LIVE, lambda live, i=i: live.create(
                d, b"f%d" % i, stat.S_IFREG | 0o644, 0, 0))
            for mode in (0o600, 0o640, 0o444):        # the same record, again and again
                _run(committer, LIVE, lambda live, ino=ino, mode=mode:
                     live.save(ino, live.get(ino).evolve(mode=stat.S_IFREG | mode)))
            with pytest.raises(FsError, match="failed half-way"):
                _run(committer, LIVE, _half_done, d, b"half%d" % i)
            if i % 3 == 0:
                _run(committer, LIVE, lambda live, i=i: live.destroy(
                    live.unlink(d, b"f%d" % i)[0]))
        assert committer._deferred_buckets.before        # deferred, not yet folded
        epoch_before = live_epoch[0]

        def snapshot(txn):
            snap = snapshots.create(txn, store.db, "s1")
            live_epoch[0] = store.live_epoch(txn)
            return snap
        _run(committer, TXN, snapshot)                    # commits (folds) first
        assert live_epoch[0] == epoch_before + 1
        _run(committer, LIVE, lambda live: live.create(d, b"after", stat.S_IFREG, 0, 0))
        _run(committer, SYNC)
    finally:
        committer.stop()
    with store.read() as txn:
        for epoch in (epoch_before, live_epoch[0]):
            assert buckets.at(txn, store.db, epoch, store.bucket_count) == \
                buckets.compute(txn, store.db, epoch, store.bucket_count)
        assert any(b != buckets.ZERO for b in buckets.at(txn, store.db, live_epoch[0],
                                                          store.bucket_count))
    store.close()
    fsck_clean(path)


def test_posted_steps_wait_in_a_batch_then_run_in_order_and_commit_on_their_own(tmp_path):
    """Posted steps do not wake the committer one by one (Committer.post): the batch runs
    by its own deadline with nothing else arriving, and commits; a step somebody waits for
    runs after every step posted before it."""
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    store = Store.open(path)
    with store.read() as txn:
        epoch = store.live_epoch(txn)
    committed, ran = queue.SimpleQueue(), []
    committer = Committer(store, lambda: epoch, lambda n, txn_no: committed.put(n),
                          ran.extend)
    committer.start()

    def post(name: bytes) -> Step:
        step = Step(LIVE, lambda live: live.create(S.ROOT_INO, name, stat.S_IFREG, 0, 0),
                    posted=set())
        committer.post(step)
        return step
    try:
        steps = [post(b"f%d" % i) for i in range(50)]
        assert committed.get(timeout=30) == 50          # one commit, by the batch's timer
        assert ran == steps and all(s.error is None for s in steps)
        with store.read() as txn:
            view = View(txn, store.db, epoch, store.chunk_size)
            assert all(view.lookup(S.ROOT_INO, b"f%d" % i) for i in range(50))
        late = post(b"late")
        seen = _run(committer, LIVE, lambda live: live.lookup(S.ROOT_INO, b"late"))
        assert seen is not None and late.error is None  # the posted step ran first
    finally:
        committer.stop()
    store.close()
    fsck_clean(path)


def test_a_batch_of_posted_steps_is_bounded_whatever_the_commit_delay(tmp_path, monkeypatch):
    """With a long commit delay (MOUNTFS_COMMIT_DELAY) posted steps must not pile up in
    memory until it ends: BATCH_STEPS of them make the batch run."""
    monkeypatch.setattr("mountfs.committer.COMMIT_DELAY", 3600.0)
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    store = Store.open(path)
    with store.read() as txn:
        epoch = store.live_epoch(txn)
    ran: list = []
    committer = Committer(store, lambda: epoch, lambda n, txn_no: None, ran.extend)
    committer.start()
    try:
        for i in range(2 * BATCH_STEPS + 10):
            committer.post(Step(LIVE, lambda live, i=i: live.create(
                S.ROOT_INO, b"f%d" % i, stat.S_IFREG, 0, 0), posted=set()))
        deadline = time.monotonic() + 60
        while len(ran) < 2 * BATCH_STEPS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ran) >= 2 * BATCH_STEPS and not any(s.error for s in ran)
        assert len(committer._posted) <= BATCH_STEPS
    finally:
        committer.stop()                        # runs and commits the rest
    with store.read() as txn:
        view = View(txn, store.db, epoch, store.chunk_size)
        assert view.lookup(S.ROOT_INO, b"f%d" % (2 * BATCH_STEPS + 9))
    store.close()
    fsck_clean(path)
