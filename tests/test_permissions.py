"""Permissions are enforced for other users (default_permissions): checks run as ``nobody``
through setpriv, against a mount made with --allow-other."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

NOBODY = 65534


def as_nobody(code: str) -> subprocess.CompletedProcess:
    """Run Python ``code`` as nobody; it prints the errno name of a failure, or 'ok'."""
    wrapper = ("import errno, os, sys\ntry:\n" +
               "".join(f"    {line}\n" for line in code.splitlines()) +
               "    print('ok')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])\n")
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", sys.executable, "-c", wrapper],
                          capture_output=True, text=True, timeout=60)


def outcome(code: str) -> str:
    res = as_nobody(code)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.fixture(autouse=True)
def traversable(tmp_path):
    """Let nobody walk down to the test's mountpoints (pytest's temp dirs are 0700)."""
    for p in [tmp_path, *tmp_path.parents]:
        if str(p) in ("/", "/tmp"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o011)


@pytest.fixture
def shared(make_mount):
    m = make_mount(None, "--allow-other")
    os.chmod(m.mnt, 0o755)
    return m


def test_mode_bits_are_enforced_for_other_users(shared):
    m = shared.mnt
    (m / "public").write_text("everyone may read")
    os.chmod(m / "public", 0o644)
    (m / "secret").write_text("root only")
    os.chmod(m / "secret", 0o600)
    (m / "open").mkdir()
    os.chmod(m / "open", 0o777)
    (m / "sticky").mkdir()
    os.chmod(m / "sticky", 0o1777)
    (m / "sticky/roots").write_text("x")
    assert outcome(f"print(open('{m}/public').read(), end=' ')") == "everyone may read ok"
    assert outcome(f"open('{m}/public', 'a')") == "EACCES"
    assert outcome(f"open('{m}/secret')") == "EACCES"
    assert outcome(f"open('{m}/new', 'w')") == "EACCES"            # root's 0755 directory
    assert outcome(f"open('{m}/open/mine', 'w').write('x')") == "ok"
    assert os.stat(m / "open/mine").st_uid == NOBODY
    assert outcome(f"os.unlink('{m}/sticky/roots')") == "EPERM"      # sticky: not theirs
    assert outcome(f"os.chmod('{m}/public', 0o666)") == "EPERM"
    assert outcome(f"os.chown('{m}/open/mine', 0, 0)") == "EPERM"
    assert outcome(f"os.setxattr('{m}/public', 'user.k', b'v')") == "EACCES"
    assert outcome(f"os.listdir('{m}/.snapshot')") == "ok"          # browsing is reading


def test_snapshots_keep_their_permissions(shared):
    m = shared.mnt
    (m / "secret").write_text("root only")
    os.chmod(m / "secret", 0o600)
    shared.snapctl("create", "s1")
    assert outcome(f"open('{m}/.snapshot/s1/secret')") == "EACCES"


def test_without_allow_other_nobody_is_kept_out(mounted):
    (mounted.mnt / "f").write_text("x")
    os.chmod(mounted.mnt, 0o755)
    os.chmod(mounted.mnt / "f", 0o644)
    assert outcome(f"os.listdir('{mounted.mnt}')") == "EACCES"


def test_the_control_socket_is_owner_only(shared):
    sock = shared.store / "control.sock"
    assert os.stat(sock).st_mode & 0o777 == 0o600
    assert outcome("import socket\n"
                   "s = socket.socket(socket.AF_UNIX)\n"
                   f"s.connect('{sock}')") == "EACCES"
