"""Snapshots on one write transaction: create (O(1): the live epoch becomes the snapshot's
and the live epoch moves on), list, delete (O(1); the versions only it could see are
reclaimed later by gc.py), roll the live tree back, and restore one path as a copy.

These functions are used by the mount's control server and by snapctl on an unmounted store.
"""

from __future__ import annotations

import os
import stat
import time
import uuid as uuidlib
from dataclasses import dataclass, field, replace

from . import schema as S
from .namespace import FsError, Live, View, add_written, written
from .snapnames import SnapshotError
from .store import StoreError, delete_live, get_version, put_live


# Characters that would let a name rewrite what `snapctl list` shows: C0 and C1 controls
# and DEL (newline, ESC sequences), and the bidirectional overrides.
_SPOOFING = {*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def validate_name(name: str) -> bytes:
    """A snapshot name as stored: UTF-8, printable, no '/', not '.' or '..', NAME_MAX bytes."""
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise SnapshotError("snapshot name is not valid UTF-8") from None
    if not raw:
        raise SnapshotError("snapshot name must not be empty")
    bad = next((c for c in name if ord(c) in _SPOOFING), None)
    if bad is not None:
        raise SnapshotError(f"snapshot name {name!r} contains the control character "
                            f"U+{ord(bad):04X}; use printable characters")
    if b"/" in raw or b"\0" in raw:
        raise SnapshotError(f"snapshot name {name!r} must not contain '/' or NUL")
    if raw in (b".", b".."):
        raise SnapshotError(f"snapshot name {name!r} is reserved")
    if len(raw) > S.NAME_MAX:
        raise SnapshotError(f"snapshot name is {len(raw)} bytes long; the limit is {S.NAME_MAX}")
    return raw


def live_epoch(txn, dbs) -> int:
    return S.from_u64(txn.get(b"live_epoch", db=dbs["meta"]))


def create(txn, dbs, name: str, snap_uuid: bytes | None = None,
           created_ns: int | None = None) -> S.Snapshot:
    raw = validate_name(name)
    if txn.get(raw, db=dbs["snaps"]) is not None:
        raise SnapshotError(f"a snapshot named {name!r} already exists")
    meta = dbs["meta"]
    epoch = live_epoch(txn, dbs)
    snap_id = S.from_u64(txn.get(b"next_snap_id", db=meta))
    if snap_id > S.MAX_SNAP_ID:
        raise SnapshotError(f"this store has used all {S.MAX_SNAP_ID} snapshot ids (they "
                            f"number snapshot inodes and are never reused)")
    snap = S.Snapshot(name, epoch, created_ns or time.time_ns(), snap_id,
                      snap_uuid or uuidlib.uuid4().bytes)
    txn.put(raw, snap.pack(), db=dbs["snaps"])
    txn.put(S.u64(epoch), raw, db=dbs["snapepochs"])
    txn.put(b"next_snap_id", S.u64(snap_id + 1), db=meta)
    txn.put(b"live_epoch", S.u64(epoch + 1), db=meta)
    return snap


def list_all(txn, dbs) -> list[S.Snapshot]:
    out = []
    for epoch_key, name in txn.cursor(db=dbs["snapepochs"]):
        snap = S.Snapshot.unpack(name, txn.get(bytes(name), db=dbs["snaps"]))
        out.append(replace(snap, written=written(txn, dbs, snap.epoch)))
    return out


def newest_epoch(txn, dbs) -> int | None:
    """The epoch of the newest snapshot there is (None: none), in O(1)."""
    cur = txn.cursor(db=dbs["snapepochs"])
    return S.from_u64(cur.key()) if cur.last() else None


def get(txn, dbs, name: str) -> S.Snapshot:
    raw = name.encode("utf-8", "surrogateescape")
    val = txn.get(raw, db=dbs["snaps"]) if raw and len(raw) <= 511 else None
    if val is None:
        raise SnapshotError(f"no snapshot named {name!r}")
    return S.Snapshot.unpack(raw, val)


def retained_epochs(txn, dbs) -> list[int]:
    """Epochs whose state must stay readable: every snapshot's and the live one."""
    epochs = [S.from_u64(k) for k, _ in txn.cursor(db=dbs["snapepochs"])]
    return epochs + [live_epoch(txn, dbs)]


def delete(txn, dbs, name: str, force: bool = False) -> S.Snapshot:
    """Delete snapshot ``name``. A snapshot that is the replication base of a mirror is
    kept unless ``force`` (the next cycle to that mirror then reconciles by buckets). The
    mirror's hold stays, naming the deleted base, so that status and check still report
    that mirror (as behind: its base was deleted) until the next cycle holds a new one."""
    snap = get(txn, dbs, name)
    held_for = sorted(label for mirror, snap_uuid, label in holds(txn, dbs)
                      if snap_uuid == snap.uuid)
    if held_for and not force:
        which = f"mirror {held_for[0]}" if len(held_for) == 1 else \
            f"mirrors {', '.join(held_for[:-1])} and {held_for[-1]}"
        raise SnapshotError(f"snapshot {name!r} is the replication base of {which}; "
                            f"replicate a newer snapshot first, or pass --force")
    txn.delete(snap.name.encode("utf-8", "surrogateescape"), db=dbs["snaps"])
    txn.delete(S.u64(snap.epoch), db=dbs["snapepochs"])
    _merge_written(txn, dbs, snap.epoch)
    token = txn.get(b"gc_pending", db=dbs["meta"])
    txn.put(b"gc_pending", S.u64(S.from_u64(token) + 1 if token else 1), db=dbs["meta"])
    return snap


HOLD_PREFIX = b"hold:"


def holds(txn, dbs) -> list[tuple[bytes, bytes, str]]:
    """(mirror uuid, base snapshot uuid, mirror label) for every mirror replicated to; the
    base may be gone (deleted with ``force``)."""
    out = []
    cur = txn.cursor(db=dbs["meta"])
    if cur.set_range(HOLD_PREFIX):
        for key, value in cur:
            key, value = bytes(key), bytes(value)
            if not key.startswith(HOLD_PREFIX):
                break
            out.append((key[len(HOLD_PREFIX):], value[:16], value[16:].decode()))
    return out


def bases(txn, dbs) -> dict[str, str]:
    """Snapshots that are a mirror's replication base, each with why it must stay (retention
    keeps them rather than fail on the refusal of ``delete``)."""
    by_uuid = {s.uuid: s.name for s in list_all(txn, dbs)}
    labels: dict[str, list[str]] = {}
    for _, u, label in holds(txn, dbs):
        if u in by_uuid:
            labels.setdefault(by_uuid[u], []).append(label)
    return {name: f"replication base of {' and '.join(sorted(held))}"
            for name, held in labels.items()}


def set_hold(txn, dbs, mirror_uuid: bytes, name: str, label: str) -> None:
    """Record snapshot ``name`` as the replication base of a mirror (replacing the older one)."""
    snap = get(txn, dbs, name)
    txn.put(HOLD_PREFIX + mirror_uuid, snap.uuid + label.encode(), db=dbs["meta"])


def drop_holds(txn, dbs, label: str) -> int:
    """Forget every mirror recorded under ``label`` (its URL): its base is no longer kept.
    Returns how many were dropped."""
    gone = [mirror for mirror, _, held_label in holds(txn, dbs) if held_label == label]
    for mirror in gone:
        txn.delete(HOLD_PREFIX + mirror, db=dbs["meta"])
    return len(gone)


def _merge_written(txn, dbs, epoch: int) -> None:
    """A deleted snapshot's epoch merges into the next retained one (the next snapshot's,
    or the live one), and so does its count of written bytes."""
    nxt = min(e for e in retained_epochs(txn, dbs) if e > epoch)
    moved = written(txn, dbs, epoch)
    txn.delete(S.written_key(epoch), db=dbs["meta"])
    add_written(txn, dbs, nxt, moved)


# ---- rollback of the whole tree ---------------------------------------------------------------

@dataclass
class Rollback:
    """What a rollback changed, so the mount can tell the kernel."""
    inodes: set[int] = field(default_factory=set)
    entries: set[tuple[int, bytes]] = field(default_factory=set)


def rollback(txn, dbs, chunk_size: int, snap: S.Snapshot, force: bool = False) -> Rollback:
    """Make the live tree equal to ``snap`` by writing, in the live epoch, the snapshot's
    version of every record changed since. Inode identities are kept (a mirror stays
    comparable item by item) and no chunk data is copied: chunk references are re-pointed.
    Without ``force``, refuses when the live tree changed since (the root's mepoch says so in
    O(1)), since those changes would be lost."""
    live = Live(txn, dbs, live_epoch(txn, dbs), chunk_size)
    if not force and live.get(S.ROOT_INO).mepoch > snap.epoch:
        raise SnapshotError(f"the live tree has changed since snapshot {snap.name!r}; pass "
                            f"--force to discard those changes (take a snapshot first to "
                            f"keep them)")
    return rollback_to_epoch(txn, dbs, chunk_size, snap.epoch)


def rollback_to_epoch(txn, dbs, chunk_size: int, epoch: int) -> Rollback:
    """Make the live tree equal to its state at the end of ``epoch`` (a snapshot's, or the
    one an interrupted change started from: see undo_interrupted)."""
    live = Live(txn, dbs, live_epoch(txn, dbs), chunk_size)
    done = Rollback()
    for dbname in S.VERSIONED_DBS:
        for base, old, new in _changed_since(txn, dbs[dbname], epoch):
            _restore_record(live, dbname, base, old, new, done)
    for ino in sorted(done.inodes):
        if live.inode(ino) is not None:
            live.touch(ino)
            txn.delete(S.u64(ino), db=dbs["purge"])
            txn.delete(S.u64(ino), db=dbs["orphans"])
    return done


def _changed_since(txn, db, epoch: int):
    """(base, live value or None, value at ``epoch`` or None) for every record with a version
    newer than ``epoch`` whose visible value differs."""
    cur = txn.cursor(db)
    if not cur.first():
        return
    while True:
        key = bytes(cur.key())
        base = key[:-8]
        if S.epoch_of_key(key) > epoch:
            now = bytes(cur.value()) or None
            then = get_version(txn, db, base, epoch)
            then = (bytes(then[1]) or None) if then is not None else None
            if now != then:
                yield base, now, then
        if not cur.set_range(base + b"\xff" * 8):
            return


def _restore_record(live: Live, dbname: str, base: bytes, now, then, done: Rollback) -> None:
    txn, db, L = live.txn, live.db[dbname], live.live
    if dbname == "inodes":
        ino = S.from_u64(base)
        if then is None:
            delete_live(txn, db, base, L)
        else:
            put_live(txn, db, base, S.Inode.unpack(then).pack_at(L), L)
        done.inodes.add(ino)
    elif dbname == "dirents":
        parent, name = S.from_u64(base[:8]), S.name_of_dirent_key(base)
        if then is None:
            live.delete_dirent(parent, name)
        else:
            live.put_dirent(parent, name, S.from_u64(then))
        done.inodes.add(parent)
        done.entries.add((parent, name))
    elif dbname == "chunks":
        ino, index = S.from_u64(base[:8]), S.from_u64(base[8:16])
        if then is None:
            live.drop_chunk(ino, index)
        else:
            digest, _ = S.unpack_chunk(then)
            live.incref(digest)
            old = put_live(txn, db, base, then, L)
            txn.put(S.chunklog_key(ino, L, index), b"", db=live.db["chunklog"])
            if old:
                live.decref(S.unpack_chunk(old)[0])
        done.inodes.add(ino)
    else:  # xattrs
        if then is None:
            delete_live(txn, db, base, L)
        else:
            put_live(txn, db, base, then, L)
        done.inodes.add(S.from_u64(base[:8]))


# ---- restore of one path as a copy -------------------------------------------------------------

@dataclass
class Restored:
    """What a path restore did: where the copy went (DEST, or DEST/NAME for a DEST ending in
    '/'), so the message and the kernel's caches name the real place, and what it replaced,
    so the user is told what was discarded."""
    dest: str
    parent: int
    name: bytes
    top: int
    copied: int
    replaced: str | None = None       # the kind of what was replaced ("directory", "file"...)
    replaced_entries: int = 0         # names that were below a replaced directory
    orphans: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"inode": self.top, "copied": self.copied, "dest": self.dest,
                "replaced": self.replaced, "replaced_entries": self.replaced_entries}


