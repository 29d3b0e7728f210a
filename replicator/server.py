"""``mountfs serve-mirror``: the receiver that owns a mirror store on a remote host.

An ASGI application (Starlette) served by hypercorn on trio. Every request must carry
``Authorization: Bearer TOKEN``; anything else gets 401 and changes nothing. Two tokens, two
rights: the replicate token adds snapshots and nothing else (append-only: no rollback, no
snapshot deletion), the admin token (optional) may also roll back and prune. The store is
touched only in worker threads (LMDB transactions are bound to their thread), one writer at
a time; the event loop only moves bytes. Every body is bounded (413 beyond the limit, on the
wire and decompressed, streamed with a hard cap) and parsed in a worker thread; every
malformed request gets one 4xx with a one-line reason and one log line.

API (version 1; bodies are zstd-compressed):
  GET  /v1/info                 mirror identity, chunk size, snapshots, the token's rights
  POST /v1/missing              digests (32 bytes each) -> the digests the mirror lacks
  POST /v1/chunks               frames of digest:32 + length:u32 + data -> staged, verified
  POST /v1/commit               {"source_uuid", "base_uuid", "snapshot", "changeset"} (JSON)
  POST /v1/parts/TRANSFER/N     part N of a changeset (JSON, at most 16 MiB): validated, staged
  POST /v1/commit-parts         {"source_uuid", "base_uuid", "snapshot", "transfer", "parts":
                                [hex digest of each part, in order], "force"}: applies the
                                staged parts; "force" (admin token only) lets them replace a
                                store that is no mirror and has files of its own
  POST /v1/rollback             {"base_uuid"} (JSON): discard mirror changes since the base
  POST /v1/buckets              {"snapshot": uuid or null, "recompute"} -> K hashes, 32 bytes each
  POST /v1/bucket-items         {"snapshot", "buckets": [..]} -> {bucket: {identity: hash}}
  POST /v1/scrub                re-read every chunk -> {"missing": [..], "corrupt": [..]}
  POST /v1/replace-chunks       frames, as /v1/chunks: good copies of lost or corrupt chunks
  POST /v1/repair               {"base_uuid", "changeset"}: fix the live tree (verify --repair)
  POST /v1/delete-snapshot      {"name"}: prune a snapshot (never the newest)
  POST /v1/export               {"snapshot": name, "path"} -> the subtree's entries (restore)
  POST /v1/read-chunks          digests -> frames of committed chunk data (restore)
"""

from __future__ import annotations

import functools
import hmac
import io
import json
import logging
import signal
import socket
import struct
from dataclasses import dataclass

import trio
import zstandard
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mountfs.store import Store, StoreError
from mountfs.units import Address

from . import mirror
from .changeset import Changeset

log = logging.getLogger(__name__)

FRAME = struct.Struct(">32sI")
MIN_RATE = 64 << 10           # bytes/s a body must average once its grace time is over
MAX_BODY = 1 << 30            # bytes, on the wire and decompressed, per request or response


class TooLarge(mirror.MirrorError):
    """A body beyond the limit (413): refused before it is held in full."""


def pack_frames(chunks) -> bytes:
    """[(digest, data)] -> one zstd-compressed body."""
    return compress(b"".join(FRAME.pack(bytes(d), len(data)) + bytes(data)
                             for d, data in chunks))


def unpack_frames(body: bytes, limit: int = MAX_BODY) -> list[tuple[bytes, bytes]]:
    raw = decompress(body, limit)
    out, pos = [], 0
    while pos < len(raw):
        if pos + FRAME.size > len(raw):
            raise mirror.MirrorError("truncated chunk frame")
        digest, n = FRAME.unpack_from(raw, pos)
        pos += FRAME.size
        if pos + n > len(raw):
            raise mirror.MirrorError("truncated chunk frame")
        out.append((digest, raw[pos:pos + n]))
        pos += n
    return out


def decompress(body: bytes, limit: int = MAX_BODY) -> bytes:
    """Stream-decompress with a hard cap on the output: the size a frame header declares is
    not believed (python-zstandard's ``max_output_size`` is ignored when it is present)."""
    out = bytearray()
    try:
        for piece in zstandard.ZstdDecompressor().read_to_iter(io.BytesIO(body),
                                                               write_size=1 << 20):
            out += piece
            if len(out) > limit:
                raise TooLarge(f"body decompresses to more than {limit} bytes")
    except zstandard.ZstdError as e:
        raise mirror.MirrorError(f"body is not valid zstd: {e}") from None
    return bytes(out)


