"""The mount's side of the control socket (``control`` has the protocol's client and
what both sides share): accepting connections from clients it distrusts, checking each
request against one table, and answering it from the engine. Loaded only by the mount
process."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import struct
from pathlib import Path

from .control import (RECORD_NAME, SOCKET_NAME, ControlError, SnapshotInUse, mount_dir,
                      process_start, snapshot_json, socket_path)
from .errors import StoreError

log = logging.getLogger(__name__)

MAX_REQUEST = 1 << 16
REQUEST_TIMEOUT = 10.0      # seconds a client has to send its request, and to take its answer
MAX_CONNECTIONS = 64        # served at once; more are answered at once that the mount is busy
BACKLOG = 64
ACCEPT_RETRY = 0.1          # seconds between accepts while file descriptors run out


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