def kind(mode: int) -> str:
    """What an inode is, in the words of the restore's messages."""
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    return "symbolic link" if stat.S_ISLNK(mode) else "special file"


def restore_target(path: str, dest: str, src_kind: str, kind_of, force: bool
                   ) -> tuple[str, str | None]:
    """Where a restore of ``path`` (a ``src_kind``) to ``dest`` goes, and the kind of what it
    replaces there (None: nothing). ``kind_of(p)`` is the kind of the live path p, or None.
    A DEST ending in '/' is an existing directory to restore into, as with cp. A directory
    never replaces a non-directory nor the reverse, even with ``force``: that would discard
    a whole tree, or put one where a file was, by a slip of the path. The same rule serves
    ``restore --from``."""
    name = os.path.basename(os.path.normpath("/" + path))
    if os.path.normpath("/" + dest).split("/")[1] == ".snapshot":
        raise SnapshotError(f"{dest!r} is inside .snapshot, whose snapshots never change: "
                            f"restore into the live tree (--to PATH outside .snapshot)")
    if dest.endswith("/"):
        if kind_of(dest) != "directory":
            raise SnapshotError(f"{dest!r} is not an existing directory; create it first, or "
                                f"drop the '/' to restore under that name")
        if not name:
            raise SnapshotError(f"the root has no name to restore into {dest!r}; use "
                                f"--to {dest}NAME")
        dest = dest + name
    old = kind_of(dest)
    if old is None:
        return dest, None
    if old == "directory" and src_kind != "directory":
        raise SnapshotError(f"{dest!r} is a directory and {path!r} a {src_kind}: to restore "
                            f"the {src_kind} into it, use --to {dest.rstrip('/')}/{name}")
    if old != "directory" and src_kind == "directory":
        raise SnapshotError(f"{dest!r} is a {old} and {path!r} a directory: restore it "
                            f"elsewhere with --to, or move {dest!r} away first")
    if not force:
        raise SnapshotError(f"{dest!r} exists; pass --force to replace it")
    return dest, old


