"""A hostile token holder against a real ``mountfs serve-mirror`` on loopback: structurally
wrong commits, out-of-range numbers, malformed and oversized bodies, decompression bombs,
slow bodies, overfull staging, and random mutations of valid commits. Each is refused with
one 4xx and the mirror unchanged (every record of every table), or accepted and fsck-clean.
One receiver serves the whole module; no FUSE, no Spark."""

from __future__ import annotations

import base64
import functools
import json
import socket
import stat
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import blake3
import httpx
import pytest
import zstandard
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from mountfs import buckets, fsck
from mountfs import schema as S
from mountfs import snapshots as snaps
from mountfs.namespace import Live
from mountfs.store import Store
from replicator import changeset, mirror
from replicator.client import HttpMirror
from replicator.server import compress, compress_json, pack_frames

from conftest import ADMIN_TOKEN, TOKEN, Receiver

CHUNK = 64 << 10
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Source:
    """A source store built through the namespace (no mount), and what it replicated."""

    def __init__(self, path):
        Store.mkfs(path, CHUNK)
        self.store = Store.open(path)
        self.uuid = self.store.uuid
        with self.store.write() as txn:
            live = self._live(txn)
            self.d, _ = live.create(S.ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
            self.f, _ = live.create(self.d, b"f", stat.S_IFREG | 0o644, 0, 0)
            self.data = [bytes([i]) * CHUNK for i in range(2)]
            for i, data in enumerate(self.data):
                live.put_chunk(self.f, i, blake3.blake3(data).digest(), data)
            live.setattr(self.f, size=2 * CHUNK)
            live.set_xattr(self.f, b"user.k", b"v")
            self.sub, _ = live.create(self.d, b"sub", stat.S_IFDIR | 0o755, 0, 0)
            self.link, _ = live.create(S.ROOT_INO, b"l", stat.S_IFLNK | 0o777, 0, 0,
                                       target=b"d/f")
            self.snap = snaps.create(txn, self.store.db, "s1")
        with self.store.read() as txn:
            self.cs = changeset.build(txn, self.store.db, CHUNK, None, self.snap.epoch)
            self.view = Live(txn, self.store.db, snaps.live_epoch(txn, self.store.db), CHUNK)
            self.rec = {x: self.view.get(x) for x in (S.ROOT_INO, self.d, self.f, self.sub,
                                                      self.link)}

    def _live(self, txn):
        return Live(txn, self.store.db, snaps.live_epoch(txn, self.store.db), CHUNK)

    def frames(self):
        return [(blake3.blake3(d).digest(), d) for d in self.data]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "token").write_text(TOKEN)
    (tmp / "token").chmod(0o600)
    (tmp / "admin-token").write_text(ADMIN_TOKEN)
    (tmp / "admin-token").chmod(0o600)
    src = Source(tmp / "src")
    r = Receiver(tmp / "mirror", tmp / "token",
                 extra=("--chunk-size", "64K", "--max-request", "1M", "--max-staged", "512K",
                        "--body-timeout", "2")).start()
    m = HttpMirror(r.url, TOKEN)
    m.stage(src.frames())
    m.commit(src.uuid, None, mirror.SnapshotRef("s1", src.snap.uuid.hex(),
                                                src.snap.created_ns), src.cs)
    yield src, r, m
    m.close()
    r.stop()
    err = r.log()
    assert "Traceback" not in err, err
    assert TOKEN not in err and ADMIN_TOKEN not in err
    assert "refused POST /v1/commit from 127.0.0.1: 409" in err


def dump(r: Receiver) -> dict:
    """Every record of every table of the mirror store (what 'unchanged' is checked on)."""
    store = Store.open(r.store, readonly=True, lock=False)
    try:
        with store.read() as txn:
            return {name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
                    for name, db in store.db.items()}
    finally:
        store.close()


def fsck_problems(r: Receiver) -> list[str]:
    store = Store.open(r.store, readonly=True, lock=False)
    try:
        return fsck.check(store).problems
    finally:
        store.close()


def newest(m: HttpMirror) -> dict:
    return m.info()["snapshots"][-1]


