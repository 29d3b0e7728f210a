"""The source's chunk endpoint (replicator.chunkserver), served from a real store on
loopback: only the job's chunks, only with the job's credential, digests checked where the
data arrives, TLS, and an endpoint that is gone named in the error."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import time

import blake3
import pytest

from mountfs.store import Store
from replicator import chunkserver
from replicator.chunkserver import ChunkClient, ChunkEndpointError, ChunkServer


@pytest.fixture
def source(store):
    """The store with three chunks in it; yields (open store, {digest: data})."""
    s = Store.open(store)
    chunks = {}
    with s.write() as txn:
        for size in (1, 70_000, 1 << 20):
            data = os.urandom(size)
            digest = blake3.blake3(data).digest()
            txn.put(digest, data, db=s.db["blobs"])
            chunks[digest] = data
    yield s, chunks
    s.close()


def test_serves_the_jobs_chunks_checked(source):
    store, chunks = source
    job = dict(list({d: len(v) for d, v in chunks.items()}.items())[:2])
    with ChunkServer(store, job, "127.0.0.1") as server:
        client = server.client()
        got = client.fetch(list(job), timeout=10)
        assert got == [(d, chunks[d]) for d in job]
        assert client.local_address == "127.0.0.1"


def test_refuses_other_chunks_credentials_and_paths(source):
    store, chunks = source
    digests = list(chunks)
    with ChunkServer(store, {digests[0]: 1}, "127.0.0.1") as server, \
            ChunkServer(store, {digests[0]: 1}, "127.0.0.1") as other_job:
        with pytest.raises(ChunkEndpointError, match=r"refused the request \(403\).*not part"):
            server.client().fetch([digests[1]], timeout=10)
        foreign = ChunkClient(server.url, other_job.credential)
        with pytest.raises(ChunkEndpointError, match=r"\(401\).*not the running job's"):
            foreign.fetch([digests[0]], timeout=10)
        host, port = server.server.server_address
        with socket.create_connection((host, port)) as s:
            s.sendall(b"GET /v1/chunks HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 405")


def test_a_finished_jobs_credential_is_worthless(source):
    store, chunks = source
    digest = next(iter(chunks))
    server = ChunkServer(store, {digest: len(chunks[digest])}, "127.0.0.1").__enter__()
    client = server.client()
    server.close()
    with pytest.raises(ChunkEndpointError,
                       match=rf"cannot reach the source's chunk endpoint {server.url} "):
        client.fetch([digest], timeout=10)


def test_over_tls_with_the_jobs_certificate(source, tmp_path):
    store, chunks = source
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    digest = next(iter(chunks))
    with ChunkServer(store, {digest: len(chunks[digest])}, "127.0.0.1",
                     tls=(str(cert), str(key))) as server:
        assert server.url.startswith("https://")
        assert server.client().fetch([digest], timeout=10) == [(digest, chunks[digest])]
        untrusting = ChunkClient(server.url, server.credential)      # system CAs only
        with pytest.raises(ChunkEndpointError, match="CERTIFICATE_VERIFY_FAILED"):
            untrusting.fetch([digest], timeout=10)


def test_batches_balance_bytes_and_count():
    """Many tiny chunks weigh as much as a few big ones: no batch gets all the tiny ones,
    and none holds more than about MAX_CHUNKS chunks."""
    from replicator import transfer
    big = [(os.urandom(32), 1 << 20) for _ in range(8)]
    tiny = [(os.urandom(32), 100) for _ in range(3 * transfer.MAX_CHUNKS - 8)]
    bins = transfer.batches(big + tiny, batch_bytes=8 << 20)
    assert len(bins) == 3                                   # by count, not by bytes (2)
    assert sorted(h for b in bins for h, _ in b) == sorted(d.hex() for d, _ in big + tiny)
    counts = [len(b) for b in bins]
    assert max(counts) <= transfer.MAX_CHUNKS + 64 and min(counts) >= transfer.MAX_CHUNKS // 2
    loads = [sum(n for _, n in b) + len(b) * transfer.CHUNK_COST for b in bins]
    assert max(loads) - min(loads) <= (1 << 20) + transfer.CHUNK_COST


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset, as a host that dies mid-request leaves the connection."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_peer_that_resets_or_stalls_prints_nothing_and_holds_nothing(source, capfd,
                                                                        monkeypatch):
    store, chunks = source
    monkeypatch.setattr(chunkserver._Handler, "timeout", 0.5)
    with ChunkServer(store, {d: len(v) for d, v in chunks.items()}, "127.0.0.1") as server:
        address = server.server.server_address
        for partial in (b"POST /v1/chunks HTT", b"POST /v1/chunks HTTP/1.1\r\nContent-Le"):
            s = socket.create_connection(address)
            s.sendall(partial)
            time.sleep(0.2)                      # the handler is reading when the reset comes
            _reset(s)
        with socket.create_connection(address) as idle:
            idle.settimeout(30)
            assert idle.recv(100) == b""         # closed by the server, not by us
        got = server.client().fetch(list(chunks), timeout=10)
        assert [d for d, _ in got] == list(chunks)
    out, err = capfd.readouterr()
    assert err == "" and out == ""