def restore_path(txn, dbs, chunk_size: int, snap: S.Snapshot, path: str, dest: str,
                 force: bool, mounted: bool = False) -> Restored:
    """Copy ``path`` as it was in ``snap`` to ``dest`` in the live tree (see
    restore_target): new inodes (hard links inside the tree are kept), the same chunk data
    by reference. With ``mounted``, the replaced inodes left without links are returned as
    orphans, which the mount deletes once the kernel does not hold them; without, they are
    deleted here."""
    view = View(txn, dbs, snap.epoch, chunk_size)
    live = Live(txn, dbs, live_epoch(txn, dbs), chunk_size)
    try:
        src = view.resolve(path)
    except FsError:
        raise SnapshotError(f"{path!r} does not exist in snapshot {snap.name!r}") from None
    if os.path.normpath("/" + dest) == "/" and not dest.endswith("/"):
        raise SnapshotError("cannot restore over the root by path; use 'snapctl restore NAME' "
                            "to roll the whole tree back")
    dest, replaced = restore_target(path, dest, kind(view.get(src).mode),
                                    lambda p: _live_kind(live, p), force)
    parent_path, _, name = os.path.normpath("/" + dest).rpartition("/")
    try:
        parent = live.resolve(parent_path)
    except FsError:
        raise SnapshotError(f"the parent directory of {dest!r} does not exist") from None
    if not stat.S_ISDIR(live.get(parent).mode):
        raise SnapshotError(f"the parent of {dest!r} is not a directory")
    bname = name.encode("utf-8", "surrogateescape")
    orphans, removed = [], 1
    if replaced is not None:
        if live.is_ancestor(live.lookup(parent, bname), parent):
            raise SnapshotError(f"{dest!r} contains the restore target's parent")
        orphans, removed = remove_tree(live, parent, bname, mounted)
    copied: dict = {}
    top = _copy(view, src, live, parent, bname, copied)
    return Restored(dest, parent, bname, top, len(copied), replaced, removed - 1, orphans)


