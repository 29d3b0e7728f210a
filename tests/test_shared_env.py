"""LMDB allows one environment per store per process (its fcntl locks are the process's, and
py-lmdb refuses a second open): the unlocked read-only opens of one process share one (the
daemon reads a store while its cycles to several mirrors read it in other threads)."""

from __future__ import annotations

import os
import threading

from mountfs.store import Store


def filled(tmp_path) -> tuple:
    """A store holding one 3 MiB value, and (key, value)."""
    Store.mkfs(tmp_path / "s", 1 << 20)
    writer = Store.open(tmp_path / "s")
    key, value = os.urandom(32), os.urandom(3 << 20)
    with writer.write() as txn:
        txn.put(key, value, db=writer.db["blobs"])
    writer.close()
    return tmp_path / "s", key, value


def read(store: Store, key: bytes) -> bytes:
    with store.read() as txn:
        return store.copy(txn.get(key, db=store.db["blobs"]))


def test_read_only_opens_share_one_environment_until_the_last_close(tmp_path):
    path, key, value = filled(tmp_path)
    first = Store.open(path, readonly=True, lock=False, readahead=False)
    second = Store.open(path, readonly=True, lock=False)      # the first's readahead applies
    assert second.env is first.env and second._values is not None
    first.close()
    first.close()                                             # one user fewer, once
    assert read(second, key) == value                         # still open for the second
    second.close()
    third = Store.open(path, readonly=True, lock=False)       # a new one, its own readahead
    assert third.env is not first.env and third._values is None
    assert read(third, key) == value
    third.close()


def test_threads_opening_reading_and_closing_at_once(tmp_path):
    path, key, value = filled(tmp_path)
    errors = []

    def reader():
        try:
            for _ in range(30):
                store = Store.open(path, readonly=True, lock=False, readahead=False)
                try:
                    assert read(store, key) == value
                finally:
                    store.close()
        except Exception as e:                  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=reader) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_stores_dropped_without_close_let_their_environments_go(tmp_path):
    """Each environment maps the store's whole map size, so a process has room for only a
    few dozen at once. The table of shared environments held them for good: Stores a
    caller dropped without close() (as they were before sharing, freed with the Store)
    used up the address space, and every later open failed ("Cannot allocate memory")."""
    for i in range(40):
        Store.mkfs(tmp_path / f"s{i}", 1 << 20)
        store = Store.open(tmp_path / f"s{i}", readonly=True, lock=False)
        assert store.chunk_size == 1 << 20
        del store                                 # dropped, never closed
