"""The POSIX surface of a mounted mountfs, as a user of a local disk expects it."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import random
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
AT_FDCWD = -100


def renameat2(old, new, flags) -> None:
    if libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def raises_errno(code, fn, *args, **kw):
    with pytest.raises(OSError) as info:
        fn(*args, **kw)
    assert info.value.errno == code, info.value


# ---- files: data --------------------------------------------------------------------------

def test_write_read_overwrite_append_and_eof(mounted):
    f = mounted.mnt / "f"
    f.write_bytes(b"hello world")
    with open(f, "r+b") as h:
        h.seek(6)
        h.write(b"WORLD")
    assert f.read_bytes() == b"hello WORLD"
    with open(f, "ab") as h:
        h.write(b"!")
    with open(f, "rb") as h:
        h.seek(100)
        assert h.read(10) == b""                           # past EOF
        h.seek(0)
        assert h.read() == b"hello WORLD!"
    assert f.stat().st_size == 12
    fd = os.open(f, os.O_WRONLY | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"?")                                 # O_APPEND ignores the offset
    finally:
        os.close(fd)
    fd = os.open(f, os.O_RDONLY)
    try:
        assert os.pread(fd, 100, 10) == b"D!?"             # a read that crosses EOF is short
    finally:
        os.close(fd)


def test_no_file_grows_past_the_stores_maximum_size(make_mount):
    """A file ends at the store's last chunk index (2**52 bytes with 4 KiB chunks): a write
    or truncation past it is EFBIG, one that crosses it is cut short, and a file at the
    limit stays valid (fsck at cleanup; a mirror would refuse one chunk further)."""
    m = make_mount(chunk_size="4K")
    limit = 1 << 52
    f = m.mnt / "huge"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert os.pwrite(fd, b"x", limit - 1) == 1
        raises_errno(errno.EFBIG, os.pwrite, fd, b"y", limit)
        raises_errno(errno.EFBIG, os.pwrite, fd, b"y", 1 << 62)
        assert os.pwrite(fd, b"ab", limit - 2) == 2
        assert os.pwrite(fd, b"cde", limit - 2) == 2             # cut at the limit
        assert os.pread(fd, 4, limit - 3) == b"\0cd"
        raises_errno(errno.EFBIG, os.ftruncate, fd, limit + 1)
    finally:
        os.close(fd)
    assert f.stat().st_size == limit
    raises_errno(errno.EFBIG, os.truncate, f, limit + 1)
    raises_errno(errno.EFBIG, os.truncate, f, 1 << 62)
    os.truncate(f, limit)
    assert f.stat().st_size == limit


TRUNCATE_SIZES = [0, 1, 4095, 4096, 4097, 65535, 65536, 65537, 3 * 65536 + 7]


def test_truncate_down_and_up_across_chunks(make_mount):
    """os.truncate down to sizes in, at and across 64 KiB chunk boundaries, then ftruncate
    up again: the kept part is intact and the grown part reads as zeros, also remounted."""
    m = make_mount(chunk_size="64K")
    data = os.urandom(4 * 65536 + 123)
    expected = {}
    for size in TRUNCATE_SIZES:
        f = m.mnt / f"t{size}"
        f.write_bytes(data)
        os.truncate(f, size)
        assert f.read_bytes() == data[:size] and f.stat().st_size == size
        with open(f, "r+b") as h:
            h.truncate(size + 70000)                       # ftruncate: grows with zeros
        expected[f] = data[:size] + bytes(70000)
        assert f.read_bytes() == expected[f]
    m.umount()
    m.mount()                                              # and it is all in the store
    for f, want in expected.items():
        assert f.read_bytes() == want, f


def test_ftruncate_of_unflushed_writes_never_brings_old_bytes_back(make_mount):
    """Truncating while writes are still buffered, then growing again, reads zeros where
    the cut data was: in the open file, after close and after a remount."""
    m = make_mount(chunk_size="64K")
    f = m.mnt / "t"
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"\xff" * 150_000)                 # three chunks, still in the buffer
        os.ftruncate(fd, 70_000)                         # inside the second chunk
        os.ftruncate(fd, 140_000)
        os.pwrite(fd, b"end", 200_000)
        expected = b"\xff" * 70_000 + bytes(130_000) + b"end"
        assert os.pread(fd, 300_000, 0) == expected
        assert os.fstat(fd).st_size == 200_003
    finally:
        os.close(fd)
    assert f.read_bytes() == expected
    m.umount()
    m.mount()
    assert f.read_bytes() == expected


def test_small_writes_over_stored_chunks_are_read_back_exactly(make_mount):
    """Small writes into chunks already stored are buffered without reading the chunk; what
    reads, a second handle, a commit and a remount see is the stored data with the writes
    laid over it (checked against a model, with reads between the writes). Each check
    opens the file anew: a reader fd kept open across another fd's writes can read stale
    pages from the kernel's cache, on the do-nothing pyfuse3 filesystem too (kernel FUSE
    without the writeback cache), which is not what this test is about."""
    m = make_mount(chunk_size="64K")
    rng = random.Random(7)
    model = bytearray(os.urandom(5 * 65536 + 1234))
    (m.mnt / "f").write_bytes(model)
    with open(m.mnt / "f", "r+b", buffering=0) as h:
        for step in range(400):
            off = rng.randrange(len(model) + 5000)
            data = os.urandom(rng.choice((1, 100, 4096, 70_000)))
            h.seek(off)
            h.write(data)
            if off > len(model):
                model.extend(bytes(off - len(model)))
            model[off:off + len(data)] = data
            if step % 37 == 0:                      # read back mid-way: merges some chunks
                at = rng.randrange(len(model))
                with open(m.mnt / "f", "rb") as r:  # a fresh open: see the test's note
                    r.seek(at)
                    assert r.read(80_000) == bytes(model[at:at + 80_000]), step
        assert h.seek(0) == 0 and h.read() == bytes(model)
    assert (m.mnt / "f").read_bytes() == bytes(model)
    m.umount()
    m.mount()
    assert (m.mnt / "f").read_bytes() == bytes(model)


def test_file_capabilities_are_kept_and_dropped_by_a_write_like_a_local_disk(mounted,
                                                                            tmp_path):
    """The mount remembers which files have no security.capability (the kernel asks before
    every write); a capability set later must still be seen, and a write must drop it as on
    a local disk."""
    cap = struct.pack("<IIIII", 0x02000000, 1 << 10, 0, 0, 0)    # cap_net_bind_service=p
    seen = {}
    for root in (tmp_path / "local", mounted.mnt):
        root.mkdir(exist_ok=True)
        f = root / "tool"
        with open(f, "wb") as h:
            h.write(b"one")                           # the mount learns "no capability"
        os.setxattr(f, "security.capability", cap)
        kept = os.getxattr(f, "security.capability")
        with open(f, "ab") as h:
            h.write(b"two")                           # a write drops the capability
        try:
            after = os.getxattr(f, "security.capability")
        except OSError as e:
            after = e.errno
        seen[root] = (kept, after)
    assert seen[mounted.mnt] == seen[tmp_path / "local"]
    assert seen[mounted.mnt][0] == cap


def test_open_with_o_trunc_and_o_excl(mounted):
    f = mounted.mnt / "f"
    f.write_bytes(os.urandom(3 << 20))
    fd = os.open(f, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"new")
    os.close(fd)
    assert f.read_bytes() == b"new"
    raises_errno(errno.EEXIST, os.open, f, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with open(f, "w"):                                   # the shell's '>'
        pass
    assert f.read_bytes() == b"" and f.stat().st_size == 0


def test_one_write_larger_than_a_chunk(make_mount):
    m = make_mount(chunk_size="64K")
    data = os.urandom(5 * 65536 + 333)
    fd = os.open(m.mnt / "w", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert os.pwrite(fd, data, 1000) == len(data)   # unaligned, spans six chunks
        patch = os.urandom(3 * 65536)
        assert os.pwrite(fd, patch, 65536 - 10) == len(patch)
        os.fsync(fd)
    finally:
        os.close(fd)
    expected = bytearray(bytes(1000) + data)
    expected[65536 - 10:65536 - 10 + len(patch)] = patch
    assert (m.mnt / "w").read_bytes() == expected


def test_sparse_file_with_holes(make_mount):
    m = make_mount(chunk_size="64K")
    f = m.mnt / "sparse"
    with open(f, "wb") as h:
        h.write(b"head")
        h.seek(10 * 65536 + 5)
        h.write(b"middle")
        h.seek(100 * 65536)
        h.write(b"tail")
    data = f.read_bytes()
    assert len(data) == 100 * 65536 + 4 == f.stat().st_size
    assert data[:4] == b"head" and data[10 * 65536 + 5:10 * 65536 + 11] == b"middle"
    assert data[4:10 * 65536 + 5] == bytes(10 * 65536 + 1) and data.endswith(b"tail")


def test_large_file_round_trip_and_unaligned_io(mounted):
    f = mounted.mnt / "big"
    data = os.urandom(50 << 20)
    with open(f, "wb") as h:
        for off in range(0, len(data), 300_001):          # writes that straddle chunks
            h.write(data[off:off + 300_001])
        h.flush()
        os.fsync(h.fileno())
    assert hashlib.sha256(f.read_bytes()).digest() == hashlib.sha256(data).digest()
    with open(f, "rb") as h:
        h.seek(12_345_678)
        assert h.read(2_000_000) == data[12_345_678:14_345_678]


def store_use(mnt: Path) -> int:
    """Bytes the store occupies, from statfs (total - free, where free is the disk's free
    space plus the store's own free pages)."""
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_unlinked_open_file_stays_usable_until_closed(mounted):
    f = mounted.mnt / "ghost"
    data = os.urandom(24 << 20)
    os.sync()
    empty = store_use(mounted.mnt)
    with open(f, "w+b") as h:
        h.write(data)
        h.flush()
        os.fsync(h.fileno())
        os.unlink(f)
        assert not f.exists() and os.listdir(mounted.mnt) == []
        assert os.fstat(h.fileno()).st_nlink == 0
        h.write(b"more")
        h.seek(0, os.SEEK_END)
        assert h.tell() == len(data) + 4
        h.seek(0)
        assert h.read() == data + b"more"
        os.fsync(h.fileno())
        assert store_use(mounted.mnt) > empty + (20 << 20)   # still held while open
    deadline = time.monotonic() + 60
    while store_use(mounted.mnt) > empty + (8 << 20):     # reclaimed once closed
        assert time.monotonic() < deadline, "an unlinked file's space never came back"
        time.sleep(0.2)


# ---- attributes ---------------------------------------------------------------------------

def test_getattr_fields_and_nanosecond_times(mounted):
    f = mounted.mnt / "a"
    f.write_text("x")
    st = f.stat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert (st.st_uid, st.st_gid, st.st_nlink, st.st_size) == (0, 0, 1, 1)
    assert st.st_blocks * 512 >= st.st_size and st.st_ino != os.stat(mounted.mnt).st_ino
    os.utime(f, ns=(1_000_000_001, 2_000_000_002))
    st = f.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_001, 2_000_000_002)
    f.write_text("changed")
    assert f.stat().st_mtime_ns > 2_000_000_002


