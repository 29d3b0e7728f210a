"""The source's chunk endpoint: what executors on other hosts read a job's chunks from.

A Spark executor on another host cannot open the source store (LMDB lives on a local disk),
so for the length of one transfer the replicating process serves the chunks of that job, and
only those, over HTTP(S): read-only, in its own threads, behind a random credential made for
the job and carried in each task. Anything else (another path, another job's credential, a
digest outside the job) is refused without touching the store. Executors check every digest
when the data arrives, before pushing it to the mirror (which checks it again).

    POST /v1/chunks   body: digests, 32 bytes each (at most MAX_DIGESTS)
                      -> frames of digest:32 + length:u32 + data, in the order asked
    POST /v1/problem  body: one line (at most MAX_PROBLEM bytes): why a task failed, so
                      that a stalled job can say which side is unreachable
"""

from __future__ import annotations

import hmac
import http.client
import secrets
import socket
import ssl
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import blake3

FRAME = struct.Struct(">32sI")
MAX_DIGESTS = 1 << 16              # one request: a batch is far smaller (transfer.MAX_CHUNKS)
MAX_PROBLEM = 1000
CONNECT_SECONDS = 10.0
IDLE_SECONDS = 120.0               # a connection silent this long is closed (a thread each)


class ChunkEndpointError(Exception):
    """An executor could not get its chunks from the source (names the address tried)."""


