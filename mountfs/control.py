"""The control socket: how snapctl talks to a running mount.

Each mount owns its socket (mode 0600, and the peer's uid is checked against the mount's
owner): the writable mount, the store's one writer, listens on ``STORE/control.sock``; a
read-only mount, which may run beside it, listens in its own runtime directory and never
touches the store. Every mount also keeps a record there, keyed by its mountpoint: its pid
and its socket, so that ``snapctl -m MNT`` reaches exactly the mount at MNT and ``umount
MNT`` waits for exactly the process that served it. One request per connection: a JSON
object on one line; one JSON answer on one line, ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``.

This module is the client's side and what both sides share (paths, records, errors); the
mount's side, the server, is ``controlserver``: ``snapctl`` loads neither it nor trio.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import struct
import time
from pathlib import Path

from .errors import StoreError

SOCKET_NAME = "control.sock"


RECORD_NAME = "mount.json"
# Seconds a client waits for an answer before it looks whether the mount process is stopped.
STOPPED_CHECK = 1.0


def socket_path(store: str | os.PathLike) -> Path:
    """The writable mount's socket (what callers holding only a store path reach)."""
    return Path(store) / SOCKET_NAME


def runtime_dir(create: bool = False) -> Path:
    """This user's private directory of mount records: /run/mountfs/mounts for root, else
    $XDG_RUNTIME_DIR/mountfs (or /tmp/mountfs-UID, checked to be ours and private)."""
    uid = os.getuid()
    if uid == 0:
        base = Path("/run/mountfs/mounts")
    elif os.environ.get("XDG_RUNTIME_DIR"):
        base = Path(os.environ["XDG_RUNTIME_DIR"]) / "mountfs"
    else:
        base = Path(f"/tmp/mountfs-{uid}")
    if create:
        # A file or a link in its place: refused below.
        with contextlib.suppress(FileExistsError):
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = base.lstat()
    except FileNotFoundError:
        return base
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise StoreError(f"{base} is not a private directory of uid {uid}: "
                         f"{_runtime_fix(base, uid)}")
    return base


def _runtime_fix(base: Path, uid: int) -> str:
    """What to do about a runtime directory that is not ours. Another user may have made
    /tmp/mountfs-UID first; in sticky /tmp only they can remove it."""
    if base.parent == Path("/tmp"):
        return (f"another user may have made it; set XDG_RUNTIME_DIR to a directory of "
                f"your own (export XDG_RUNTIME_DIR=/run/user/{uid})")
    return "remove it, or set XDG_RUNTIME_DIR to a directory of your own"


def mount_dir(mountpoint: str, create: bool = False) -> Path:
    """The runtime directory of the mount at ``mountpoint`` (named by a hash: socket paths
    are limited to 107 bytes)."""
    key = hashlib.sha256(os.path.abspath(mountpoint).encode("utf-8", "surrogateescape"))
    d = runtime_dir(create) / key.hexdigest()[:24]
    if create:
        d.mkdir(mode=0o700, exist_ok=True)
    return d


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is none: with
    the pid, it names one process even after pids wrap around. A zombie counts as gone."""
    fields = _proc_stat(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (Ctrl-Z, SIGSTOP, a debugger): it answers nothing
    until resumed."""
    fields = _proc_stat(pid)
    return fields is not None and fields[0] in ("T", "t")


def mount_record(mountpoint: str) -> dict | None:
    """{'pid', 'start', 'store', 'mountpoint', 'socket'} of the mount at ``mountpoint``."""
    try:
        rec = json.loads((mount_dir(mountpoint) / RECORD_NAME).read_text())
    except (OSError, ValueError, StoreError):
        return None
    if not isinstance(rec, dict) or rec.get("mountpoint") != os.path.abspath(mountpoint) \
            or not isinstance(rec.get("pid"), int) or not isinstance(rec.get("socket"), str):
        return None
    return rec


class ControlError(StoreError):
    """The mount refused a request or could not be reached."""


class MountStopped(ControlError):
    """The mount process, or its writer, is stopped: it answers nothing until resumed."""


class SnapshotInUse(ControlError):
    """A snapshot to delete has files or directories open (its reply says ``"busy"``)."""