def ctime_moves(path, action, moved_to=None) -> None:
    """``action`` must raise ``path``'s ctime and leave its mtime alone (as on a local disk);
    ``moved_to`` is where a rename puts it."""
    before = os.lstat(path)
    time.sleep(0.002)                                # let the clock tick past ``before``
    action()
    after = os.lstat(moved_to or path)
    assert after.st_ino == before.st_ino
    assert after.st_ctime_ns > before.st_ctime_ns, action
    assert after.st_mtime_ns == before.st_mtime_ns, action


def test_ctime_changes_on_chmod_chown_rename_link_and_xattrs(mounted):
    m = mounted.mnt
    (m / "d").mkdir()
    f = m / "f"
    f.write_text("x")
    os.utime(f, ns=(5, 7))
    ctime_moves(f, lambda: os.chmod(f, 0o600))
    ctime_moves(f, lambda: os.chown(f, 1234, 5678))
    ctime_moves(f, lambda: os.link(f, m / "g"))
    ctime_moves(f, lambda: os.unlink(m / "g"))
    ctime_moves(f, lambda: os.setxattr(f, "user.k", b"v"))
    ctime_moves(m / "d", lambda: os.rename(m / "d", m / "e"), m / "e")
    ctime_moves(f, lambda: os.rename(f, m / "e/f"), m / "e/f")
    st = os.stat(m / "e/f")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == \
        (0o600, 1234, 5678, 7)