_names = iter(range(10**9))


def commit_body(src: Source, m: HttpMirror, cs_json: dict) -> bytes:
    return compress_json({"source_uuid": src.uuid.hex(), "base_uuid": newest(m)["uuid"],
                          "snapshot": {"name": f"h{next(_names)}",
                                       "uuid": blake3.blake3(str(next(_names)).encode())
                                       .digest()[:16].hex(), "created_ns": 1},
                          "changeset": cs_json})


def refused(r: Receiver, path: str, body: bytes, status=None, headers=AUTH) -> str:
    """POST a hostile body: one 4xx with a one-line reason, the mirror unchanged."""
    before = dump(r)
    res = httpx.post(r.url + path, headers=headers, content=body, timeout=60)
    assert 400 <= res.status_code < 500, (res.status_code, res.text)
    if status:
        assert res.status_code == status, res.text
    reason = res.json()["error"]
    assert reason and "\n" not in reason
    assert dump(r) == before
    return reason


def cs_with(src: Source, **parts) -> dict:
    cs = changeset.Changeset()
    for key, value in parts.items():
        getattr(cs, key).update(value)
    return cs.to_json()


def digest_of(src: Source, i=0):
    return (blake3.blake3(src.data[i]).digest(), CHUNK)


# ---- 2: structurally wrong commits --------------------------------------------------------

def structural_cases(src: Source):
    rec = src.rec
    file_rec = rec[src.f]
    new = 900
    return {
        "root becomes a file": dict(inodes={S.ROOT_INO: rec[S.ROOT_INO].evolve(
            mode=stat.S_IFREG | 0o644, nlink=1)}),
        "entry under a regular file": dict(
            entries={(src.f, b"x"): new},
            inodes={new: file_rec.evolve(parent=src.f, name=b"x", nlink=1, size=0)}),
        "directory with children becomes a file": dict(inodes={src.d: rec[src.d].evolve(
            mode=stat.S_IFREG | 0o644, nlink=1)}),
        "empty directory becomes a file (its parent's nlink)": dict(
            inodes={src.sub: rec[src.sub].evolve(mode=stat.S_IFREG | 0o644, nlink=1)}),
        "chunks of an inode that does not exist": dict(chunks={5000: {0: digest_of(src)}}),
        "xattrs of an inode that does not exist": dict(xattrs={5000: {b"user.a": b"1"}}),
        "chunks in the virtual range": dict(chunks={1 << 62: {0: digest_of(src)}}),
        "xattrs in the virtual range": dict(xattrs={(1 << 62) + 5: {b"user.a": b"1"}}),
        "inode 2**62-1": dict(entries={(S.ROOT_INO, b"big"): (1 << 62) - 1},
                              inodes={(1 << 62) - 1: file_rec.evolve(
                                  parent=S.ROOT_INO, name=b"big", nlink=1, size=0)}),
        "inode MAX_INO+1": dict(entries={(S.ROOT_INO, b"big"): S.MAX_INO + 1},
                                inodes={S.MAX_INO + 1: file_rec.evolve(
                                    parent=S.ROOT_INO, name=b"big", nlink=1, size=0)}),
        "chunk index 2**40": dict(chunks={src.f: {1 << 40: digest_of(src)}}),
        "3 MiB chunk on a 64 KiB store": dict(chunks={src.f: {0: (digest_of(src)[0],
                                                                  3 << 20)}}),
        "chunk beyond the file's size": dict(chunks={src.f: {7: digest_of(src)}}),
        "wrong nlink": dict(inodes={src.f: file_rec.evolve(nlink=5)}),
        "wrong directory nlink": dict(inodes={src.d: rec[src.d].evolve(nlink=7)}),
        "wrong parent": dict(inodes={src.f: file_rec.evolve(parent=src.sub)}),
        "symlink without target": dict(inodes={src.link: rec[src.link].evolve(target=b"")}),
        "empty xattr name": dict(xattrs={src.f: {b"": b"1"}}),
        "NUL in xattr name": dict(xattrs={src.f: {b"user.a\0b": b"1"}}),
        "missing parent": dict(entries={(7777, b"x"): src.f}),
        "name left pointing nowhere": dict(entries={(src.d, b"f"): None}),
        "chunks on a directory": dict(chunks={src.d: {0: digest_of(src)}}),
    }