def _live_kind(live: Live, path: str) -> str | None:
    """The kind of the live path, or None if nothing is there (or its parent is missing:
    restore_path says so)."""
    try:
        return kind(live.get(live.resolve(path)).mode)
    except FsError:
        return None


def _copy(view: View, src: int, live: Live, parent: int, name: bytes, copied: dict) -> int:
    if src in copied:                                   # a hard link inside the tree
        live.add_entry(parent, name, copied[src])
        return copied[src]
    rec = view.get(src)
    ino = live.clone(rec)
    copied[src] = ino
    for xname, value in view.xattrs(src).items():
        put_live(live.txn, live.db["xattrs"], S.xattr_key(ino, xname), b"\x01" + value,
                 live.live)
    if stat.S_ISREG(rec.mode):
        for idx in view.chunk_indices(src):
            digest, length = view.chunk(src, idx)
            live.incref(digest)
            put_live(live.txn, live.db["chunks"], S.chunk_key(ino, idx),
                     S.pack_chunk(digest, length), live.live)
            live.txn.put(S.chunklog_key(ino, live.live, idx), b"", db=live.db["chunklog"])
    live.add_entry(parent, name, ino)
    if stat.S_ISDIR(rec.mode):
        for child_name, child in list(view.listdir(src)):
            _copy(view, child, live, ino, child_name, copied)
        # Linking the children set the copy's mtime to now; a restored directory keeps the
        # snapshot's, as restored files do (its ctime says when it was restored).
        live.save(ino, live.get(ino).evolve(mtime_ns=rec.mtime_ns))
    return ino