class ChunkServer:
    """Serves the chunks named in ``lengths`` (digest -> length) of ``store`` (an open
    source Store) until closed. ``advertise`` is the address executors are told to use,
    ``bind`` the one to listen on; ``tls`` a (cert file, key file) pair for HTTPS."""

    def __init__(self, store, lengths: dict[bytes, int], advertise: str, bind: str = "",
                 tls: tuple[str, str] | None = None):
        self.store = store
        self.lengths = lengths
        self.credential = secrets.token_urlsafe(32)
        self.ca_pem = None
        self.started = time.monotonic()
        self.last_contact: tuple[float, str] | None = None     # (when, executor address)
        self.problem: str | None = None                         # the last one reported
        server = _Server((bind or advertise, 0), _Handler)
        server.owner = self
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            server.socket = context.wrap_socket(server.socket, server_side=True)
            with open(tls[0]) as f:
                self.ca_pem = f.read()
        self.server = server
        host = f"[{advertise}]" if ":" in advertise else advertise
        self.url = f"{'https' if tls else 'http'}://{host}:{server.server_address[1]}"
        self.thread = threading.Thread(target=server.serve_forever, name="chunk-endpoint",
                                       daemon=True)

    def __enter__(self) -> "ChunkServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving: the credential is worthless from here on."""
        self.credential = None
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def client(self) -> "ChunkClient":
        """What a task carries: the address, the job's credential and the CA to trust."""
        return ChunkClient(self.url, self.credential, self.ca_pem)

    def explain(self) -> str:
        """Why the job may be stuck, from the executors' side: the last failure a task
        reported, else how long since any executor reached this endpoint."""
        if self.problem:
            return self.problem
        if self.last_contact is None:
            return (f"no executor has reached the source's chunk endpoint {self.url} in "
                    f"{time.monotonic() - self.started:.0f} s (can they reach that address?)")
        when, who = self.last_contact
        return (f"no executor has reached the source's chunk endpoint {self.url} for "
                f"{time.monotonic() - when:.0f} s (last: {who})")

    def allowed(self, header: str) -> bool:
        given = header.removeprefix("Bearer ") if header.startswith("Bearer ") else ""
        credential = self.credential
        return bool(given and credential) and hmac.compare_digest(given.encode(),
                                                                   credential.encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: ChunkServer

    def handle_error(self, request, client_address) -> None:
        """A peer that breaks its connection mid-request (a worker host that died, a
        hostile client) is not the source's failure: socketserver would print a traceback
        on the user's terminal. The job notices the missing batch through its own deadline,
        which names the executor it lost."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_SECONDS
    server: _Server

    def log_message(self, *args) -> None:        # no access log on the terminal
        pass

    def do_GET(self) -> None:
        self._refuse(405, "only POST /v1/chunks")

    def do_POST(self) -> None:
        owner = self.server.owner
        if not owner.allowed(self.headers.get("Authorization", "")):
            return self._refuse(401, "this credential is not the running job's")
        owner.last_contact = (time.monotonic(), self.client_address[0])
        try:
            size = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self._refuse(411, "Content-Length required")
        if self.path == "/v1/problem" and 0 < size <= MAX_PROBLEM:
            text = self.rfile.read(size).decode(errors="replace").splitlines()
            owner.problem = f"executor {self.client_address[0]}: {text[0]}" if text else None
            return self._refuse(200, "noted")
        if self.path != "/v1/chunks":
            return self._refuse(404, "only POST /v1/chunks or /v1/problem")
        if size % 32 or not 0 < size <= 32 * MAX_DIGESTS:
            return self._refuse(413, f"1 to {MAX_DIGESTS} digests of 32 bytes")
        raw = self.rfile.read(size)
        digests = [raw[i:i + 32] for i in range(0, len(raw), 32)]
        unknown = next((d for d in digests if d not in owner.lengths), None)
        if unknown is not None:
            return self._refuse(403, f"chunk {unknown.hex()[:16]} is not part of this job")
        self._send(owner, digests)

    def _send(self, owner: ChunkServer, digests: list[bytes]) -> None:
        """Stream the frames from one read transaction (one chunk in memory at a time: a
        request may name 65,536 of them)."""
        from mountfs import chunkfile
        store = owner.store
        with store.read() as txn:
            lengths = [chunkfile.length(txn, store.db, d) for d in digests]
            if any(n is None for n in lengths):
                return self._refuse(410, "a chunk of this job left the source store")
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(sum(FRAME.size + n for n in lengths)))
            self.end_headers()
            for digest, n in zip(digests, lengths):
                self.wfile.write(FRAME.pack(digest, n))
                self.wfile.write(store.copy(chunkfile.get(txn, store.db, digest)))

    def _refuse(self, status: int, message: str) -> None:
        body = message.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


class ChunkClient:
    """The executor's side (picklable: an address, a credential and a CA certificate)."""

    def __init__(self, url: str, credential: str, ca_pem: str | None = None):
        self.url = url
        self.credential = credential
        self.ca_pem = ca_pem
        self.local_address = None      # this executor's address toward the source, once used

    def fetch(self, digests: list[bytes], timeout: float) -> list[tuple[bytes, bytes]]:
        """The chunks, each checked against its digest; ChunkEndpointError names the
        endpoint's address on any failure."""
        where = f"the source's chunk endpoint {self.url} (from {socket.gethostname()})"
        status, body = self._post("/v1/chunks", b"".join(digests), timeout, where)
        if status != 200:
            raise ChunkEndpointError(f"{where} refused the request ({status}): "
                                     f"{body[:200].decode(errors='replace')}")
        return _checked_frames(body, digests, where)

    def report(self, problem: str) -> None:
        """Tell the driver why this task failed (best effort: the link may be down)."""
        try:
            self._post("/v1/problem", problem.encode()[:MAX_PROBLEM], CONNECT_SECONDS, "")
        except ChunkEndpointError:
            pass

    def _post(self, path: str, body: bytes, timeout: float, where: str):
        parsed = urlparse(self.url)
        if parsed.scheme == "https":
            context = ssl.create_default_context(cadata=self.ca_pem) if self.ca_pem \
                else ssl.create_default_context()
            conn = http.client.HTTPSConnection(parsed.hostname, parsed.port,
                                               timeout=CONNECT_SECONDS, context=context)
        else:
            conn = http.client.HTTPConnection(parsed.hostname, parsed.port,
                                              timeout=CONNECT_SECONDS)
        try:
            conn.connect()
            self.local_address = conn.sock.getsockname()[0]
            conn.sock.settimeout(timeout)
            conn.request("POST", path, body=body,
                         headers={"Authorization": f"Bearer {self.credential}"})
            res = conn.getresponse()
            return res.status, res.read()
        except (OSError, http.client.HTTPException) as e:
            raise ChunkEndpointError(f"cannot reach {where}: {e or type(e).__name__}; the "
                                     f"executors must reach that address (spark.driver.host)"
                                     ) from None
        finally:
            conn.close()


def _checked_frames(body: bytes, digests: list[bytes], where: str):
    out, pos = [], 0
    for digest in digests:
        if pos + FRAME.size > len(body):
            raise ChunkEndpointError(f"{where} sent a truncated reply")
        got, n = FRAME.unpack_from(body, pos)
        pos += FRAME.size
        data = body[pos:pos + n]
        pos += n
        if got != digest or len(data) != n or blake3.blake3(data).digest() != digest:
            raise ChunkEndpointError(f"chunk {digest.hex()[:16]} from {where} does not "
                                     f"match its digest (corrupted in transit?)")
        out.append((digest, data))
    return out