def test_structurally_wrong_commits_are_refused(world):
    src, r, m = world
    for name, parts in structural_cases(src).items():
        reason = refused(r, "/v1/commit", commit_body(src, m, cs_with(src, **parts)))
        assert reason, name
    assert fsck_problems(r) == []


def test_content_only_changes_raise_the_epochs_and_keep_fsck_clean(world):
    src, r, m = world
    before = newest(m)["uuid"]
    for parts in (dict(xattrs={src.f: {b"user.k": b"changed"}}),
                  dict(chunks={src.f: {1: digest_of(src, 0)}}),
                  dict(entries={(src.sub, b"n"): src.f},
                       inodes={src.f: src.rec[src.f].evolve(nlink=2)})):
        res = httpx.post(r.url + "/v1/commit", headers=AUTH,
                         content=commit_body(src, m, cs_with(src, **parts)), timeout=60)
        assert res.status_code == 200, res.text
        assert fsck_problems(r) == []
    assert newest(m)["uuid"] != before


# ---- 3: inode numbers and bucket-items ----------------------------------------------------

def test_bucket_items_is_bounded(world):
    src, r, m = world
    count = m.info()["buckets"]
    for wanted in ([count], [-1], list(range(count + 1)), "all", [1.5], [True]):
        refused(r, "/v1/bucket-items", compress_json({"snapshot": None, "buckets": wanted}),
                400)
    b = src.f % count
    items = m.bucket_items(None, [b])[b]
    assert any(S.from_u64(i[1:9]) == src.f for i in items)
    assert functools.reduce(buckets.xor, items.values(), buckets.ZERO) == \
        m.bucket_hashes(None)[b]                      # the seeks found every item


class BombingMirror(ThreadingHTTPServer):
    """A hostile mirror for the client side: every POST is answered with ``reply``."""

    def __init__(self, reply: bytes):
        self.reply = reply

        class Handler(BaseHTTPRequestHandler):
            def do_POST(h):
                h.rfile.read(int(h.headers.get("content-length", 0)))
                h.send_response(200)
                h.send_header("Content-Length", str(len(self.reply)))
                h.end_headers()
                h.wfile.write(self.reply)

            def log_message(h, *args):
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


def bomb_of(size: int) -> bytes:
    """A zstd frame whose header declares ``size`` bytes of zeros, made in 1 MiB steps."""
    c = zstandard.ZstdCompressor(level=3).compressobj(size=size)
    out = b"".join(c.compress(b"\0" * (1 << 20)) for _ in range(size >> 20))
    return out + c.flush()


@pytest.mark.parametrize("reply,refusal", [
    (bomb_of(64 << 20), "decompresses to more than"),
    (b"\0" * (17 << 20), "sent a response over"),
    (compress_json({"0": {"zz": 5}}), "malformed bucket-items response"),
    (compress_json([1, 2]), "malformed bucket-items response"),
    (compress(b"[" * 100000), r"malformed response \(not JSON\)"),
], ids=["zstd bomb", "raw body over the cap", "bad hex", "not an object", "deep nesting"])
def test_a_hostile_mirror_cannot_exhaust_the_source(reply, refusal):
    server = BombingMirror(reply)
    m = HttpMirror(server.url, TOKEN, max_response=16 << 20)
    try:
        with pytest.raises(mirror.MirrorError, match=refusal) as e:
            m.bucket_items(None, [0])
        assert "\n" not in str(e.value)
    finally:
        m.close()
        server.shutdown()


