"""Full chunks in STORE/chunks.dat, in fixed slots (mountfs/chunkfile.py), through real
mounts: freed slots are reused (the file does not grow without bound), but never while a
reader that can still see their old chunk is open; a flipped byte or a short file is found
by fsck and served as EIO, never as wrong bytes; a format 2 store (every chunk in LMDB) is
refused read-only and upgraded by a mount; a chunks.dat that is a link, a FIFO or another
user's is refused; statfs counts the chunk file's slots in use."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import blake3
import pytest
from conftest import cli, fsck_clean
from test_errors import fails_clearly, lmdb_env
from test_snapshots import store_used, wait_gc_idle
from test_store_paths import NOBODY, refused, victim  # noqa: F401 (victim: a fixture)

from mountfs import chunkfile
from mountfs import schema as S
from mountfs.errors import StoreError
from mountfs.namespace import View
from mountfs.store import Store

CS = 1 << 20                    # the default chunk size: a full chunk goes into a slot
MiB = 1 << 20


# ---- helpers ------------------------------------------------------------------------------

def write_synced(path: Path, data: bytes) -> bytes:
    """Write ``data`` to ``path`` and fsync it: the mount commits it (one commit each)."""
    with open(path, "wb") as h:
        h.write(data)
        h.flush()
        os.fsync(h.fileno())
    return data


def drop_all_caches() -> None:
    """Make the kernel forget file pages too: a read then reaches the mount."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class Slots:
    """The chunk file's tables as one fresh read transaction sees them."""

    def __init__(self, store: Path):
        st = Store.open(store, readonly=True, lock=False)
        try:
            with st.read() as txn:
                raw = txn.get(chunkfile.NEXT_SLOT, db=st.db["meta"])
                self.next_slot = S.from_u64(raw) if raw is not None else 0
                self.slots = {bytes(k): S.from_u64(v) for k, v in txn.cursor(db=st.db["slots"])}
                self.free = [(S.from_u64(bytes(k)[:8]), S.from_u64(bytes(k)[8:16]))
                             for k in txn.cursor(db=st.db["freeslots"]).iternext(values=False)]
                self.blobs = {bytes(k) for k in
                              txn.cursor(db=st.db["blobs"]).iternext(values=False)}
                self.txn_id = txn.id()          # the last committed transaction
        finally:
            st.close()

    @property
    def free_slots(self) -> set[int]:
        return {slot for _, slot in self.free}


def slots_freed(store: Path, slots: set[int]) -> "Slots | None":
    """The tables once every one of ``slots`` is free, else None."""
    state = Slots(store)
    return state if slots <= state.free_slots else None


def file_digests(store: Path, name: str) -> list[bytes]:
    """The digests of a live file's chunks, in order."""
    st = Store.open(store, readonly=True, lock=False)
    try:
        with st.read() as txn:
            view = View(txn, st.db, st.live_epoch(txn), st.chunk_size)
            ino = view.resolve(name)
            return [view.chunk(ino, i)[0] for i in view.chunk_indices(ino)]
    finally:
        st.close()


def store_format(store: Path) -> int:
    env = lmdb_env(store)
    try:
        with env.begin() as txn:
            return S.U32.unpack(txn.get(b"format", db=env.open_db(b"meta", txn=txn)))[0]
    finally:
        env.close()