def test_directory_mtime_follows_its_entries(mounted):
    d = mounted.mnt / "d"
    d.mkdir()
    os.utime(d, ns=(1, 1))
    for change in (lambda: (d / "f").touch(), lambda: os.rename(d / "f", d / "g"),
                   lambda: os.unlink(d / "g"), lambda: os.mkdir(d / "s"),
                   lambda: os.rmdir(d / "s")):
        os.utime(d, ns=(1, 1))
        change()
        assert os.stat(d).st_mtime_ns > 1, change


def mode_story(root: Path) -> list:
    """chmod and chown as root, with set-id bits: what a local disk shows at each step."""
    f = root / "f"
    f.write_text("x")
    seen = []
    for mode in (0o4751, 0o2755, 0o6711, 0o1644, 0o0):
        os.chmod(f, mode)
        seen.append(oct(os.stat(f).st_mode))
        os.chown(f, 1234, 5678)                    # root changing owners drops set-id bits
        seen.append((oct(os.stat(f).st_mode), os.stat(f).st_uid, os.stat(f).st_gid))
        os.chown(f, 0, 0)
    (root / "d").mkdir(mode=0o700)
    os.chmod(root / "d", 0o3775)
    os.chown(root / "d", 99, 98)                   # directories keep theirs
    seen.append(oct(os.stat(root / "d").st_mode))
    return seen


