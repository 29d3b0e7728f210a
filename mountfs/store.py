"""The LMDB environment of a store: creating, opening, locking, transactions, and the
primitive operations on versioned records (see schema.py for the layout).

A store is a directory holding ``data.mdb`` (LMDB), ``chunks.dat`` (full chunks, in slots
LMDB names: chunkfile.py), ``lock`` (an flock held by the one process that may write: a
mount, or snapctl/fsck working offline) and, while mounted, ``control.sock``.

Durability: LMDB runs with ``sync=True, metasync=False``: a commit writes its data pages,
fdatasyncs them, then writes the meta page without a sync. Data pages therefore reach the disk
before the meta page that points at them, and pages are reused only two transactions after
they were freed, so a power loss leaves the store whole: at worst the newest commit is undone
(its meta page lost). ``sync()`` syncs that meta page too; it runs on fsync(), after a
snapshot, on unmount, and every second by the mount's syncer. A commit costs an fdatasync, so
the mount groups many operations into one commit, in a worker thread (engine.py). A killed
process loses nothing that was committed. A commit that names slots of the chunk file syncs
that file first (``commit``, ``write``). tests/test_powerloss.py checks all of this.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import struct
import threading
import time
import uuid as uuidlib
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import lmdb

from . import buckets, chunkfile
from . import schema as S
from .errors import StoreError, StoreFull
from .strictmodes import check_new_store, check_store, open_regular

if TYPE_CHECKING:
    from .mapread import MapReader

log = logging.getLogger(__name__)

MAP_SIZE = 1 << 43          # address space only (8 TiB); the file grows with the data
DEFAULT_CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 64 << 20


FULL_DISK_MARGIN = 64 << 20     # below this much free space, a failed write means "full"


def _pages(stat: dict) -> int:
    return stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _data_file(path: Path) -> Path:
    return path / "data.mdb"


def _make_private(path: Path) -> None:
    """chmod 700 the new store's directory itself, never what a link in its place names."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


