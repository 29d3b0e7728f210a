"""Shared fixtures: stores, real FUSE mounts in their own processes, and the rule that every
mount's store must pass fsck after the test.

FUSE tests need /dev/fuse and fusermount3. Without them they fail when CI=true (CI must run
them) and skip with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Every posted step's answer is checked against what it wrote, not one in CHECKED_EVERY
# (mountfs.writer): a test that makes the trio thread answer wrongly must hear of it.
os.environ["MOUNTFS_CHECK_ANSWERS"] = "1"


def fuse_missing() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


FUSE_FIXTURES = {"mounted", "make_mount"}


def pytest_collection_modifyitems(config, items):
    """Tests that mount (through the fixtures below, or marked ``fuse``) need FUSE."""
    fuse_items = [i for i in items
                  if "fuse" in i.keywords or FUSE_FIXTURES & set(getattr(i, "fixturenames", ()))]
    for item in fuse_items:
        item.add_marker(pytest.mark.fuse)
    reason = fuse_missing()
    if reason is None or not fuse_items:
        return
    if IN_CI:
        raise pytest.UsageError(f"CI=true but the FUSE tests cannot run: {reason}")
    for item in fuse_items:
        item.add_marker(pytest.mark.skip(reason=f"FUSE tests need FUSE: {reason}"))


def cli(*args, check=True, input=None, env=None, timeout=120) -> subprocess.CompletedProcess:
    """Run ``mountfs``/``snapctl`` as a user would (a separate process)."""
    tool, *rest = args
    module = {"mountfs": "cmdline.mountfs", "snapctl": "cmdline.snapctl"}[tool]
    res = subprocess.run([sys.executable, "-m", module, *map(str, rest)], capture_output=True,
                         text=True, input=input, env=env, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} failed ({res.returncode}):\n"
                             f"{res.stdout}{res.stderr}")
    return res


def drop_caches() -> None:
    """Make the kernel forget every unused dentry and inode (FUSE then gets FORGETs), so a
    test does not hope the kernel forgot: it makes it."""
    os.sync()
    for _ in range(2):      # a second pass frees what the first released
        Path("/proc/sys/vm/drop_caches").write_text("2\n")


@contextlib.contextmanager
def tmpfs_disk(path: Path, size: str):
    """A disk of ``size`` (a tmpfs) at ``path``, for the tests that fill one."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(path: Path, most_mib: int) -> None:
    """Write ``path`` in 1 MiB blocks of random data, then fsync, on a disk that fills
    before ``most_mib``: the call that fails (write, fsync or close) must say ENOSPC. Then
    fill the store itself: the commit that failed had grown its data file into the last of
    the disk, and LMDB takes that space again for the next transactions (up to one whole
    transaction, 32 MiB, was left: a 5 MB write then still fitted), so ``path`` is appended
    to 256 KiB at a time, each synced, until even that fails."""
    with pytest.raises(OSError) as info:
        with open(path, "wb") as h:
            for _ in range(most_mib):
                h.write(os.urandom(1 << 20))
            os.fsync(h.fileno())
    assert info.value.errno == errno.ENOSPC, info.value
    with pytest.raises(OSError) as info:
        with open(path, "ab") as h:
            for _ in range(4 * most_mib):
                h.write(os.urandom(256 << 10))
                os.fsync(h.fileno())
    assert info.value.errno == errno.ENOSPC, info.value


