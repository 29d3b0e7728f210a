"""Putting a finished tree in the place of a name, atomically, and taking trees away.

What ``restore --from`` needs so that its destination is never half-restored: a temporary
name beside the destination that says what it is (``side_name``), the swap itself
(``swap``: one rename, or RENAME_EXCHANGE for a directory, with a rename-aside fallback
where the kernel lacks it), and the removal of a partial or old tree (``discard``, which
an ``Interrupted`` stops only when asked). Everything works relative to a directory
descriptor: the caller opened the parent, and no path is followed through a symlink.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat

from mountfs import schema as S
from mountfs.interrupts import Interrupted


def side_name(name: str, what: str) -> str:
    """``.NAME.mountfs-WHAT-PID``: a temporary name beside NAME that says what it is (NAME
    shortened to keep it within NAME_MAX)."""
    tail = f".mountfs-{what}-{os.getpid()}".encode()
    raw = name.encode("utf-8", "surrogateescape")[:S.NAME_MAX - 1 - len(tail)]
    return "." + raw.decode("utf-8", "surrogateescape") + tail.decode()


def exists_at(parent_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


_libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
NO_FLAGS = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


def renameat2(fd: int, old: str, new: str, flags: int) -> bool:
    """renameat2(2) within one directory; False if the call or the flag is unsupported."""
    call = getattr(_libc, "renameat2", None)
    if call is None:
        return False
    if call(fd, os.fsencode(old), fd, os.fsencode(new), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in NO_FLAGS:
        return False
    raise OSError(err, os.strerror(err), new)


def swap(parent_fd: int, tmp: str, name: str, replacing: bool) -> str | None:
    """Put the finished ``tmp`` in place of ``name`` atomically (the caller holds the
    signals). Returns the name beside it under which the old data now lies (None: nothing
    to remove)."""
    if not replacing:
        if not renameat2(parent_fd, tmp, name, RENAME_NOREPLACE):
            if exists_at(parent_fd, name):
                raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), name)
            os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        return None
    st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        return None
    old = side_name(name, "old")
    if renameat2(parent_fd, tmp, name, RENAME_EXCHANGE):
        with contextlib.suppress(OSError):   # the old tree gets a name that says so
            if renameat2(parent_fd, tmp, old, RENAME_NOREPLACE):
                return old
        return tmp
    if exists_at(parent_fd, old):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), old)
    os.rename(name, old, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    try:
        os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except BaseException:
        os.rename(old, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        raise
    return old


def discard(parent_fd: int, name: str, raise_interrupt: bool = False) -> bool:
    """Remove ``name`` in ``parent_fd`` (a tree, never following symlinks), best effort:
    False if something is left. Directories a listing made read-only are opened up first
    when the plain removal fails."""
    try:
        if not exists_at(parent_fd, name):
            return True
        if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=parent_fd)
            return True
        try:
            shutil.rmtree(name, dir_fd=parent_fd)
            return True
        except OSError:
            pass
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent_fd)
        try:
            os.fchmod(fd, 0o700)
            for _, subdirs, _, dfd in os.fwalk(".", dir_fd=fd):
                for d in subdirs:
                    os.chmod(d, 0o700, dir_fd=dfd)
        finally:
            os.close(fd)
        shutil.rmtree(name, dir_fd=parent_fd)
        return True
    except Interrupted:
        if raise_interrupt:
            raise
        return False
    except (OSError, KeyboardInterrupt):
        return False
