"""Permissions are enforced for other users (default_permissions): checks run as ``nobody``
through setpriv, against a mount made with --allow-other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    """Let nobody walk down to the test's mountpoints and to the checkout it runs the code
    from (pytest's temp dirs are 0700, and so is a checkout made under `mktemp -d`)."""
    checkout = Path(__file__).resolve().parent.parent
    for start in (tmp_path, checkout):
        for p in [start, *start.parents]:
            if str(p) in ("/", "/tmp", "/var/tmp"):
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
    assert outcome(f"os.rename('{m}/sticky/roots', '{m}/sticky/r2')") == "EPERM"
    assert outcome(f"open('{m}/sticky/own', 'w').close()\n"
                   f"os.unlink('{m}/sticky/own')") == "ok"           # but their own, yes
    assert (m / "sticky/roots").read_text() == "x"
    assert outcome(f"os.truncate('{m}/public', 0)") == "EACCES"
    assert (m / "public").read_text() == "everyone may read"
    assert outcome(f"os.chmod('{m}/public', 0o666)") == "EPERM"
    assert outcome(f"os.chown('{m}/open/mine', 0, 0)") == "EPERM"
    assert outcome(f"os.setxattr('{m}/public', 'user.k', b'v')") == "EACCES"
    assert outcome(f"os.listdir('{m}/.snapshot')") == "ok"          # browsing is reading


def test_group_bits_and_search_permission(shared):
    """The group class is chosen by gid and then decides alone (other bits do not add);
    a directory without x for nobody hides what is inside, whatever its own mode."""
    m = shared.mnt
    for name, mode in (("group-read", 0o640), ("group-none", 0o604)):
        (m / name).write_text(name)
        os.chown(m / name, 0, NOBODY)
        os.chmod(m / name, mode)
    (m / "locked").mkdir(mode=0o700)
    (m / "locked/inside").write_text("x")
    os.chmod(m / "locked/inside", 0o644)
    assert outcome(f"open('{m}/group-read').read()") == "ok"
    assert outcome(f"open('{m}/group-none').read()") == "EACCES"
    assert outcome(f"open('{m}/locked/inside').read()") == "EACCES"
    assert outcome(f"os.stat('{m}/locked/inside')") == "EACCES"
    os.chmod(m / "locked", 0o711)                                   # search without read
    assert outcome(f"open('{m}/locked/inside').read()") == "ok"
    assert outcome(f"os.listdir('{m}/locked')") == "EACCES"


def test_times_and_set_id_bits_for_a_non_owner(shared):
    """Write permission lets a non-owner set the times to now, not to chosen values; a
    write by a non-owner drops the set-user-id bit (as on a local disk)."""
    m = shared.mnt
    (m / "shared").write_text("x")
    os.chmod(m / "shared", 0o666)
    os.utime(m / "shared", ns=(1, 1))
    assert outcome(f"os.utime('{m}/shared')") == "ok"
    assert os.stat(m / "shared").st_mtime_ns > 1
    assert outcome(f"os.utime('{m}/shared', ns=(5, 5))") == "EPERM"
    os.chmod(m / "shared", 0o4777)
    assert outcome(f"open('{m}/shared', 'a').write('more')") == "ok"
    assert (m / "shared").read_text() == "xmore"
    assert os.stat(m / "shared").st_mode & 0o7777 == 0o777


def test_snapshots_keep_their_permissions(shared):
    m = shared.mnt
    (m / "secret").write_text("root only")
    os.chmod(m / "secret", 0o600)
    shared.snapctl("create", "s1")
    assert outcome(f"open('{m}/.snapshot/s1/secret')") == "EACCES"


def test_without_allow_other_nobody_is_kept_out(mounted):
    (mounted.mnt / "f").write_text("x")
    os.chmod(mounted.mnt, 0o777)
    os.chmod(mounted.mnt / "f", 0o666)
    for code in (f"os.listdir('{mounted.mnt}')", f"os.stat('{mounted.mnt}/f')",
                 f"open('{mounted.mnt}/f').read()", f"open('{mounted.mnt}/g', 'w')"):
        assert outcome(code) == "EACCES", code
    assert outcome(f"os.stat('{mounted.mnt.parent}')") == "ok"     # nobody gets this far


def test_the_control_socket_is_owner_only(shared):
    sock = shared.store / "control.sock"
    assert os.stat(sock).st_mode & 0o777 == 0o600
    assert outcome("import socket\n"
                   "s = socket.socket(socket.AF_UNIX)\n"
                   f"s.connect('{sock}')") == "EACCES"


def snapctl_as_nobody(mount, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           sys.executable, "-m", "cmdline.snapctl", "-m", str(mount.mnt), *args],
                          capture_output=True, text=True, timeout=60, cwd="/")


def test_snapctl_as_nobody_fails_with_one_clear_line(shared):
    (shared.mnt / "f").write_text("x")
    for args in (("create", "s1"), ("list",)):
        res = snapctl_as_nobody(shared, *args)
        assert res.returncode != 0, args
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
        assert res.stderr.startswith("snapctl: permission denied: only the owner of the mount")
    assert os.listdir(shared.mnt / ".snapshot") == []
    shared.snapctl("create", "mine")                                 # root still may
    assert os.listdir(shared.mnt / ".snapshot") == ["mine"]


def test_the_peer_uid_is_checked_even_if_the_socket_mode_is_opened(shared):
    """A second lock: with the store directory and the socket opened to everyone, the mount
    still answers nobody with 'permission denied' (SO_PEERCRED) and does nothing."""
    sock = shared.store / "control.sock"
    assert outcome(f"os.stat('{sock}')") == "EACCES"                # the store is closed
    os.chmod(shared.store, 0o711)
    os.chmod(sock, 0o666)
    reply = outcome("import socket\n"
                    "s = socket.socket(socket.AF_UNIX)\n"
                    f"s.connect('{sock}')\n"
                    "print(s.makefile().readline().strip())\n"    # refused before any request
                    "try:\n"
                    "    s.sendall(b'{\"op\": \"create\", \"name\": \"sneaky\"}\\n')\n"
                    "except OSError:\n"
                    "    pass\n")
    assert reply.splitlines() == ['{"ok": false, "error": "permission denied"}', "ok"]
    assert os.listdir(shared.mnt / ".snapshot") == []
    assert outcome("from mountfs import control\n"                 # the client's view, often:
                   "for _ in range(200):\n"                          # refused mid-request
                   "    try:\n"
                   f"        control.request('{shared.store}', {{'op': 'create', 'name': 'x'}})\n"
                   "    except control.ControlError as e:\n"
                   "        assert str(e) == 'permission denied', e\n"
                   "    else:\n"
                   "        raise SystemExit('accepted')") == "ok"
    res = snapctl_as_nobody(shared, "create", "sneaky")
    assert (res.returncode, res.stderr) == (1, "snapctl: permission denied\n")
    assert os.listdir(shared.mnt / ".snapshot") == []