def test_an_inode_counter_at_the_edge_neither_spins_nor_promotes(tmp_path):
    """A mirror whose counter came from a hostile peer before commits were bounded: one
    bucket-items request costs the records stored (was: a loop to the counter), and
    promote refuses (its next file would take the .snapshot inode)."""
    src = Source(tmp_path / "m")
    with src.store.write() as txn:
        txn.put(b"next_ino", S.u64((1 << 62) - 1), db=src.store.db["meta"])
        txn.put(b"mirror_of", b"\1" * 16, db=src.store.db["meta"])
    b = src.f % src.store.bucket_count
    items = mirror.bucket_items(src.store, None, [b])[b]
    assert any(S.from_u64(i[1:9]) == src.f for i in items)
    assert functools.reduce(buckets.xor, items.values(), buckets.ZERO) == \
        mirror.bucket_hashes(src.store, None)[b]
    src.store.close()
    res = subprocess.run([sys.executable, "-m", "mountfs.cli", "promote", str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "inode counter is beyond" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


# ---- 4, 5: bodies and malformed requests ------------------------------------------------

def test_decompression_bomb_and_oversized_bodies_get_413(world):
    src, r, m = world
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    assert len(bomb) < 64 << 10 and zstandard.frame_content_size(bomb) == 64 << 20
    for path in ("/v1/commit", "/v1/chunks", "/v1/missing", "/v1/bucket-items"):
        refused(r, path, bomb, 413)
    refused(r, "/v1/chunks", b"\0" * (2 << 20), 413)                      # plain, over 1M
    big = (b"x" * (3 << 20))
    refused(r, "/v1/chunks", pack_frames([(blake3.blake3(big).digest(), big)]), 413)
    assert m.info()["chunk_size"] == CHUNK                            # still serving


@pytest.mark.parametrize("mutate", [
    lambda j: j["entries"].append([-1, base64.b64encode(b"x").decode(), 2]),
    lambda j: j["entries"].append([1, base64.b64encode(b"x").decode(), 1 << 64]),
    lambda j: j["chunks"].append([2, [[-1, "00" * 32, 5]]]),
    lambda j: j["chunks"].append([2, [[1 << 64, "00" * 32, 5]]]),
    lambda j: j["chunks"].append([2, [[0, "00" * 31, 5]]]),
    lambda j: j.update(entries="x"),
    lambda j: j.update(inodes=[[1, "bm90IGFuIGlub2Rl"]]),
    lambda j: j.update(xattrs=[[1, {"!!": "AA=="}]]),
    lambda j: j.update(chunks=[[2, [[0, "zz" * 32, 5]]]]),
    lambda j: j.pop("entries"),
], ids=["negative parent", "child 2**64", "negative index", "index 2**64", "short digest",
        "entries not a list", "inode not a record", "xattr name not base64", "digest not hex",
        "no entries"])
def test_malformed_changesets_get_400(world, mutate):
    src, r, m = world
    cs = changeset.Changeset().to_json()
    mutate(cs)
    refused(r, "/v1/commit", commit_body(src, m, cs))


def test_malformed_envelopes_get_400(world):
    src, r, m = world
    good = json.loads(zstandard.ZstdDecompressor().decompress(
        commit_body(src, m, changeset.Changeset().to_json())))
    for change in ({"snapshot": {**good["snapshot"], "created_ns": -1}},
                   {"snapshot": {**good["snapshot"], "created_ns": 1 << 64}},
                   {"snapshot": {**good["snapshot"], "name": 5}},
                   {"snapshot": "s"}, {"source_uuid": "xyz"}, {"base_uuid": 7}):
        refused(r, "/v1/commit", compress_json({**good, **change}), 400)
    refused(r, "/v1/commit", compress(b"[" * 100000 + b"]" * 100000), 400)
    refused(r, "/v1/commit", compress(b"[1, 2]"), 400)
    refused(r, "/v1/export", compress_json({"snapshot": ["s1"], "path": "."}), 400)
    refused(r, "/v1/read-chunks", compress(b"\0" * 33), 409)
    refused(r, "/v1/chunks", b"not zstd", 409)


# ---- 6: staging and slow bodies -------------------------------------------------------------

def test_staging_is_bounded(world):
    src, r, m = world
    batch = [(blake3.blake3(d).digest(), d)
             for d in (bytes([7, i]) * (CHUNK // 2) for i in range(6))]
    m.stage(batch[:6])                                # 384K of 512K
    reason = refused(r, "/v1/chunks", pack_frames(
        [(blake3.blake3(d).digest(), d) for d in (bytes([8, i]) * (CHUNK // 2)
                                                  for i in range(4))]), 409)
    assert "staged" in reason


def test_abandoned_staging_expires_and_staging_keeps_the_disk_free(tmp_path):
    Store.mkfs(tmp_path / "m", CHUNK)
    store = Store.open(tmp_path / "m")
    one, two = ([(blake3.blake3(d).digest(), d)] for d in (b"a" * 1000, b"b" * 1000))

    def stage(chunks, limits, free=None):
        with store.write() as txn:
            return mirror.stage(txn, store.db, chunks, limits, free)

    def staged():
        with store.read() as txn:
            return [bytes(k) for k in txn.cursor(db=store.db["staged"]).iternext(values=False)]
    try:
        assert stage(one, mirror.StagingLimits()) == (1, 1000)
        assert stage(two, mirror.StagingLimits(idle_seconds=3600)) == (1, 1000)
        assert len(staged()) == 2                      # a live cycle keeps what it staged
        assert stage(one, mirror.StagingLimits(idle_seconds=-1)) == (1, 1000)
        assert staged() == [one[0][0]]                 # the abandoned batches were dropped
        with pytest.raises(mirror.MirrorError, match="less than 4096 bytes free"):
            stage(two, mirror.StagingLimits(keep_free=4096), free=4096 + 999)
        assert staged() == [one[0][0]]
        assert stage(two, mirror.StagingLimits(keep_free=4096), free=4096 + 1000) == (1, 1000)
    finally:
        store.close()


def test_a_slow_body_is_cut_off(world):
    src, r, m = world
    with socket.create_connection(("127.0.0.1", r.port)) as s:
        s.sendall(b"POST /v1/commit HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                  TOKEN.encode() + b"\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        s.settimeout(120)
        reply = s.recv(4096)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply


# ---- 7: append-only ------------------------------------------------------------------------

def test_the_replicate_token_cannot_roll_back_or_prune(world):
    src, r, m = world
    held = m.info()["snapshots"]
    assert len(held) >= 2
    refused(r, "/v1/rollback", compress_json({"base_uuid": held[0]["uuid"]}), 403)
    refused(r, "/v1/delete-snapshot", compress_json({"name": held[0]["name"]}), 403)
    res = httpx.post(r.url + "/v1/delete-snapshot", headers=ADMIN,
                     content=compress_json({"name": held[0]["name"]}))
    assert res.status_code == 200, res.text
    assert [s["name"] for s in m.info()["snapshots"]] == [s["name"] for s in held[1:]]
    assert fsck_problems(r) == []


def test_a_mirror_is_pruned_on_its_own_host(tmp_path):
    """Only names of the daemon's own form go: 'auto-manual' is a user's."""
    own = [f"auto-2026010{i}T000000.000000Z" for i in (1, 2, 3)]
    Store.mkfs(tmp_path / "m", CHUNK)
    store = Store.open(tmp_path / "m")
    with store.write() as txn:
        for name in (own[0], "mine", "auto-manual", own[1], own[2]):
            snaps.create(txn, store.db, name)
    store.close()

    def prune(*args):
        return subprocess.run([sys.executable, "-m", "cmdline.snapctl", "prune", "--store",
                               str(tmp_path / "m"), *args], capture_output=True, text=True,
                              timeout=60)
    Store.mkfs(tmp_path / "empty", CHUNK)
    res = subprocess.run([sys.executable, "-m", "cmdline.snapctl", "prune", "--store",
                          str(tmp_path / "empty"), "--retention", "keep_last = 1"],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (0, "no snapshots; nothing to prune\n",
                                                        "")
    res = prune("--retention", "keep_last = 1")
    assert res.stdout.splitlines() == [f"prune {own[0]}",
                                       "keep  mine: made by a user (prune_user is off)",
                                       "keep  auto-manual: made by a user (prune_user is off)",
                                       f"prune {own[1]}", f"keep  {own[2]}: newest, keep_last 1"]
    store = Store.open(tmp_path / "m", readonly=True, lock=False)
    with store.read() as txn:
        assert [s.name for s in snaps.list_all(txn, store.db)] == ["mine", "auto-manual",
                                                                   own[2]]
    store.close()
    for bad, reason in (("keep_last = -1", "keep_last must be a count"),
                        ("keep_last = 0", "keep_last must be a count"),
                        ("daily=7 keep_last=3", "Unclosed inline table at column 9; write "
                                                "the rules as in the config, separated by "
                                                "commas, e.g. 'daily = 7, keep_last = 3'"),
                        ("daily: 7", "at column 6;")):
        res = prune("--retention", bad)
        assert res.returncode == 2 and f"--retention {bad!r}: " in res.stderr, res.stderr
        assert reason in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_prune_store_keeps_a_replication_base_and_prunes_the_rest(tmp_path):
    """--store keeps a base as --config does, in the dry run and the real one alike; no
    line claims a prune that did not happen."""
    Store.mkfs(tmp_path / "s", CHUNK)
    store = Store.open(tmp_path / "s")
    with store.write() as txn:
        for name in ("a", "b", "c"):
            snaps.create(txn, store.db, name)
        snaps.set_hold(txn, store.db, b"\x01" * 16, "a", "file:///elsewhere")
    store.close()

    def prune(*args):
        return subprocess.run([sys.executable, "-m", "cmdline.snapctl", "prune", "--store",
                               str(tmp_path / "s"), "--retention",
                               "keep_last = 1, prune_user = true", *args],
                              capture_output=True, text=True, timeout=60)
    want = ["keep  a: replication base of file:///elsewhere", "prune b",
            "keep  c: newest, keep_last 1"]
    res = prune("--dry-run")
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout.splitlines() == [w + (" (dry run)" if w == "prune b" else "")
                                       for w in want]
    res = prune()
    assert (res.returncode, res.stderr, res.stdout.splitlines()) == (0, "", want)
    store = Store.open(tmp_path / "s", readonly=True, lock=False)
    with store.read() as txn:
        assert [s.name for s in snaps.list_all(txn, store.db)] == ["a", "c"]
    store.close()


# ---- 8: token and transport hygiene ------------------------------------------------------

def test_a_token_file_others_can_read_is_refused(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o644)
    res = subprocess.run([sys.executable, "-m", "cmdline.mountfs", "serve-mirror",
                          str(tmp_path / "m"), "--token-file", str(token)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "readable by group or others" in res.stderr and "chmod 600" in res.stderr
    assert "Traceback" not in res.stderr and TOKEN not in res.stderr


def test_mountfsd_check_warns_about_a_token_others_can_read(tmp_path):
    from test_daemon import write_config
    (tmp_path / "mnt").mkdir()
    for name, mode in (("token", 0o644), ("admin-token", 0o600)):
        (tmp_path / name).write_text(TOKEN)
        (tmp_path / name).chmod(mode)
    config = write_config(tmp_path / "c.toml", tmp_path / "mnt", tmp_path / "state",
                          "https://backup:8765", tmp_path / "token")
    res = subprocess.run([sys.executable, "-m", "daemon.cli", "--check", "--config",
                          str(config)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"token_file {tmp_path / 'token'} is readable by group or others" in res.stderr
    assert "admin_token_file" not in res.stderr


def test_plain_http_on_a_network_address_warns(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    # 192.0.2.1 (TEST-NET) is on no interface: the warning comes, then the bind fails
    res = subprocess.run([sys.executable, "-m", "cmdline.mountfs", "serve-mirror",
                          str(tmp_path / "m"), "--token-file", str(token),
                          "--listen", "192.0.2.1:9"], capture_output=True, text=True,
                         timeout=60)
    assert "WARNING: serving on 192.0.2.1:9 without TLS" in res.stderr


def test_a_listen_address_that_cannot_be_used_is_one_line(tmp_path):
    """Not an exception group from inside the server, and never the server's own default
    port for an address without one; the mirror store is not created for nothing."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)

    def serve_mirror(listen: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cmdline.mountfs", "serve-mirror",
                               str(tmp_path / "m"), "--token-file", str(token), "--listen",
                               listen], capture_output=True, text=True, timeout=60)
    for listen, message in (("127.0.0.1:80000", "port 80000 is out of range 1-65535"),
                            ("localhost", "expected HOST:PORT")):
        res = serve_mirror(listen)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("mountfs serve-mirror: Invalid value for '--listen': "
                                     f"{message}"), res.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = serve_mirror(f"127.0.0.1:{port}")
    assert res.returncode == 1, res.stderr
    assert res.stderr == (f"mountfs: --listen: cannot listen on 127.0.0.1:{port}: Address "
                          f"already in use; choose a free port or an address of this host\n")
    res = serve_mirror("nosuchhost.invalid:9")       # after the warning about plain HTTP
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.splitlines()[-1].startswith(
        "mountfs: --listen: cannot listen on nosuchhost.invalid:9: "), res.stderr
    assert not (tmp_path / "m").exists()


# ---- random mutations of a valid commit -----------------------------------------------------

def mutations():
    """(kind, table, row, depth, number, blob): replace a leaf of the JSON, drop a row, or
    set one field of an inode record (mostly to values that are plausible somewhere)."""
    kind = st.sampled_from(["leaf", "drop", "field"])
    table = st.sampled_from(["entries", "inodes", "xattrs", "chunks"])
    number = st.one_of(st.integers(-2, 2**65), st.sampled_from(
        [0, 1, 2, 3, 4, 5, 6, 900, CHUNK, 2 * CHUNK + 1, stat.S_IFREG | 0o644,
         stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777, stat.S_IFIFO | 0o600, 0o170777,
         (1 << 40) - 1, 1 << 40, (1 << 62) - 1, 1 << 62, 2**64 - 1]))
    return st.tuples(kind, table, st.integers(0, 50), st.integers(0, 8), number,
                     st.binary(max_size=8))


INODE_FIELDS = ("mode", "nlink", "size", "parent", "name", "target", "mepoch", "uid")


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(mutations())
def test_random_mutations_are_refused_or_fsck_clean(world, mutation):
    src, r, m = world
    kind, table, which, depth, number, blob = mutation
    cs = json.loads(json.dumps(src.cs.to_json()))
    rows = cs["inodes" if kind == "field" else table]
    if not rows:
        return
    i = which % len(rows)
    if kind == "drop":
        del rows[i]
    elif kind == "field":
        _set_inode_field(rows[i], INODE_FIELDS[depth % len(INODE_FIELDS)], number, blob)
    else:
        _mutate(rows[i], depth, number, blob)
    before = dump(r)
    res = httpx.post(r.url + "/v1/commit", headers=AUTH, content=commit_body(src, m, cs),
                     timeout=60)
    assert res.status_code == 200 or 400 <= res.status_code < 500, res.text
    event(f"{kind}: {'accepted' if res.status_code == 200 else 'refused'}")
    if res.status_code == 200:
        assert fsck_problems(r) == []
    else:
        assert dump(r) == before


def _set_inode_field(row, name: str, number: int, blob: bytes) -> None:
    """Set one field of the inode record in ``row`` ([ino, base64 record])."""
    if row[1] is None:
        return
    rec = S.Inode.unpack(base64.b64decode(row[1]))
    value = blob if name in ("name", "target") else number
    try:
        row[1] = base64.b64encode(rec.evolve(**{name: value}).pack()).decode()
    except struct.error:
        assume(False)                       # not representable in the record


def _mutate(row, depth: int, number: int, blob: bytes) -> None:
    """Replace one leaf of ``row`` (a JSON list) with a number, a string or None."""
    path = []
    node = row
    for _ in range(depth):
        if isinstance(node, list) and node:
            i = number % len(node) if number >= 0 else 0
            path.append((node, i))
            node = node[i]
        elif isinstance(node, dict) and node:
            k = sorted(node)[abs(number) % len(node)]
            path.append((node, k))
            node = node[k]
        else:
            break
    parent, key = path[-1] if path else (row, 0)
    choice = abs(number) % 3
    parent[key] = number if choice == 0 else base64.b64encode(blob).decode() \
        if choice == 1 else None