def loads(raw: bytes):
    """JSON from a peer: a nesting too deep for the parser is a malformed body, not a crash."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def compress(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(raw)


def compress_json(obj) -> bytes:
    return compress(json.dumps(obj).encode())


@dataclass(frozen=True)
class Limits:
    """What one token holder may make the receiver hold or wait for."""

    max_body: int = MAX_BODY              # bytes per request, on the wire and decompressed
    body_seconds: float = 300.0           # to receive one request body in full
    staging: mirror.StagingLimits = mirror.StagingLimits()


class Receiver:
    """The mirror store and the rules for touching it from the event loop."""

    def __init__(self, store: Store, token: str, admin_token: str | None = None,
                 limits: Limits = Limits()):
        self.store = store
        self.token = token.encode()
        self.admin_token = admin_token.encode() if admin_token else None
        self.limits = limits
        self.write_lock = trio.Lock()

    def rights(self, request: Request) -> str | None:
        """'admin', 'replicate', or None for a missing or wrong token (constant time)."""
        header = request.headers.get("authorization", "")
        given = header.removeprefix("Bearer ").encode() if header.startswith("Bearer ") else b""
        if not given:
            return None
        admin = self.admin_token is not None and hmac.compare_digest(given, self.admin_token)
        replicate = hmac.compare_digest(given, self.token)
        return "admin" if admin else "replicate" if replicate else None

    async def body(self, request: Request) -> bytes:
        """The raw body, refused (413) beyond the limit before it is held, and (408) when it
        arrives too slowly: a client has ``body_seconds`` plus one second per MIN_RATE bytes
        it has sent, so a big body on a slow link gets through and a trickle does not."""
        limit = self.limits.max_body
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"body of {declared} bytes is over the limit of {limit}")
        out = bytearray()
        start = trio.current_time()
        pieces = request.stream().__aiter__()
        while True:
            with trio.move_on_at(start + self.limits.body_seconds + len(out) / MIN_RATE):
                try:
                    out += await pieces.__anext__()
                except StopAsyncIteration:
                    return bytes(out)
                if len(out) > limit:
                    raise TooLarge(f"body is over the limit of {limit} bytes")
                continue
            raise SlowBody(f"body arrived slower than {MIN_RATE} bytes/s after the first "
                           f"{self.limits.body_seconds:g} s")

    async def raw(self, request: Request) -> bytes:
        """The decompressed body (in a worker thread: a big body never stalls the loop)."""
        body = await self.body(request)
        return await trio.to_thread.run_sync(decompress, body, self.limits.max_body)

    async def json(self, request: Request) -> dict:
        body = await self.body(request)
        req = await trio.to_thread.run_sync(
            lambda: loads(decompress(body, self.limits.max_body)))
        if not isinstance(req, dict):
            raise ValueError("the body is not a JSON object")
        return req

    async def frames(self, request: Request) -> list[tuple[bytes, bytes]]:
        body = await self.body(request)
        frames = await trio.to_thread.run_sync(unpack_frames, body, self.limits.max_body)
        for digest, data in frames:
            if len(data) > self.store.chunk_size:
                raise TooLarge(f"a chunk of {len(data)} bytes is over this mirror's chunk "
                               f"size ({self.store.chunk_size})")
        return frames

    async def read(self, fn, *args):
        return await trio.to_thread.run_sync(functools.partial(fn, *args))

    async def write(self, fn, *args):
        """Run ``fn(txn, dbs, *args)`` in one write transaction in a worker thread."""
        def work():
            with self.store.write() as txn:
                result = fn(txn, self.store.db, *args)
            self.store.sync()
            return result
        async with self.write_lock:
            return await trio.to_thread.run_sync(work)

    # ---- handlers --------------------------------------------------------------------------

    async def info(self, request: Request):
        """What ``mirror.info`` says, and the rights of the token that asked ("admin" or
        "replicate"): a client can refuse at once what this token would have refused only
        at the commit, after every chunk was sent."""
        info = await self.read(mirror.info, self.store)
        return JSONResponse({**info, "rights": self.rights(request)})

    async def missing(self, request: Request):
        raw = await self.raw(request)
        if len(raw) % 32:
            raise mirror.MirrorError("digest list is not a multiple of 32 bytes")
        digests = [raw[i:i + 32] for i in range(0, len(raw), 32)]

        def lookup():
            with self.store.read() as txn:
                return mirror.missing(txn, self.store.db, digests)
        return Response(b"".join(await self.read(lookup)), media_type="application/octet-stream")

    async def chunks(self, request: Request):
        frames = await self.frames(request)
        free = await trio.to_thread.run_sync(lambda: self.store.disk_usage(False)[1])
        stored, nbytes = await self.write(mirror.stage, frames, self.limits.staging, free)
        return JSONResponse({"stored": stored, "bytes": nbytes})

    async def commit(self, request: Request):
        req = await self.json(request)
        snap = _snapshot_ref(req.get("snapshot"))
        cs = await trio.to_thread.run_sync(Changeset.from_json, req["changeset"])
        await self.write(mirror.commit, self.store.chunk_size, _uuid(req, "source_uuid"),
                         _uuid_hex(req, "base_uuid"), snap, cs, bool(req.get("reconcile")))
        async with self.write_lock:
            await trio.to_thread.run_sync(mirror.purge_deleted, self.store)
        log.info("committed snapshot %s (%d names and %d inodes changed)", snap.name,
                 len(cs.entries), len(cs.inodes))
        return JSONResponse({"ok": True})

    async def part(self, request: Request):
        """Stage one changeset part: bounded like a body, validated like a commit, counted
        against the staging limits like chunks."""
        transfer = _hex_id(request.path_params["transfer"])
        index = request.path_params["index"]
        body = await self.body(request)
        raw = await trio.to_thread.run_sync(decompress, body,
                                            min(self.limits.max_body, mirror.MAX_PART_BYTES))
        free = await trio.to_thread.run_sync(lambda: self.store.disk_usage(False)[1])
        await self.write(mirror.stage_part, self.store.chunk_size, transfer, index, raw,
                         self.limits.staging, free)
        return JSONResponse({"ok": True})

    async def commit_parts(self, request: Request):
        """Apply the parts the request names (each present and matching its digest) and
        take the snapshot: atomically for every snapshot, in as many transactions as memory
        needs (mirror.commit_staged)."""
        req = await self.json(request)
        snap = _snapshot_ref(req.get("snapshot"))
        transfer = _hex_id(_string(req, "transfer"))
        names = req["parts"]
        if not isinstance(names, list) or not 0 < len(names) <= mirror.MAX_PARTS:
            raise ValueError(f"parts must be a list of 1..{mirror.MAX_PARTS} digests")
        digests = [_digest(d) for d in names]
        force = _flag(req, "force")
        if force and self.rights(request) != "admin":
            raise AdminOnly("this token may only add snapshots: --force, which replaces the "
                            "files of a store that is no mirror, needs the admin token")

        def work():
            done = mirror.commit_staged(self.store, _uuid(req, "source_uuid"),
                                        _uuid_hex(req, "base_uuid"), snap, transfer, digests,
                                        bool(req.get("reconcile")), force)
            self.store.sync()
            mirror.purge_deleted(self.store)
            return done
        async with self.write_lock:
            done = await trio.to_thread.run_sync(work)
        log.info("committed snapshot %s (%d names and %d inodes changed) from %d changeset "
                 "parts", snap.name, done.entries, done.inodes, len(digests))
        return JSONResponse({"ok": True})

    async def rollback(self, request: Request):
        req = await self.json(request)
        await self.write(mirror.rollback_to, self.store.chunk_size,
                         _uuid_hex(req, "base_uuid", nullable=False))
        return JSONResponse({"ok": True})

    async def buckets(self, request: Request):
        req = await self.json(request)
        hashes = await self.read(mirror.bucket_hashes, self.store, _uuid_hex(req, "snapshot"),
                                 bool(req.get("recompute")))
        return Response(b"".join(hashes), media_type="application/octet-stream")

    async def bucket_items(self, request: Request):
        req = await self.json(request)
        wanted = req["buckets"]
        count = self.store.bucket_count
        if not isinstance(wanted, list) or len(wanted) > count or not all(
                type(b) is int and 0 <= b < count for b in wanted):
            raise ValueError(f"buckets must be a list of at most {count} numbers "
                             f"0..{count - 1}")
        items = await self.read(mirror.bucket_items, self.store, _uuid_hex(req, "snapshot"),
                                sorted(set(wanted)))
        body = {str(b): {ident.hex(): h.hex() for ident, h in its.items()}
                for b, its in items.items()}
        return Response(compress_json(body), media_type="application/zstd")

    async def scrub(self, request: Request):
        found = await self.read(mirror.scrub, self.store)
        return JSONResponse({k: [d.hex() for d in v] for k, v in found.items()})

    async def replace_chunks(self, request: Request):
        frames = await self.frames(request)
        return JSONResponse({"replaced": await self.write(mirror.replace_chunks, frames)})

    async def repair(self, request: Request):
        req = await self.json(request)
        cs = await trio.to_thread.run_sync(Changeset.from_json, req["changeset"])
        await self.write(mirror.repair, self.store.chunk_size,
                         _uuid_hex(req, "base_uuid", nullable=False), cs)
        async with self.write_lock:
            await trio.to_thread.run_sync(mirror.purge_deleted, self.store)
        return JSONResponse({"ok": True})

    async def delete_snapshot(self, request: Request):
        req = await self.json(request)
        async with self.write_lock:
            await trio.to_thread.run_sync(mirror.delete_snapshot, self.store,
                                          _string(req, "name"))
        return JSONResponse({"ok": True})

    async def export(self, request: Request):
        req = await self.json(request)
        entries = await self.read(mirror.export, self.store, _string(req, "snapshot"),
                                  _string(req, "path"))
        return Response(compress_json(entries), media_type="application/zstd")

    async def read_chunks(self, request: Request):
        raw = await self.raw(request)
        if len(raw) % 32:
            raise mirror.MirrorError("digest list is not a multiple of 32 bytes")
        digests = [raw[i:i + 32] for i in range(0, len(raw), 32)]
        chunks = await self.read(mirror.read_chunks, self.store, digests)
        return Response(pack_frames(chunks), media_type="application/zstd")


class SlowBody(mirror.MirrorError):
    """A body that did not arrive in time (408)."""


class AdminOnly(mirror.MirrorError):
    """A request only the admin token may make, told by its body (403)."""


def _string(req: dict, key: str) -> str:
    value = req[key]
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    return value


def _flag(req: dict, key: str) -> bool:
    value = req.get(key, False)
    if type(value) is not bool:
        raise ValueError(f"{key} must be true or false")
    return value


def _uuid_hex(req: dict, key: str, nullable: bool = True) -> str | None:
    value = req.get(key)
    if value is None and nullable:
        return None
    if not isinstance(value, str) or len(value) != 32:
        raise ValueError(f"{key} must be a uuid of 32 hex digits")
    bytes.fromhex(value)
    return value.lower()


def _hex_id(value: str) -> bytes:
    """A transfer id: 32 hex digits."""
    if not isinstance(value, str) or len(value) != 32:
        raise ValueError("a transfer id is 32 hex digits")
    return bytes.fromhex(value)


def _digest(value) -> bytes:
    if not isinstance(value, str) or len(value) != 64:
        raise ValueError("a part digest is 64 hex digits")
    return bytes.fromhex(value)


def _uuid(req: dict, key: str) -> bytes:
    return bytes.fromhex(_uuid_hex(req, key, nullable=False))


def _snapshot_ref(raw) -> mirror.SnapshotRef:
    if not isinstance(raw, dict):
        raise ValueError("snapshot must be an object")
    created = raw.get("created_ns")
    if type(created) is not int or not 0 <= created < 1 << 63:
        raise ValueError("snapshot created_ns must be a number 0..2**63-1")
    return mirror.SnapshotRef(_string(raw, "name"), _uuid_hex(raw, "uuid", nullable=False),
                              created)


ADMIN_ONLY = {"/v1/rollback", "/v1/delete-snapshot"}
MALFORMED = (ValueError, KeyError, TypeError, IndexError, struct.error, OverflowError,
             RecursionError, UnicodeError)


def make_app(receiver: Receiver) -> Starlette:
    def refuse(request: Request, status: int, reason: str) -> JSONResponse:
        client = request.client.host if request.client else "?"
        log.warning("refused %s %s from %s: %d %s", request.method, request.url.path, client,
                    status, reason)
        return JSONResponse({"error": reason}, status_code=status)

    def guarded(handler):
        async def endpoint(request: Request):
            rights = receiver.rights(request)
            if rights is None:
                return refuse(request, 401, "missing or wrong bearer token")
            if request.url.path in ADMIN_ONLY and rights != "admin":
                return refuse(request, 403, "this token may only add snapshots (append-only "
                                            "mirror); rollback and pruning need the admin "
                                            "token, or 'snapctl prune --store' on the mirror "
                                            "host")
            try:
                return await handler(request)
            except TooLarge as e:
                return refuse(request, 413, str(e))
            except SlowBody as e:
                return refuse(request, 408, str(e))
            except AdminOnly as e:
                return refuse(request, 403, str(e))
            except StoreError as e:          # MirrorError included: the client's fault
                return refuse(request, 409, _one_line(str(e)))
            except MALFORMED as e:
                return refuse(request, 400, _one_line(f"malformed request: "
                                                      f"{type(e).__name__}: {e}"))
        return endpoint

    return Starlette(routes=[
        Route("/v1/info", guarded(receiver.info), methods=["GET"]),
        Route("/v1/missing", guarded(receiver.missing), methods=["POST"]),
        Route("/v1/chunks", guarded(receiver.chunks), methods=["POST"]),
        Route("/v1/commit", guarded(receiver.commit), methods=["POST"]),
        Route("/v1/parts/{transfer}/{index:int}", guarded(receiver.part), methods=["POST"]),
        Route("/v1/commit-parts", guarded(receiver.commit_parts), methods=["POST"]),
        Route("/v1/rollback", guarded(receiver.rollback), methods=["POST"]),
        Route("/v1/buckets", guarded(receiver.buckets), methods=["POST"]),
        Route("/v1/bucket-items", guarded(receiver.bucket_items), methods=["POST"]),
        Route("/v1/scrub", guarded(receiver.scrub), methods=["POST"]),
        Route("/v1/replace-chunks", guarded(receiver.replace_chunks), methods=["POST"]),
        Route("/v1/repair", guarded(receiver.repair), methods=["POST"]),
        Route("/v1/delete-snapshot", guarded(receiver.delete_snapshot), methods=["POST"]),
        Route("/v1/export", guarded(receiver.export), methods=["POST"]),
        Route("/v1/read-chunks", guarded(receiver.read_chunks), methods=["POST"]),
    ])


def _one_line(msg: str) -> str:
    return " ".join(msg.split())[:300]


def _peer_gone(record: logging.LogRecord) -> bool:
    """hypercorn logs a traceback when a client hangs up while its reply is being sent
    (its reader closes the stream under the writer): one line is enough for that."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, (trio.BusyResourceError, trio.BrokenResourceError,
                          trio.ClosedResourceError)):
        record.msg, record.args = "a client hung up before its reply was sent", ()
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True


