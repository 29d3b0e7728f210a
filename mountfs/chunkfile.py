"""Full chunks in a file of their own beside LMDB (``chunks.dat``), in fixed slots.

Why: a chunk kept in LMDB crosses its commit twice (copied into a dirty page, written out by
the commit, which then waits for the disk in the one writing thread); for a sequential write
that path was the mount's bound (docs/benchmarks.md, thirty-sixth round). A full chunk is
instead written at once with pwrite(2) into a slot of the chunk file, its writeback started
(sync_file_range), and the file fdatasync'ed just before the LMDB commit that names the slot
(``Store.commit``); LMDB carries only the slot's number.

Layout: slot ``n`` is bytes ``[n * chunk_size, (n + 1) * chunk_size)``. Only chunks of
exactly the store's chunk size, and larger than ``LARGE`` (64 KiB), go there (a slot wastes
nothing, and the mount's inline checks never meet one); the rest stay in ``blobs``.

Invariants (``fsck`` checks them):

* a digest with ``refs`` is in exactly one of ``blobs`` and ``slots``;
* every slot below ``next_slot`` is named once: by one ``slots`` value or one ``freeslots``
  key, never by both;
* a slot named in ``slots`` holds the chunk whose digest names it.

Crash order: a chunk's bytes are synced before the commit that names its slot, so a power
loss that keeps the commit keeps the bytes; one that undoes it leaves bytes in a slot nothing
names. A slot freed by transaction T is written again only when

* T is durable: a commit after T has fdatasync'ed the data file (LMDB runs with metasync
  off, so a power loss may undo the newest commit, which would name the slot again), i.e.
  the writing transaction's id is at least T + 2 (or T + 1 after syncing LMDB, which
  ``put`` does only when the disk has no room for a new slot); and
* no reader can still see the slot's old chunk: every reader in LMDB's reader table read
  from T on (an older one may read the slot through the record T deleted).

Until then a new chunk takes a new slot at the end. The file never shrinks: freed slots are
the store's free space, as LMDB's free pages are.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import threading
from pathlib import Path

from . import schema as S
from .errors import StoreError, StoreFull
from .strictmodes import open_private

NAME = "chunks.dat"
NEXT_SLOT = b"next_slot"            # meta key: u64, the first slot never used
# Chunks this large or smaller stay in LMDB: the mount checks those on its serving thread
# when they are in memory (engine.verify), which a read of the chunk file must not be.
LARGE = 64 << 10
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range():
    """sync_file_range(2) (not in Python's os): ctypes, loaded only by a writer."""
    import ctypes
    call = ctypes.CDLL(None, use_errno=True).sync_file_range
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return call


class Tables(dict):
    """A store's sub-databases by name, and its chunk file (None: there is none to use)."""
    chunkfile: "ChunkFile | None" = None


class ChunkFile:
    """The open chunk file of one store. Written only by the store's one writing thread;
    read from any."""

    def __init__(self, store: Path, chunk_size: int, writable: bool, env):
        self.path = store / NAME
        self.env = env
        self.chunk_size = chunk_size
        self.writable = writable
        self.dirty = False          # written since the last sync
        self._durable_below = 0     # every commit below this transaction id is durable
        self._readers = (None, 0)   # (transaction id, the oldest reader's then)
        self._opening = threading.Lock()
        self.fd = None
        if writable:
            self.fd = open_private(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
            if os.fstat(self.fd).st_size == 0:
                _sync_directory(store)  # its name, durable before a commit names a slot
        else:
            self._open_to_read()

    def _open_to_read(self) -> int | None:
        """The file open for reading; None while it does not exist (a read-only opener
        may come before the first full chunk's writer made it, and stay open after)."""
        with self._opening, contextlib.suppress(FileNotFoundError):
            if self.fd is None:
                self.fd = open_private(self.path, os.O_RDONLY | os.O_CLOEXEC)
        return self.fd

    def takes(self, data) -> bool:
        """Whether ``data`` goes into a slot."""
        return self.writable and len(data) == self.chunk_size and self.chunk_size > LARGE

    def read(self, slot: int, start: int = 0, length: int | None = None) -> bytes:
        """The slot's bytes from ``start`` (short, or empty, where the file ends: a digest
        check fails)."""
        if self.fd is None and self._open_to_read() is None:
            return b""
        if length is None:
            length = self.chunk_size - start
        return os.pread(self.fd, length, slot * self.chunk_size + start)

    def write(self, slot: int, data) -> bool:
        """Write ``data`` into ``slot`` and start its writeback; False if the disk is full
        (nothing was promised: what a new slot at the end took is given back)."""
        view, at = memoryview(data), slot * self.chunk_size
        try:
            while view:
                n = os.pwrite(self.fd, view, at)
                view, at = view[n:], at + n
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            if os.fstat(self.fd).st_size <= (slot + 1) * self.chunk_size:
                os.ftruncate(self.fd, slot * self.chunk_size)
            return False
        self.dirty = True
        _sync_file_range()(self.fd, slot * self.chunk_size, len(data), _SYNC_FILE_RANGE_WRITE)
        return True

    def sync(self) -> None:
        """Make every slot written so far durable: before the commit that names them. A
        disk found full only now (some filesystems allocate at writeback) is StoreFull, as
        LMDB's own full disk: the commit is not made, and the committer makes room."""
        if self.dirty:
            try:
                os.fdatasync(self.fd)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StoreFull(f"no space left on the store's disk ({self.path})") from e
                raise StoreError(f"{self.path}: cannot sync the chunk file: {e}") from e
            self.dirty = False

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def reusable_before(self, txn, sync: bool = False) -> int:
        """Slots freed by a transaction below this id may be written in ``txn`` (see the
        module's docstring). With ``sync``, LMDB's data file is synced first if that lets
        more be reused (a full disk: the alternative is no room)."""
        me = txn.id()
        if sync and self._durable_below < me:
            self.env.sync(True)             # every commit before ``txn`` is durable now
            self._durable_below = me
        if self._readers[0] != me:
            self._readers = (me, _oldest_reader(self.env))
        return min(max(me - 1, self._durable_below), self._readers[1] + 1)


def _sync_directory(path: Path) -> None:
    """fsync(2) a directory: a file created in it survives a power loss by its name."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _oldest_reader(env) -> int:
    """The oldest transaction id a reader of this environment reads (readers of processes
    that died are cleared first); a large number when none reads."""
    oldest = 1 << 63
    env.reader_check()
    for line in env.readers().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 3 and fields[2].isdigit():
            oldest = min(oldest, int(fields[2]))
    return oldest


def get(txn, dbs, digest: bytes):
    """A chunk's bytes (a view into the map for one kept in LMDB), or None if the store
    holds no such chunk."""
    data = txn.get(digest, db=dbs["blobs"])
    if data is not None:
        return data
    slot = txn.get(digest, db=dbs["slots"])
    if slot is None:
        return None
    return dbs.chunkfile.read(S.from_u64(slot))     # short if cut: its digest check fails


def get_range(txn, dbs, digest: bytes, start: int, length: int):
    """Bytes ``[start, start + length)`` of a chunk (fewer where it ends), or None if the
    store holds no such chunk, or a slot the chunk file cuts short (corrupt: never
    padded); a read of part of a full chunk reads only that part."""
    data = txn.get(digest, db=dbs["blobs"])
    if data is not None:
        return data[start:start + length]
    slot = txn.get(digest, db=dbs["slots"])
    if slot is None:
        return None
    data = dbs.chunkfile.read(S.from_u64(slot), start, length)
    return data if len(data) == min(length, dbs.chunkfile.chunk_size - start) else None


def length(txn, dbs, digest: bytes) -> int | None:
    """A chunk's length without reading it (None: the store holds no such chunk)."""
    data = txn.get(digest, db=dbs["blobs"])
    if data is not None:
        return len(data)
    return dbs.chunkfile.chunk_size if txn.get(digest, db=dbs["slots"]) is not None else None


def has(txn, dbs, digest: bytes) -> bool:
    """Whether the store holds the chunk, without reading it."""
    return txn.get(digest, db=dbs["blobs"]) is not None or \
        txn.get(digest, db=dbs["slots"]) is not None


def put(txn, dbs, digest: bytes, data) -> None:
    """Store a new chunk: in a slot if it is a full one and the disk has room for it
    there, else in ``blobs``."""
    chunkfile = getattr(dbs, "chunkfile", None)     # a plain dict: mkfs's, tests'
    if chunkfile is not None and chunkfile.takes(data) \
            and txn.get(digest, db=dbs["blobs"]) is None:   # not staged there by a mirror
        slot = _reuse(txn, dbs, chunkfile)
        if slot is None:
            slot = _append(txn, dbs)
        if not chunkfile.write(slot, data):
            _unappend(txn, dbs, slot)
            slot = _reuse(txn, dbs, chunkfile, sync=True)     # the disk is full
            if slot is not None and not chunkfile.write(slot, data):
                _unappend(txn, dbs, slot)
                slot = None
        if slot is not None:
            txn.put(digest, S.u64(slot), db=dbs["slots"])
            return
    txn.put(digest, data, db=dbs["blobs"])      # LMDB may still find room


def delete(txn, dbs, digest: bytes) -> None:
    """Forget a chunk; its slot, if it had one, is free from this transaction on."""
    if txn.delete(digest, db=dbs["blobs"]):
        return
    slot = txn.get(digest, db=dbs["slots"])
    if slot is not None:
        slot = bytes(slot)
        txn.delete(digest, db=dbs["slots"])
        txn.put(S.u64(txn.id()) + slot, b"", db=dbs["freeslots"])


def replace(txn, dbs, digest: bytes, data) -> None:
    """Put a good copy of a chunk the store holds lost or corrupt (a repair)."""
    delete(txn, dbs, digest)
    txn.put(digest, data, db=dbs["blobs"])


def _reuse(txn, dbs, chunkfile: ChunkFile, sync: bool = False) -> int | None:
    """The free slot freed longest ago, if this transaction may write it (with ``sync``:
    after syncing LMDB if that is what it waits for)."""
    cur = txn.cursor(db=dbs["freeslots"])
    if not cur.first() or S.from_u64(cur.key()[:8]) >= chunkfile.reusable_before(txn, sync):
        return None
    key = bytes(cur.key())
    txn.delete(key, db=dbs["freeslots"])
    return S.from_u64(key[8:16])


def _append(txn, dbs) -> int:
    """A new slot at the end of the chunk file."""
    raw = txn.get(NEXT_SLOT, db=dbs["meta"])
    slot = S.from_u64(raw) if raw is not None else 0
    txn.put(NEXT_SLOT, S.u64(slot + 1), db=dbs["meta"])
    return slot


def _unappend(txn, dbs, slot: int) -> None:
    """Give back a slot this transaction took and could not fill: a new one at the end is
    the end again; a reused one is free again (from this transaction: it was written)."""
    if S.from_u64(txn.get(NEXT_SLOT, db=dbs["meta"])) == slot + 1:
        txn.put(NEXT_SLOT, S.u64(slot), db=dbs["meta"])
    else:
        txn.put(S.u64(txn.id()) + S.u64(slot), b"", db=dbs["freeslots"])


def usage(txn, dbs, chunk_size: int) -> tuple[int, int]:
    """(bytes of slots in use, bytes of free slots) of the chunk file."""
    raw = txn.get(NEXT_SLOT, db=dbs["meta"])
    slots = S.from_u64(raw) if raw is not None else 0
    free = txn.stat(dbs["freeslots"])["entries"]
    return (slots - free) * chunk_size, free * chunk_size