def test_chmod_chown_behave_like_a_local_disk(mounted, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    expected = mode_story(local)
    assert expected[0] == oct(stat.S_IFREG | 0o4751)          # the story itself is meaningful
    assert mode_story(mounted.mnt) == expected


def test_statfs_has_real_figures(mounted):
    before = os.statvfs(mounted.mnt)
    assert before.f_bsize > 0 and before.f_blocks > 0 and before.f_bfree <= before.f_blocks
    assert before.f_namemax == 255
    with open(mounted.mnt / "fill", "wb") as f:
        f.write(os.urandom(8 << 20))
        os.fsync(f.fileno())    # commits it: a sync(2) does not reach a FUSE filesystem
    after = os.statvfs(mounted.mnt)
    assert after.f_bfree * after.f_frsize < before.f_bfree * before.f_frsize


# ---- directories and names ----------------------------------------------------------------

def put(path: Path, text: str) -> None:
    path.write_text(text)


NAME_STEPS = [    # (what, the outcome POSIX and a local disk give, the step on a root r)
    ("mkdir", "ok", lambda r: os.mkdir(r / "d")),
    ("mkdir existing", "EEXIST", lambda r: os.mkdir(r / "d")),
    ("file in d", "ok", lambda r: put(r / "d/f", "f")),
    ("rmdir non-empty", "ENOTEMPTY", lambda r: os.rmdir(r / "d")),
    ("rmdir a file", "ENOTDIR", lambda r: os.rmdir(r / "d/f")),
    ("rmdir missing", "ENOENT", lambda r: os.rmdir(r / "nope")),
    ("mkdir under a file", "ENOTDIR", lambda r: os.mkdir(r / "d/f/sub")),
    ("unlink a dir", "EISDIR", lambda r: os.unlink(r / "d")),
    ("unlink missing", "ENOENT", lambda r: os.unlink(r / "nope")),
    ("name too long", "ENAMETOOLONG", lambda r: os.mkdir(r / ("n" * 256))),
    ("open a dir for writing", "EISDIR", lambda r: open(r / "d", "w")),
    ("a, b", "ok", lambda r: (put(r / "a", "A"), put(r / "b", "B"))),
    ("file over file", "ok", lambda r: os.rename(r / "a", r / "b")),
    ("rename a file", "ok", lambda r: os.rename(r / "b", r / "d/b")),
    ("rename a dir", "ok", lambda r: os.rename(r / "d", r / "dir")),
    ("empty", "ok", lambda r: os.mkdir(r / "empty")),
    ("dir over empty dir", "ok", lambda r: os.rename(r / "dir", r / "empty")),
    ("full", "ok", lambda r: (os.mkdir(r / "full"), put(r / "full/x", "x"))),
    ("dir over non-empty dir", "ENOTEMPTY", lambda r: os.rename(r / "empty", r / "full")),
    ("file over dir", "EISDIR", lambda r: os.rename(r / "empty/b", r / "full")),
    ("dir over file", "ENOTDIR", lambda r: os.rename(r / "full", r / "empty/b")),
    ("dir into itself", "EINVAL", lambda r: os.rename(r / "empty", r / "empty/sub")),
    ("missing source", "ENOENT", lambda r: os.rename(r / "nope", r / "x")),
    ("onto itself", "ok", lambda r: os.rename(r / "full/x", r / "full/x")),
    ("twin link", "ok", lambda r: os.link(r / "full/x", r / "twin")),
    ("onto its own hard link", "ok", lambda r: os.rename(r / "twin", r / "full/x")),
    ("noreplace, taken", "EEXIST",
     lambda r: renameat2(r / "empty/b", r / "full/x", RENAME_NOREPLACE)),
    ("noreplace, free", "ok", lambda r: renameat2(r / "empty/b", r / "c", RENAME_NOREPLACE)),
    ("exchange with nothing", "ENOENT", lambda r: renameat2(r / "c", r / "zz", RENAME_EXCHANGE)),
    ("exchange two files", "ok", lambda r: renameat2(r / "c", r / "twin", RENAME_EXCHANGE)),
    ("exchange dir and file", "ok", lambda r: renameat2(r / "full", r / "c", RENAME_EXCHANGE)),
    ("exchange into own child", "EINVAL",
     lambda r: renameat2(r / "empty", r / "empty/f", RENAME_EXCHANGE)),
    ("subdirs", "ok", lambda r: (os.mkdir(r / "empty/s1"), os.mkdir(r / "empty/s2"))),
    ("dir across parents", "ok", lambda r: os.rename(r / "empty/s2", r / "c/s2")),
    ("hard link a dir", "EPERM", lambda r: os.link(r / "empty", r / "dirlink")),
    ("link onto a name", "EEXIST", lambda r: os.link(r / "twin", r / "c/x")),
    ("link under a file", "ENOTDIR", lambda r: os.link(r / "twin", r / "full/x/y")),
    ("symlink onto a name", "EEXIST", lambda r: os.symlink("t", r / "twin")),
    ("readlink of a file", "EINVAL", lambda r: os.readlink(r / "twin")),
    ("rmdir .", "EINVAL", lambda r: os.rmdir(f"{r}/empty/.")),   # (pathlib drops a '.')
]


def outcome_of(fn, root) -> str:
    try:
        fn(root)
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]


