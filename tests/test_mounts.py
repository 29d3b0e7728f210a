"""Mounting and unmounting as a user meets it: a read-only mount beside the writable one
(either order of mount and unmount), a read-only mount of a mirror its receiver is serving,
and 'umount' that returns only once the store is released."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli, fsck_clean
from mountfs import control
from mountfs.control import ControlError, process_start
from mountfs.errors import StoreError
from mountfs.mapread import resident
from mountfs.mount import READAHEAD_KIB
from mountfs.mountinfo import canonical, mounts
from mountfs.store import Store


def log_of(store) -> str:
    return (store / "mountfs.log").read_text()


def test_read_only_beside_writer_each_mount_owns_its_socket(make_mount):
    a = make_mount()
    (a.mnt / "f").write_text("one")
    b = make_mount(a.store, "--read-only")
    a.snapctl("create", "t")                                  # reaches A, not B
    res = b.snapctl("create", "u", check=False)
    assert res.returncode != 0 and "read-only" in res.stderr
    assert "t" in b.snapctl("list").stdout                    # B follows A's commits
    assert (b.mnt / ".snapshot/t/f").read_text() == "one"
    assert (b.mnt / "f").read_text() == "one"
    with open(b.mnt / "f") as h:                              # fsync on B syncs nothing
        os.fsync(h.fileno())
    b.umount()                                                # waits for B, not for A
    assert os.path.ismount(a.mnt) and not os.path.ismount(b.mnt)
    a.snapctl("create", "v")                                  # A's socket survived
    assert "v" in a.snapctl("list").stdout
    assert "Traceback" not in log_of(a.store) and "ReadonlyError" not in log_of(a.store)
    a.umount()
    fsck_clean(a.store)


def test_read_only_first_then_writer_unmounted_first(make_mount):
    a = make_mount()
    (a.mnt / "f").write_text("x")
    a.umount()
    b = make_mount(a.store, "--read-only")
    a.mount()                                                 # the writer comes second
    (a.mnt / "g").write_text("y")
    a.snapctl("create", "s")
    a.umount()
    fsck_clean(a.store)                                       # a read-only mount is no writer
    assert (b.mnt / ".snapshot/s/g").read_text() == "y"       # B goes on, on its own socket
    assert [line for line in b.snapctl("list").stdout.splitlines() if "s" in line.split()]
    b.umount()
    assert "Traceback" not in log_of(a.store)


def test_read_only_mount_of_a_mirror_being_served(make_mount, receiver, tmp_path):
    r = receiver(store=tmp_path / "mirror")                   # holds the mirror's store lock
    b = make_mount(r.store, "--read-only", fsck=False)
    assert os.listdir(b.mnt) == []
    res = cli("mountfs", "umount", "--timeout", "30", b.mnt, check=False)
    assert res.returncode == 0, res.stderr                    # never waits for the receiver
    assert r.proc.poll() is None


def test_umount_returns_once_the_store_is_released(make_mount):
    m = make_mount()
    payload = os.urandom(1 << 20)
    for round_ in range(3):
        for i in range(40):
            with open(m.mnt / f"f{i}", "wb") as h:
                for _ in range(4):
                    h.write(payload)
        m.umount()
        res = cli("mountfs", "fsck", "-q", m.store, check=False)
        assert res.returncode == 0, f"round {round_}: {res.stdout}{res.stderr}"
        m.mount()



def test_mounting_over_files_says_they_are_hidden_not_gone(make_mount):
    """mount(8) hides a directory's files without a word; a user who mounts over their
    data must not believe it lost. The files are there again after umount."""
    m = make_mount()
    m.umount()
    (m.mnt / "notes.txt").write_text("mine")
    res = cli("mountfs", "mount", m.store, m.mnt)
    assert res.stdout.strip().endswith(
        f"; 1 entry already in {m.mnt} is hidden (not deleted) until "
        f"'mountfs umount {m.mnt}'"), res.stdout
    assert not (m.mnt / "notes.txt").exists()
    m.umount()
    assert (m.mnt / "notes.txt").read_text() == "mine"
    (m.mnt / "notes.txt").unlink()
    assert "hidden" not in cli("mountfs", "mount", m.store, m.mnt).stdout


def test_umount_of_a_busy_mount_says_who_to_look_for(make_mount):
    """A shell cd'ed into the mount keeps it busy: umount says so and how to find it, in
    one line, and the mount goes on serving; once the shell leaves, umount succeeds."""
    m = make_mount()
    (m.mnt / "f").write_text("still here")
    shell = subprocess.Popen(["sleep", "60"], cwd=m.mnt)
    try:
        res = cli("mountfs", "umount", m.mnt, check=False)
        assert res.returncode != 0 and res.stdout == "" and res.stderr.count("\n") == 1
        assert "busy" in res.stderr and f"'fuser -vm {m.mnt}' lists them" in res.stderr
        assert (m.mnt / "f").read_text() == "still here"
    finally:
        shell.kill()
        shell.wait()
    m.umount()
    assert not os.path.ismount(m.mnt)


PROBER = r'''
import sys, time
from mountfs.store import lock_holder
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    lock_holder(sys.argv[1])
'''


def test_fsck_is_not_refused_by_processes_that_only_ask_who_holds_the_store(make_mount):
    """umount's wait, 'mounts()', status commands and the daemon ask who holds the store
    lock: each probe holds a shared lock for microseconds. fsck right after umount (or any
    lock taker) must wait such probes out, not say 'store is in use' naming a process long
    gone (reproduced: 5 of 40 fsck runs refused beside one probing process)."""
    m = make_mount()
    (m.mnt / "f").write_bytes(os.urandom(1 << 20))
    m.umount()
    prober = subprocess.Popen([sys.executable, "-c", PROBER, str(m.store), "60"],
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        refused = []
        for i in range(300):
            try:
                Store.open(m.store, readonly=True, holder="fsck").close()
            except StoreError as e:
                refused.append(str(e))
        res = cli("mountfs", "fsck", "-q", m.store, check=False)
    finally:
        prober.kill()
        prober.wait()
    assert not refused, f"{len(refused)} of 300 opens refused: {refused[0]}"
    assert res.returncode == 0, res.stdout + res.stderr
    m.mount()
    res = cli("mountfs", "fsck", m.store, check=False)        # a real holder: refused
    assert res.returncode != 0 and "in use" in res.stderr and "mounted at" in res.stderr


def readahead_kib(mnt) -> int:
    dev = os.stat(mnt).st_dev                   # a FUSE mount's bdi is named major:minor
    return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())


def test_a_mount_reads_ahead_more_than_the_kernels_128_kib(make_mount):
    """The kernel gives a FUSE mount 128 KiB of readahead, which left a cold sequential read
    waiting for each chunk in turn; the mount raises it once the kernel's INIT is answered
    (set earlier, the answer lowers it again), read-only mounts too."""
    if os.geteuid() != 0:
        pytest.skip("the readahead is set through sysfs, which needs root")
    a = make_mount()
    data = os.urandom(3 << 20)
    (a.mnt / "f").write_bytes(data)
    b = make_mount(a.store, "--read-only")
    for m in (a, b):
        deadline = time.monotonic() + 10        # set by the mount just after INIT's answer
        while readahead_kib(m.mnt) != READAHEAD_KIB and time.monotonic() < deadline:
            time.sleep(0.05)
        assert readahead_kib(m.mnt) == READAHEAD_KIB > 128
    assert (a.mnt / "f").read_bytes() == data
    b.umount()
    a.umount()


def in_page_cache(path: Path) -> bool:
    """Whether every page of ``path`` is in the kernel's page cache right after an open,
    before any read (mincore(2) of a map of it)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        view = memoryview(m)
        try:
            return resident(view)
        finally:
            view.release()


