"""The control socket: how snapctl talks to a running mount.

Each mount owns its socket (mode 0600, and the peer's uid is checked against the mount's
owner): the writable mount, the store's one writer, listens on ``STORE/control.sock``; a
read-only mount, which may run beside it, listens in its own runtime directory and never
touches the store. Every mount also keeps a record there, keyed by its mountpoint: its pid
and its socket, so that ``snapctl -m MNT`` reaches exactly the mount at MNT and ``umount
MNT`` waits for exactly the process that served it. One request per connection: a JSON
object on one line; one JSON answer on one line, ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import time
from pathlib import Path

from .errors import StoreError

log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
MAX_REQUEST = 1 << 16
REQUEST_TIMEOUT = 10.0      # seconds a client has to send its request, and to take its answer
MAX_CONNECTIONS = 64        # served at once; more are answered at once that the mount is busy
BACKLOG = 64
ACCEPT_RETRY = 0.1          # seconds between accepts while file descriptors run out


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


class BadRequest(ControlError):
    """A request that is not what the protocol allows (not JSON, a field of a wrong type)."""

    def __init__(self, why: str):
        super().__init__(f"bad request: {why}")


# The requests and their fields: every one is required, but a flag left out is false.
REQUESTS = {
    "status": {}, "flush": {}, "list": {},
    "create": {"name": str},
    "delete": {"name": str, "force": bool},
    "hold": {"mirror": str, "name": str, "label": str},
    "forget_mirror": {"label": str},
    "rollback": {"name": str, "force": bool},
    "restore": {"name": str, "path": str, "dest": str, "force": bool},
}
FLAGS = {"force"}
KINDS = {str: "a string", bool: "true or false"}


def parse_request(line: bytes) -> dict:
    """The request on ``line``, checked against REQUESTS (what dispatch may then take as
    given); BadRequest or an unknown op's ControlError, one line, otherwise."""
    try:
        req = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):      # UnicodeDecodeError is a ValueError
        raise BadRequest("not JSON") from None
    if not isinstance(req, dict):
        raise BadRequest("not a JSON object")
    if not isinstance(req.get("op"), str):
        raise BadRequest('"op" must be a string')
    fields = REQUESTS.get(req["op"])
    if fields is None:
        raise ControlError(f"unknown request {req['op']!r}")
    for key, kind in fields.items():
        if key not in req and key in FLAGS:
            req[key] = False
        elif key not in req:
            raise BadRequest(f'"{key}" is missing')
        elif not isinstance(req[key], kind):
            raise BadRequest(f'"{key}" must be {KINDS[kind]}')
    return req