class Store:
    """An open store. Only the process holding the lock writes; any number may read."""

    def __init__(self, path: Path, env: lmdb.Environment, lockfd: int | None, readonly: bool):
        self.path = path
        self.env = env
        self.lockfd = lockfd
        self.readonly = readonly
        self._values: MapReader | None = None     # set when opened without readahead
        self._shared: _SharedEnv | None = None    # the environment's entry, if shared
        self._closed = False
        self.db = chunkfile.Tables(
            (name, env.open_db(name.encode(), create=False)) for name in S.DB_NAMES)
        with env.begin() as txn:
            self.bucket_count = buckets.count_of(txn, self.db)
            buckets.track(self.db, self.bucket_count)
            self.chunk_size = S.U32.unpack(txn.get(b"chunk_size", db=self.db["meta"]))[0]
            self.uuid = bytes(txn.get(b"uuid", db=self.db["meta"]))
            mirror_of = txn.get(b"mirror_of", db=self.db["meta"])
            self.mirror_of = bytes(mirror_of) if mirror_of is not None else None
        self.db.chunkfile = chunkfile.ChunkFile(path, self.chunk_size, not readonly, env)

    # ---- lifecycle -----------------------------------------------------------------------

    @staticmethod
    def mkfs(path: str | os.PathLike, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        """Create an empty store with a root directory owned by the caller."""
        from .namespace import make_root  # the namespace module owns inode semantics

        path = Path(path)
        if chunk_size < MIN_CHUNK_SIZE or chunk_size > MAX_CHUNK_SIZE or chunk_size & (chunk_size - 1):
            raise StoreError(f"chunk size {chunk_size} must be a power of two between "
                             f"{MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} bytes")
        check_new_store(path)
        _refuse_a_mountpoint(path)
        if path.exists() and any(path.iterdir()):
            raise StoreError(f"{path} is not empty; refusing to create a store over it")
        path.mkdir(parents=True, exist_ok=True)
        _make_private(path)
        env = _open_env(path, readonly=False, create=True)
        try:
            with env.begin(write=True) as txn:
                dbs = {n: env.open_db(n.encode(), txn=txn, create=True) for n in S.DB_NAMES}
                meta = dbs["meta"]
                txn.put(b"format", S.U32.pack(S.FORMAT_VERSION), db=meta)
                txn.put(b"chunk_size", S.U32.pack(chunk_size), db=meta)
                txn.put(b"live_epoch", S.u64(1), db=meta)
                txn.put(b"next_ino", S.u64(S.ROOT_INO + 1), db=meta)
                txn.put(b"next_snap_id", S.u64(1), db=meta)
                txn.put(b"uuid", uuidlib.uuid4().bytes, db=meta)
                txn.put(b"bucket_count", S.U32.pack(buckets.DEFAULT_COUNT), db=meta)
                buckets.track(dbs, buckets.DEFAULT_COUNT)
                make_root(txn, dbs, os.getuid(), os.getgid())
            env.sync(True)
        finally:
            env.close()

    @classmethod
    def open(cls, path: str | os.PathLike, readonly: bool = False, lock: bool = True,
             holder: str = "", readahead: bool = True) -> "Store":
        """Open an existing store. With ``lock``, take the exclusive store lock (a second
        writer gets a clear StoreError naming the holder). ``readahead=False`` suits a
        process that reads only metadata (see _open_env). Unlocked read-only opens in one
        process share one environment (_open_shared)."""
        path = Path(path).absolute()
        check_store(path)
        if not path.is_dir():
            raise StoreError(f"{path}: no such store directory")
        if not _data_file(path).exists():
            _refuse_a_mountpoint(path)
            raise StoreError(f"{path} is not a mountfs store (no data.mdb); create one with "
                             f"'mountfs mkfs {path}'")
        if _data_file(path).stat().st_size == 0:    # LMDB would make a new, empty one in it
            raise StoreError(f"{_data_file(path)} is empty: an interrupted mkfs (delete it and "
                             f"run 'mountfs mkfs {path}' again), or a store whose data was "
                             f"lost (restore it from a backup or a mirror)")
        if readonly and not lock:
            return cls._open_shared(path, readahead)
        lockfd = _take_lock(path, holder) if lock else None
        env = None
        try:
            env = _open_env(path, readonly=readonly, create=False, readahead=readahead)
            _check_size(env, path)
            _check_format(env, path, upgrade=not readonly)
            store = cls(path, env, lockfd, readonly)
            if not readahead:
                from .mapread import MapReader      # ctypes: loaded only where needed
                store._values = MapReader(str(_data_file(path)))
        except BaseException:
            if env is not None:
                env.close()
            if lockfd is not None:
                os.close(lockfd)
            raise
        if lockfd is not None and not readonly:
            store._finish_interrupted()
        return store

    @classmethod
    def _open_shared(cls, path: Path, readahead: bool) -> "Store":
        """An unlocked read-only open, of the environment this process has open for the
        store if there is one: LMDB allows one per process (its fcntl locks are the
        process's; py-lmdb refuses a second), and the daemon reads a store while its
        replication cycles read it in other threads. The first opener's readahead applies.
        A store is its data file (as for py-lmdb): not one made anew at the same path."""
        st = _data_file(path).stat()
        key = (st.st_dev, st.st_ino)
        with _shared_lock:
            entry = _shared.get(key) or _SharedEnv.open(path, key, readahead)
            try:
                store = cls(path, entry.env, None, True)
                if not entry.readahead:
                    from .mapread import MapReader
                    store._values = MapReader(str(_data_file(path)))
            except BaseException:
                if not entry.users:
                    entry.env.close()
                raise
            entry.users += 1
            _shared[key] = entry
        store._shared = entry
        return store

    def _finish_interrupted(self) -> None:
        """Whoever holds the lock to write is alone: a change spanning transactions that is
        still marked unfinished was cut short (kill -9, power loss), and is undone before
        anything else reads or writes the live tree (snapshots.begin_undoable)."""
        from . import snapshots
        try:
            with self.write() as txn:
                undone = snapshots.undo_interrupted(txn, self.db, self.chunk_size)
        except BaseException:
            self.close()
            raise
        if undone:
            log.warning("%s: undid a change of the live tree that was cut short (a mirror's "
                        "commit); snapshots were never touched", self.path)

    def copy(self, value) -> bytes:
        """A value read in a transaction still open, as bytes. A store opened without
        readahead copies a large one with one pread (mountfs.mapread): faulting it in
        through the map would be a disk read per 4 KiB page."""
        return self._values.copy(value) if self._values is not None else bytes(value)

    def close(self) -> None:
        """Idempotent: a shared environment must lose this user once only."""
        if self._closed:
            return
        self._closed = True
        if self._shared is not None:
            self._shared.release()
        else:
            if not self.readonly:
                self.env.sync(True)
            self.env.close()
        if self._values is not None:
            self._values.close()
            self._values = None
        self.db.chunkfile.close()
        if self.lockfd is not None:
            release_lock(self.lockfd)
            self.lockfd = None

    def sync(self) -> None:
        """Make every committed transaction durable (fdatasync). Safe from any thread. A
        read-only store has nothing of its own to make durable: syncing it is a no-op (LMDB
        refuses it, and the writer beside us owns the file)."""
        if not self.readonly:
            self.env.sync(True)

    # ---- transactions --------------------------------------------------------------------

    def read(self) -> lmdb.Transaction:
        """A read transaction, for a ``with`` block (which ends it). LMDB's own transaction
        is the context manager: a generator-based one cost five Python calls per read, and
        the mount makes one read per getattr or lookup (docs/benchmarks.md, eighth round)."""
        return self.env.begin(buffers=True)

    @contextmanager
    def write(self) -> Iterator[lmdb.Transaction]:
        """A write transaction; ENOSPC / map-full become StoreFull and nothing is committed."""
        if self.readonly:
            raise StoreError("store is open read-only")
        with self._write_errors():
            with self.env.begin(write=True, buffers=True) as txn:
                yield txn
                self.db.chunkfile.sync()        # the slots this commit names, first

    def commit(self, txn: lmdb.Transaction, last_writes=None) -> None:
        """Commit a write transaction begun with ``env.begin`` (the mount's committer keeps
        one open across calls), with the errors of ``write``; ``last_writes(txn)`` first,
        under the same errors (the bucket hashes it deferred)."""
        with self._write_errors():
            if last_writes is not None:
                last_writes(txn)
            self.db.chunkfile.sync()            # the slots this commit names, first
            txn.commit()

    def release_freed_pages(self) -> bool:
        """Let the next transaction reuse the pages the last one freed. LMDB reuses a page
        only from the second transaction after the one that freed it, so on a full disk
        the change right after a deleted file's chunks were dropped found no room (ENOSPC)
        while a moment later it would have: this commits a transaction that rewrites the
        format record unchanged. False if even that found no room."""
        try:
            with self.write() as txn:
                meta = self.db["meta"]
                txn.put(b"format", bytes(txn.get(b"format", db=meta)), db=meta)
        except StoreFull:
            return False
        return True

    def free_bytes(self) -> int:
        """Free space on the store's disk, plus the data file's preallocated tail (space
        LMDB writes without taking more from the disk; not counting LMDB's free pages)."""
        return self.disk_free() + self._tail()

    def disk_free(self) -> int:
        """Free space on the store's disk, and nothing else."""
        return _free_bytes(self.path)

    @property
    def data_file(self) -> Path:
        return _data_file(self.path)

    def pages_end(self) -> int:
        """Where LMDB's last page ends in the data file (bytes)."""
        return _pages_end(self.env)

    @functools.cached_property
    def psize(self) -> int:
        return self.env.stat()["psize"]

    def _tail(self) -> int:
        """Bytes of the data file past LMDB's last page (prealloc.Preallocator's)."""
        return max(0, os.stat(self.data_file).st_size - self.pages_end())

    @contextmanager
    def _write_errors(self) -> Iterator[None]:
        """ENOSPC and map-full as StoreFull; an I/O error says whether the disk is full."""
        try:
            yield
        except lmdb.MapFullError as e:
            raise StoreFull("store map is full") from e
        except lmdb.Error as e:
            if "No space left" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
                raise StoreFull("no space left on the store's disk") from e
            if "Input/output error" in str(e):
                # LMDB reports a failed write of a growing data file as EIO, also when the
                # cause is a full disk: say which, with the figure.
                free = _free_bytes(self.path)
                if free < FULL_DISK_MARGIN:
                    raise StoreFull(f"no space left on the store's disk ({free} bytes "
                                    f"free)") from e
                raise StoreError(f"I/O error writing the store ({free} bytes free on its "
                                 f"disk): nothing of this transaction was committed") from e
            raise

    def live_epoch(self, txn) -> int:
        return S.from_u64(txn.get(b"live_epoch", db=self.db["meta"]))

    def disk_usage(self, free_slots: bool = True) -> tuple[int, int, int]:
        """(store bytes used, bytes free, disk bytes total) for statfs. Used counts the
        chunk file's slots in use too. Free is the disk's free space plus the pages inside
        the data file that LMDB holds free for reuse (the file never shrinks: space given
        back by a deleted snapshot lands there), the file's preallocated tail, and, unless
        ``free_slots`` is False, the chunk file's free slots (it never shrinks either; only
        full chunks written by a mount take them: a mirror's staging does not)."""
        st = os.statvfs(self.path)
        psize = self.psize
        with self.env.begin() as txn:
            in_use = sum(_pages(txn.stat(db)) for db in self.db.values()) + \
                _pages(self.env.stat())
            slots_used, slots_free = chunkfile.usage(txn, self.db, self.chunk_size)
        file_pages = self.env.info()["last_pgno"] + 1
        free_inside = max(0, file_pages - in_use) * psize + self._tail() + \
            (slots_free if free_slots else 0)
        return in_use * psize + slots_used, st.f_bavail * st.f_frsize + free_inside, \
            st.f_blocks * st.f_frsize


def _refuse_a_mountpoint(path: Path) -> None:
    """Say so when ``path`` is where a store is mounted: a user giving the mountpoint for the
    store must be pointed at the store, not told to make one there (inside the mount)."""
    from .mountinfo import canonical, mounts    # only to explain a refusal
    known = mounts()
    where = canonical(str(path), known)
    store = next((m.store for m in known if m.mountpoint == where), None)
    if store is not None:
        raise StoreError(f"{path} is where the store {store} is mounted, not a store: give "
                         f"the store's directory instead")


class _SharedEnv:
    """A read-only environment and how many open Stores use it (Store._open_shared). The
    Stores hold it; the table of them only refers to it (weakly), so that Stores dropped
    without close() let it go with them, as an unshared environment goes: each maps the
    store's whole map size, and a process has room for only a few dozen of those."""

    def __init__(self, env: lmdb.Environment, key: tuple, readahead: bool):
        self.env, self.key, self.readahead, self.users = env, key, readahead, 0

    @classmethod
    def open(cls, path: Path, key: tuple, readahead: bool) -> "_SharedEnv":
        env = _open_env(path, readonly=True, create=False, readahead=readahead)
        try:
            _check_size(env, path)
            _check_format(env, path)
        except BaseException:
            env.close()
            raise
        return cls(env, key, readahead)

    def release(self) -> None:
        """One user fewer; the last one closes the environment."""
        with _shared_lock:
            self.users -= 1
            if not self.users:
                if _shared.get(self.key) is self:
                    del _shared[self.key]
                self.env.close()


_shared_lock = threading.Lock()
_shared: "weakref.WeakValueDictionary[tuple, _SharedEnv]" = weakref.WeakValueDictionary()
# (st_dev, st_ino) of a data file -> its environment, while a Store holds it


def _open_env(path: Path, readonly: bool, create: bool,
              readahead: bool = True) -> lmdb.Environment:
    # Readahead on suits chunk data (a chunk's overflow pages are contiguous, read in
    # sequence): without it every 4 KiB page of a cold chunk is a separate synchronous disk
    # read, ~13x slower, unless the reader copies it with Store.copy. Off suits metadata
    # readers (a diff, replication): random B-tree pages, where readahead made a cold diff
    # of a 1M-file store ~5x slower (docs/benchmarks.md).
    try:
        return lmdb.open(str(path), map_size=MAP_SIZE, max_dbs=len(S.DB_NAMES) + 2,
                         readonly=readonly, create=create, sync=True, metasync=False,
                         readahead=readahead, max_readers=1024, lock=True)
    except lmdb.Error as e:
        raise StoreError(f"{path}: cannot open store: {e}") from e


def _pages_end(env: lmdb.Environment) -> int:
    return (env.info()["last_pgno"] + 1) * env.stat()["psize"]


def _check_size(env: lmdb.Environment, path: Path) -> None:
    """Refuse a data file cut short of the root pages its newest meta names. LMDB maps the
    file: the first read of a page past its end would kill the process with SIGBUS, no
    message. Not the file's size against the meta's last page: a page freed in the
    transaction that allocated it is never written, so a crash may leave the file short of
    that (CI saw it after a kill -9 during a commit); a root page is always written before
    the meta naming it. A cut past the roots but before an inner page still goes unseen."""
    psize = env.stat()["psize"]
    with open(_data_file(path), "rb") as f:
        head = f.read(2 * psize)             # the metas first: a writer writes pages first
        size = os.fstat(f.fileno()).st_size
    metas = [m for m in (_meta(head, 0), _meta(head, psize)) if m is not None]
    if not metas:
        return                              # LMDB has accepted it: not ours to judge
    _txnid, roots = max(metas)
    end = max(((root + 1) * psize for root in roots), default=0)
    if size < end:
        raise StoreError(f"{_data_file(path)} is truncated: {size:,} bytes but its tree's "
                         f"root page ends at {end:,}; the store is damaged: restore it from "
                         f"a backup or a mirror (copy the mirror's store, then 'mountfs "
                         f"promote' the copy); a damaged mirror: move it aside and "
                         f"replicate again")


_META = struct.Struct("<II")                # MDB_meta after the page header: magic, version
_META_MAGIC = 0xBEEFC0DE
_P_INVALID = (1 << 64) - 1                  # md_root of an empty database


def _meta(head: bytes, at: int) -> tuple[int, list[int]] | None:
    """(txnid, root pages) of the LMDB meta page at ``at`` (64-bit layout: a 16-byte page
    header, then magic, version, address, mapsize, two 48-byte MDB_db with md_root at 40,
    last page, txnid), or None if it is not one."""
    off = at + 16
    if len(head) < off + 136 or _META.unpack_from(head, off)[0] != _META_MAGIC:
        return None
    roots = [struct.unpack_from("<Q", head, off + 24 + 48 * i + 40)[0] for i in (0, 1)]
    txnid = struct.unpack_from("<Q", head, off + 128)[0]
    return txnid, [r for r in roots if r != _P_INVALID]


def _check_format(env: lmdb.Environment, path: Path, upgrade: bool = False) -> None:
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            raw = txn.get(b"format", db=meta)
    except lmdb.Error:
        raw = None
    if raw is None:
        env.close()
        raise StoreError(f"{path} is not a mountfs store (no format record)")
    version = S.U32.unpack(raw)[0]
    if version in S.UPGRADABLE and upgrade:
        _upgrade(env)
        return
    if version in S.UPGRADABLE:
        env.close()
        raise StoreError(f"{path}: store format version {version} is an older one: mount it "
                         f"once with this mountfs (which upgrades it in place to version "
                         f"{S.FORMAT_VERSION}), then try again")
    if version != S.FORMAT_VERSION:
        env.close()
        raise StoreError(f"{path}: store format version {version} is not supported by this "
                         f"mountfs (which reads version {S.FORMAT_VERSION})")


def _upgrade(env: lmdb.Environment) -> None:
    """Bring an older store to this format in place, in one transaction: the tables it
    lacks are made (empty: every chunk it holds stays in ``blobs``)."""
    with env.begin(write=True) as txn:
        for name in S.DB_NAMES:
            env.open_db(name.encode(), txn=txn, create=True)
        txn.put(b"format", S.U32.pack(S.FORMAT_VERSION),
                db=env.open_db(b"meta", txn=txn, create=False))
    log.warning("upgraded the store to format version %d", S.FORMAT_VERSION)


ORPHANED_WRITER = "committing the changes its mount sent before it died"   # lock's holder
LOCK_PATIENCE = 2.0     # seconds a lock taker waits out holders that are only probes


def _take_lock(path: Path, holder: str) -> int:
    """The exclusive store lock. ``lock_holder`` probes (umount's wait, ``mounts()``, status
    commands, the daemon) hold a shared lock for microseconds: a taker waits them out for
    LOCK_PATIENCE instead of refusing a store nobody uses; a real holder keeps it longer."""
    fd = open_regular(path / "lock", os.O_RDWR | os.O_CREAT)
    deadline = time.monotonic() + LOCK_PATIENCE
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            who = _holder_of(fd) or "another process"
            os.close(fd)
            raise StoreError(f"{path} is in use ({who}); a store has only one writer at a "
                             f"time{_way_out(who)}") from None
    os.ftruncate(fd, 0)
    try:
        os.write(fd, f"pid {os.getpid()}{' ' + holder if holder else ''}\n".encode())
    except OSError as e:         # a full disk: the name is for messages, the flock is held
        if e.errno != errno.ENOSPC:
            os.close(fd)
            raise
    return fd


def release_lock(fd: int) -> None:
    """Clear the holder's name first: a later refusal must never name a process long gone."""
    os.ftruncate(fd, 0)
    os.close(fd)


def relabel_lock(fd: int, holder: str) -> None:
    """Name this process as the holder of the lock held through ``fd`` (an open file shared
    with the process that took it and has since died)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} {holder}\n".encode(), 0)


def lock_holder(path: str | os.PathLike) -> str | None:
    """Who holds the store lock ('pid N ...'), or None if it is free. Root asks this of
    users' stores (umount): a link or a FIFO in the lock's place is nobody's lock, never a
    file to read or an open that waits forever. Nor is a lock that cannot be opened (the
    store's path runs through a dead FUSE mount: ENOTCONN)."""
    try:
        fd = open_regular(Path(path) / "lock", os.O_RDONLY)
    except (OSError, StoreError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_of(fd)
    finally:
        os.close(fd)
    return None


def _way_out(holder: str) -> str:
    """What to do about the holder of the lock, when it is a mount (its text ends
    'mounted at MOUNTPOINT'): fsck or promote wants it unmounted, most else works through
    it; when it is a mirror's receiver, its snapshots can be read through a read-only
    mount meanwhile."""
    if holder.endswith(ORPHANED_WRITER):
        return ": it exits once that is committed, in a moment; then try again"
    _, found, mountpoint = holder.partition(" mounted at ")
    if found:
        return (f": unmount it first ('mountfs umount {mountpoint}'), or work through the "
                f"mount ('snapctl -m {mountpoint} ...')")
    if "serving a mirror" in holder:
        return (": stop that serve-mirror first, or read the mirror meanwhile through a "
                "read-only mount ('mountfs mount --read-only STORE DIR', then 'snapctl -m "
                "DIR list')")
    return ""


def _holder_of(fd: int) -> str:
    """The holder's name the lock file ``fd`` holds (read from the file that is locked)."""
    return os.pread(fd, 4096, 0).decode(errors="replace").strip()


# ---- versioned records ------------------------------------------------------------------

def get_version(txn, db, base: bytes, epoch: int) -> tuple[int, bytes] | None:
    """The newest version of ``base`` at or below ``epoch``: (its epoch, its value), where a
    tombstone has value b''. None if no such version."""
    cur = txn.cursor(db)
    if not cur.set_range(base + S.inv(epoch)):
        return None
    key = bytes(cur.key())
    if len(key) != len(base) + 8 or key[:len(base)] != base:
        return None
    return S.epoch_of_key(key), cur.value()


def get_at(txn, db, base: bytes, epoch: int):
    """The value of ``base`` visible at ``epoch``, or None (absent or deleted). Every read
    of a record goes through here, several per request on the mount's trio thread: it
    leaves the version's epoch undecoded (``get_version`` without it: 0.56 µs against 0.89)."""
    cur = txn.cursor(db)
    if not cur.set_range(base + S.inv(epoch)):
        return None
    key = cur.key()
    if len(key) != len(base) + 8 or key[:len(base)] != base:
        return None
    value = cur.value()
    return value if len(value) else None


def put_live(txn, db, base: bytes, value: bytes, live: int) -> bytes | None:
    """Write ``value`` as the live version of ``base``: overwrites a version made in the live
    epoch (returning the value it replaced, for reference counting), else adds a version.
    Keeps the bucket hashes of tracked tables current."""
    key = base + S.inv(live)
    if buckets.is_tracked(db):
        _bucket_change(txn, db, base, lambda: _bytes_or_none(get_at(txn, db, base, live)),
                       value, live)
    old = txn.get(key, db=db)
    old = bytes(old) if old is not None else None
    txn.put(key, value, db=db)
    return old


def delete_live(txn, db, base: bytes, live: int) -> tuple[bool, bytes | None]:
    """Delete ``base`` in the live epoch. Returns (whether it existed, the value of a
    live-epoch version key that was physically replaced or removed, if any)."""
    key = base + S.inv(live)
    cur = txn.cursor(db)
    if not cur.set_range(key):
        return False, None
    k = bytes(cur.key())
    if len(k) != len(key) or k[:len(base)] != base:
        return False, None
    value = bytes(cur.value())
    if value and buckets.is_tracked(db):
        _bucket_change(txn, db, base, lambda: value, None, live)
    if S.epoch_of_key(k) != live:
        if not value:
            return False, None
        txn.put(key, S.TOMBSTONE, db=db)
        return True, None
    # A version made in the live epoch: remove it, and hide an older visible one if any.
    existed = bool(value)
    older_visible = cur.next() and bytes(cur.key()[:len(base)]) == base and \
        len(cur.key()) == len(key) and len(cur.value()) > 0
    if older_visible:
        txn.put(key, S.TOMBSTONE, db=db)
    else:
        txn.delete(key, db=db)
    return existed, value or None


def _bucket_change(txn, db, base: bytes, old_of, new: bytes | None, live: int) -> None:
    """Keep the bucket hashes current as item ``base`` goes from ``old_of()`` to ``new``: at
    once, or when the transaction commits if it defers them (its ``deferred_buckets``)."""
    deferred = getattr(txn, "deferred_buckets", None)
    if deferred is not None:
        deferred.note(db, base, old_of)
    else:
        buckets.changed(txn, db, base, old_of(), new, live)


def _bytes_or_none(value) -> bytes | None:
    return bytes(value) if value is not None else None


def iter_visible(txn, db, prefix: bytes, epoch: int, start: bytes | None = None):
    """Yield (base, value) for every record under ``prefix`` visible at ``epoch``, in key
    order, from base ``start`` on. Skips newer versions and tombstones in O(1) seeks each."""
    cur = txn.cursor(db)
    plen = len(prefix)
    pos = start if start is not None else prefix
    if not cur.set_range(pos):
        return
    while True:
        key = bytes(cur.key())
        if key[:plen] != prefix:
            return
        base = key[:-8]
        if S.epoch_of_key(key) > epoch:
            if not cur.set_range(base + S.inv(epoch)):
                return
            key = bytes(cur.key())
            if key[:-8] != base:
                continue          # no version at or below epoch: cursor is at the next base
        value = cur.value()
        if len(value):
            yield base, value
        if not cur.set_range(base + b"\xff" * 8):   # epoch 0 never exists: lands on next base
            return


def iter_versions(txn, db, base: bytes):
    """All stored versions of ``base``, newest first: [(epoch, value)]."""
    cur = txn.cursor(db)
    out = []
    if not cur.set_range(base):
        return out
    for key, value in cur:
        key = bytes(key)
        if len(key) != len(base) + 8 or key[:len(base)] != base:
            break
        out.append((S.epoch_of_key(key), bytes(value)))
    return out
