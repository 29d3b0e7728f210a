"""A command never writes outside a store, a mirror or its own files by following what
another user put there (a link, a FIFO, a directory of theirs): it refuses with one line
that says what to do, before opening anything (as ssh's StrictModes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli

NOBODY = 65534
CHECKOUT = Path(__file__).resolve().parent.parent


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file only root may write, which no command may touch."""
    path = tmp_path / "victim"
    path.write_text("root's secret\n")
    path.chmod(0o600)
    return path


def refused(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode != 0, res.stdout
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, \
        res.stderr
    for word in words:
        assert word in res.stderr, res.stderr


def test_a_store_made_by_mkfs_passes(store):
    assert os.stat(store).st_mode & 0o777 == 0o700
    cli("mountfs", "fsck", "-q", store)
    cli("snapctl", "--store", store, "create", "s1")


def test_a_lock_linked_elsewhere_is_not_truncated(store, victim):
    """fsck takes the store lock (opened, then truncated): through a link that was
    /etc/shadow."""
    (store / "lock").unlink(missing_ok=True)
    (store / "lock").symlink_to(victim)
    refused(cli("mountfs", "fsck", store, check=False), f"{store}/lock is a symbolic link",
            "remove it")
    assert victim.read_text() == "root's secret\n"


def test_root_refuses_a_store_another_user_owns(store, victim):
    """The attacker's own store: its files are theirs to replace between our check and our
    open, so root refuses it whole, and says how to run the command instead."""
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(store)], check=True)
    for args in (("mountfs", "fsck", store), ("snapctl", "--store", store, "list"),
                 ("mountfs", "promote", store)):
        refused(cli(*args, check=False), f"{store} is owned by nobody: run the command as "
                f"nobody (runuser -u nobody -- ...) or chown -R root {store}")


def test_data_linked_into_another_store_is_refused(tmp_path):
    """data.mdb linked to another store's: a root replicate or snapshot into the first
    would write into the second."""
    one, other = tmp_path / "one", tmp_path / "other"
    cli("mountfs", "mkfs", one)
    cli("mountfs", "mkfs", other)
    before = (other / "data.mdb").read_bytes()
    (one / "data.mdb").unlink()
    (one / "data.mdb").symlink_to(other / "data.mdb")
    refused(cli("snapctl", "--store", one, "create", "s1", check=False),
            f"{one}/data.mdb is a symbolic link")
    refused(cli("snapctl", "--store", other, "replicate", "--to", f"file://{one}",
                check=False), f"{one}/data.mdb is a symbolic link")
    assert (other / "data.mdb").read_bytes() == before


def test_a_store_others_may_write_is_refused(store):
    store.chmod(0o770)
    refused(cli("mountfs", "fsck", store, check=False),
            f"{store} is writable by group or others", f"chmod go-w {store}")


def test_a_lock_that_is_a_fifo_is_refused_at_once(store):
    (store / "lock").unlink(missing_ok=True)
    os.mkfifo(store / "lock")
    refused(cli("mountfs", "fsck", store, check=False, timeout=20),
            f"{store}/lock is not a regular file")


def test_mkfs_follows_no_link_and_takes_no_other_users_directory(tmp_path, victim):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(target)
    refused(cli("mountfs", "mkfs", tmp_path / "link", check=False), "is a symbolic link")
    assert os.stat(target).st_mode & 0o777 == 0o755 and not any(target.iterdir())
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    refused(cli("mountfs", "mkfs", theirs, check=False), f"{theirs} is owned by nobody")
    assert not any(theirs.iterdir())


def test_a_read_only_mount_appends_to_no_linked_log(store, victim, tmp_path):
    """The background mount appends its log to STORE/mountfs.log, read-only mounts too."""
    (store / "mountfs.log").symlink_to(victim)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        refused(cli("mountfs", "mount", "--read-only", store, mnt, check=False),
                f"{store}/mountfs.log is a symbolic link")
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)])
    assert victim.read_text() == "root's secret\n"


@pytest.mark.fuse
def test_root_unmounts_a_mount_whose_lock_was_replaced_by_a_fifo(make_mount):
    """umount asks who holds the lock: an open for reading of a FIFO would wait forever."""
    m = make_mount()
    (m.mnt / "f").write_text("x")
    (m.store / "lock").unlink()              # the mount keeps its lock open
    os.mkfifo(m.store / "lock")
    res = cli("mountfs", "umount", m.mnt, check=False, timeout=30)
    assert res.returncode == 0, res.stderr
    assert not os.path.ismount(m.mnt)
    os.unlink(m.store / "lock")              # for the fixture's fsck


@pytest.mark.fuse
def test_a_runtime_directory_another_user_made_is_refused_before_mounting(store, tmp_path):
    """Without XDG_RUNTIME_DIR a user's mount records go to /tmp/mountfs-UID, which anyone
    can make first: the mount says so, and leaves no dead mount behind. In the foreground
    (the background mount's child runs the same code): this venv's interpreter lies under
    /root, so the user can start it but it cannot start another."""
    uid = 40000 + os.getpid() % 10000
    planted = Path(f"/tmp/mountfs-{uid}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(store), str(mnt)], check=True)
    for p in [tmp_path, *tmp_path.parents, CHECKOUT, *CHECKOUT.parents]:
        os.chmod(p, os.stat(p).st_mode | 0o011)       # let the user walk down to them
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    try:
        res = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                              sys.executable, "-m", "cmdline.mountfs", "mount", "--foreground",
                              str(store), str(mnt)], capture_output=True, text=True, timeout=60, env=env,
                             cwd=CHECKOUT)
        refused(res, f"{planted} is not a private directory of uid {uid}",
                f"export XDG_RUNTIME_DIR=/run/user/{uid}")
        assert str(mnt) not in Path("/proc/self/mountinfo").read_text()
    finally:
        if os.path.ismount(mnt) or str(mnt) in Path("/proc/self/mountinfo").read_text():
            subprocess.run(["fusermount3", "-uz", str(mnt)])
        planted.rmdir()


def test_the_spark_log_follows_no_link_and_is_private(tmp_path, victim, monkeypatch):
    from mountfs.errors import StoreError
    from replicator import transfer
    log = tmp_path / "spark.log"
    log.symlink_to(victim)
    with pytest.raises(StoreError, match="is a symbolic link"):
        with transfer._stderr_to(str(log)):
            os.write(2, b"spark says\n")
    assert victim.read_text() == "root's secret\n"
    log.unlink()
    with transfer._stderr_to(str(log)):
        os.write(2, b"spark says\n")
    assert os.stat(log).st_mode & 0o777 == 0o600 and log.read_text() == "spark says\n"
    os.chown(log, NOBODY, NOBODY)          # made first by another user, in a shared /tmp
    with pytest.raises(StoreError, match="is owned by nobody"):
        with transfer._stderr_to(str(log)):
            os.write(2, b"never here\n")
    assert log.read_text() == "spark says\n"


def test_a_replicate_without_spark_opens_no_spark_log(store, tmp_path, victim):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / f"mountfs-spark-{os.getuid()}.log").symlink_to(tmp_path / "planted")
    cli("snapctl", "--store", store, "create", "s1")
    cli("snapctl", "--store", store, "replicate", "--to", f"file://{tmp_path}/mirror",
        "--snapshot", "s1", env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert not (tmp_path / "planted").exists()
