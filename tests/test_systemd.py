"""The systemd integration: units installed by scripts/install-systemd pass
``systemd-analyze verify``, and the mount and the daemon speak the notify protocol (to a
real datagram socket standing in for systemd's)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli

TOP = Path(__file__).resolve().parent.parent


def install(tmp_path: Path, *args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEST=str(tmp_path / "units"), CONFIG_DIR=str(tmp_path / "etc"),
               BINDIR=str(Path(sys.executable).parent))
    return subprocess.run(["bash", str(TOP / "scripts/install-systemd"), *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_install_writes_units_store_and_config(tmp_path):
    token = tmp_path / "token"
    res = install(tmp_path, "demo", tmp_path / "store", tmp_path / "mnt",
                  "http://backup:8765", token)
    assert res.returncode == 2                         # the token file must exist first
    assert res.stderr.strip().endswith(f"mirror http://backup:8765: token_file {token} "
                                       f"does not exist or cannot be read")
    token.write_text("t" * 32)
    (tmp_path / "etc/demo.toml").unlink()
    res = install(tmp_path, "demo", tmp_path / "store", tmp_path / "mnt",
                  "http://backup:8765", token)
    assert res.returncode == 0, res.stderr
    units = tmp_path / "units"
    for unit in ("mountfs@.service", "mountfsd@.service"):
        text = (units / unit).read_text()
        assert "@BINDIR@" not in text and str(Path(sys.executable).parent) in text
    assert (tmp_path / "store/data.mdb").exists()
    assert (tmp_path / "etc/demo.env").read_text().startswith(f"STORE={tmp_path}/store\n")
    config = (tmp_path / "etc/demo.toml").read_text()
    assert 'url = "http://backup:8765"' in config
    assert "stall_timeout" in config and "ca_file" in config
    assert (tmp_path / "mnt").is_dir()


def test_install_makes_relative_paths_absolute(tmp_path):
    """A user in their home directory types ``install-systemd demo store mnt URL token``;
    the services run from /, and the daemon refuses relative paths."""
    (tmp_path / "token").write_text("t" * 32)
    res = install(tmp_path, "demo", "store", "mnt", "http://backup:8765", "token",
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "etc/demo.env").read_text().startswith(
        f"STORE={tmp_path}/store\nMOUNTPOINT={tmp_path}/mnt\n")
    config = (tmp_path / "etc/demo.toml").read_text()
    assert f'mountpoint = "{tmp_path}/mnt"' in config
    assert f'token_file = "{tmp_path}/token"' in config


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
def test_units_pass_systemd_analyze_verify(tmp_path):
    assert install(tmp_path).returncode == 0
    units = tmp_path / "units"
    for unit in ("mountfs", "mountfsd"):
        shutil.copy(units / f"{unit}@.service", units / f"{unit}@demo.service")
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", "mountfs@demo.service",
                          "mountfsd@demo.service"], cwd=units, capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr


class NotifySocket:
    """A datagram socket where systemd would listen; collects what is sent."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def wait_for(self, field: str, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.messages:
                if field in m.splitlines():
                    return m
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                pass
        raise AssertionError(f"no {field!r} in {self.messages}")


@pytest.mark.fuse
def test_mount_and_daemon_notify_systemd(store, tmp_path):
    notify = NotifySocket(tmp_path / "notify.sock")
    env = dict(os.environ, NOTIFY_SOCKET=notify.path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = subprocess.Popen([sys.executable, "-m", "mountfs.cli", "mount", "--foreground",
                              str(store), str(mnt)], env=env, stderr=subprocess.PIPE)
    try:
        ready = notify.wait_for("READY=1")
        assert os.path.ismount(mnt) and f"STATUS=mounted {store}" in ready
        config = tmp_path / "d.toml"
        config.write_text(f'[daemon]\nstate_dir = "{tmp_path}/state"\n[[filesystem]]\n'
                          f'name = "d"\nmountpoint = "{mnt}"\n')
        daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--config", str(config)],
                                  env=dict(env, WATCHDOG_USEC="2000000",
                                           WATCHDOG_PID=""), stderr=subprocess.PIPE)
        try:
            notify.messages.clear()
            notify.wait_for("READY=1")
            notify.wait_for("WATCHDOG=1")
            assert notify.wait_for("STATUS=d: no mirrors")
        finally:
            daemon.terminate()
            assert daemon.wait(timeout=60) == 0
        notify.wait_for("STOPPING=1")
    finally:
        cli("mountfs", "umount", mnt)
        mount.wait(timeout=60)
