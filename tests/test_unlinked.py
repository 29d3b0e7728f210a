"""An unlinked file the kernel still holds stays whole: reached through an O_PATH descriptor,
or opened by a reader racing the unlink (a file deleted by its unlink step while the kernel
held it failed both)."""

from __future__ import annotations

import os
import threading


def test_reopen_unlinked_file_through_o_path_fd(mounted):
    """On any local filesystem an O_PATH fd keeps an unlinked file reachable: fstat works
    (nlink 0) and /proc/self/fd/N reopens it with its data."""
    f = mounted.mnt / "f"
    f.write_bytes(b"hello" * 1000)
    fd = os.open(f, os.O_PATH)
    try:
        os.unlink(f)
        assert os.fstat(fd).st_nlink == 0
        fd2 = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        try:
            assert os.read(fd2, 10) == b"hellohello"
        finally:
            os.close(fd2)
    finally:
        os.close(fd)


def test_open_racing_unlink_never_reads_zeros(mounted):
    """An open that succeeds while an unlink of the same name is in flight must see the
    file's data (POSIX: the file lives until its last descriptor closes)."""
    data = b"D" * 8192
    bad = []
    for i in range(1000):
        p = mounted.mnt / f"f{i}"
        p.write_bytes(data)
        go, stop = threading.Event(), threading.Event()

        def reader():
            go.set()
            while not stop.is_set():
                try:
                    fd = os.open(p, os.O_RDONLY)
                except FileNotFoundError:
                    return
                try:
                    got = os.pread(fd, len(data), 0)
                except OSError as e:
                    got = f"error {e}".encode()
                finally:
                    os.close(fd)
                if got != data:
                    bad.append((i, got[:16], len(got)))
                    return
        t = threading.Thread(target=reader)
        t.start()
        go.wait()
        os.unlink(p)
        stop.set()
        t.join()
        if bad:
            break
    assert not bad, f"opened during unlink, read {bad}"
