"""Replication to a receiver on loopback: ``mountfs serve-mirror`` for real, in its own
process, reached over HTTP and HTTPS with a bearer token."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import blake3
import httpx
import pytest

from mountfs.store import Store
from replicator.changeset import Changeset
from replicator.client import HttpMirror
from replicator.cycle import replicate
from replicator.mirror import MirrorError
from replicator.server import compress_json

from conftest import ADMIN_TOKEN, TOKEN, Mount, Receiver, cli, free_port
from test_replicate import assert_mirror_equals, churn, populate, staged_count, tamper

def send(m: Mount, url: str, snapshot: str, token=TOKEN, ca_file=None, **kw):
    mirror = HttpMirror(url, token, ca_file=ca_file)
    try:
        return replicate(str(m.store), mirror, snapshot, **kw)
    finally:
        mirror.close()


def test_full_and_incremental_over_http(spark, mounted, receiver, tmp_path):
    m = mounted
    r = receiver()
    populate(m.mnt)
    m.snapctl("create", "s1")
    first = send(m, r.url, "s1")
    assert first.base is None and first.bytes_sent > 0
    churn(m.mnt)
    m.snapctl("create", "s2")
    second = send(m, r.url, "s2")
    assert second.base == "s1"
    r.stop()
    assert_mirror_equals(m, tmp_path / "mirror", "s1", tmp_path, latest=False)
    assert_mirror_equals(m, tmp_path / "mirror", "s2", tmp_path)


@pytest.mark.parametrize("token", [None, "", "wrong-token-wrong-token"])
def test_a_missing_or_wrong_token_gets_401_and_changes_nothing(mounted, receiver, token):
    r = receiver()
    headers = {"Authorization": f"Bearer {token}".strip()} if token is not None else {}
    for method, path in [("GET", "/v1/info"), ("POST", "/v1/chunks"), ("POST", "/v1/commit"),
                         ("POST", "/v1/rollback"), ("POST", "/v1/missing")]:
        res = httpx.request(method, r.url + path, headers=headers, content=b"x")
        assert res.status_code == 401, (method, path)
    if token:
        with pytest.raises(MirrorError, match="refused the token"):
            HttpMirror(r.url, token).info()
    r.stop()
    store = Store.open(r.store, readonly=True, lock=False)
    with store.read() as txn:
        assert txn.stat(store.db["staged"])["entries"] == 0
        assert txn.stat(store.db["snaps"])["entries"] == 0
    store.close()


def test_unreachable_mirror_is_a_clear_error(mounted):
    mounted.snapctl("create", "s1")
    with pytest.raises(MirrorError, match="cannot reach the mirror"):
        send(mounted, f"http://127.0.0.1:{free_port()}", "s1")


def test_malformed_requests_are_refused(receiver):
    r = receiver()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    res = httpx.post(r.url + "/v1/chunks", headers=auth, content=b"not zstd")
    assert res.status_code == 409 and "zstd" in res.json()["error"]
    res = httpx.post(r.url + "/v1/commit", headers=auth,
                     content=__import__("zstandard").ZstdCompressor().compress(b"{}"))
    assert res.status_code == 400 and "malformed" in res.json()["error"]


def test_sigterm_stops_the_receiver_cleanly_with_a_request_in_flight(receiver, tmp_path):
    """SIGTERM (systemd's stop) ends serve-mirror as Ctrl-C does: a request still arriving
    is given a moment, the store is closed (exit 0, the lock released, fsck clean). Also
    when it was started ignoring SIGINT (a background job of a script), where SIGTERM used
    to kill it outright and Ctrl-C did nothing."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)       # inherited by the server
    try:
        r = receiver()
    finally:
        signal.signal(signal.SIGINT, old)
    with socket.create_connection(("127.0.0.1", r.port)) as s:
        s.sendall(f"POST /v1/chunks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                  f"\r\nContent-Length: 100000\r\n\r\n".encode() + b"x" * 1000)
        time.sleep(0.5)
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(timeout=60) == 0, r.log()
    assert "SIGTERM: stopping" in r.log() and "Traceback" not in r.log()
    fsck = subprocess.run([sys.executable, "-m", "cmdline.mountfs", "fsck", str(r.store)],
                          capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_receiver_killed_mid_transfer_then_resumed(mounted, receiver, tmp_path):
    m = mounted
    r = receiver()
    proc = replicate_cli(m, r, tmp_path)
    r.kill9()                                          # the link (and the receiver) die
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert err.startswith("snapctl: ") and "Traceback" not in err
    kept = staged_count(r.store)
    assert kept > 0
    r2 = receiver()
    result = send(m, r2.url, "s1")
    assert result.bytes_sent <= (24 - kept) * (1 << 20)
    r2.stop()
    assert_mirror_equals(m, tmp_path / "mirror", "s1", tmp_path)


def replicate_cli(m, r: Receiver, tmp_path: Path, *args) -> subprocess.Popen:
    """``snapctl replicate`` of 24 MiB in 1 MiB batches to ``r``, once it has started
    staging chunks (so that whatever happens next happens mid-transfer)."""
    for i in range(24):
        (m.mnt / f"f{i}").write_bytes(os.urandom(1 << 20))
    m.snapctl("create", "s1")
    proc = subprocess.Popen([sys.executable, "-m", "cmdline.snapctl", "-m", str(m.mnt),
                             "replicate", "--to", r.url, "--token-file", str(tmp_path / "token"),
                             "--snapshot", "s1", "--batch-size", "1M", "--spark-threshold", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while staged_count(r.store) == 0:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the transfer never started"
        time.sleep(0.05)
    return proc


def test_https_with_a_self_signed_certificate(spark, mounted, receiver, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    r = receiver(tls=(cert, key))
    (mounted.mnt / "f").write_text("over tls")
    mounted.snapctl("create", "s1")
    with pytest.raises(MirrorError, match="cannot reach.*CERTIFICATE_VERIFY_FAILED.*for a "
                       "self-signed receiver pass --ca-file"):      # unknown CA: refused
        send(mounted, r.url, "s1")
    with pytest.raises(MirrorError, match="does not speak TLS there: is it served over "
                       "http://"):                                  # https:// to plain http
        send(mounted, f"https://127.0.0.1:{receiver(store=tmp_path / 'plain').port}", "s1")
    assert send(mounted, r.url, "s1", ca_file=str(cert)).bytes_sent == len("over tls")
    info = HttpMirror(r.url, TOKEN, ca_file=str(cert)).info()
    assert [s["name"] for s in info["snapshots"]] == ["s1"]


def test_verify_and_repair_over_http(spark, mounted, receiver, tmp_path):
    from replicator.verify import verify
    from test_verify import tamper_live
    m = mounted
    (m.mnt / "dir").mkdir()
    for i in range(8):
        (m.mnt / "dir" / f"f{i}").write_bytes(os.urandom(20_000))
    m.snapctl("create", "s1")
    r = receiver()
    send(m, r.url, "s1")
    r.stop()
    tamper_live(tmp_path / "mirror")
    r = receiver()
    mirror = HttpMirror(r.url, TOKEN)
    try:
        found = verify(str(m.store), mirror)
        assert not found.clean and found.mismatched["snapshot"] == 0
        repaired = verify(str(m.store), mirror, repair=True)
        assert repaired.repaired and repaired.clean
    finally:
        mirror.close()
    r.stop()
    assert_mirror_equals(m, tmp_path / "mirror", "s1", tmp_path)


def test_restore_from_an_http_mirror(spark, mounted, receiver, tmp_path):
    from test_replicate import tree_state
    m = mounted
    populate(m.mnt)
    m.snapctl("create", "s1")
    r = receiver()
    send(m, r.url, "s1")
    want = tree_state(m.mnt / ".snapshot/s1")
    m.snapctl("delete", "s1")
    res = m.snapctl("restore", "--from", r.url, "--token-file", tmp_path / "token", "s1",
                    "--to", "back", check=False)
    assert res.returncode == 0, res.stderr
    assert tree_state(m.mnt / "back") == want
    res = m.snapctl("restore", "--from", r.url, "s1", "--to", "again", check=False)
    assert res.returncode == 1 and "no token" in res.stderr


def test_a_store_of_its_own_is_served_and_replaced_only_when_forced(spark, mounted, receiver,
                                                                     tmp_path):
    """serve-mirror will not serve a store that is no mirror and has a file of its own
    unless given --force; served, a replicate is refused without --force (and the receiver
    refuses the commit of a client that does not check), its --force travels in the commit,
    checked, and needs the admin token (which the client learns from /v1/info, so a
    replicate token is refused before any chunk is sent); with both, the store becomes a
    mirror."""
    m, own = mounted, tmp_path / "mirror"
    Store.mkfs(own)
    tamper(own)
    res = subprocess.run([sys.executable, "-m", "cmdline.mountfs", "serve-mirror", str(own),
                          "--token-file", str(tmp_path / "token")], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 1 and res.stderr.splitlines() == [
        f"mountfs: {own} is a mountfs store with files of its own, not a mirror: serving it "
        f"would offer them to be replaced; serve a new or empty directory, or pass --force "
        f"to serve this store all the same"]
    r = receiver(extra=("--force",))
    (m.mnt / "f").write_text("x")
    m.snapctl("create", "s1")
    with pytest.raises(MirrorError, match=f"^{r.url} is a mountfs store with files of its "
                                          f"own, not a mirror: .* pass --force"):
        send(m, r.url, "s1")
    client = HttpMirror(r.url, TOKEN)
    raw, transfer = json.dumps(Changeset().to_json()).encode(), os.urandom(16)
    client.stage_part(transfer, 0, raw)
    commit = {"source_uuid": "01" * 16, "base_uuid": None, "reconcile": True,
              "snapshot": {"name": "s", "uuid": "ab" * 16, "created_ns": 1},
              "transfer": transfer.hex(), "parts": [blake3.blake3(raw).hexdigest()]}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for force, status, reason in ((None, 409, "receiving store is a mountfs store with files"),
                                  ("yes", 400, "force must be true or false"),
                                  (True, 403, "needs the admin token")):
        body = commit if force is None else {**commit, "force": force}
        res = httpx.post(r.url + "/v1/commit-parts", headers=auth, content=compress_json(body))
        assert res.status_code == status and reason in res.json()["error"], res.text
    phases = []
    with pytest.raises(MirrorError, match=f"^{r.url} is a mountfs store with files of its "
                                          f"own, and this token may only add snapshots: "
                                          f"--force, .* needs the admin token"):
        send(m, r.url, "s1", force=True, phase=phases.append)
    assert phases == []                   # refused before listing, sending or committing
    assert HttpMirror(r.url, TOKEN).info()["snapshots"] == []
    send(m, r.url, "s1", token=ADMIN_TOKEN, force=True)
    r.stop()
    assert_mirror_equals(m, own, "s1", tmp_path)


def test_a_hung_receiver_trips_the_watchdog_and_the_rerun_resumes(mounted, receiver, tmp_path):
    m = mounted
    r = receiver()
    proc = replicate_cli(m, r, tmp_path, "--stall-timeout", "10")
    r.proc.send_signal(signal.SIGSTOP)                 # the peer hangs: no error, no bytes
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        r.proc.send_signal(signal.SIGCONT)
    assert proc.returncode == 1
    assert "no chunk batch finished in 10 s" in err and "Traceback" not in err
    result = send(m, r.url, "s1")
    assert result.bytes_sent < 24 * (1 << 20)
    r.stop()
    assert_mirror_equals(m, tmp_path / "mirror", "s1", tmp_path)


def test_a_killed_spark_worker_is_retried_and_the_cycle_completes(mounted, receiver, tmp_path):
    m = mounted
    r = receiver()
    proc = replicate_cli(m, r, tmp_path, "--json")
    workers = [pid for pid in descendants(proc.pid)
               if b"pyspark.daemon" in cmdline(pid) or b"pyspark.worker" in cmdline(pid)]
    assert workers, "no Spark Python worker to kill"
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    r.stop()
    assert_mirror_equals(m, tmp_path / "mirror", "s1", tmp_path)


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_reading_a_served_mirrors_store_says_how(receiver):
    """`snapctl --store MIRROR list` while serve-mirror holds the store said only that a
    store has one writer at a time, though list only reads: it now says how to read it."""
    r = receiver()
    res = cli("snapctl", "--store", r.store, "list", check=False)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.strip().endswith(
        "a store has only one writer at a time: stop that serve-mirror first, or read the "
        "mirror meanwhile through a read-only mount ('mountfs mount --read-only STORE DIR', "
        "then 'snapctl -m DIR list')"), res.stderr
