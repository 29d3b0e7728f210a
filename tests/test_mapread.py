"""A store opened without readahead copies large values with one pread at their place in
the map (mountfs.mapread): the bytes must be exactly what LMDB maps, for every size, after
the file grew, with the page cache dropped, and while a writer rewrites the store. And
``resident`` tells a value in memory from one the disk must give first (the mount checks a
small chunk on its serving thread only in the first case)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest

from mountfs.mapread import LARGE, PAGE, resident
from mountfs.store import Store


def fill(store: Store, sizes: list[int]) -> dict[bytes, bytes]:
    values = {os.urandom(32): os.urandom(n) for n in sizes}
    with store.write() as txn:
        for key, value in values.items():
            txn.put(key, value, db=store.db["blobs"])
    return values


def drop_caches() -> None:
    if os.geteuid() == 0:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")


REWRITE = """
import os, sys
from mountfs.store import Store
store = Store.open(sys.argv[1])
with store.write() as txn:
    for key, size in [line.split() for line in sys.stdin]:
        txn.put(bytes.fromhex(key), os.urandom(int(size)), db=store.db["blobs"])
        print(key, txn.get(bytes.fromhex(key), db=store.db["blobs"]).hex())
store.close()
"""


def test_large_and_small_values_copy_exactly(tmp_path):
    Store.mkfs(tmp_path / "s", 1 << 20)
    writer = Store.open(tmp_path / "s")
    sizes = [1, 4095, LARGE - 1, LARGE, LARGE + 1, 1 << 20, 3 << 20]
    values = fill(writer, sizes)
    writer.close()
    drop_caches()
    reader = Store.open(tmp_path / "s", readonly=True, lock=False, readahead=False)
    try:
        assert reader._values is not None and reader._values.base is not None
        with reader.read() as txn:
            for key, value in values.items():
                assert reader.copy(txn.get(key, db=reader.db["blobs"])) == value
        # another process rewrites every value and grows the file past what was mapped
        wanted = [(k, len(v)) for k, v in values.items()] + \
            [(os.urandom(32), 2 << 20) for _ in range(8)]
        out = subprocess.run([sys.executable, "-c", REWRITE, str(tmp_path / "s")], check=True,
                             input="".join(f"{k.hex()} {n}\n" for k, n in wanted),
                             capture_output=True, text=True).stdout
        values = {bytes.fromhex(k): bytes.fromhex(v) for k, v in map(str.split, out.splitlines())}
        assert len(values) == len(wanted)
        with reader.read() as txn:
            for key, value in values.items():
                assert reader.copy(txn.get(key, db=reader.db["blobs"])) == value
    finally:
        reader.close()


def test_a_store_with_readahead_copies_from_the_map(tmp_path):
    Store.mkfs(tmp_path / "s", 1 << 20)
    store = Store.open(tmp_path / "s")
    try:
        values = fill(store, [1 << 20])
        assert store._values is None
        with store.read() as txn:
            for key, value in values.items():
                assert store.copy(txn.get(key, db=store.db["blobs"])) == value
    finally:
        store.close()


def test_resident_tells_touched_pages_from_untouched_ones():
    region = mmap.mmap(-1, 16 * PAGE)       # anonymous: no page is there until touched
    view = memoryview(region)
    try:
        assert not resident(view) and not resident(view[:PAGE])
        region[PAGE] = 1
        assert resident(view[PAGE:2 * PAGE]) and resident(view[PAGE + 10:PAGE + 20])
        assert not resident(view[PAGE:2 * PAGE + 1])    # one byte on an untouched page
        assert resident(b"copied values are in memory") and resident(view[:0])
    finally:
        view.release()
        region.close()


def test_resident_says_whether_a_mapped_file_must_be_read_from_disk_first(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("dropping the page cache needs root")
    path = tmp_path / "data"
    path.write_bytes(os.urandom(64 * PAGE))
    drop_caches()
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    region.madvise(mmap.MADV_RANDOM)        # a fault reads its own page, no neighbours
    view = memoryview(region)
    try:
        value = view[40 * PAGE + 100:40 * PAGE + 200]
        assert not resident(value) and not resident(view)
        assert region[40 * PAGE + 150] is not None         # read: the page comes in
        assert resident(value) and not resident(view[39 * PAGE:41 * PAGE])
    finally:
        value.release()
        view.release()
        region.close()
