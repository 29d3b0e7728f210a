"""``snapctl restore --from MIRROR``: bring a snapshot, or one path of it, back from a mirror.

The tree is rebuilt through the mounted filesystem with ordinary file operations, so the
source's own rules (permissions, snapshots, crash safety) apply unchanged. Chunk data the
source store still holds (same digest) is read locally; only the rest travels.

The mirror is not trusted (a compromised backup host, or anyone on a plain-http path): the
whole listing is checked before anything is written (`_checked`), and every name is created
relative to a directory descriptor this restore made itself, without following symlinks
(`_Dirs`), so no entry can reach outside the target. Chunk data is written only after its
blake3 digest and length match. Set-uid/set-gid files, file capabilities and device nodes
are refused unless asked for (root), or left out with a warning (other users, who could not
create them faithfully anyway).

Nothing at the destination changes until the whole tree is there: it is built beside it
under ``.NAME.mountfs-restore-PID`` (0700 until complete) and swapped in at the end
(``_restore_at``, with ``swap.py``); a failure or SIGHUP/SIGTERM/SIGINT before that removes
the partial copy.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from mountfs import chunkfile
from mountfs import schema as S
from mountfs import snapshots as snaps
from mountfs.interrupts import SIGNALS, Interrupted, signals_raise
from mountfs.store import Store, StoreError

from .mirror import MirrorError
from .swap import discard, exists_at, side_name, swap

FETCH_BATCH = 64
OPEN_DIRS = 128                     # directory descriptors kept open while restoring
MAX_TARGET = 4095                   # symlink target, as PATH_MAX
MAX_XATTR_VALUE = 64 << 10
MAX_SIZE = (1 << 63) - 1
KINDS = {stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK}
DEVICES = {stat.S_IFCHR, stat.S_IFBLK}
PRIVILEGED_XATTR = b"security.capability"


@dataclass
class RestoreResult:
    entries: int = 0
    bytes_fetched: int = 0
    bytes_local: int = 0
    left_out: list[str] = field(default_factory=list)   # special files a non-root user skipped
    dest: str = ""                  # where the tree went: DEST, or DEST/NAME for DEST/
    replaced: str | None = None     # the kind of what --force replaced there, if anything
    replaced_entries: int = 0       # the names that were in it, for a directory


@dataclass
class Entry:
    """One checked entry of a mirror's export: ``parts`` are the path's components below
    the restored top (``()`` for the top itself)."""
    parts: tuple[str, ...]
    link: tuple[str, ...] | None = None
    mode: int = 0
    uid: int = 0
    gid: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    size: int = 0
    rdev: int = 0
    target: bytes = b""
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    chunks: list[tuple[int, bytes, int]] = field(default_factory=list)

    @property
    def shown(self) -> str:
        return "/".join((".",) + self.parts)


def restore_from(mirror, source_store: str, mountpoint: str, snapshot: str, path: str,
                 dest: str, force: bool, allow_special: bool = False) -> RestoreResult:
    """Rebuild ``path`` of mirror snapshot ``snapshot`` at ``dest`` (relative to the mount).
    ``allow_special`` lets set-id files, file capabilities and device nodes through.

    The tree is built under a temporary name beside the destination (``side_name``) and
    swapped into place only once every entry is written, checked and has its final mode
    and times: a new name or a replaced file by one rename, a replaced directory by one
    RENAME_EXCHANGE, after which the old tree is removed. A restore that fails or is
    interrupted (SIGHUP, SIGTERM, SIGINT) before the swap removes its partial copy and
    leaves the destination as it was."""
    if os.path.realpath(Path(mountpoint) / dest.lstrip("/")) == \
            os.path.realpath(mountpoint) and not dest.endswith("/"):
        raise StoreError("restoring from a mirror over the whole tree is not supported; "
                         "restore into a directory with --to DEST")
    chunk_size = _int(mirror.info().get("chunk_size"), 1, 1 << 30, "the mirror's chunk size")
    result = RestoreResult()
    entries = _checked(mirror.export(snapshot, path), chunk_size, allow_special, result)
    result.dest, replaced = snaps.restore_target(
        path, dest, snaps.kind(entries[0].mode) if entries else "special file",
        lambda p: _path_kind(Path(mountpoint) / p.lstrip("/")), force)
    target = Path(mountpoint) / result.dest.lstrip("/")
    if not target.parent.is_dir():
        raise StoreError(f"the parent directory of {dest!r} does not exist")
    result.replaced = replaced
    if replaced == "directory":
        result.replaced_entries = len(os.listdir(target))
    with signals_raise():
        parent_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _restore_at(mirror, source_store, parent_fd, target.name, replaced is not None,
                        entries, chunk_size, result)
        except Interrupted as e:             # before the temporary copy was begun
            raise RestoreAborted(f"{e}; {result.dest!r} was left as it was") from None
        finally:
            os.close(parent_fd)
    return result


def _restore_at(mirror, source_store: str, parent_fd: int, name: str, replacing: bool,
                entries: list[Entry], chunk_size: int, result: RestoreResult) -> None:
    """Build the tree beside ``name`` in ``parent_fd``, swap it in, remove the old one."""
    tmp = side_name(name, "restore")
    if exists_at(parent_fd, tmp):
        raise StoreError(f"{tmp!r} is in the way of the restore's temporary copy (left by "
                         f"an earlier restore that was killed?); remove it. "
                         f"{result.dest!r} was left as it was")
    old, swapped = None, False
    try:
        _build(mirror, source_store, parent_fd, tmp, entries, chunk_size, result)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:                    # a signal now lands before or after the swap, never inside
            old = swap(parent_fd, tmp, name, replacing)
            swapped = True
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if old is not None and not discard(parent_fd, old, raise_interrupt=True):
            raise RestoreAborted(f"{result.dest!r} was restored, but its old copy could not "
                                 f"be removed: the old data is left beside it as {old!r}")
    except RestoreAborted:
        raise
    except BaseException as e:
        if swapped:
            left = f" while its old copy was removed: the old data is left beside it as " \
                   f"{old!r}" if old is not None else ""
            raise RestoreAborted(f"{result.dest!r} was restored, but {_why(e)}{left}") \
                from None
        left = "" if discard(parent_fd, tmp) else \
            f" (its partial copy {tmp!r} beside it could not be removed)"
        why = f"{_why(e)}; {result.dest!r} was left as it was{left}"
        if isinstance(e, (StoreError, OSError, Interrupted, KeyboardInterrupt)):
            raise RestoreAborted(why) from None
        e.add_note(why)
        raise


class RestoreAborted(StoreError):
    """A restore --from that stopped: the one line says what it left where."""


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f" {e.filename}" if e.filename else ""
        return f"restore from the mirror failed: {e.strerror.lower()}:{where}" if where \
            else f"restore from the mirror failed: {e.strerror.lower()}"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted by SIGINT"
    return str(e) or type(e).__name__


def _build(mirror, source_store: str, parent_fd: int, tmp: str, entries: list[Entry],
           chunk_size: int, result: RestoreResult) -> None:
    """Every entry under ``tmp`` in ``parent_fd``, with final modes and times."""
    local = Store.open(source_store, readonly=True, lock=False)
    dirs = _Dirs(os.dup(parent_fd), tmp)
    try:
        for entry in entries:
            _create(mirror, local, dirs, entry, chunk_size, result)
        for entry in reversed(entries):          # children before parents
            if entry.link is None:
                _finish(dirs, entry)
    finally:
        dirs.close()
        local.close()


def _path_kind(p: Path) -> str | None:
    """The kind of what is at ``p`` (not following a final symlink), or None."""
    try:
        return snaps.kind(os.lstat(p).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


# ---- checking what the mirror sent ----------------------------------------------------------

def _refuse(what: str) -> MirrorError:
    return MirrorError(f"refused the mirror's listing: {what}")


def _int(value, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _refuse(f"{what} is not a number in [{low}, {high}]")
    return value


def _hex(value, what: str, size: int | None = None, limit: int = MAX_XATTR_VALUE) -> bytes:
    if not isinstance(value, str) or len(value) > 2 * limit:
        raise _refuse(f"{what} is not hex of at most {limit} bytes")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise _refuse(f"{what} is not hex") from None
    if size is not None and len(raw) != size:
        raise _refuse(f"{what} is not {size} bytes")
    return raw


def _parts(path, what: str) -> tuple[str, ...]:
    """The components of a relative path ``.`` or ``./a/b``: no empty, ``.``, ``..`` or
    over-long component, no NUL; never absolute."""
    if not isinstance(path, str) or not (path == "." or path.startswith("./")):
        raise _refuse(f"{what} {path!r} is not a relative path starting with './'")
    parts = tuple(path[2:].split("/")) if path != "." else ()
    for p in parts:
        if p in ("", ".", "..") or "\0" in p or \
                len(p.encode("utf-8", "surrogateescape")) > S.NAME_MAX:
            raise _refuse(f"{what} {path!r} has the component {p!r}")
    return parts


def _checked(raw, chunk_size: int, allow_special: bool, result: RestoreResult) -> list[Entry]:
    """Every entry validated as a tree before anything is written: parents (directories
    listed earlier) before children, each path once, links to files listed earlier, values
    in range. Special files are refused (root) or left out (other users)."""
    if not isinstance(raw, list) or not raw:
        raise _refuse("it is not a non-empty list of entries")
    dirs, files, seen, out = set(), set(), set(), []
    for item in raw:
        if not isinstance(item, dict):
            raise _refuse("an entry is not an object")
        parts = _parts(item.get("path"), "path")
        if (parts == ()) != (not out):
            raise _refuse(f"{item.get('path')!r} is not where the listing puts it: the "
                          f"top ('.') comes first, and only once")
        if parts in seen:
            raise _refuse(f"{item['path']!r} is listed twice")
        if parts and parts[:-1] not in dirs:
            raise _refuse(f"the parent of {item['path']!r} is not a directory listed "
                          f"before it")
        seen.add(parts)
        if "link" in item:
            link = _parts(item["link"], "link")
            if link not in files:
                raise _refuse(f"{item['path']!r} links to {item['link']!r}, which is not a "
                              f"file listed before it")
            out.append(Entry(parts, link=link))
            continue
        entry = _entry(item, parts, chunk_size)
        if _special(entry) and not allow_special:
            if os.geteuid() == 0:
                raise _refuse(f"{entry.shown} is {_special(entry)}; pass --allow-special "
                              f"to restore such files")
            if stat.S_IFMT(entry.mode) in DEVICES:
                result.left_out.append(entry.shown)
                continue
            entry.mode &= ~(stat.S_ISUID | stat.S_ISGID)
            entry.xattrs.pop(PRIVILEGED_XATTR, None)
            result.left_out.append(entry.shown)
        kind = stat.S_IFMT(entry.mode)
        (dirs if kind == stat.S_IFDIR else files if kind == stat.S_IFREG else set()).add(parts)
        out.append(entry)
    return out


def _special(entry: Entry) -> str | None:
    kind = stat.S_IFMT(entry.mode)
    if kind in DEVICES:
        return "a device node"
    if kind == stat.S_IFREG and entry.mode & (stat.S_ISUID | stat.S_ISGID):
        return "set-uid or set-gid"
    if PRIVILEGED_XATTR in entry.xattrs:
        return "a file with capabilities"
    return None


def _entry(item: dict, parts: tuple[str, ...], chunk_size: int) -> Entry:
    where = "/".join((".",) + parts)
    mode = _int(item.get("mode"), 0, 0xFFFF, f"the mode of {where}")
    if stat.S_IFMT(mode) not in KINDS | DEVICES:
        raise _refuse(f"{where} has an unknown file type")
    times = [_int(item.get(k), -(1 << 63), (1 << 63) - 1, f"{k} of {where}")
             for k in ("atime_ns", "mtime_ns")]
    entry = Entry(parts, mode=mode,
                  uid=_int(item.get("uid"), 0, 2**32 - 2, f"the owner of {where}"),
                  gid=_int(item.get("gid"), 0, 2**32 - 2, f"the group of {where}"),
                  atime_ns=times[0], mtime_ns=times[1],
                  size=_int(item.get("size"), 0, MAX_SIZE, f"the size of {where}"),
                  rdev=_int(item.get("rdev", 0), 0, 2**64 - 1, f"the device of {where}"))
    if stat.S_ISLNK(mode):
        entry.target = _hex(item.get("target"), f"the target of {where}", limit=MAX_TARGET)
        if not entry.target or b"\0" in entry.target:
            raise _refuse(f"the symlink {where} has an empty target or a NUL in it")
    xattrs = item.get("xattrs", {})
    if not isinstance(xattrs, dict):
        raise _refuse(f"the xattrs of {where} are not an object")
    for k, v in xattrs.items():
        name = _hex(k, f"an xattr name of {where}", limit=S.NAME_MAX)
        if not name or b"\0" in name or not name.startswith((b"user.", b"trusted.",
                                                              b"security.")):
            raise _refuse(f"{where} has the xattr name {name!r}")
        entry.xattrs[name] = _hex(v, f"the xattr {name!r} of {where}")
    if stat.S_ISREG(mode):
        entry.chunks = _chunks(item.get("chunks"), entry.size, chunk_size, where)
    return entry


def _chunks(leaves, size: int, chunk_size: int, where: str) -> list[tuple[int, bytes, int]]:
    """(index, digest, length) of each chunk: starting inside the file's size (the file is
    cut to its size after), each index once."""
    if not isinstance(leaves, list):
        raise _refuse(f"the chunk list of {where} is not a list")
    out, seen = [], set()
    for leaf in leaves:
        if not isinstance(leaf, list) or len(leaf) != 3:
            raise _refuse(f"a chunk of {where} is not [index, digest, length]")
        index = _int(leaf[0], 0, (size - 1) // chunk_size if size else -1,
                     f"a chunk index of {where}")
        digest = _hex(leaf[1], f"a chunk digest of {where}", size=S.DIGEST_SIZE)
        length = _int(leaf[2], 1, chunk_size, f"a chunk length of {where}")
        if index in seen:
            raise _refuse(f"{where} lists chunk {index} twice")
        seen.add(index)
        out.append((index, digest, length))
    return out


# ---- creating, never outside the target ----------------------------------------------------

class _Dirs:
    """Descriptors of the directories this restore created, opened one component at a time
    below the target's parent with O_NOFOLLOW (a few kept open, the rest reopened)."""

    def __init__(self, parent_fd: int, top_name: str):
        self.parent_fd = parent_fd
        self.top_name = top_name
        self.open: OrderedDict[tuple[str, ...], int] = OrderedDict()

    def parent_of(self, parts: tuple[str, ...]) -> tuple[int, str]:
        """(directory descriptor, name) at which ``parts`` is created."""
        if not parts:
            return self.parent_fd, self.top_name
        return self.fd(parts[:-1]), parts[-1]

    def fd(self, parts: tuple[str, ...]) -> int:
        fd = self.open.get(parts)
        if fd is not None:
            self.open.move_to_end(parts)
            return fd
        parent, name = self.parent_of(parts)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
        self.open[parts] = fd
        while len(self.open) > OPEN_DIRS:
            os.close(self.open.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        for fd in self.open.values():
            os.close(fd)
        self.open.clear()
        os.close(self.parent_fd)


def _create(mirror, local: Store, dirs: _Dirs, entry: Entry, chunk_size: int,
            result: RestoreResult) -> None:
    result.entries += 1
    if entry.link is not None:
        src_parent, src_name = dirs.parent_of(entry.link)
        src_parent = os.dup(src_parent)          # held while the destination is opened
        try:
            parent, name = dirs.parent_of(entry.parts)
            os.link(src_name, name, src_dir_fd=src_parent, dst_dir_fd=parent,
                    follow_symlinks=False)
        finally:
            os.close(src_parent)
        return
    parent, name = dirs.parent_of(entry.parts)
    kind = stat.S_IFMT(entry.mode)
    if kind == stat.S_IFDIR:
        os.mkdir(name, 0o700, dir_fd=parent)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
    elif kind == stat.S_IFREG:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=parent)
    elif kind == stat.S_IFLNK:
        os.symlink(entry.target, name, dir_fd=parent)
        _own(None, parent, name, entry)
        return
    else:
        os.mknod(name, kind | 0o600, entry.rdev, dir_fd=parent)
        _own(None, parent, name, entry)
        os.chmod(name, stat.S_IMODE(entry.mode), dir_fd=parent)   # just made: no symlink
        return
    try:
        if kind == stat.S_IFREG:
            _write_file(mirror, local, fd, entry, chunk_size, result)
            _own(fd, parent, name, entry)
            os.fchmod(fd, stat.S_IMODE(entry.mode))    # after chown, which clears set-id bits
        else:
            _own(fd, parent, name, entry)              # its mode comes last (_finish)
    finally:
        os.close(fd)