def snapshot_json(snap) -> dict:
    return {"name": snap.name, "epoch": snap.epoch, "created_ns": snap.created_ns,
            "id": snap.snap_id, "uuid": snap.uuid.hex(), "written": snap.written}


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (a mount's: its writer process)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(child) for child in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def _stopped_error(pid: int, store) -> MountStopped | None:
    """The error that says the mount process ``pid``, or its writer process, is stopped:
    either way nothing that changes the filesystem can be answered until it is resumed.
    None if neither is."""
    if process_stopped(pid):
        return MountStopped(f"the mount process {pid} serving {store} is stopped (Ctrl-Z or "
                            f"SIGSTOP): resume it with 'kill -CONT {pid}'")
    for child in _children(pid):
        if process_stopped(child):
            return MountStopped(f"the writer process {child} of the mount process {pid} "
                                f"serving {store} is stopped (SIGSTOP): resume it with "
                                f"'kill -CONT {child}'")
    return None


def check_running(mountpoint: str, store) -> None:
    """Refuse at once if the process of the mount at ``mountpoint`` (or its writer) is
    stopped: anything touching the mount (a syncfs, a request) would wait for it."""
    rec = mount_record(mountpoint)
    if rec is not None and (stopped := _stopped_error(rec["pid"], store)) is not None:
        raise stopped


def _peer_pid(s: socket.socket) -> int:
    """The pid of the process listening on the other end of a connected UNIX socket."""
    creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _connect(s: socket.socket, path: Path, rec: dict | None, store, deadline: float) -> None:
    """Connect ``s`` to ``path``. A full queue of connections (EAGAIN: the mount is
    stopped, or swamped) is tried again for a second, then said in one line."""
    waited_until = min(deadline, time.monotonic() + STOPPED_CHECK)
    while True:
        try:
            s.connect(str(path))
            return
        except BlockingIOError:
            if time.monotonic() >= waited_until:
                break
            time.sleep(0.05)
    stopped = _stopped_error(rec["pid"], store) if rec else None
    raise stopped or ControlError(f"the mount serving {store} accepts no connection (the "
                                  f"queue of its control socket {path} is full: the mount "
                                  f"is stopped or swamped)")


def request(store: str | os.PathLike, payload: dict, timeout: float = 600.0,
            mountpoint: str | None = None) -> dict:
    """Send one request to the mount at ``mountpoint`` (if given and recorded), else to the
    writable mount of ``store``; raise ControlError on refusal."""
    rec = mount_record(mountpoint) if mountpoint else None
    path = Path(rec["socket"]) if rec else socket_path(store)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        _connect(s, path, rec, store, deadline)
        server = _peer_pid(s)
        s.settimeout(min(timeout, STOPPED_CHECK))
        try:
            s.sendall(json.dumps(payload).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass        # refused before our request was read: the refusal is read below
        buf = b""
        while not buf.endswith(b"\n"):
            try:
                data = s.recv(1 << 16)
            except ConnectionResetError:
                break
            except socket.timeout:
                if (stopped := _stopped_error(server, store)) is not None:
                    raise stopped from None
                if time.monotonic() >= deadline:
                    raise
                continue
            if not data:
                break
            buf += data
    except (FileNotFoundError, ConnectionRefusedError):
        raise ControlError(f"no mount is serving {store} (control socket {path} not "
                           f"answering)") from None
    except PermissionError:
        raise ControlError(f"permission denied: only the owner of the mount of {store} may "
                           f"control it") from None
    except socket.timeout:
        raise ControlError(f"the mount serving {store} did not answer within "
                           f"{timeout:.0f} s") from None
    except OSError as e:        # ECONNABORTED and the like: the mount died meanwhile
        raise ControlError(f"the mount serving {store} broke off the request "
                           f"({e.strerror}): if its process died, 'mountfs umount' its "
                           f"mountpoint and mount it again") from None
    finally:
        s.close()
    if not buf:
        raise ControlError(f"the mount serving {store} closed the connection without an answer")
    reply = json.loads(buf)
    if not reply.get("ok"):
        refused = SnapshotInUse if reply.get("busy") is True else ControlError
        raise refused(str(reply.get("error", "request failed")))
    return reply