def wait_for(what, condition, limit: float = 60.0):
    """Poll ``condition()`` until it returns something true (the limit only keeps a broken
    collector from hanging the suite)."""
    deadline = time.monotonic() + limit
    while not (value := condition()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return value


def problems(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in res.stdout.splitlines() if line.startswith("PROBLEM")]


# ---- reuse --------------------------------------------------------------------------------

def test_freed_slots_are_reused_so_the_chunk_file_stays_small(make_mount):
    """Twelve rounds of write 4 MiB + fsync, delete (waiting for the slots to be freed:
    the delete is committed in the background): without reuse chunks.dat would be 48 MiB;
    with it, a few files' worth (a slot freed by T waits for T + 2). The last file, written
    into reused slots, reads back after a remount, and fsck is clean."""
    m = make_mount()
    sizes = []
    for _ in range(12):
        write_synced(m.mnt / "f", os.urandom(4 * MiB))
        digests = set(file_digests(m.store, "f"))
        os.unlink(m.mnt / "f")
        wait_for("the deleted file's slots are freed",
                 lambda: not digests & Slots(m.store).slots.keys())
        sizes.append(os.path.getsize(m.store / "chunks.dat"))
    assert sizes[0] >= 4 * MiB, sizes               # the full chunks did go to the file
    assert sizes[-1] <= 12 * MiB, [s // MiB for s in sizes]
    keep = write_synced(m.mnt / "keep", os.urandom(4 * MiB))
    state = Slots(m.store)
    assert os.path.getsize(m.store / "chunks.dat") == state.next_slot * CS
    assert state.next_slot <= 12
    kept = file_digests(m.store, "keep")
    assert len(kept) == 4 and all(d in state.slots for d in kept)
    m.umount()
    fsck_clean(m.store)
    m.mount()
    drop_all_caches()
    assert (m.mnt / "keep").read_bytes() == keep


def test_a_slot_is_not_rewritten_while_a_reader_can_still_see_its_chunk(make_mount):
    """A read-only opener (another process, as replication or snapctl diff) holds a read
    transaction that sees a file's four full chunks; the file is deleted through the mount
    and new full chunks are written and fsync'ed, commit after commit. Each takes a new
    slot: the freed ones are durable (only the reader holds them back), and the reader
    still reads the old chunks, intact, through its old transaction. Once it is closed,
    the next writes take the freed slots and the file stops growing."""
    m = make_mount()
    old = write_synced(m.mnt / "old", os.urandom(4 * CS))
    reader = Store.open(m.store, readonly=True, lock=False)
    try:
        with reader.read() as txn:
            view = View(txn, reader.db, reader.live_epoch(txn), reader.chunk_size)
            ino = view.resolve("old")
            digests = [view.chunk(ino, i)[0] for i in range(4)]
            old_slots = {S.from_u64(txn.get(d, db=reader.db["slots"])) for d in digests}
            assert len(old_slots) == 4, "the old file's chunks are not in four slots"

            os.unlink(m.mnt / "old")
            freed = wait_for("the deleted file's slots are freed",
                             lambda: slots_freed(m.store, old_slots))
            for i in range(4):
                write_synced(m.mnt / f"new{i}", os.urandom(CS))
            after = Slots(m.store)
            assert after.txn_id >= freed.txn_id + 4            # a commit per fsync at least
            assert after.next_slot == freed.next_slot + 4, "a slot a reader sees was taken"
            assert old_slots <= after.free_slots
            # the transactions that freed them are durable (a later one has committed: the
            # next writer's id is at least theirs + 2): the reader alone kept them
            assert all(t + 2 <= after.txn_id + 1 for t, slot in after.free if slot in old_slots)

            for i, digest in enumerate(digests):
                data = bytes(chunkfile.get(txn, reader.db, digest))
                assert blake3.blake3(data).digest() == digest, f"chunk {i} was overwritten"
                assert data == old[i * CS:(i + 1) * CS]
            assert view.read(ino, 0, len(old), len(old)) == old
    finally:
        reader.close()

    before = Slots(m.store)
    assert len(before.free) == 4
    news = [write_synced(m.mnt / f"later{i}", os.urandom(CS)) for i in range(4)]
    after = Slots(m.store)
    assert after.next_slot == before.next_slot, "freed slots were not reused once unread"
    assert after.free == []
    assert {after.slots[d] for name in [f"later{i}" for i in range(4)]
            for d in file_digests(m.store, name)} == old_slots
    m.umount()
    fsck_clean(m.store)
    m.mount()
    drop_all_caches()
    for i, data in enumerate(news):
        assert (m.mnt / f"later{i}").read_bytes() == data


def test_a_snapshot_keeps_its_slots_until_it_is_deleted(make_mount):
    """A file deleted from the live tree but held by a snapshot keeps its slots: new writes
    take others, and the snapshot's copy reads back intact. Once the snapshot is deleted
    and reclaimed, its slots are free and the next writes take them."""
    m = make_mount()
    data = write_synced(m.mnt / "f", os.urandom(3 * CS))
    m.snapctl("create", "s")
    held = {Slots(m.store).slots[d] for d in file_digests(m.store, "f")}
    os.unlink(m.mnt / "f")
    for i in range(4):
        write_synced(m.mnt / f"n{i}", os.urandom(CS))
    state = Slots(m.store)
    assert state.free == [] and state.next_slot == 7
    drop_all_caches()
    assert (m.mnt / ".snapshot/s/f").read_bytes() == data
    m.snapctl("delete", "s")
    wait_gc_idle(m)
    wait_for("the snapshot's slots are freed", lambda: Slots(m.store).free_slots == held)
    write_synced(m.mnt / "commit", b"one commit more: the freeing one is durable (T + 2)")
    for i in range(3):
        write_synced(m.mnt / f"m{i}", os.urandom(CS))
    state = Slots(m.store)
    assert state.next_slot == 7 and state.free == []


def test_a_read_only_mount_made_before_the_chunk_file_reads_full_chunks(make_mount, tmp_path):
    """README: read-only mounts sit beside the writer, "mounted before or after it". Here
    the read-only mount comes first, on a store made by mkfs (no chunks.dat yet); the writer
    then writes full chunks, which the read-only mount must serve."""
    store = tmp_path / "fresh"
    cli("mountfs", "mkfs", store)
    assert not (store / "chunks.dat").exists()
    ro = make_mount(store, "--read-only", fsck=False)
    rw = make_mount(store)
    data = write_synced(rw.mnt / "f", os.urandom(2 * CS) + b"tail")
    small = write_synced(rw.mnt / "small", b"x" * 5000)
    wait_for("the read-only mount follows the writer", lambda: "f" in os.listdir(ro.mnt))
    drop_all_caches()
    assert (ro.mnt / "small").read_bytes() == small
    assert (ro.mnt / "f").read_bytes() == data


# ---- corruption ---------------------------------------------------------------------------

def test_a_flipped_byte_in_the_chunk_file_is_found_and_never_served(make_mount):
    """One bit flipped in a slot of an unmounted store: fsck reports that chunk, and only
    it, with exit 1; the mount, with the page cache dropped, answers EIO for any read that
    touches the chunk (every time), and serves the rest of the file and other files."""
    m = make_mount()
    data = write_synced(m.mnt / "bad", os.urandom(2 * CS + 5000))  # two slots and a tail
    good = write_synced(m.mnt / "good", os.urandom(CS))
    digests = file_digests(m.store, "bad")
    state = Slots(m.store)
    assert digests[0] in state.slots and digests[1] in state.slots
    assert digests[2] in state.blobs                                # the tail: in LMDB
    m.umount()
    m.check_fsck = False                                            # corrupt on purpose
    slot = state.slots[digests[1]]
    with open(m.store / "chunks.dat", "r+b") as h:
        h.seek(slot * CS + 777)
        byte = h.read(1)
        h.seek(slot * CS + 777)
        h.write(bytes([byte[0] ^ 0x01]))

    res = cli("mountfs", "fsck", "-q", m.store, check=False)
    assert res.returncode == 1, res
    assert "Traceback" not in res.stderr, res.stderr
    found = problems(res)
    assert len(found) == 1, res.stdout
    assert f"chunk {digests[1].hex()[:16]} (slot {slot})" in found[0], found
    assert "does not match its digest" in found[0], found

    m.mount()
    drop_all_caches()
    for _ in range(2):                                  # not once, then cached as fine
        with pytest.raises(OSError) as info:
            (m.mnt / "bad").read_bytes()
        assert info.value.errno == errno.EIO
    fd = os.open(m.mnt / "bad", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            os.pread(fd, 4096, CS)                      # inside the corrupt chunk
        assert info.value.errno == errno.EIO
        assert os.pread(fd, 4096, 0) == data[:4096]     # the chunk before it is fine
    finally:
        os.close(fd)
    assert (m.mnt / "good").read_bytes() == good


def test_a_chunk_file_cut_short_or_missing_is_reported(make_mount):
    """Cut inside slot 1 of three: fsck names the two chunks it lost (not the first),
    the mount serves EIO for them; with no chunks.dat at all, all three are reported."""
    m = make_mount()
    data = write_synced(m.mnt / "f", os.urandom(3 * CS))
    digests = file_digests(m.store, "f")
    state = Slots(m.store)
    assert sorted(state.slots[d] for d in digests) == [0, 1, 2]
    m.umount()
    m.check_fsck = False
    os.truncate(m.store / "chunks.dat", CS + CS // 2)

    res = cli("mountfs", "fsck", "-q", m.store, check=False)
    assert res.returncode == 1, res
    found = problems(res)
    lost = [d for d in digests if state.slots[d] >= 1]
    assert len(found) == 2, res.stdout
    for digest in lost:
        assert any(f"chunk {digest.hex()[:16]}" in p and "corrupt or missing" in p
                   for p in found), (digest.hex(), found)
    first = [d for d in digests if state.slots[d] == 0][0]
    assert not any(first.hex()[:16] in p for p in found), found

    m.mount()
    drop_all_caches()
    with pytest.raises(OSError) as info:
        (m.mnt / "f").read_bytes()
    assert info.value.errno == errno.EIO
    fd = os.open(m.mnt / "f", os.O_RDONLY)
    try:
        at = digests.index(first) * CS          # the chunk in slot 0 is fine
        assert os.pread(fd, 4096, at) == data[at:at + 4096]
    finally:
        os.close(fd)
    m.umount()

    os.unlink(m.store / "chunks.dat")
    res = cli("mountfs", "fsck", "-q", m.store, check=False)
    assert res.returncode == 1, res
    found = problems(res)
    assert len(found) == 3, res.stdout
    assert all(any(d.hex()[:16] in p for p in found) for d in digests), found


def test_a_chunk_file_cut_short_under_a_mount_is_eio_never_zeros(make_mount):
    """A chunk read once is not checked again (its digest is remembered): if chunks.dat is
    then cut short under the mount, the next read must still be EIO, never the missing
    bytes made up as zeros (an LMDB value could not be short; a slot can)."""
    m = make_mount()
    data = write_synced(m.mnt / "f", os.urandom(2 * CS))
    assert (m.mnt / "f").read_bytes() == data           # checked, and remembered
    os.truncate(m.store / "chunks.dat", CS // 2)
    drop_all_caches()
    fd = os.open(m.mnt / "f", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            os.pread(fd, 4096, CS // 2 + 4096)
        assert info.value.errno == errno.EIO
        assert os.pread(fd, 4096, 0) == data[:4096]     # what the file still holds
    finally:
        os.close(fd)
    m.umount()
    m.check_fsck = False


def test_malformed_slot_records_are_reported_not_a_traceback(make_mount):
    """fsck reads the slot tables as untrusted bytes: a slot number of the wrong width and a
    free-slot record naming a transaction still to come are each one PROBLEM line."""
    m = make_mount()
    write_synced(m.mnt / "f", os.urandom(CS))
    m.umount()
    m.check_fsck = False
    env = lmdb_env(m.store)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"\x01" * 32, b"\x00\x01", db=env.open_db(b"slots", txn=txn))
            txn.put(S.u64(1 << 60) + S.u64(0), b"", db=env.open_db(b"freeslots", txn=txn))
    finally:
        env.close()
    res = cli("mountfs", "fsck", "-q", m.store, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res
    found = problems(res)
    assert any("slot record 0101010101010101" in p and "malformed" in p for p in found), found
    assert any("free-slot record" in p and "transaction still to come" in p
               for p in found), found


def test_no_chunk_the_mount_checks_inline_is_in_a_slot():
    """The mount checks chunks on its serving thread only if together they are at most
    INLINE_HASH bytes and in memory (engine.verify), never reading the chunk file there:
    every chunk in a slot must be longer than that."""
    from mountfs.filecache import INLINE_HASH
    assert chunkfile.LARGE >= INLINE_HASH


# ---- format 2 -----------------------------------------------------------------------------

def make_format_2(store: Path) -> None:
    """Turn a format 3 store into the format 2 store it would have been: every chunk in
    ``blobs``, no ``slots``/``freeslots`` tables, no ``next_slot``, no chunks.dat."""
    env = lmdb_env(store)
    try:
        with env.begin(write=True) as txn:
            dbs = {n: env.open_db(n.encode(), txn=txn, create=False) for n in S.DB_NAMES}
            with open(store / "chunks.dat", "rb") as h:
                for digest, slot in list(txn.cursor(db=dbs["slots"])):
                    data = os.pread(h.fileno(), CS, S.from_u64(slot) * CS)
                    assert blake3.blake3(data).digest() == bytes(digest)
                    txn.put(bytes(digest), data, db=dbs["blobs"])
            txn.drop(dbs["slots"], delete=True)
            txn.drop(dbs["freeslots"], delete=True)
            txn.delete(chunkfile.NEXT_SLOT, db=dbs["meta"])
            txn.put(b"format", S.U32.pack(2), db=dbs["meta"])
    finally:
        env.close()
    os.unlink(store / "chunks.dat")


def test_a_format_2_store_is_refused_read_only_and_upgraded_by_a_mount(make_mount, tmp_path):
    """A format 2 store (full chunks in LMDB, in a file and in a snapshot): every read-only
    opener refuses it in one line saying to mount it, and leaves it as it is; a mount
    upgrades it (format 3), serves the old chunks from LMDB, puts new full chunks in slots,
    fsck is clean, and the old chunks are still dropped once nothing names them."""
    m = make_mount()
    old = write_synced(m.mnt / "old", os.urandom(2 * CS + 300))
    (m.mnt / "small").write_text("small file")
    m.snapctl("create", "before")
    old_digests = file_digests(m.store, "old")
    assert sum(d in Slots(m.store).slots for d in old_digests) == 2
    m.umount()
    make_format_2(m.store)
    assert store_format(m.store) == 2

    with pytest.raises(StoreError) as info:
        Store.open(m.store, readonly=True, lock=False)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert "format version 2" in message and "mount it" in message, message
    ro = tmp_path / "ro"
    ro.mkdir()
    fails_clearly("mountfs", "fsck", m.store, code=2, contains="format version 2")
    fails_clearly("mountfs", "mount", "--read-only", m.store, ro, contains="format version 2")
    assert not os.path.ismount(ro)
    assert store_format(m.store) == 2 and not (m.store / "chunks.dat").exists()

    m.mount()                                           # upgrades it in place
    assert store_format(m.store) == 3
    drop_all_caches()
    assert (m.mnt / "old").read_bytes() == old
    assert (m.mnt / ".snapshot/before/old").read_bytes() == old
    assert (m.mnt / "small").read_text() == "small file"
    new = write_synced(m.mnt / "new", os.urandom(3 * CS))
    state = Slots(m.store)
    new_digests = file_digests(m.store, "new")
    assert all(d in state.slots for d in new_digests)       # new full chunks: in slots
    assert all(d in state.blobs for d in old_digests)        # old ones stay in LMDB
    assert not any(d in state.slots for d in old_digests)
    m.umount()
    fsck_clean(m.store)
    st = Store.open(m.store, readonly=True, lock=False)      # format 3: read-only is fine
    st.close()
    m.mount()
    drop_all_caches()
    assert (m.mnt / "old").read_bytes() == old
    assert (m.mnt / "new").read_bytes() == new
    os.unlink(m.mnt / "old")                                 # old chunks in blobs: freed
    m.snapctl("delete", "before")
    wait_gc_idle(m)
    wait_for("the old chunks are dropped",
             lambda: not any(d in Slots(m.store).blobs for d in old_digests[:2]))


# ---- strict modes -------------------------------------------------------------------------

def plant(store: Path, kind: str, victim: Path) -> None:
    path = store / "chunks.dat"
    path.unlink(missing_ok=True)
    if kind == "link":
        path.symlink_to(victim)
    elif kind == "dangling link":
        path.symlink_to(store.parent / "planted")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b"")
        os.chown(path, NOBODY, NOBODY)


@pytest.mark.parametrize("kind", ["link", "dangling link", "fifo", "another user's"])
def test_a_chunk_file_that_is_not_our_regular_file_is_refused(make_mount, victim, kind):
    """chunks.dat is opened O_CREAT for writing by the mount: a link in its place would
    have root write chunks into /etc/shadow (or create the file it names), a FIFO would
    hang the open, another user's file would be theirs to read. Every opener refuses it in
    one line, and nothing is written anywhere."""
    m = make_mount()
    write_synced(m.mnt / "f", os.urandom(2 * CS))
    m.umount()
    m.check_fsck = False
    plant(m.store, kind, victim)
    words = {"link": "is a symbolic link", "dangling link": "is a symbolic link",
             "fifo": "is not a regular file", "another user's": "is owned by nobody"}[kind]
    what = f"{m.store}/chunks.dat {words}"
    ro = m.store.parent / "ro"
    ro.mkdir()
    for args in (("mountfs", "mount", m.store, m.mnt),
                 ("mountfs", "mount", "--read-only", m.store, ro),
                 ("mountfs", "fsck", m.store),
                 ("snapctl", "--store", m.store, "create", "s1")):
        refused(cli(*args, check=False, timeout=30), what)
    assert not os.path.ismount(m.mnt) and not os.path.ismount(ro)
    with pytest.raises(StoreError) as info:
        Store.open(m.store, readonly=True, lock=False)
    assert str(info.value).startswith(what) and len(str(info.value).splitlines()) == 1
    assert victim.read_text() == "root's secret\n"
    assert not (m.store.parent / "planted").exists()


# ---- statfs -------------------------------------------------------------------------------

def test_statfs_counts_the_slots_in_use(make_mount):
    """df must not hide the chunk file: 16 MiB written in full chunks adds about 16 MiB to
    the used space, and deleting it (slots freed, the file not shrunk) takes it back off."""
    m = make_mount()
    before = store_used(m)
    write_synced(m.mnt / "big", os.urandom(16 * MiB))
    assert os.path.getsize(m.store / "chunks.dat") == 16 * MiB
    grown = store_used(m) - before
    assert 16 * MiB - 64 * 1024 <= grown <= 18 * MiB, grown / MiB
    os.unlink(m.mnt / "big")
    wait_gc_idle(m)
    wait_for("the deleted file's slots are freed", lambda: len(Slots(m.store).free) == 16)
    assert os.path.getsize(m.store / "chunks.dat") == 16 * MiB
    assert store_used(m) - before <= 2 * MiB, (store_used(m) - before) / MiB