def test_a_reopened_file_is_read_from_the_kernels_cache_on_a_writable_mount_only(make_mount):
    """A writable mount lets the kernel keep a file's pages across opens (a build reopening
    its headers reads them once); a read-only one, which follows another process's
    commits, drops them at each open and so reads what the writer changed."""
    a = make_mount()
    old, new = os.urandom(256 << 10), os.urandom(256 << 10)
    with open(a.mnt / "f", "wb") as f:                              # committed before B reads
        f.write(old)
        os.fsync(f.fileno())
    b = make_mount(a.store, "--read-only")
    for m in (a, b):
        assert (m.mnt / "f").read_bytes() == old                    # in the page cache now
    assert in_page_cache(a.mnt / "f")
    assert not in_page_cache(b.mnt / "f")
    with open(a.mnt / "f", "r+b") as f:                             # same size, new bytes
        f.write(new)
        os.fsync(f.fileno())
    assert (a.mnt / "f").read_bytes() == new
    assert (b.mnt / "f").read_bytes() == new
    b.umount()
    a.umount()


@pytest.fixture
def linked_mountpoint(tmp_path):
    """``link``, a symlink to the directory ``real``; whatever stays mounted on ``real``
    after the test is detached."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    yield link
    if str(real) in {m.mountpoint for m in mounts()}:          # dead ones too
        subprocess.run(["fusermount3", "-uz", str(real)], capture_output=True)


def test_a_mountpoint_given_through_a_symlink_is_the_links_target(linked_mountpoint, store):
    """The kernel mounts on a symlink's target, and /proc/self/mountinfo names that: the
    link given to mount, snapctl and umount must find the mount there (it did not: umount
    said 'not a mountfs mount' and the readahead stayed at the kernel's 128 KiB)."""
    link, real = linked_mountpoint, linked_mountpoint.resolve()
    cli("mountfs", "mount", store, link)
    (link / "f").write_text("through the link")
    assert os.path.ismount(real)
    cli("snapctl", "-m", link, "create", "s")
    assert (real / ".snapshot/s/f").read_text() == "through the link"
    if os.geteuid() == 0:
        deadline = time.monotonic() + 10
        while readahead_kib(link) != READAHEAD_KIB and time.monotonic() < deadline:
            time.sleep(0.05)
        assert readahead_kib(link) == READAHEAD_KIB
        assert "not in /proc/self/mountinfo" not in log_of(store)
    cli("mountfs", "umount", link)
    assert not os.path.ismount(real)
    fsck_clean(store)


def test_canonical_resolves_links_as_the_kernel_does(tmp_path, monkeypatch):
    """'..' after a symlink is the parent of the link's target (as for the kernel and
    realpath), not the link's own directory; relative paths start at the working directory."""
    (tmp_path / "a/real/sub").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b/link").symlink_to(tmp_path / "a/real")
    monkeypatch.chdir(tmp_path / "b")
    assert canonical("link") == str(tmp_path / "a/real")
    assert canonical("link/sub/./..") == str(tmp_path / "a/real")
    assert canonical("link/..") == str(tmp_path / "a")
    assert canonical(str(tmp_path / "b/link/sub")) == str(tmp_path / "a/real/sub")
    assert canonical("missing/x") == str(tmp_path / "b/missing/x")


def test_umount_through_a_symlink_detaches_a_mount_whose_process_was_killed(
        linked_mountpoint, store):
    """kill -9 of the mount process leaves a mount that answers ENOTCONN: 'mountfs umount'
    (here through a symlinked mountpoint, which must not be looked up inside the dead
    mount) detaches it, and the store mounts again."""
    link, real = linked_mountpoint, linked_mountpoint.resolve()
    cli("mountfs", "mount", store, link)
    with open(link / "f", "w") as f:
        f.write("kept")
        f.flush()
        os.fsync(f.fileno())                # what a kill -9 keeps (README: Guarantees)
    pid = int((store / "lock").read_text().split()[1])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while process_start(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(OSError):
        os.stat(real)
    cli("mountfs", "umount", link, timeout=30)
    assert not os.path.ismount(real)
    cli("mountfs", "mount", store, link)
    assert (link / "f").read_text() == "kept"
    cli("mountfs", "umount", link)
    fsck_clean(store)
    res = cli("mountfs", "umount", link, check=False)
    assert res.returncode == 1 and res.stderr.strip() == (
        f"mountfs: {link} is not a mountfs mount (it is no mountpoint; 'mount | grep mountfs' "
        f"lists the mounts)")


def test_umount_of_a_mount_whose_process_is_stopped_returns(make_mount):
    """A stopped (or stuck) mount process answers nothing, so any stat of its mountpoint
    waits forever: 'mountfs mount' there and 'mountfs umount' must not make one (click's
    path check and the mountpoint checks did), and 'snapctl create' must say the process is
    stopped instead of waiting out its 600 s. umount unmounts, waits --timeout for the
    process and says so; the process, resumed, flushes and exits."""
    m = make_mount()
    with open(m.mnt / "f", "w") as f:
        f.write("flushed at the end")
    other = m.store.parent / "other"
    cli("mountfs", "mkfs", other)
    pid = m.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        again = cli("mountfs", "mount", other, m.mnt, check=False, timeout=60)
        snap = cli("snapctl", "-m", m.mnt, "create", "s", check=False, timeout=60)
        with pytest.raises(ControlError, match=f"mount process {pid} .* is stopped"):
            control.request(m.store, {"op": "status"}, timeout=30)   # as mountfsd asks
        res = cli("mountfs", "umount", "--timeout", "1", m.mnt, check=False, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (snap.returncode, snap.stderr) == (1, f"snapctl: the mount process {pid} serving "
                                              f"{m.store} is stopped (Ctrl-Z or SIGSTOP): "
                                              f"resume it with 'kill -CONT {pid}'\n")
    assert (again.returncode, again.stderr) == (1, f"mountfs: {m.mnt} is already a mountpoint\n")
    assert res.returncode == 1
    assert res.stderr.startswith(f"mountfs: unmounted, but the mount process {pid} has not "
                                 f"exited after 1 s") and len(res.stderr.splitlines()) == 1
    assert str(m.mnt) not in {i.mountpoint for i in mounts()}
    deadline = time.monotonic() + 30
    while process_start(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)                    # process_start: a zombie counts as exited
    assert process_start(pid) is None
    m.mount()
    assert (m.mnt / "f").read_text() == "flushed at the end"


def test_a_mount_started_beside_another_mountfs_runs_its_own_code(make_mount, tmp_path):
    """'python -m' puts the current directory first on the import path: a mount started
    from a directory holding another ``mountfs`` (a second checkout) ran that one, and
    here failed to start. The mount and its writer run this tree's code, from '/' (they
    must not keep the caller's directory, and its filesystem, busy)."""
    m = make_mount()
    m.umount()
    decoy = tmp_path / "checkout"
    (decoy / "mountfs").mkdir(parents=True)
    (decoy / "mountfs" / "__init__.py").write_text("raise SystemExit('the decoy ran')\n")
    mountfs_command = Path(sys.executable).with_name("mountfs")
    res = subprocess.run([mountfs_command, "mount", os.path.relpath(m.store, decoy),
                          os.path.relpath(m.mnt, decoy)], cwd=decoy, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr + log_of(m.store)
    (m.mnt / "f").write_text("written")
    os.sync()
    writer = [int(p) for p in Path(f"/proc/{m.pid}/task/{m.pid}/children").read_text().split()]
    assert len(writer) == 1
    for pid in (m.pid, *writer):
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        assert "-P" in Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    m.umount()
    m.mount()
    assert (m.mnt / "f").read_text() == "written"
    assert "decoy" not in log_of(m.store)


def test_a_foreground_mount_unmounts_when_its_terminal_hangs_up(store, tmp_path, make_mount):
    """SIGHUP (the terminal of a ``--foreground`` mount closing) unmounts it cleanly, as
    SIGTERM and Ctrl-C do: what was written stays, and the store is clean."""
    from conftest import as_typed_at_a_terminal
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = subprocess.Popen([sys.executable, "-m", "mountfs.cli", "mount", "--foreground",
                              str(store), str(mnt)], stderr=subprocess.PIPE,
                             preexec_fn=as_typed_at_a_terminal)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt) and time.monotonic() < deadline:
            time.sleep(0.05)
        (mnt / "kept").write_bytes(b"written before the hangup")
        mount.send_signal(signal.SIGHUP)
        assert mount.wait(timeout=60) == 0, mount.stderr.read().decode()
    finally:
        if mount.poll() is None:
            mount.kill()
            mount.wait()
    assert not os.path.ismount(mnt)
    fsck_clean(store)
    again = make_mount(store)
    assert (again.mnt / "kept").read_bytes() == b"written before the hangup"