def bind(address: Address) -> socket.socket:
    """The server's listening socket, made before it starts: an address that cannot be
    resolved or bound is then one OSError, not an exception group from inside hypercorn
    (which would also take a missing port for its own default, 8000)."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address.host, address.port,
                                                          type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


async def serve(store: Store, token: str, sock: socket.socket, certfile: str | None = None,
                keyfile: str | None = None, task_status=trio.TASK_STATUS_IGNORED,
                admin_token: str | None = None, limits: Limits = Limits()) -> None:
    """Serve the mirror on ``sock`` (from ``bind``, which hypercorn then owns) until
    cancelled."""
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.certfile, config.keyfile = certfile, keyfile
    config.accesslog = None
    config.errorlog = log
    log.addFilter(_peer_gone)
    # No read timeout: hypercorn's would also cut a client that waits, silent, for a long
    # commit (a million-file first copy takes minutes). An idle peer is dropped after
    # keep_alive_timeout all the same, and a slow body by Receiver.body's rate.
    config.read_timeout = None
    app = make_app(Receiver(store, token, admin_token, limits))
    await hypercorn_serve(app, config, shutdown_trigger=_terminated, task_status=task_status)


async def _terminated() -> None:
    """Returns on SIGTERM (systemd's stop, kill): the server then stops as on Ctrl-C, letting
    requests in progress finish for a moment and closing the store, also when the shell
    that started it in the background made it ignore SIGINT."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            log.info("SIGTERM: stopping")
            return