def remove_tree(live: Live, parent: int, name: bytes, keep_orphans: bool
                ) -> tuple[list[int], int]:
    """Unlink parent/name and everything below it. Inodes left without links are destroyed,
    or, with ``keep_orphans``, marked orphans and returned (a mount deletes them once the
    kernel does not hold them), with the number of names removed (parent/name included)."""
    orphans, removed = [], 1
    child = live.lookup(parent, name)
    if stat.S_ISDIR(live.get(child).mode):
        for sub, _ in list(live.listdir(child)):
            below, count = remove_tree(live, child, sub, keep_orphans)
            orphans += below
            removed += count
    ino, rec = live.remove_entry(parent, name)
    if rec.nlink == 0:
        if keep_orphans:
            live.add_orphan(ino)
            orphans.append(ino)
        else:
            live.destroy(ino)
    return orphans, removed


__all__ = ["SnapshotError", "validate_name", "bases", "create", "list_all", "get", "delete",
           "rollback", "restore_path", "restore_target", "Restored", "remove_tree",
           "retained_epochs", "Rollback"]


# ---- changes of the live tree too big for one transaction --------------------------------------

UNDO_MARK = b"undo_to"    # meta: epoch:u64 + uuid of the snapshot the live tree equalled (or b"")


def begin_undoable(txn, dbs, equal_to: S.Snapshot | None) -> int:
    """Start a change of the live tree that spans several transactions (a mirror's large
    commit). The live epoch moves on, so that everything the change writes is newer than the
    state it started from, which stays readable at the returned epoch; the mark lets
    undo_interrupted put that state back if the change never ends (kill -9, power loss, a
    refusal). ``equal_to``: the snapshot the live tree equals now, which it equals again
    after an undo."""
    meta = dbs["meta"]
    if txn.get(UNDO_MARK, db=meta) is not None:
        raise StoreError("another change of the live tree is under way")
    epoch = live_epoch(txn, dbs)
    txn.put(UNDO_MARK, S.u64(epoch) + (equal_to.uuid if equal_to else b""), db=meta)
    txn.put(b"live_epoch", S.u64(epoch + 1), db=meta)
    return epoch


def end_undoable(txn, dbs) -> None:
    """The change is whole (in the transaction that ends it)."""
    txn.delete(UNDO_MARK, db=dbs["meta"])


def interrupted_at(txn, dbs) -> int | None:
    """The epoch an unfinished change started from, if one was cut short (or is under way)."""
    raw = txn.get(UNDO_MARK, db=dbs["meta"])
    return S.from_u64(bytes(raw)[:8]) if raw is not None else None


def readable_live_epoch(txn, dbs) -> int:
    """The epoch a reader sees as the live tree: the live epoch, or, while a change spanning
    transactions is unfinished (or was cut short and not yet undone), the state before it:
    nobody ever reads a half-applied commit."""
    before = interrupted_at(txn, dbs)
    return live_epoch(txn, dbs) if before is None else before


def undo_interrupted(txn, dbs, chunk_size: int) -> bool:
    """Put the live tree back as it was before a change that never ended; whether there was
    one. The undo is itself one transaction: a crash during it leaves the mark to undo
    again."""
    raw = txn.get(UNDO_MARK, db=dbs["meta"])
    if raw is None:
        return False
    raw = bytes(raw)
    rollback_to_epoch(txn, dbs, chunk_size, S.from_u64(raw[:8]))
    equal = next((s for s in list_all(txn, dbs) if s.uuid == raw[8:]), None)
    if equal is not None:
        mark_equal(txn, dbs, equal)
    txn.delete(UNDO_MARK, db=dbs["meta"])
    return True


def mark_equal(txn, dbs, snap: S.Snapshot) -> None:
    """The live tree was just made equal to ``snap``: close the live epoch and say so, so
    that it counts as unchanged since ``snap`` until something writes again."""
    epoch = live_epoch(txn, dbs)
    txn.put(b"rolled_back_to", S.u64(epoch) + snap.uuid, db=dbs["meta"])
    txn.put(b"live_epoch", S.u64(epoch + 1), db=dbs["meta"])