def tree(root: Path) -> list:
    """Every path below ``root`` with its type, link count and (for files) content."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            st = os.lstat(p)
            text = p.read_text() if stat.S_ISREG(st.st_mode) else None
            out.append((str(p.relative_to(root)), stat.S_IFMT(st.st_mode), st.st_nlink, text))
    return sorted(out) + [("<root nlink>", os.stat(root).st_nlink)]


def test_name_operations_and_their_errors_match_a_local_disk(mounted, tmp_path):
    """Each step's outcome is what POSIX says, and the same as on a local directory; so is
    the resulting tree."""
    trees = []
    for root in (tmp_path / "local", mounted.mnt / "t"):
        root.mkdir()
        got = [(what, outcome_of(fn, root)) for what, _, fn in NAME_STEPS]
        assert got == [(what, want) for what, want, _ in NAME_STEPS], root
        trees.append(tree(root))
    assert trees[1] == trees[0]
    for entry in (("c/x", stat.S_IFREG, 2, "x"), ("full", stat.S_IFREG, 2, "x"),
                  ("twin", stat.S_IFREG, 1, "A"), ("empty/f", stat.S_IFREG, 1, "f"),
                  ("empty", stat.S_IFDIR, 3, None), ("c", stat.S_IFDIR, 3, None)):
        assert entry in trees[1]                            # the swaps and moves landed


def test_hard_links(mounted):
    m = mounted.mnt
    (m / "d").mkdir()
    (m / "orig").write_text("shared")
    os.link(m / "orig", m / "d/link")
    assert os.stat(m / "orig").st_nlink == 2
    assert os.stat(m / "orig").st_ino == os.stat(m / "d/link").st_ino
    (m / "d/link").write_text("through the link")
    assert (m / "orig").read_text() == "through the link"
    os.unlink(m / "orig")
    assert os.stat(m / "d/link").st_nlink == 1
    assert (m / "d/link").read_text() == "through the link"
    raises_errno(errno.EPERM, os.link, m / "d", m / "dirlink")
    raises_errno(errno.EEXIST, os.link, m / "d/link", m / "d/link")


def test_symlinks_fifos_and_devices(mounted):
    m = mounted.mnt
    (m / "target").write_text("t")
    os.symlink("target", m / "ln")
    os.symlink("dangling/nowhere", m / "bad")
    assert os.readlink(m / "ln") == "target" and (m / "ln").read_text() == "t"
    assert stat.S_ISLNK(os.lstat(m / "ln").st_mode) and stat.S_ISREG(os.stat(m / "ln").st_mode)
    assert os.lstat(m / "ln").st_size == len("target")
    raises_errno(errno.ENOENT, os.stat, m / "bad")
    os.mkfifo(m / "fifo", 0o600)
    assert stat.S_ISFIFO(os.stat(m / "fifo").st_mode)
    writer = subprocess.Popen(["sh", "-c", f"echo through the pipe > '{m}/fifo'"])
    assert (m / "fifo").read_text() == "through the pipe\n"
    assert writer.wait(timeout=30) == 0
    os.mknod(m / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    st = os.stat(m / "null")
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) == 3
    assert os.statvfs(m).f_flag & os.ST_NODEV            # FUSE's safe default: nodev, so
    raises_errno(errno.EACCES, open, m / "null", "wb")    # the node is stored, not usable


def test_big_directory_listing_is_complete_and_stable(mounted):
    d = mounted.mnt / "many"
    d.mkdir()
    names = {f"file-{i:05d}" for i in range(2000)}
    for n in names:
        (d / n).touch()
    assert set(os.listdir(d)) == names and len(os.listdir(d)) == 2000
    with os.scandir(d) as it:                              # changes while reading
        seen = []
        for i, e in enumerate(it):
            seen.append(e.name)
            if i == 10:
                (d / "added-late").touch()
                os.unlink(d / "file-01999")
    assert len(seen) == len(set(seen)) and names - {"file-01999"} <= set(seen)


def test_listing_while_another_process_adds_and_removes(mounted):
    """Directories listed while another process churns them: every listing has each stable
    name once, nothing is duplicated, and the mount stays up."""
    d = mounted.mnt / "busy"
    d.mkdir()
    stable = {f"keep-{i:04d}" for i in range(200)}
    for n in stable:
        (d / n).touch()
    churn = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "d = sys.argv[1]\n"
        "for i in range(300):\n"
        "    open(f'{d}/tmp-{i}', 'w').close()\n"
        "    if i >= 20: os.unlink(f'{d}/tmp-{i - 20}')\n"), str(d)])
    listings = 0
    while churn.poll() is None or listings < 5:
        seen = os.listdir(d)
        assert len(seen) == len(set(seen)) and stable <= set(seen)
        listings += 1
    assert churn.returncode == 0
    assert set(os.listdir(d)) == stable | {f"tmp-{i}" for i in range(280, 300)}


# ---- extended attributes ------------------------------------------------------------------

def test_xattrs_on_files_and_directories(mounted):
    m = mounted.mnt
    (m / "f").write_text("x")
    (m / "d").mkdir()
    big = os.urandom(65536)                              # the kernel's largest value
    for p in (m / "f", m / "d"):
        os.setxattr(p, "user.small", b"v")
        os.setxattr(p, "user.big", big)
        assert os.getxattr(p, "user.big") == big
        assert sorted(os.listxattr(p)) == ["user.big", "user.small"]
        raises_errno(errno.EEXIST, os.setxattr, p, "user.small", b"w", os.XATTR_CREATE)
        raises_errno(errno.ENODATA, os.setxattr, p, "user.none", b"w", os.XATTR_REPLACE)
        os.setxattr(p, "user.small", b"w", os.XATTR_REPLACE)
        assert os.getxattr(p, "user.small") == b"w"
        os.removexattr(p, "user.small")
        raises_errno(errno.ENODATA, os.getxattr, p, "user.small")
        raises_errno(errno.ENODATA, os.removexattr, p, "user.small")
        raises_errno(errno.E2BIG, os.setxattr, p, "user.huge", big + b"!")
        raises_errno(errno.ERANGE, os.setxattr, p, "user." + "n" * 300, b"v")
        os.setxattr(p, "trusted.root", b"")               # root's namespace, an empty value
        assert os.getxattr(p, "trusted.root") == b""
        assert sorted(os.listxattr(p)) == ["trusted.root", "user.big"]
    os.symlink("f", m / "ln")                             # user.* is for files and dirs only
    raises_errno(errno.EPERM, os.setxattr, m / "ln", "user.k", b"v", follow_symlinks=False)
    assert os.getxattr(m / "ln", "user.big") == big       # through the link: f's


# ---- mounts -------------------------------------------------------------------------------

def test_everything_survives_a_remount(mounted):
    m = mounted.mnt
    (m / "dir").mkdir(mode=0o750)
    (m / "dir/f").write_bytes(b"data" * 1000)
    os.utime(m / "dir/f", ns=(5, 6_000_000_007))
    os.symlink("dir/f", m / "ln")
    os.link(m / "dir/f", m / "hard")
    os.setxattr(m / "dir", "user.k", b"v")
    data = os.urandom(3 << 20)
    with open(m / "sparse", "wb") as h:
        h.write(data)
        h.seek(10 << 20)
        h.write(data[:1000])
    before = {p: os.lstat(m / p) for p in ("dir", "dir/f", "ln", "hard", "sparse")}
    mounted.umount()
    mounted.mount()
    for p, st in before.items():
        now = os.lstat(m / p)
        fields = ("st_mode", "st_size", "st_nlink", "st_uid", "st_gid", "st_ino",
                  "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
        assert [getattr(now, k) for k in fields] == [getattr(st, k) for k in fields], p
    assert os.getxattr(m / "dir", "user.k") == b"v" and os.readlink(m / "ln") == "dir/f"
    with open(m / "sparse", "rb") as h:                   # seek + read, in any order
        for off, n in ((10 << 20, 2000), (123_457, 2_000_000), (3 << 20, 5000), (0, 10)):
            h.seek(off)
            want = (data + bytes((10 << 20) - len(data)) + data[:1000])[off:off + n]
            assert h.read(n) == want, off


def test_read_only_mount_refuses_every_write(make_mount):
    m = make_mount()
    (m.mnt / "f").write_text("x")
    m.umount()
    m.extra = ["--read-only"]
    m.mount()
    assert (m.mnt / "f").read_text() == "x"
    for op in (lambda: (m.mnt / "g").write_text("y"), lambda: os.mkdir(m.mnt / "d"),
               lambda: os.unlink(m.mnt / "f"), lambda: os.chmod(m.mnt / "f", 0o600),
               lambda: os.setxattr(m.mnt / "f", "user.a", b"b"),
               lambda: open(m.mnt / "f", "ab"), lambda: os.truncate(m.mnt / "f", 0),
               lambda: os.rename(m.mnt / "f", m.mnt / "g"), lambda: os.link(m.mnt / "f", m.mnt / "g"),
               lambda: os.symlink("f", m.mnt / "s"), lambda: os.utime(m.mnt / "f", ns=(1, 1)),
               lambda: os.mkfifo(m.mnt / "p")):
        raises_errno(errno.EROFS, op)
    res = m.snapctl("create", "s", check=False)
    assert res.returncode != 0 and "read-only" in res.stderr


WRITER = """
import os, sys
path, seed = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
for i in range(40):
    os.write(fd, bytes([(seed * 40 + i) % 251]) * 65536)
    if i % 10 == 9:
        os.fsync(fd)