class ControlServer:
    """Serves the control socket. Every connection is a client to distrust: it has
    REQUEST_TIMEOUT to send its request (and to take its answer), at most MAX_CONNECTIONS
    are served at once (more are told so at once), and a mount out of file descriptors
    says so once in its log, not at every retry."""

    def __init__(self, engine, ops, mountpoint: str):
        self.engine = engine
        self.ops = ops
        self.mountpoint = mountpoint
        self.dir = mount_dir(mountpoint, create=True)
        self.path = self.dir / SOCKET_NAME if ops.read_only else \
            socket_path(engine.store.path)
        self.connections = 0

    async def serve(self, task_status) -> None:
        import trio             # here, so that snapctl's client side never loads trio
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()
        old = os.umask(0o177)
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(BACKLOG)
        record = self.dir / RECORD_NAME
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "start": process_start(os.getpid()),
                                   "store": str(self.engine.store.path),
                                   "mountpoint": self.mountpoint, "socket": str(self.path)}))
        tmp.replace(record)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                await self._accept(trio.SocketListener(sock), nursery)
        finally:
            self.path.unlink(missing_ok=True)
            record.unlink(missing_ok=True)
            _remove_empty(self.dir)

    async def _accept(self, listener, nursery) -> None:
        import trio
        starved = False
        while True:
            try:
                stream = await listener.accept()
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                if not starved:
                    log.warning("control socket: cannot accept connections (%s); retrying "
                                "every %s s", os.strerror(e.errno), ACCEPT_RETRY)
                starved = True
                await trio.sleep(ACCEPT_RETRY)
                continue
            if starved:
                log.warning("control socket: accepting connections again")
                starved = False
            nursery.start_soon(self._serve_one, stream)

    async def _serve_one(self, stream) -> None:
        async with stream:
            if self.connections >= MAX_CONNECTIONS:
                await _answer(stream, {"ok": False, "error": "the mount is serving "
                                       f"{MAX_CONNECTIONS} control connections; try again"})
                return
            self.connections += 1
            try:
                await self._handle(stream)
            finally:
                self.connections -= 1

    async def _handle(self, stream) -> None:
        import trio
        from .namespace import FsError
        if not self._peer_allowed(stream):
            await _answer(stream, {"ok": False, "error": "permission denied"})
            return
        try:
            reply = await self.dispatch(parse_request(await _receive(stream)))
        except trio.BrokenResourceError:
            return                      # the client went away
        except (StoreError, FsError, ValueError) as e:
            reply = {"ok": False, "error": _message(e, self.engine.store.path)}
            if isinstance(e, SnapshotInUse):
                reply["busy"] = True
        except Exception as e:        # never let a bad request take the mount down
            log.exception("control request failed")
            reply = {"ok": False, "error": f"internal error: {e}"}
        await _answer(stream, reply)

    def _peer_allowed(self, stream) -> bool:
        creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                         struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid in (0, os.getuid())

    async def dispatch(self, req: dict) -> dict:
        op = req["op"]
        engine = self.engine
        if op == "status":
            return {"ok": True, "pid": os.getpid(), "mountpoint": self.mountpoint,
                    "store": str(engine.store.path), "live_epoch": engine.live,
                    "changed": await engine.changed_since_snapshot(),
                    "dirty_bytes": engine.files.dirty_bytes}
        if op == "flush":
            await engine.files.flush_all()
            await engine.commit()
            return {"ok": True, "live_epoch": engine.live}
        if op == "list":
            return {"ok": True, "snapshots": [snapshot_json(s) for s in engine.list_snapshots()]}
        if self.ops.read_only:
            raise ControlError("the filesystem is mounted read-only")
        if op == "create":
            return {"ok": True, "snapshot": snapshot_json(await engine.create_snapshot(req["name"]))}
        if op == "delete":
            if not req["force"]:
                self._refuse_if_open(engine.snapshot(req["name"]))
            snap = await engine.delete_snapshot(req["name"], req["force"])
            self.ops.forget_snapshot(snap.name)
            return {"ok": True, "snapshot": snapshot_json(snap)}
        if op == "hold":
            await engine.hold(_uuid(req["mirror"]), req["name"], req["label"])
            return {"ok": True}
        if op == "forget_mirror":
            return {"ok": True, "dropped": await engine.forget_mirror(req["label"])}
        if op == "rollback":
            done = await engine.rollback(req["name"], req["force"], self.ops.invalidate)
            return {"ok": True, "changed_inodes": len(done.inodes)}
        if op == "restore":
            done = await engine.restore_path(req["name"], req["path"], req["dest"],
                                             req["force"])
            await self.ops.reap(done.orphans)
            await self.ops.invalidate([done.parent], [(done.parent, done.name)])
            return {"ok": True, **done.to_json()}
        raise ControlError(f"unknown request {op!r}")


    def _refuse_if_open(self, snap) -> None:
        """A snapshot a program is reading is not deleted under it (ZFS answers "dataset is
        busy"); the daemon keeps it until a later prune."""
        n = self.ops.open_in_snapshot(snap)
        if n:
            where = os.path.join(self.mountpoint, ".snapshot", snap.name)
            what = "1 open file or directory" if n == 1 else \
                f"{n} open files or directories"
            raise SnapshotInUse(f"snapshot {snap.name!r} is in use: {what} under {where}; "
                                f"close them ('fuser -vm {self.mountpoint}' lists who has "
                                f"them), or pass --force")


def _uuid(text: str) -> bytes:
    """A mirror's uuid as a hold's key takes it: 16 bytes, no fewer."""
    try:
        uuid = bytes.fromhex(text)
    except ValueError:
        uuid = b""
    if len(uuid) != 16:
        raise BadRequest('"mirror" must be a uuid (32 hex digits)')
    return uuid


def _message(e: Exception, store) -> str:
    """A refusal in one line; a full disk says whose, and what gives room; an error that
    says why (a writer process that died: remount) says it."""
    from .namespace import FsError
    if isinstance(e, FsError):
        if e.errno == errno.ENOSPC:
            return (f"no space left on the disk of the store {store}: free some there, or "
                    f"delete files or snapshots ('snapctl delete NAME') of this store")
        why = e.args[1] if len(e.args) > 1 else ""
        plain = os.strerror(e.errno)
        return plain if why in ("", errno.errorcode.get(e.errno)) else f"{plain}: {why}"
    return str(e)


async def _receive(stream) -> bytes:
    """The request line: at most MAX_REQUEST bytes, within REQUEST_TIMEOUT."""
    import trio
    buf = b""
    with trio.move_on_after(REQUEST_TIMEOUT) as waited:
        while b"\n" not in buf and len(buf) < MAX_REQUEST:
            data = await stream.receive_some(MAX_REQUEST)
            if not data:
                break
            buf += data
    line = buf.partition(b"\n")[0]
    if len(line) >= MAX_REQUEST:
        raise ControlError("request too large")
    if waited.cancelled_caught:
        raise ControlError(f"no request within {REQUEST_TIMEOUT:.0f} s")
    return line


async def _answer(stream, reply: dict) -> None:
    """Send ``reply``, unless the client is gone or does not take it in REQUEST_TIMEOUT."""
    import trio
    with trio.move_on_after(REQUEST_TIMEOUT), contextlib.suppress(trio.BrokenResourceError):
        await stream.send_all(json.dumps(reply).encode() + b"\n")


def _remove_empty(d: Path) -> None:
    """Remove a mount's runtime directory once its socket and record are gone (one per
    mountpoint ever mounted would pile up); one another mount took meanwhile stays."""
    with contextlib.suppress(OSError):
        d.rmdir()


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
