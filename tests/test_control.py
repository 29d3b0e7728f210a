"""The control socket treats every connection as hostile: a malformed, oversized or stalled
request gets one line and costs the mount nothing (no traceback, no descriptor kept), and
the client says in one line why a mount cannot be reached."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import time

import pytest

from mountfs import control, controlserver


def raw(m, payload: bytes) -> str:
    """Send ``payload`` as it is on the writable mount's socket; the error of the answer
    (at once, not after the mount's REQUEST_TIMEOUT)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(controlserver.REQUEST_TIMEOUT / 2)
        s.connect(str(control.socket_path(m.store)))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(payload)          # refused before all of it was read: the answer says so
        answer = s.makefile("rb").readline()
    reply = json.loads(answer)
    assert reply["ok"] is False
    return reply["error"]


BAD = [
    (b'{"op": "create", "name": 123}\n', 'bad request: "name" must be a string'),
    (b'["create", "x"]\n', "bad request: not a JSON object"),
    (b'{"op": "hold", "mirror": "00", "name": "s", "label": 5}\n',
     'bad request: "label" must be a string'),
    (b'{"op": "delete"}\n', 'bad request: "name" is missing'),
    (b'{"op": "hold", "mirror": "00", "name": "s", "label": "x"}\n',
     'bad request: "mirror" must be a uuid (32 hex digits)'),
    (b'{"op": "delete", "name": "s", "force": "yes"}\n',
     'bad request: "force" must be true or false'),
    (b'{"op": 7}\n', 'bad request: "op" must be a string'),
    (b'\xff\xfe{\x00"\x00\n', "bad request: not JSON"),
    (b"[" * 50000 + b"\n", "bad request: not JSON"),
    (b'{"op": "create", "name": "' + b"x" * 70000 + b'"}\n', "request too large"),
    (b"x" * (1 << 16), "request too large"),
]


def test_a_malformed_request_gets_one_line_and_no_traceback(mounted):
    for payload, error in BAD:
        assert raw(mounted, payload) == error, payload[:40]
    assert "Traceback" not in mounted.log()
    assert control.request(mounted.store, {"op": "list"})["snapshots"] == []


def stall(m, n: int) -> list[socket.socket]:
    """``n`` connections that send nothing."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(control.socket_path(m.store)))
        out.append(s)
    return out


def test_stalled_connections_are_capped_and_cut_off(mounted):
    """More than MAX_CONNECTIONS at once are told so at once; a connection that sends
    nothing is answered and closed after REQUEST_TIMEOUT, and the mount answers again."""
    idle = stall(mounted, controlserver.MAX_CONNECTIONS)
    try:
        time.sleep(0.5)
        with pytest.raises(control.ControlError, match="serving 64 control connections"):
            control.request(mounted.store, {"op": "list"})
        idle[0].settimeout(controlserver.REQUEST_TIMEOUT + 10)
        answer = json.loads(idle[0].makefile("rb").readline())
        assert answer == {"ok": False, "error": "no request within 10 s"}
        time.sleep(0.5)
        assert control.request(mounted.store, {"op": "list"})["ok"]
    finally:
        for s in idle:
            s.close()


def test_a_mount_out_of_descriptors_says_so_once_and_recovers(mounted):
    pid = mounted.pid
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    used = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + 4, limits[1]))
    try:
        idle = stall(mounted, 20)
        time.sleep(1.5)                 # 15 accepts retried, every ACCEPT_RETRY
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    for s in idle:
        s.close()
    assert control.request(mounted.store, {"op": "list"})["ok"]
    log = mounted.log()
    assert "Traceback" not in log
    assert log.count("cannot accept connections (Too many open files)") == 1
    assert log.count("accepting connections again") == 1


def test_commands_say_a_stopped_mount_is_stopped_even_with_its_queue_full(make_mount):
    """list and delete say what create says (not that the store is in use, from the
    offline fallback); once the socket's queue is full, connect's EAGAIN is one line."""
    m = make_mount()
    m.snapctl("create", "s")
    pid = m.pid
    stopped = (f"snapctl: the mount process {pid} serving {m.store} is stopped (Ctrl-Z or "
               f"SIGSTOP): resume it with 'kill -CONT {pid}'\n")
    queued = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for args in (["list"], ["delete", "s"]):
            res = m.snapctl(*args, check=False)
            assert (res.returncode, res.stderr) == (1, stopped), args
        while len(queued) < 1000:
            s = socket.socket(socket.AF_UNIX)
            queued.append(s)
            s.setblocking(False)
            try:
                s.connect(str(control.socket_path(m.store)))
            except BlockingIOError:
                break
        res = m.snapctl("list", check=False)
        assert (res.returncode, res.stderr) == (1, stopped)
        with pytest.raises(control.ControlError, match=r"accepts no connection \(the queue"):
            control.request(m.store, {"op": "status"})
    finally:
        os.kill(pid, signal.SIGCONT)
        for s in queued:
            s.close()
    assert "s" in m.snapctl("list").stdout


def test_unmounting_removes_the_mounts_runtime_directory(make_mount):
    m = make_mount()
    where = control.mount_dir(str(m.mnt))
    assert (where / control.RECORD_NAME).exists()
    m.umount()
    assert not where.exists()


def test_deleting_the_newest_snapshot_makes_what_only_it_held_a_change_again(mounted):
    """mountfsd snapshots when the status says "changed". That compared the root's mepoch
    with the live epoch's start: after the newest snapshot was deleted, the writes only it
    had held were never snapshotted again (nor replicated) until the next write."""
    def changed() -> bool:
        return control.request(mounted.store, {"op": "status"})["changed"]
    (mounted.mnt / "a").write_text("a")
    mounted.snapctl("create", "s1")
    assert not changed()
    (mounted.mnt / "b").write_text("b")
    assert changed()
    mounted.snapctl("create", "s2")
    assert not changed()
    mounted.snapctl("delete", "s2")
    assert changed()                    # b is in no snapshot now
    mounted.snapctl("create", "s3")
    assert not changed()
    mounted.snapctl("delete", "s1")     # an older one: s3 holds everything
    assert not changed()
