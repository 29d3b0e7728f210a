"""What a store directory must be before a command opens anything in it, and opening the
files we write ourselves without following links (as ssh's StrictModes does for ~/.ssh).

LMDB opens ``data.mdb`` and ``lock.mdb`` by name, the store lock is truncated and the mount
appends to ``mountfs.log``: run by root on a store another user controls, a command would
write wherever that user's symbolic links point (``/etc/shadow``), or into another store.
So a store must be a real directory owned by the user running the command and writable by
nobody else, and its files real files of that user: then nobody but that user (or root)
can put anything in it. LMDB creates its files with the caller's umask (0644 usually) in
the 0700 directory ``mkfs`` makes: their modes are not checked, the directory's keeps
others out.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

from .errors import StoreError

# What mountfs and LMDB open in a store directory, and what each must be.
STORE_FILES = {"data.mdb": (stat.S_ISREG, "a regular file"),
               "chunks.dat": (stat.S_ISREG, "a regular file"),
               "lock.mdb": (stat.S_ISREG, "a regular file"),
               "lock": (stat.S_ISREG, "a regular file"),
               "mountfs.log": (stat.S_ISREG, "a regular file"),
               "control.sock": (stat.S_ISSOCK, "a socket")}


def check_store(path: str | os.PathLike) -> None:
    """Refuse, in one line that says what to do, a store directory whose files another user
    could redirect. A missing directory passes: the caller says it is missing."""
    path = Path(path)
    st = _lstat(path)
    if st is None:
        return
    _check(path, st, (stat.S_ISDIR, "a directory"), path)
    if st.st_mode & 0o022:
        raise StoreError(f"{path} is writable by group or others, who could replace the "
                         f"store's files: chmod go-w {path}")
    for name, kind in STORE_FILES.items():
        st = _lstat(path / name)
        if st is not None:
            _check(path / name, st, kind, path)


def check_new_store(path: str | os.PathLike) -> None:
    """Refuse to make a store in an existing directory that is a link or another user's
    (mkfs then makes it 0700, which would follow the link)."""
    st = _lstat(Path(path))
    if st is not None:
        _check(Path(path), st, (stat.S_ISDIR, "a directory"), Path(path))


def open_regular(path: str | os.PathLike, flags: int, mode: int = 0o600) -> int:
    """Open ``path`` as a regular file: never through a symbolic link in its place, and never
    waiting on a FIFO there (an open for reading would block until a writer comes)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StoreError(f"{path} is a symbolic link: remove it") from None
        if e.errno == errno.ENXIO:          # a FIFO opened for writing with no reader
            raise StoreError(f"{path} is not a regular file: remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(f"{path} is not a regular file: remove it")
    os.set_blocking(fd, True)
    return fd


def open_private(path: str | os.PathLike, flags: int) -> int:
    """Open (or create, 0600) ``path`` as a regular file of ours: a file another user made
    there first (in /tmp) would let them read what we write, or be theirs to redirect."""
    fd = open_regular(path, flags, 0o600)
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise StoreError(f"{path} is owned by {_user(owner)}, not by {_user(os.geteuid())}: "
                         f"remove it")
    return fd


def _check(path: Path, st: os.stat_result, kind, store: Path) -> None:
    is_kind, noun = kind
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"{path} is a symbolic link, and a store's paths are never "
                         f"followed: {'give the directory itself' if path == store else 'remove it'}")
    if not is_kind(st.st_mode):
        raise StoreError(f"{path} is not {noun}: "
                         f"{'give a store directory' if path == store else 'remove it'}")
    if st.st_uid != os.geteuid():
        user, me = _user(st.st_uid), _user(os.geteuid())
        raise StoreError(f"{path} is owned by {user}: run the command as {user} "
                         f"(runuser -u {user} -- ...) or chown -R {me} {store}")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