def _finish(dirs: _Dirs, entry: Entry) -> None:
    """Times, and a directory's mode (last, so that a read-only directory could be filled)."""
    parent, name = dirs.parent_of(entry.parts)
    if stat.S_ISDIR(entry.mode):
        os.fchmod(dirs.fd(entry.parts), stat.S_IMODE(entry.mode))
        parent, name = dirs.parent_of(entry.parts)
    os.utime(name, ns=(entry.atime_ns, entry.mtime_ns), dir_fd=parent, follow_symlinks=False)


def _own(fd: int | None, parent: int, name: str, entry: Entry) -> None:
    """Owner and xattrs: the mirror's owners only when root (as tar does); otherwise the
    files stay the restoring user's. Never through a symlink."""
    if os.geteuid() == 0:
        if fd is None:
            os.chown(name, entry.uid, entry.gid, dir_fd=parent, follow_symlinks=False)
        else:
            os.fchown(fd, entry.uid, entry.gid)
    if fd is None:
        return          # symlinks and special files: xattrs only where they can be set safely
    for xname, value in entry.xattrs.items():
        os.setxattr(fd, xname, value)


def _write_file(mirror, local: Store, fd: int, entry: Entry, chunk_size: int,
                result: RestoreResult) -> None:
    leaves = entry.chunks
    for start in range(0, len(leaves), FETCH_BATCH):
        batch = leaves[start:start + FETCH_BATCH]
        data = _chunk_data(mirror, local, batch, result, entry.shown)
        for (index, _, _), chunk in zip(batch, data, strict=True):
            if os.pwrite(fd, chunk, index * chunk_size) != len(chunk):
                raise OSError(errno.EIO, "short write", entry.shown)
    os.ftruncate(fd, entry.size)
    os.fsync(fd)