os.close(fd)
"""


def test_concurrent_writers_with_fsync(mounted):
    """Four processes write and fsync their own files at once; each file has exactly its
    writer's bytes."""
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(mounted.mnt / f"w{n}"), str(n)])
             for n in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    for n in range(4):
        want = b"".join(bytes([(n * 40 + i) % 251]) * 65536 for i in range(40))
        assert (mounted.mnt / f"w{n}").read_bytes() == want, n


def test_fsynced_data_survives_a_killed_mount(mounted):
    """What fsync (file and directory) returned for is in the store, even if the mount
    process dies right after."""
    m = mounted.mnt
    data = os.urandom(2 << 20)
    (m / "d").mkdir()
    fd = os.open(m / "d/f", os.O_WRONLY | os.O_CREAT, 0o644)
    dfd = os.open(m / "d", os.O_RDONLY | os.O_DIRECTORY)
    os.write(fd, data)
    os.fsync(fd)
    os.fsync(dfd)
    mounted.kill9()                                      # the file is still open: no close
    for leftover in (fd, dfd):
        try:
            os.close(leftover)
        except OSError:
            pass                                         # the mount is gone
    mounted.mount()
    assert (m / "d/f").read_bytes() == data


# ---- names longer than NAME_MAX ----------------------------------------------------------

