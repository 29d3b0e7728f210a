"""The benchmarks' second floor, scripts/durable_floor.py: its figures claim to be the least
durability costs in this stack, so it must keep what it answered. Read back from its store
after an unmount, the tree is the one made through it; an fsync that returned is in the
store even when the floor and its writer are killed with SIGKILL right after."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "durable_floor.py"
_U64 = struct.Struct(">Q")
_MODE = struct.Struct("<I")      # in an inode record, after the inode number


class DurableFloor:
    def __init__(self, tmp_path: Path):
        self.mnt, self.store = tmp_path / "mnt", tmp_path / "store"
        self.mnt.mkdir()
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(self.mnt),
                                      str(self.store)], start_new_session=True,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mnt):
            assert self.proc.poll() is None, self.proc.stderr.read().decode()
            assert time.monotonic() < deadline, "durable_floor.py did not mount"
            time.sleep(0.02)

    def umount(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=True)
        assert self.proc.wait(timeout=60) == 0, self.proc.stderr.read().decode()

    def kill9(self) -> None:
        """The floor and its writer (its session) at once, then the dead mount detached."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        subprocess.run(["fusermount3", "-uz", str(self.mnt)], check=False)

    def tree(self) -> dict[str, bytes | None]:
        """The store read back: each path -> its data (None: a directory)."""
        env = lmdb.open(str(self.store), readonly=True, lock=False)
        with env.begin() as txn:
            items = {bytes(k): bytes(v) for k, v in txn.cursor()}
        env.close()
        children: dict[int, dict[bytes, int]] = {}
        for key, value in items.items():
            if key[:1] == b"d":
                children.setdefault(_U64.unpack(key[1:9])[0], {})[key[9:]] = \
                    _U64.unpack(value)[0]

        def data(ino: int) -> bytes:
            out, index = b"", 0
            while (chunk := items.get(b"c" + _U64.pack(ino) + _U64.pack(index))) is not None:
                out, index = out + chunk, index + 1
            return out
        out = {}

        def walk(ino: int, path: str) -> None:
            for name, child in children.get(ino, {}).items():
                sub = f"{path}/{name.decode()}".lstrip("/")
                if stat.S_ISDIR(_MODE.unpack_from(items[b"i" + _U64.pack(child)], 8)[0]):
                    out[sub] = None
                    walk(child, sub)
                else:
                    out[sub] = data(child)
        walk(1, "")
        return out


@pytest.fixture
def floor(tmp_path):
    f = DurableFloor(tmp_path)
    yield f
    if f.proc.poll() is None:
        f.kill9()


@pytest.mark.fuse
def test_the_durable_floor_stores_the_tree_made_through_it(floor):
    mnt = floor.mnt
    (mnt / "d").mkdir()
    (mnt / "d" / "sub").mkdir()
    (mnt / "d" / "a").write_bytes(b"alpha")
    (mnt / "d" / "gone").write_bytes(b"x")
    (mnt / "big").write_bytes(os.urandom(3 << 20))
    big = (mnt / "big").read_bytes()
    (mnt / "d" / "a").rename(mnt / "d" / "sub" / "b")
    (mnt / "d" / "gone").unlink()
    (mnt / "short").write_bytes(os.urandom(2 << 20))
    (mnt / "short").write_bytes(b"now short")        # O_TRUNC: its old chunks go

    floor.umount()

    assert floor.tree() == {"d": None, "d/sub": None, "d/sub/b": b"alpha", "big": big,
                            "short": b"now short"}


@pytest.mark.fuse
def test_an_fsync_that_returned_survives_a_kill9_of_the_floor_and_its_writer(floor):
    data = os.urandom(1 << 20)
    fd = os.open(floor.mnt / "kept", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, data)
    os.close(fd)                                      # the close sends it; the fsync waits
    fd = os.open(floor.mnt / "kept", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)

    floor.kill9()

    assert floor.tree() == {"kept": data}


@pytest.mark.fuse
def test_an_fsync_of_a_file_still_open_keeps_its_data_through_a_kill9(floor):
    """As a database or fio's --end_fsync does: write, fsync, and only then close."""
    data = os.urandom((1 << 20) + 4096)
    fd = os.open(floor.mnt / "open", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        floor.kill9()
    finally:
        with contextlib.suppress(OSError):      # its filesystem is gone
            os.close(fd)

    assert floor.tree() == {"open": data}


@pytest.mark.fuse
def test_with_its_writer_gone_the_floors_fsync_fails_instead_of_lying_or_hanging(floor):
    writer = subprocess.run(["pgrep", "-f", "-s", str(floor.proc.pid), "floor_writer.py"],
                            capture_output=True, text=True, check=True).stdout.split()
    os.kill(int(writer[0]), signal.SIGKILL)
    (floor.mnt / "late").write_bytes(b"kept in memory only")
    fd = os.open(floor.mnt / "late", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as failed:
            os.fsync(fd)
    finally:
        os.close(fd)

    assert failed.value.errno == errno.EIO
    assert (floor.mnt / "late").read_bytes() == b"kept in memory only"
    floor.umount()
    assert b"its writer process is gone" in floor.proc.stderr.read()


@pytest.mark.parametrize("script", ["nullfs.py", "durable_floor.py"])
def test_a_floor_given_no_mountpoint_says_so_in_one_line(tmp_path, script):
    missing = tmp_path / "not-made"
    args = [str(missing)] + ([str(tmp_path / "store")] if script == "durable_floor.py" else [])
    run = subprocess.run([sys.executable, str(REPO / "scripts" / script), *args],
                         capture_output=True, text=True, timeout=60)

    assert run.returncode != 0
    assert run.stderr.splitlines() == [f"{script}: {missing} is not a directory: make it "
                                       f"first (mkdir -p {missing})"]


@pytest.mark.fuse
@pytest.mark.parametrize("discard", [False, True])
def test_the_floor_keeps_or_discards_what_is_written(tmp_path, discard):
    """``bench_io.py --floor-discard`` measures a floor that carries the data through FUSE
    and keeps none of it (reads give zeros, sizes are kept); without it the floor keeps the
    data in memory. The figures mean that only if the floor does what it is told."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "nullfs.py"), str(mnt),
                             *(["--discard"] if discard else [])], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "nullfs.py did not mount"
            time.sleep(0.02)
        data = os.urandom(3 << 20)
        (mnt / "f").write_bytes(data)
        back = (mnt / "f").read_bytes()
        assert len(back) == len(data)
        assert back == (bytes(len(data)) if discard else data)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