def _chunk_data(mirror, local: Store, leaves, result: RestoreResult, where: str) -> list[bytes]:
    """The data of each chunk, from the source store when it still has it, else fetched;
    written only if its digest and length are those the listing gave."""
    want = {digest: length for _, digest, length in leaves}
    found = {}
    with local.read() as txn:
        for digest in want:
            data = chunkfile.get(txn, local.db, digest)
            if data is not None and _good(digest, want[digest], bytes(data)):
                found[digest] = bytes(data)
                result.bytes_local += len(data)
    wanted = [d for d in want if d not in found]
    if wanted:
        for digest, data in mirror.read_chunks(wanted):
            digest = bytes(digest)
            if digest not in want or not _good(digest, want[digest], data):
                raise MirrorError(f"the mirror sent wrong data for a chunk of {where} "
                                  f"(digest or length does not match); nothing more is "
                                  f"written")
            found[digest] = data
            result.bytes_fetched += len(data)
    missing = [d for d in want if d not in found]
    if missing:
        raise MirrorError(f"the mirror did not send chunk {missing[0].hex()[:16]} of {where}")
    return [found[digest] for _, digest, _ in leaves]


def _good(digest: bytes, length: int, data: bytes) -> bool:
    return len(data) == length and blake3.blake3(data).digest() == digest