def fsck_clean(store: Path) -> None:
    res = cli("mountfs", "fsck", "-q", store, check=False)
    assert res.returncode == 0, f"fsck found problems:\n{res.stdout}{res.stderr}"


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` ends within ``within`` seconds (a zombie counts as ended: it
    may be another process's child, not ours to reap)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


class Mount:
    """A store mounted for real by a background ``mountfs mount`` process."""

    def __init__(self, store: Path, mnt: Path, extra=()):
        self.store = store
        self.mnt = mnt
        self.extra = list(extra)

    def mount(self) -> "Mount":
        cli("mountfs", "mount", self.store, self.mnt, *self.extra)
        return self

    @property
    def pid(self) -> int:
        return int((self.store / "lock").read_text().split()[1])

    def is_mounted(self) -> bool:
        return os.path.ismount(self.mnt) or self._dead_mount()

    def _dead_mount(self) -> bool:
        try:
            os.stat(self.mnt)
        except OSError:
            return True
        return False

    def umount(self) -> None:
        cli("mountfs", "umount", self.mnt)

    def log(self) -> str:
        """What the mount process logged so far."""
        return (self.store / "mountfs.log").read_text()

    def kill9(self) -> None:
        """Kill the mount process as a crash would, and detach the dead mount."""
        pid = self.pid
        os.kill(pid, signal.SIGKILL)
        gone(pid)
        subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)

    def snapctl(self, *args, check=True):
        return cli("snapctl", "-m", self.mnt, *args, check=check)

    def cleanup(self) -> None:
        if self.is_mounted():
            try:
                self.umount()
            except AssertionError:
                subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
                time.sleep(0.5)


@pytest.fixture
def store(tmp_path) -> Path:
    path = tmp_path / "store"
    cli("mountfs", "mkfs", path)
    return path



def as_typed_at_a_terminal() -> None:
    """In a child (``preexec_fn``): SIGHUP, SIGINT and SIGTERM take their default course, as
    for a command typed at a terminal, whatever this test run inherited (CI started in the
    background ignores SIGINT, under nohup SIGHUP; the commands keep an ignored signal
    ignored)."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)

@pytest.fixture
def make_mount(tmp_path):
    """Factory: make_mount(store=None, *extra_options) -> Mount. Every mount is unmounted
    after the test and its store must then pass fsck."""
    made: list[Mount] = []

    def factory(store: Path | None = None, *extra, fsck=True, chunk_size=None) -> Mount:
        n = len(made)
        if store is None:
            store = tmp_path / f"store{n}"
            cli("mountfs", "mkfs", store, *(["--chunk-size", chunk_size] if chunk_size else []))
        mnt = tmp_path / f"mnt{n}"
        mnt.mkdir(exist_ok=True)
        m = Mount(store, mnt, extra).mount()
        m.check_fsck = fsck
        made.append(m)
        return m

    yield factory
    for m in made:
        m.cleanup()
    for m in made:
        if m.check_fsck:
            fsck_clean(m.store)


@pytest.fixture
def mounted(make_mount) -> Mount:
    return make_mount()


# ---- replication: one Spark session, real receivers ------------------------------------------

@pytest.fixture(scope="session")
def spark():
    """One embedded Spark session for every replication test of the session."""
    from replicator import transfer
    return transfer.spark_session()


TOKEN = "s3cret-token-for-tests-0123456789"
ADMIN_TOKEN = "admin-token-for-tests-9876543210"     # rollback and pruning (append-only mirror)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    """A ``mountfs serve-mirror`` process on a loopback port."""

    def __init__(self, store: Path, token_file: Path, tls: tuple[Path, Path] | None = None,
                 extra=()):
        self.store, self.token_file, self.tls, self.extra = store, token_file, tls, extra
        self.port = free_port()
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> "Receiver":
        args = [sys.executable, "-m", "cmdline.mountfs", "serve-mirror", str(self.store),
                "--listen", f"127.0.0.1:{self.port}", "--token-file", str(self.token_file),
                "--admin-token-file", str(self.token_file.with_name("admin-token")),
                *self.extra]
        if self.tls:
            args += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        # the log goes to a file, not a pipe: a pipe nobody drains blocks the server once
        # 64 KiB of log lines (one per refused request) have been written
        self.log_path = self.store.parent / f"serve-mirror-{self.port}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise AssertionError(f"serve-mirror exited: {self.log()}")
                assert time.monotonic() < deadline, "serve-mirror did not start listening"
                time.sleep(0.1)

    def log(self) -> str:
        """What the server wrote to stdout and stderr so far."""
        return self.log_path.read_text()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, the server's stop signal (SIGINT does nothing when whoever started the
        suite ran it as a background job of a script: the shell makes it ignored)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()


@pytest.fixture
def receiver(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN_TOKEN + "\n")
    admin_file.chmod(0o600)
    started = []

    def start(tls=None, store: Path | None = None, extra=()) -> Receiver:
        r = Receiver(store or tmp_path / "mirror", token_file, tls, extra).start()
        started.append(r)
        return r
    yield start
    for r in started:
        r.stop()