def _too_long_calls(d: Path):
    """Every name-taking call on a 256-byte name below ``d``, with its arguments."""
    long = d / ("n" * 256)
    return [("stat", os.stat, (long,)), ("chmod", os.chmod, (long, 0o644)),
            ("chown", os.chown, (long, os.getuid(), os.getgid())),
            ("truncate", os.truncate, (long, 0)), ("unlink", os.unlink, (long,)),
            ("rmdir", os.rmdir, (long,)), ("rename from", os.rename, (long, d / "x")),
            ("rename to", os.rename, (d / "x", long)), ("link from", os.link, (long, d / "y")),
            ("link to", os.link, (d / "x", long)), ("open", os.open, (long, os.O_RDONLY)),
            ("create", os.open, (long, os.O_CREAT | os.O_WRONLY, 0o644)),
            ("mkdir", os.mkdir, (long,)), ("symlink", os.symlink, ("x", long)),
            ("mknod", os.mkfifo, (long,)), ("lstat", os.lstat, (long,))]


def test_names_longer_than_255_bytes_are_enametoolong_like_a_local_disk(mounted, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    for d in (local, mounted.mnt):
        (d / "x").write_text("x")
    for (what, fn, args), (_, local_fn, local_args) in zip(_too_long_calls(mounted.mnt),
                                                           _too_long_calls(local)):
        with pytest.raises(OSError) as here:
            fn(*args)
        with pytest.raises(OSError) as there:
            local_fn(*local_args)
        assert there.value.errno == errno.ENAMETOOLONG, what
        assert (what, here.value.errno) == (what, there.value.errno)
    assert os.listdir(mounted.mnt) == ["x"]
    ok = mounted.mnt / ("n" * 255)                         # the limit itself is fine
    ok.write_text("fits")
    assert ok.read_text() == "fits"
