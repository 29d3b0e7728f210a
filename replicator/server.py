"""``mountfs serve-mirror``: the receiver that owns a mirror store on a remote host.

An ASGI application (Starlette) served by hypercorn on trio. Every request must carry
``Authorization: Bearer TOKEN``; anything else gets 401 and changes nothing. The store is
touched only in worker threads (LMDB transactions are bound to their thread), one writer at
a time; the event loop only moves bytes.

API (version 1; bodies are zstd-compressed):
  GET  /v1/info                 mirror identity, chunk size, snapshots (JSON)
  POST /v1/missing              digests (32 bytes each) -> the digests the mirror lacks
  POST /v1/chunks               frames of digest:32 + length:u32 + data -> staged, verified
  POST /v1/commit               {"source_uuid", "base_uuid", "snapshot", "changeset"} (JSON)
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
import json
import logging
import struct

import trio
import zstandard
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mountfs.store import Store, StoreError

from . import mirror
from .changeset import Changeset

log = logging.getLogger(__name__)

FRAME = struct.Struct(">32sI")
MAX_BODY = 1 << 30


def pack_frames(chunks) -> bytes:
    """[(digest, data)] -> one zstd-compressed body."""
    return compress(b"".join(FRAME.pack(bytes(d), len(data)) + bytes(data)
                             for d, data in chunks))


def unpack_frames(body: bytes) -> list[tuple[bytes, bytes]]:
    raw = decompress(body)
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


def decompress(body: bytes) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY)
    except zstandard.ZstdError as e:
        raise mirror.MirrorError(f"request body is not valid zstd: {e}") from None


def compress(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(raw)


def compress_json(obj) -> bytes:
    return compress(json.dumps(obj).encode())


class Receiver:
    """The mirror store and the rules for touching it from the event loop."""

    def __init__(self, store: Store, token: str):
        self.store = store
        self.token = token.encode()
        self.write_lock = trio.Lock()

    def authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        given = header.removeprefix("Bearer ").encode() if header.startswith("Bearer ") else b""
        return bool(given) and hmac.compare_digest(given, self.token)

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
        return JSONResponse(await self.read(mirror.info, self.store))

    async def missing(self, request: Request):
        raw = decompress(await request.body())
        if len(raw) % 32:
            raise mirror.MirrorError("digest list is not a multiple of 32 bytes")
        digests = [raw[i:i + 32] for i in range(0, len(raw), 32)]

        def lookup():
            with self.store.read() as txn:
                return mirror.missing(txn, self.store.db, digests)
        return Response(b"".join(await self.read(lookup)), media_type="application/octet-stream")

    async def chunks(self, request: Request):
        frames = unpack_frames(await request.body())
        stored, nbytes = await self.write(mirror.stage, frames)
        return JSONResponse({"stored": stored, "bytes": nbytes})

    async def commit(self, request: Request):
        req = json.loads(decompress(await request.body()))
        snap = mirror.SnapshotRef(**req["snapshot"])
        cs = Changeset.from_json(req["changeset"])
        await self.write(mirror.commit, self.store.chunk_size,
                         bytes.fromhex(req["source_uuid"]), req["base_uuid"], snap, cs,
                         bool(req.get("reconcile")))
        async with self.write_lock:
            await trio.to_thread.run_sync(mirror.purge_deleted, self.store)
        log.info("committed snapshot %s (%d names and %d inodes changed)", snap.name,
                 len(cs.entries), len(cs.inodes))
        return JSONResponse({"ok": True})

    async def rollback(self, request: Request):
        req = json.loads(decompress(await request.body()))
        await self.write(mirror.rollback_to, self.store.chunk_size, req["base_uuid"])
        return JSONResponse({"ok": True})


    async def buckets(self, request: Request):
        req = json.loads(decompress(await request.body()))
        hashes = await self.read(mirror.bucket_hashes, self.store, req["snapshot"],
                                 bool(req.get("recompute")))
        return Response(b"".join(hashes), media_type="application/octet-stream")

    async def bucket_items(self, request: Request):
        req = json.loads(decompress(await request.body()))
        items = await self.read(mirror.bucket_items, self.store, req["snapshot"],
                                [int(b) for b in req["buckets"]])
        body = {str(b): {ident.hex(): h.hex() for ident, h in its.items()}
                for b, its in items.items()}
        return Response(compress_json(body), media_type="application/zstd")

    async def scrub(self, request: Request):
        found = await self.read(mirror.scrub, self.store)
        return JSONResponse({k: [d.hex() for d in v] for k, v in found.items()})

    async def replace_chunks(self, request: Request):
        frames = unpack_frames(await request.body())
        return JSONResponse({"replaced": await self.write(mirror.replace_chunks, frames)})

    async def repair(self, request: Request):
        req = json.loads(decompress(await request.body()))
        await self.write(mirror.repair, self.store.chunk_size, req["base_uuid"],
                         Changeset.from_json(req["changeset"]))
        async with self.write_lock:
            await trio.to_thread.run_sync(mirror.purge_deleted, self.store)
        return JSONResponse({"ok": True})


    async def delete_snapshot(self, request: Request):
        req = json.loads(decompress(await request.body()))
        async with self.write_lock:
            await trio.to_thread.run_sync(mirror.delete_snapshot, self.store, req["name"])
        return JSONResponse({"ok": True})

    async def export(self, request: Request):
        req = json.loads(decompress(await request.body()))
        entries = await self.read(mirror.export, self.store, req["snapshot"], req["path"])
        return Response(compress_json(entries), media_type="application/zstd")

    async def read_chunks(self, request: Request):
        raw = decompress(await request.body())
        digests = [raw[i:i + 32] for i in range(0, len(raw), 32)]
        chunks = await self.read(mirror.read_chunks, self.store, digests)
        return Response(pack_frames(chunks), media_type="application/zstd")


def make_app(receiver: Receiver) -> Starlette:
    def guarded(handler):
        async def endpoint(request: Request):
            if not receiver.authorized(request):
                return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
            try:
                return await handler(request)
            except StoreError as e:          # MirrorError included: the client's fault
                return JSONResponse({"error": str(e)}, status_code=409)
            except (ValueError, KeyError, TypeError) as e:
                return JSONResponse({"error": f"malformed request: {e}"}, status_code=400)
        return endpoint

    return Starlette(routes=[
        Route("/v1/info", guarded(receiver.info), methods=["GET"]),
        Route("/v1/missing", guarded(receiver.missing), methods=["POST"]),
        Route("/v1/chunks", guarded(receiver.chunks), methods=["POST"]),
        Route("/v1/commit", guarded(receiver.commit), methods=["POST"]),
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


async def serve(store: Store, token: str, listen: str, certfile: str | None = None,
                keyfile: str | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the mirror until cancelled."""
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve
    config = Config()
    config.bind = [listen]
    config.certfile, config.keyfile = certfile, keyfile
    config.accesslog = None
    config.errorlog = log
    app = make_app(Receiver(store, token))
    await hypercorn_serve(app, config, shutdown_trigger=trio.sleep_forever,
                          task_status=task_status)
