"""The FUSE surface: a thin adapter from pyfuse3 requests to the engine and the namespace.

Inode numbers seen by the kernel:
* below ``VIRT_BASE``: live inodes, the store's own numbers (never reused);
* ``SNAPDIR_INO``: the virtual ``.snapshot`` directory at the root (entered by name only);
* above it: an inode as of a snapshot, ``VIRT_BASE + (snapshot id << 40) + store inode``.
  A pure function of (snapshot, store inode): hard links stay links, numbers hold across
  forgets and remounts for the snapshot's whole life. Snapshot ids are never reused by a
  store, so a number the kernel still holds after its snapshot is deleted is ESTALE, never
  another snapshot's data.

Every handler runs under ``guard``: an unexpected exception is logged and answered with EIO
instead of killing the mount (pyfuse3 only catches FUSEError).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import threading
import time

import pyfuse3
import trio

from . import schema as S
from .engine import Engine
from .filecache import OpenFile, chunk_digest
from .invariants import max_file_size
from .namespace import FsError, Live, check_name, created

log = logging.getLogger(__name__)

VIRT_BASE = 1 << 62
SNAPDIR_INO = VIRT_BASE
INO_BITS = 40                       # store inodes are at most schema.MAX_INO = 2**40 - 1
assert S.MAX_INO < 1 << INO_BITS
assert VIRT_BASE + (S.MAX_SNAP_ID << INO_BITS) + S.MAX_INO < 1 << 64
SNAPDIR_NAME = b".snapshot"
READDIR_BATCH = 256                 # entries whose records one readdir step reads at once
LIVE_TIMEOUT = 300.0
SNAP_TIMEOUT = 3600.0
READONLY_TIMEOUT = 1.0
BLKSIZE = 128 << 10
ACL_XATTRS = (b"system.posix_acl_access", b"system.posix_acl_default")
CAPABILITY = b"security.capability"
CAPABILITY_MEMORY = 1 << 16     # inodes remembered without one, at most
PATH_DEPTH = 2048                # names in a path at most (PATH_MAX is 4096 bytes)
TIME_NS = (-(1 << 63), (1 << 63) - 1)   # the times a record holds (signed 64-bit ns: 1677 to
                                        # 2262): others are clamped, as ext4 and XFS clamp
                                        # to their range


def guard(fn):
    @functools.wraps(fn)
    async def wrapper(*args):       # pyfuse3 passes arguments by position
        try:
            return await fn(*args)
        except pyfuse3.FUSEError:
            raise
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            log.exception("internal error in %s%r", fn.__name__, args[1:])
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class Handle:
    """An open file. ``writing``: opened for writing (``flush`` reports the file's
    failed commits to these handles only)."""
    __slots__ = ("ino", "of", "epoch", "real", "size", "writing")

    def __init__(self, ino: int, of: OpenFile | None, epoch: int | None, real: int, size: int,
                 writing: bool = False):
        self.ino, self.of, self.epoch, self.real, self.size = ino, of, epoch, real, size
        self.writing = writing


WRITING = os.O_WRONLY | os.O_RDWR | os.O_TRUNC      # open flags of a handle that writes
_NO_INOS = object()             # Operations._post_create: no inode number reserved
_S_IFMT, _S_IFREG = 0o170000, stat.S_IFREG       # stat.S_ISREG without a call


class Operations(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, engine: Engine, read_only: bool = False):
        super().__init__()
        self.engine = engine
        self.read_only = read_only
        self.max_size = max_file_size(engine.chunk_size)
        self.lookups: dict[int, int] = {}
        self.snap_epochs: dict[int, int] = {}       # snapshot id -> epoch, of known ones
        self.handles: dict[int, Handle] = {}
        self.releasing: dict[int, int] = {}     # inode -> RELEASEs of it in progress
        self.released = trio.Event()            # set (and made anew) when one of them ends
        self.release_waiters = 0                # while ``_after_releases`` waits
        self.dirs: dict[int, tuple[int, list]] = {}
        self.next_fh = 1
        self.timeout = READONLY_TIMEOUT if read_only else LIVE_TIMEOUT
        self.initialized = trio.Event()     # the kernel's INIT is answered (``init``)
        self.mountpoint: str | None = None  # where the kernel shows us (set by the mount)
        self.refresher: int | None = None   # the thread of ``invalidate``'s chowns
        # Live inodes known to have no security.capability: the kernel asks before every
        # write (to drop capabilities), and the answer is almost always "none". Forgotten
        # on any xattr change of the inode and on a rollback or restore; a read-only mount
        # follows another writer, so it keeps no such memory.
        self.no_capability: set[int] = set()

    def init(self) -> None:
        """pyfuse3 calls this while it answers the kernel's INIT, which sets the mount's
        readahead from the answer: what waits for ``initialized`` runs after the answer
        (mount._raise_readahead)."""
        self.initialized.set()

    # ---- inode numbers -------------------------------------------------------------------

    def _where(self, ino: int) -> tuple[int | None, int]:
        """(epoch or None for live, store inode) of a kernel inode number. A snapshot that
        no longer exists is ESTALE (``engine.look`` checks it again in its transaction)."""
        if ino < VIRT_BASE:
            return None, ino
        snap_id, real = divmod(ino - VIRT_BASE, 1 << INO_BITS)
        epoch = self.snap_epochs.get(snap_id)
        if epoch is None:
            self.snap_epochs = {s.snap_id: s.epoch for s in self.engine.list_snapshots()}
            epoch = self.snap_epochs.get(snap_id)
        if epoch is None or real == 0:
            raise FsError(errno.ESTALE)
        return epoch, real

    def _virtual(self, snap: S.Snapshot, real: int) -> int:
        self.snap_epochs[snap.snap_id] = snap.epoch
        return VIRT_BASE + (snap.snap_id << INO_BITS) + real

    def _kernel_ino(self, kparent: int, real: int) -> int:
        """The number of store inode ``real`` seen in directory ``kparent`` (same view)."""
        if kparent < VIRT_BASE:
            return real
        return kparent - (kparent - VIRT_BASE) % (1 << INO_BITS) + real

    def _writable(self, ino: int) -> None:
        if ino >= VIRT_BASE:
            raise FsError(errno.EROFS)
        if self.read_only:
            raise FsError(errno.EROFS)

    def _counted(self, ino: int) -> None:
        self.lookups[ino] = self.lookups.get(ino, 0) + 1

    def _is_open(self, ino: int) -> bool:
        return ino in self.lookups or ino in self.engine.files.files

    # ---- attributes ----------------------------------------------------------------------

    def _attrs(self, kino: int, rec: S.Inode, live: bool) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()       # zeroed: generation 0
        mode, size, mtime, ctime = rec.mode, rec.size, rec.mtime_ns, rec.ctime_ns
        if live:
            of = self.engine.files.files.get(kino)
            if of is not None:
                size = of.size
                if of.mtime_ns is not None:
                    mtime = ctime = of.mtime_ns
        e.st_ino = kino
        e.entry_timeout = e.attr_timeout = self.timeout if live else SNAP_TIMEOUT
        e.st_mode = mode
        e.st_nlink = rec.nlink
        e.st_uid = rec.uid
        e.st_gid = rec.gid
        e.st_rdev = rec.rdev
        e.st_size = size
        e.st_blksize = BLKSIZE
        if mode & _S_IFMT == _S_IFREG:
            e.st_blocks = (size + 511) // 512
        e.st_atime_ns = rec.atime_ns
        e.st_mtime_ns = mtime
        e.st_ctime_ns = ctime
        return e

    def _absent(self, live: bool) -> pyfuse3.EntryAttributes:
        """A negative entry: no such name, for as long as a name is trusted."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = 0
        e.entry_timeout = self.timeout if live else SNAP_TIMEOUT
        return e

    async def _snapdir_attrs(self) -> pyfuse3.EntryAttributes:
        root = await self.engine.inode(S.ROOT_INO)
        rec = root.evolve(mode=stat.S_IFDIR | 0o555, nlink=2)
        attrs = self._attrs(SNAPDIR_INO, rec, live=False)
        attrs.entry_timeout = attrs.attr_timeout = 1.0
        return attrs

    async def _attrs_of(self, kino: int) -> pyfuse3.EntryAttributes:
        if kino < VIRT_BASE:
            return self._attrs(kino, await self.engine.inode(kino), live=True)
        if kino == SNAPDIR_INO:
            return await self._snapdir_attrs()
        epoch, real = self._where(kino)
        return self._attrs(kino, await self._record(epoch, real), live=epoch is None)

    async def _record(self, epoch: int | None, real: int) -> S.Inode:
        """Store inode ``real`` as of ``epoch`` (None: live)."""
        if epoch is None:
            return await self.engine.inode(real)
        return await self.engine.look(lambda v: v.get(real), epoch)

    # ---- lookup and forget ---------------------------------------------------------------

    @guard
    async def lookup(self, parent_inode, name, ctx=None):
        """A name that does not exist is answered as a negative entry (inode 0) with the
        entry timeout, which the kernel caches as it caches names that exist: a program
        probing for missing files (imports, include paths, git) asks once, not each time.
        Only this mount's calls change the live tree, and the kernel drops the entry when
        one of them makes the name; a rollback or restore, which changes it behind the
        kernel's back, invalidates the names it made (``invalidate``). Snapshot names stay
        ENOENT: ``snapctl create`` makes them behind the kernel's back too."""
        if parent_inode == S.ROOT_INO and name == SNAPDIR_NAME:
            return await self._snapdir_attrs()
        if parent_inode == SNAPDIR_INO:
            try:
                snap = self.engine.snapshot(os.fsdecode(name))
            except Exception:
                raise FsError(errno.ENOENT) from None
            kino = self._virtual(snap, S.ROOT_INO)
            root = await self.engine.look(lambda v: v.get(S.ROOT_INO), snap.epoch)
            attrs = self._attrs(kino, root, live=False)
            self._counted(kino)
            return attrs
        if len(name) > S.NAME_MAX:      # before the lookup: POSIX says so, not ENOENT
            raise FsError(errno.ENAMETOOLONG)
        epoch, real = self._where(parent_inode)
        if epoch is None:
            if self.engine.new_dirs.absent(real, name):
                self.engine.note_absent(real, name, self.engine.changes)
                return self._absent(live=True)
            if self.engine.dirty((real, name)):
                attrs = self._known_lookup(parent_inode, real, name)
                if attrs is not None:
                    return attrs

        def find(v):
            child = v.lookup(real, name)
            return (None, None) if child is None else (child, v.get(child))
        changes = self.engine.changes
        child, rec = await self.engine.look(find, epoch, marks=((real, name),))
        if child is None:
            if epoch is None:
                self.engine.note_absent(real, name, changes)
            return self._absent(live=epoch is None)
        if epoch is None and self.engine.dirty(child):     # read above as last committed
            rec = await self.engine.inode(child)
        kino = self._kernel_ino(parent_inode, child)
        attrs = self._attrs(kino, rec, live=epoch is None)
        self._counted(kino)
        return attrs

    def _known_lookup(self, kparent: int, parent: int, name: bytes):
        """A live lookup answered from what uncommitted changes wrote, when they wrote
        both the entry and the inode's record (None: ask the committer)."""
        known, child = self.engine.known_entry(parent, name)
        if not known:
            return None
        if child is None:
            return self._absent(live=True)
        rec = self.engine.known_inode(child)
        if rec is None:
            return None
        kino = self._kernel_ino(kparent, child)
        attrs = self._attrs(kino, rec, live=True)
        self._counted(kino)
        return attrs

    async def forget(self, inode_list):
        gone = []
        for ino, n in inode_list:
            left = self.lookups.get(ino, 0) - n
            if left > 0:
                self.lookups[ino] = left
                continue
            self.lookups.pop(ino, None)
            if ino < VIRT_BASE:
                gone.append(ino)
        await self.reap(gone)

    async def reap(self, inos: list[int]) -> None:
        """Delete the unlinked ones of ``inos`` once neither a name nor the kernel refers to
        them, in one step. Inodes an uncommitted step changed (just unlinked, mostly) go to
        the step as they are; the others only if the committed tree marks them orphans."""
        inos = [ino for ino in inos if not self._is_open(ino)]
        if not inos or self.read_only:
            return
        orphans = self.engine.db["orphans"]
        try:
            if not any(self.engine.dirty(ino) for ino in inos):
                inos = await self.engine.look(lambda v: [
                    ino for ino in inos if v.txn.get(S.u64(ino), db=orphans) is not None],
                    marks=inos)
            if inos and self.engine.can_post():
                inos = [ino for ino in inos if not self._deleted_with_remove(ino)]
                if inos:
                    self.engine.post(_destroy_orphans, inos, marks=inos)
                self.engine.wake_gc()
            elif inos and await self.engine.mutate(_destroy_orphans, inos):
                self.engine.wake_gc()
        except Exception:
            log.exception("could not delete unlinked inodes %s; the next mount will", inos)

    def _deleted_with_remove(self, ino: int) -> bool:
        """Have the unlink or rmdir of ``ino`` posted last, if it is not yet sent, delete
        the inode instead of marking it an orphan. The kernel forgets an inode right after
        the unlink that took its last name: this saves the step that would delete it, one
        per deleted file. Nothing was posted after that step, so no later change of the
        inode is queued behind it."""
        return self.engine.amend_held(self._remove_step, ino,
                                      lambda args: (*args[:-1], False) if args[-1] else None)

    @guard
    async def getattr(self, inode, ctx=None):
        if inode < VIRT_BASE:       # live: without the two coroutines of ``_attrs_of``
            rec = self.engine.known_inode(inode)
            if rec is not None:
                return self._attrs(inode, rec, live=True)
        return await self._attrs_of(inode)

    # ---- attributes that change --------------------------------------------------------------

    @guard
    async def setattr(self, inode, attr, fields, fh, ctx):
        behind = self.engine.files.behind
        if not behind:              # no rollback under way: the usual case
            return await self._setattr(inode, attr, fields)
        if inode in behind and ctx.pid == self.refresher:
            # ``invalidate``'s chown(-1, -1): it changes nothing, not even the set-id bits
            # the kernel asks to clear on a chown
            attrs = await self._attrs_of(inode)
        else:
            attrs = await self._setattr(inode, attr, fields)
        # The kernel sent this holding the inode's lock and takes the size answered: the
        # writes that follow are placed by it (what a rollback's ``invalidate`` waits for).
        behind.discard(inode)
        return attrs

    async def _setattr(self, inode, attr, fields) -> pyfuse3.EntryAttributes:
        self._writable(inode)
        if fields.update_size and attr.st_size > self.max_size:
            raise FsError(errno.EFBIG)
        of = self.engine.files.get(inode)
        if of is not None:
            await self.engine.files.flush(of)
        if fields.update_size:
            await self._truncate(inode, attr.st_size)
        changes = {}
        if fields.update_mode or fields.update_uid or fields.update_gid:
            if fields.update_mode:
                changes["mode"] = stat.S_IMODE(attr.st_mode)
            if fields.update_uid:
                changes["uid"] = attr.st_uid
            if fields.update_gid:
                changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = _clamped(attr.st_atime_ns)
        if fields.update_mtime:
            changes["mtime_ns"] = _clamped(attr.st_mtime_ns)
        if fields.update_ctime:
            changes["ctime_ns"] = _clamped(attr.st_ctime_ns)
        if changes:
            changes.setdefault("ctime_ns", time.time_ns())
            rec = self._post_setattr(inode, changes)
            if rec is None:
                rec = await self.engine.mutate(_setattr, inode, changes)
            return self._attrs(inode, rec, live=True)
        return await self._attrs_of(inode)

    def _post_setattr(self, ino: int, changes: dict) -> S.Inode | None:
        """Post the change (Engine.post) when the record it changes is known: its outcome
        is then known too, and tar's three attribute calls per file cost no round trip.
        None: not posted."""
        if not self.engine.can_post():
            return None
        rec = self.engine.known_inode(ino)
        if rec is None:
            return None
        new = _changed(rec, changes)
        self.engine.post(_setattr, ino, changes, marks=(ino,), records={ino: new},
                         merge=_joined_setattrs)
        return new

    async def _truncate(self, ino: int, size: int) -> None:
        """Under the open file's lock (if it is open): no commit of its chunks runs or is
        posted between the cut of its buffers and the truncation's step (one posted there
        would answer the size before the cut, and its step write the one after)."""
        of = self.engine.files.get(ino)
        if of is None:
            await self._truncate_locked(ino, size)
            return
        async with of.lock:
            await self._truncate_locked(ino, size)

    async def _truncate_locked(self, ino: int, size: int) -> None:
        cs = self.engine.chunk_size

        def cut_chunk(v):
            rec = v.get(ino)
            if not stat.S_ISREG(rec.mode):
                raise FsError(errno.EINVAL)
            keep = size % cs
            return v.chunk_data(ino, size // cs)[:keep] if keep and size < rec.size else None
        tail = await self.engine.look(cut_chunk, io=True, marks=(ino,))
        of = self.engine.files.get(ino)
        if of is not None:      # writes answered before this point are cut with the file;
            self.engine.files.cut(of, size)         # later ones extend it from ``size``
        digest = await trio.to_thread.run_sync(chunk_digest, tail) if tail else None
        await self.engine.mutate(_truncate, ino, size, tail, digest)

    # ---- creating names ------------------------------------------------------------------

    def _check_new_name(self, parent: int, name: bytes) -> None:
        self._writable(parent)
        if parent == S.ROOT_INO and name == SNAPDIR_NAME:
            raise FsError(errno.EEXIST)

    async def _make(self, parent, name, mode, ctx, rdev=0, target=b""):
        self._check_new_name(parent, name)
        new_dirs = self.engine.new_dirs
        new_dirs.naming(parent, name)
        since = new_dirs.begin()
        made = self._post_create(parent, name, mode, ctx.uid, ctx.gid, rdev, target)
        if made is _NO_INOS:            # this create waits; the next ones use the block
            await self.engine.reserve_inos()
            made = None
        ino, rec = made or await self.engine.mutate(
            Live.create, parent, name, mode, ctx.uid, ctx.gid, rdev, target)
        if mode & _S_IFMT == stat.S_IFDIR:
            new_dirs.made(ino, since)
        self._counted(ino)
        self._remember_no_capability(ino)      # new: no xattrs at all
        return self._attrs(ino, rec, live=True)

    def _post_create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                     rdev: int, target: bytes) -> tuple[int, S.Inode] | None:
        """Post the create (Engine.post) when its outcome is known here: the parent's
        record and the entry are known without the committer, so every error the step
        could meet is raised here instead. None: not posted (_NO_INOS: for want of a
        reserved inode number)."""
        if not self.engine.can_post():
            return None
        check_name(name)
        prec = self.engine.known_inode(parent)
        known, child = self.engine.known_entry(parent, name)
        if prec is None or not known:
            return None
        if not stat.S_ISDIR(prec.mode):
            raise FsError(errno.ENOTDIR)
        if child is not None:
            raise FsError(errno.EEXIST)
        ino = self.engine.take_ino()
        if ino is None:
            return _NO_INOS
        now = time.time_ns()
        rec, parent_rec = created(prec, parent, name, mode, uid, gid, rdev, target, now)
        self.engine.post(_create, now, ino, parent, name, mode, uid, gid, rdev, target,
                         marks=(ino, parent, (parent, name), ("ls", parent)),
                         records={ino: rec, parent: parent_rec, (parent, name): ino})
        return ino, rec

    @guard
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return await self._make(parent_inode, name, mode, ctx, rdev=rdev)

    @guard
    async def mkdir(self, parent_inode, name, mode, ctx):
        return await self._make(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx)

    @guard
    async def symlink(self, parent_inode, name, target, ctx):
        return await self._make(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target=target)

    @guard
    async def create(self, parent_inode, name, mode, flags, ctx):
        attrs = await self._make(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        return self._open_live(attrs.st_ino, 0, bool(flags & WRITING)), attrs

    @guard
    async def link(self, inode, new_parent_inode, new_name, ctx):
        self._writable(inode)
        self._check_new_name(new_parent_inode, new_name)
        self.engine.new_dirs.naming(new_parent_inode, new_name)
        rec = await self.engine.mutate(Live.link, inode, new_parent_inode, new_name)
        self._counted(inode)
        return self._attrs(inode, rec, live=True)

    @guard
    async def readlink(self, inode, ctx):
        epoch, real = self._where(inode)
        rec = await self._record(epoch, real)
        if not stat.S_ISLNK(rec.mode):
            raise FsError(errno.EINVAL)
        return rec.target

    # ---- removing names ------------------------------------------------------------------

    async def _removed(self, remove, *args) -> None:
        """Run ``remove(live, *args)`` (``Live.unlink``, ``rmdir`` or ``rename``) as a step.
        Inodes whose last link it removed become orphans there, and are deleted once the
        kernel does not hold them (``reap``: now, or when it forgets them; while it holds
        one, an O_PATH descriptor or an open racing the unlink can still reach it). Decided
        here, after the reply, so that the step reads nothing of this thread."""
        freed = await self.engine.mutate(_orphaned, remove, *args)
        if freed:
            await self.reap(freed)
        self.engine.wake_gc()
        if self.releasing:
            await self._after_releases(freed)

    @guard
    async def unlink(self, parent_inode, name, ctx):
        await self._remove_name(parent_inode, name, directory=False)

    @guard
    async def rmdir(self, parent_inode, name, ctx):
        await self._remove_name(parent_inode, name, directory=True)

    async def _remove_name(self, parent: int, name: bytes, directory: bool) -> None:
        self._writable(parent)
        posted = self._post_remove(parent, name, directory)
        if posted:
            self.engine.wake_gc()
            if self.releasing:
                await self._after_releases((posted,))
        else:
            await self._removed(Live.rmdir if directory else Live.unlink, parent, name)

    def _post_remove(self, parent: int, name: bytes, directory: bool) -> int:
        """Post the unlink of a file with one name, or the rmdir of an empty directory, when
        the entry, both records and (rmdir) whether the directory is empty are known here
        (Engine.known_empty): every error the step could meet is raised here instead.
        The inode removed; 0: not posted (the step decides, awaited). git tries an rmdir
        of the directory of every file it removes, mostly refused (ENOTEMPTY): awaited,
        each waited for the writer to apply every change queued before it."""
        if not self.engine.can_post():
            return 0
        known, child = self.engine.known_entry(parent, name)
        if not known:
            return 0
        if child is None:
            raise FsError(errno.ENOENT)
        prec, crec = self.engine.known_inode(parent), self.engine.known_inode(child)
        if prec is None or crec is None or stat.S_ISDIR(crec.mode) != directory \
                or crec.nlink != (2 if directory else 1) \
                or (crec.parent, crec.name) != (parent, name):
            return 0            # EISDIR, ENOTDIR, hard links, subdirectories: the step decides
        if directory:
            empty = self.engine.known_empty(child)
            if empty is None:
                return 0
            if not empty:
                raise FsError(errno.ENOTEMPTY)
        now = time.time_ns()
        self.engine.post(self._remove_step, now, parent, name, directory, self._is_open(child),
                         marks=(child, parent, (parent, name), ("ls", parent)),
                         records={parent: prec.evolve(nlink=prec.nlink - (1 if directory else 0),
                                                      mtime_ns=now, ctime_ns=now),
                                  child: crec.evolve(nlink=0, ctime_ns=now, parent=0,
                                                     name=b""),
                                  (parent, name): 0})
        return child

    @staticmethod
    def _remove_step(live, now: int, parent: int, name: bytes, directory: bool,
                     held: bool) -> None:
        """A posted step: unlink or rmdir with the caller's clock (the records it answered
        with). ``held``: whether the kernel held the inode when the call was answered, or
        still held it when the step was last amended (``_deleted_with_remove``).
        Decided then, not when the step runs: by then later calls may have reached the
        inode (a SETATTR racing the unlink, posted after it) and the kernel may have
        forgotten it since, so destroying it here would fail their steps; a forget after
        the call deletes the orphan (``reap``), in a step queued after theirs."""
        live.now = now
        ino, rec = (live.rmdir if directory else live.unlink)(parent, name)
        if rec.nlink == 0:
            if held:
                live.add_orphan(ino)
            else:
                live.destroy(ino)

    @guard
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self._writable(parent_inode_old)
        self._writable(parent_inode_new)
        if flags & ~(pyfuse3.RENAME_NOREPLACE | pyfuse3.RENAME_EXCHANGE):
            raise FsError(errno.EINVAL)
        if SNAPDIR_NAME in (name_old, name_new) and S.ROOT_INO in (parent_inode_old,
                                                                   parent_inode_new):
            raise FsError(errno.EPERM)
        noreplace = bool(flags & pyfuse3.RENAME_NOREPLACE)
        exchange = bool(flags & pyfuse3.RENAME_EXCHANGE)
        self.engine.new_dirs.naming(parent_inode_new, name_new)
        await self._removed(Live.rename, parent_inode_old, name_old, parent_inode_new,
                            name_new, noreplace, exchange)

    # ---- files ---------------------------------------------------------------------------

    def _new_fh(self, handle: Handle) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = handle
        return fh

    def _open_live(self, ino: int, size: int, writing: bool) -> pyfuse3.FileInfo:
        """A handle of a live file. On a writable mount the kernel keeps the file's pages
        across opens, as a local filesystem does (a build reopening its headers reads them
        once): only this mount changes the store, every write passes through those pages,
        and a rollback invalidates what it changed (``invalidate``). A read-only mount
        follows a store another process writes, so its opens drop them."""
        of = self.engine.files.open(ino, size)
        return pyfuse3.FileInfo(fh=self._new_fh(Handle(ino, of, None, ino, size, writing)),
                                keep_cache=not self.read_only)

    @guard
    async def open(self, inode, flags, ctx):
        writing = bool(flags & WRITING)
        epoch, real = self._where(inode)
        if writing:
            self._writable(inode)
        rec = await self._record(epoch, real)
        if not stat.S_ISREG(rec.mode):
            raise FsError(errno.EISDIR if stat.S_ISDIR(rec.mode) else errno.EINVAL)
        if epoch is not None:
            fh = self._new_fh(Handle(inode, None, epoch, real, rec.size))
            return pyfuse3.FileInfo(fh=fh, keep_cache=True)
        info = self._open_live(inode, rec.size, writing)
        # Always, even at stored size 0: another handle may hold buffered writes, and
        # POSIX has O_TRUNC update mtime/ctime of an existing file even if it was empty.
        if flags & os.O_TRUNC:
            of = self.handles[info.fh].of
            await self.engine.files.flush(of)
            await self._truncate(inode, 0)
        return info

    @guard
    async def read(self, fh, off, size):
        """Served from one transaction in which every chunk read is already verified: a
        flush committing a rewrite between the check and the read only means checking the
        new chunks too (the old or the new data, never an error)."""
        h = self.handles[fh]
        if h.of is not None:
            return await self._read_live(h.of, off, size)

        def served(v):
            if self.engine.unverified(v, h.real, off, size):
                return None
            return v.read(h.real, off, size, h.size)
        while True:
            data = await self.engine.look(served, h.epoch)
            if data is not None:
                return data
            await self.engine.verify(h.epoch, h.real, off, size)

    async def _read_live(self, of: OpenFile, off: int, size: int) -> bytes:
        """Buffered chunks (copied here, on the trio thread) laid over the stored ones."""
        end = min(off + size, of.size)
        if off >= end:
            return b""
        cs, ino, file_size = self.engine.chunk_size, of.ino, of.size
        while True:
            dirty = await self.engine.files.contents(of, off // cs, (end - 1) // cs)
            if self.engine.uncommitted(ino):
                stored = await self.engine.read_uncommitted(ino, off, end, file_size)
                return _assemble(lambda pos, take: stored[pos - off:pos - off + take],
                                 off, end, cs, dirty)

            def served(v):
                if self.engine.unverified(v, ino, off, end - off):
                    return None
                return _assemble(lambda pos, take: v.read(ino, pos, take, file_size),
                                 off, end, cs, dirty)
            data = await self.engine.look(served, marks=(ino,))
            if data is not None:
                return data
            await self.engine.verify(None, ino, off, end - off)

    @guard
    async def write(self, fh, off, buf):
        """Past the store's maximum file size (beyond its last chunk index: no mirror
        would take the file) a write is EFBIG, and one that crosses it is cut short, as
        Linux does at a filesystem's limit."""
        h = self.handles[fh]
        if h.of is None:
            raise FsError(errno.EROFS)
        if off + len(buf) > self.max_size:
            if off >= self.max_size:
                raise FsError(errno.EFBIG)
            buf = buf[:self.max_size - off]
        return await self.engine.files.write(h.of, off, buf)

    @guard
    async def flush(self, fh):
        """close(2) of a handle. One opened for writing commits the file's buffered writes
        and hears why they could not be committed (ENOSPC): the error is the writer's. One
        opened only for reading commits nothing and hears nothing, as NFS's close
        (nfs_file_flush): a reader's close of its own handle must not fail with the ENOSPC
        of another process's writes (nor wait for their commit). The writer's own close
        commits them, and the last RELEASE tries once more before they are dropped."""
        h = self.handles[fh]
        if h.of is not None and h.writing:
            await self.engine.files.flush(h.of)

    @guard
    async def release(self, fh):
        h = self.handles.pop(fh)
        if h.of is None:
            return
        ino = h.ino
        self.releasing[ino] = self.releasing.get(ino, 0) + 1    # for ``_after_releases``
        try:
            await self.engine.files.release(h.of)
        finally:
            try:
                if h.of.dropped:    # writes a full disk refused: the kernel still holds
                    # the size their replies gave and the pages read from the buffer (kept
                    # across opens): stat and read must show the committed file instead
                    await self._drop_kernel_caches([ino])
                if ino not in self.lookups:
                    await self.reap([ino])
            finally:
                self._released(ino)     # last: nothing awaits between it and the reply

    def _released(self, ino: int) -> None:
        """A RELEASE of ``ino`` ends."""
        left = self.releasing[ino] - 1
        if left:
            self.releasing[ino] = left
        else:
            del self.releasing[ino]
        if self.release_waiters:
            released, self.released = self.released, trio.Event()
            released.set()

    async def _after_releases(self, inos) -> None:
        """Return once no RELEASE of ``inos`` is in progress. The kernel sends RELEASE in
        the background after close(2) has returned, so the unlink that follows a close can
        reach us while the file is still being closed here (flushing its last writes: on a
        full disk, failing slowly). The kernel forgets the inode, and so lets us delete it
        and free its space, only after both replies; answering the unlink after the
        release's makes the kernel send that FORGET before the unlink returns, so the
        user's next call finds the space free, as on a local filesystem."""
        for ino in inos:
            while ino in self.releasing:
                self.release_waiters += 1
                try:
                    await self.released.wait()
                finally:
                    self.release_waiters -= 1

    @guard
    async def fsync(self, fh, datasync):
        h = self.handles[fh]
        if h.of is not None:
            await self.engine.files.flush(h.of)
            await self.engine.sync()

    # ---- directories ---------------------------------------------------------------------

    @guard
    async def opendir(self, inode, ctx):
        if inode != SNAPDIR_INO:
            epoch, real = self._where(inode)
            rec = await self._record(epoch, real)
            if not stat.S_ISDIR(rec.mode):
                raise FsError(errno.ENOTDIR)
        fh = self.next_fh
        self.next_fh += 1
        self.dirs[fh] = (inode, [])
        return fh

    async def _listing(self, inode: int) -> list[tuple[bytes, int | None, int, int]]:
        """(name, epoch, store inode, kernel inode) of every entry, frozen at the start of a
        readdir."""
        if inode == SNAPDIR_INO:
            return [(s.name.encode("utf-8", "surrogateescape"), s.epoch, S.ROOT_INO,
                     self._virtual(s, S.ROOT_INO)) for s in self.engine.list_snapshots()]
        epoch, real = self._where(inode)
        names = await self.engine.look(lambda v: list(v.listdir(real)), epoch,
                                       marks=(("ls", real),))
        return [(name, epoch, child, self._kernel_ino(inode, child)) for name, child in names]

    @guard
    async def readdir(self, fh, start_id, token):
        inode, entries = self.dirs[fh]
        if start_id == 0 or not entries:
            entries = await self._listing(inode)
            self.dirs[fh] = (inode, entries)
        if start_id == 0:       # '.' and '..' carry no lookup count
            dot = await self._attrs_of(inode)
            if not pyfuse3.readdir_reply(token, b".", dot, 1):
                return
            start_id = 1
        if start_id == 1:
            if not pyfuse3.readdir_reply(token, b"..", await self._parent_attrs(inode), 2):
                return
            start_id = 2
        for first in range(start_id - 2, len(entries), READDIR_BATCH):
            batch = entries[first:first + READDIR_BATCH]
            for i, rec in enumerate(await self._records(batch), first):
                if rec is None:
                    continue
                name, epoch, _real, kino = entries[i]
                if not pyfuse3.readdir_reply(token, name,
                                             self._attrs(kino, rec, epoch is None), i + 3):
                    return
                self._counted(kino)

    async def _records(self, entries) -> list[S.Inode | None]:
        """The inode records of listing entries, one read for each run of one epoch."""
        out: list[S.Inode | None] = []
        run: list[int] = []
        for i, (_name, epoch, real, _kino) in enumerate(entries):
            run.append(real)
            if i + 1 == len(entries) or entries[i + 1][1] != epoch:
                reals = run
                out += await self.engine.look(lambda v: [v.inode(r) for r in reals], epoch,
                                              marks=reals)
                run = []
        return out

    async def _parent_attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        """Attributes for '..': the live parent, else the directory itself (a snapshot's
        parents are not tracked; the kernel resolves '..' by its own dentries anyway)."""
        if inode < VIRT_BASE:
            parents = await self.engine.look(lambda v: v.parents(inode), marks=(inode,))
            if parents:
                return await self._attrs_of(parents[0])
        return await self._attrs_of(inode)

    @guard
    async def releasedir(self, fh):
        self.dirs.pop(fh, None)

    @guard
    async def fsyncdir(self, fh, datasync):
        await self.engine.sync()

    # ---- extended attributes -------------------------------------------------------------

    @guard
    async def setxattr(self, inode, name, value, ctx):
        self._writable(inode)
        if name in ACL_XATTRS:
            raise FsError(errno.EOPNOTSUPP)
        self.no_capability.discard(inode)
        await self.engine.mutate(Live.set_xattr, inode, name, value)

    @guard
    async def getxattr(self, inode, name, ctx):
        if inode == SNAPDIR_INO or (name == CAPABILITY and inode in self.no_capability):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        epoch, real = self._where(inode)
        value = await self.engine.look(lambda v: v.xattr(real, name), epoch, marks=(real,))
        if value is None:
            if name == CAPABILITY and epoch is None and not self.read_only:
                self._remember_no_capability(inode)
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    def _remember_no_capability(self, ino: int) -> None:
        if len(self.no_capability) >= CAPABILITY_MEMORY:
            self.no_capability.clear()
        self.no_capability.add(ino)

    @guard
    async def listxattr(self, inode, ctx):
        if inode == SNAPDIR_INO:
            return []
        epoch, real = self._where(inode)
        return await self.engine.look(lambda v: v.xattr_names(real), epoch, marks=(real,))

    @guard
    async def removexattr(self, inode, name, ctx):
        self._writable(inode)
        await self.engine.mutate(Live.remove_xattr, inode, name)

    # ---- the filesystem ------------------------------------------------------------------

    @guard
    async def statfs(self, ctx):
        used, free, total = self.engine.store.disk_usage()
        bs = 4096
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = bs
        st.f_blocks = (used + free) // bs
        st.f_bfree = st.f_bavail = free // bs
        with self.engine.store.read() as txn:
            files = txn.stat(self.engine.db["inodes"])["entries"]
        st.f_files = files + free // bs
        st.f_ffree = st.f_favail = free // bs
        st.f_namemax = S.NAME_MAX
        return st

    async def access(self, inode, mode, ctx):
        return True     # default_permissions: the kernel checks modes

    # ---- used by the control server after a rollback or restore ----------------------------

    async def invalidate(self, inodes, entries) -> None:
        """Tell the kernel that entries and inodes changed behind its back, before the
        caller answers: it forgets the names (``invalidate_entry``, not its ``_async``
        form, which may come after the answer: a path opened right after it would find
        the old file), and the attributes and pages of the inodes it holds.

        Forgotten attributes are asked for again by a stat or a path's permission check,
        but the size of an open file, which places every O_APPEND write, stays until then,
        and a program holding the file (a logger, ``tail -f``) need do neither; nor would
        the answer to a GETATTR be taken while a write that extends the file is in flight.
        So the open files a rollback changed (``FileCache.behind``, whose writes are
        dropped meanwhile) are each given a SETATTR through the mount, by their path in
        the store (``chown(path, -1, -1)``, from this thread: it needs no permission on
        the file, and ``setattr`` answers it changing nothing, not even the set-id bits
        the kernel asks to clear): the kernel sends it holding the inode's lock, which
        orders it with the writes, and takes the size answered (``setattr`` then takes the
        file out of ``behind``); then their pages, some maybe filled by the dropped writes,
        are dropped again. A file without a path there (unlinked, or under a directory
        the mount's user may not search) keeps the kernel's old size until asked."""
        self.no_capability.clear()
        names = [(parent, name) for parent, name in entries
                 if parent in self.lookups or parent == S.ROOT_INO]
        held = [ino for ino in inodes if ino in self.lookups]
        behind = [ino for ino in held if ino in self.engine.files.behind]
        paths = await self._paths(behind)

        def tell():
            for parent, name in names:
                with contextlib.suppress(OSError):  # not (or no longer) known to the kernel
                    pyfuse3.invalidate_entry(parent, name)
            _drop_caches(held)
            self.refresher = threading.get_native_id()     # what FUSE says is the caller
            for path in paths:
                # gone meanwhile, or under a directory we may not search: it keeps the old size
                with contextlib.suppress(OSError):
                    os.chown(path, -1, -1)
            _drop_caches(behind)
        if names or held:
            await trio.to_thread.run_sync(tell)

    async def _drop_kernel_caches(self, inodes) -> None:
        """Have the kernel forget the attributes and pages of those of ``inodes`` it holds.
        In a worker thread: dropping pages waits for the lock of a page a READ or WRITE of
        ours may still have to answer."""
        known = [ino for ino in inodes if ino in self.lookups]
        if known:
            await trio.to_thread.run_sync(_drop_caches, known)

    async def _paths(self, inos: list[int]) -> list[bytes]:
        """A path through the mount to each of the live ``inos`` that has a name (the one
        its record keeps)."""
        if not inos or self.mountpoint is None:
            return []
        top = os.fsencode(self.mountpoint)

        def paths(v):
            out = []
            for ino in inos:
                names, at = [], ino
                while at != S.ROOT_INO and len(names) < PATH_DEPTH:
                    rec = v.inode(at)
                    if rec is None or not rec.parent:       # deleted or unlinked: no path
                        break
                    names.append(rec.name)
                    at = rec.parent
                if at == S.ROOT_INO:
                    out.append(b"/".join([top, *reversed(names)]))
            return out
        return await self.engine.look(paths)

    def open_in_snapshot(self, snap: S.Snapshot) -> int:
        """How many files and directories of snapshot ``snap`` are open (a backup reading
        .snapshot/NAME): deleting it would fail their next read with ESTALE."""
        files = sum(1 for h in self.handles.values() if h.epoch == snap.epoch)
        dirs = sum(1 for ino, _ in self.dirs.values()
                   if ino > SNAPDIR_INO and (ino - VIRT_BASE) >> INO_BITS == snap.snap_id)
        return files + dirs

    def forget_snapshot(self, name: str) -> None:
        pyfuse3.invalidate_entry_async(SNAPDIR_INO, name.encode("utf-8", "surrogateescape"),
                                       ignore_enoent=True)


def _drop_caches(inos: list[int]) -> None:
    """Have the kernel forget the attributes and pages of ``inos`` (in a worker thread)."""
    for ino in inos:
        with contextlib.suppress(OSError):          # the kernel forgot it meanwhile
            pyfuse3.invalidate_inode(ino, attr_only=False)


def _orphaned(live, remove, *args) -> list[int]:
    """A step: ``remove(live, *args)``, which returns the inodes it unlinked (one pair, or
    a list from a rename), and those left without a link marked orphans; returns them."""
    out = remove(live, *args)
    freed = []
    for ino, rec in out if isinstance(out, list) else [out]:
        if rec.nlink == 0:
            live.add_orphan(ino)
            freed.append(ino)
    return freed


def _truncate(live, ino: int, size: int, tail: bytes | None, digest: bytes | None) -> None:
    """A step: cut ``ino`` to ``size``; ``tail``: the kept part of the chunk the cut falls
    in (None: none to keep; empty: that chunk goes), stored under ``digest``."""
    cs = live.chunk_size
    live.drop_chunks_from(ino, -(-size // cs))
    if tail is not None:
        if digest:
            live.put_chunk(ino, size // cs, digest, tail)
        else:
            live.drop_chunk(ino, size // cs)
    now = live.now
    live.setattr(ino, size=size, mtime_ns=now, ctime_ns=now)


def _destroy_orphans(live, inos: list[int]) -> int:
    """A step: delete those of ``inos`` still marked orphans; how many."""
    orphans = [ino for ino in inos
               if live.txn.get(S.u64(ino), db=live.db["orphans"]) is not None]
    for ino in orphans:
        live.destroy(ino)
    return len(orphans)


def _setattr(live, ino: int, changes: dict) -> S.Inode:
    """A step: see ``_changed``."""
    return live.save(ino, _changed(live.get(ino), changes))


def _joined_setattrs(args: tuple, later: tuple) -> tuple | None:
    """One ``_setattr`` doing what ``args`` then ``later`` do: to the same inode, the
    later values win (``_changed`` sets each field to the value given)."""
    (ino, changes), (later_ino, later_changes) = args, later
    return (ino, {**changes, **later_changes}) if ino == later_ino else None


def _create(live, now: int, ino: int, *args) -> None:
    """A posted step: ``Live.create`` with the caller's inode number and clock, so that it
    writes the records the caller answered with (``namespace.created``)."""
    live.now = now
    live.create(*args, ino=ino)


def _clamped(ns: int) -> int:
    """A time as a record can hold it (TIME_NS)."""
    low, high = TIME_NS
    return low if ns < low else high if ns > high else ns


def _changed(rec: S.Inode, changes: dict) -> S.Inode:
    """``rec`` with ``changes`` (which hold ``ctime_ns``); ``changes["mode"]``, if any,
    holds permission bits only (the type stays)."""
    if "mode" in changes:
        changes = dict(changes, mode=stat.S_IFMT(rec.mode) | changes["mode"])
    return rec.evolve(**changes)


def _assemble(stored, off: int, end: int, cs: int, dirty: dict[int, bytes]) -> bytes:
    """[off, end) of a live file: buffered chunks from ``dirty``, the rest from the store
    (``stored(pos, n)``: n bytes at pos, zeros past the end of the file)."""
    if not dirty:
        return stored(off, end - off)
    out = bytearray()
    pos = off
    while pos < end:
        idx, within = divmod(pos, cs)
        take = min(cs - within, end - pos)
        data = dirty.get(idx)
        if data is None:
            out += stored(pos, take)
        else:
            piece = data[within:within + take]
            out += piece + bytes(take - len(piece))
        pos += take
    return bytes(out)
