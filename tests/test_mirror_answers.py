"""A mirror that answers too slowly on purpose loses the call (replicator/calltime.py), and
an answer no receiver gives is named for what it is (replicator/client.py).

Real sockets on loopback: a server thread that sends a *complete, valid* /v1/info answer one
byte at a time (in its headers or its body), so a client bounded only by a read timeout per
byte would wait it out; and one that never answers, whose call ``abort_calls`` must end. An
honest slow answer keeps its call. (A TLS handshake is bounded as a whole by Python's ssl
module: the connect timeout is its deadline.)"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from replicator.calltime import abort_calls
from replicator.client import HttpMirror
from replicator.mirror import MirrorError

INFO = json.dumps({"format": 2, "uuid": "ab" * 16, "mirror_of": None, "chunk_size": 1 << 20,
                   "buckets": 1024, "empty": True, "snapshots": []}).encode()
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + \
    str(len(INFO)).encode() + b"\r\n\r\n" + INFO


class SlowServer:
    """Accepts one connection, reads the request, then runs ``answer(conn)``; closes it
    after at most ``hold`` seconds, so no test can hang on it."""

    def __init__(self, answer, hold: float = 40.0):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.asked = threading.Event()
        self.answer, self.hold = answer, hold
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(self.hold)
        with conn:
            try:
                conn.recv(65536)
                self.asked.set()
                self.answer(conn, time.monotonic() + self.hold)
            except OSError:
                pass                 # the client gave up and closed: what the tests want


def drip(data: bytes, every: float):
    def send(conn, until):
        for i in range(len(data)):
            if time.monotonic() > until:
                return
            conn.sendall(data[i:i + 1])
            time.sleep(every)
    return send


def drip_headers(conn, until):
    drip(ANSWER, 0.1)(conn, until)          # 25 s for the whole answer


def drip_body(conn, until):
    head, body = ANSWER.split(b"\r\n\r\n", 1)
    conn.sendall(head + b"\r\n\r\n")
    drip(body, 0.15)(conn, until)


def silent(conn, until):
    time.sleep(max(0.0, until - time.monotonic()))


def mirror(url: str, seconds: float) -> HttpMirror:
    m = HttpMirror(url, "token")
    m.client.timeout = httpx.Timeout(seconds, connect=seconds)
    return m


@pytest.mark.parametrize("answer", [drip_headers, drip_body], ids=["headers", "body"])
def test_a_mirror_that_drips_its_answer_loses_the_call(answer):
    """Each byte comes well within the 1 s read timeout; the whole answer would take 25 s:
    the call ends at its deadline, saying why."""
    server = SlowServer(answer)
    with pytest.raises(MirrorError) as e:
        mirror(server.url, 1.0).info()
    assert "no complete answer after" in str(e.value) and server.url in str(e.value), e.value
    assert len(str(e.value).splitlines()) == 1


def test_an_honest_slow_answer_keeps_its_call():
    """An answer that starts after most of the answer time and then moves 48 KiB at
    ~100 KiB/s: within the rule (answer time, then 64 KiB/s), so it is taken."""
    body = json.dumps({**json.loads(INFO), "pad": "x" * (48 << 10)}).encode()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    def slow(conn, until):
        time.sleep(1.5)
        for at in range(0, len(answer), 4096):
            conn.sendall(answer[at:at + 4096])
            time.sleep(0.04)
    server = SlowServer(slow)
    assert mirror(server.url, 2.0).info()["empty"] is True


def test_abort_calls_ends_a_call_the_mirror_never_answers():
    """What mountfsd does when told to stop: a thread blocked reading a silent mirror (with
    the default 600 s to answer) fails at once, saying why."""
    server = SlowServer(silent)
    failed: list[BaseException] = []

    def call():
        try:
            HttpMirror(server.url, "token").info()
        except BaseException as e:          # noqa: BLE001 - handed to the test's thread
            failed.append(e)
    caller = threading.Thread(target=call)
    caller.start()
    assert server.asked.wait(10)
    time.sleep(0.2)                         # the caller is now blocked reading
    assert abort_calls() == 1
    caller.join(10)
    assert not caller.is_alive(), "abort_calls did not end the call"
    assert len(failed) == 1 and isinstance(failed[0], MirrorError), failed
    assert "aborted" in str(failed[0])


@pytest.mark.parametrize("status, headers, body, said", [
    (302, "Location: https://login.example/sso\r\n", b"", "a redirect to "
     "'https://login.example/sso'"),
    (404, "Content-Type: text/html\r\n", b"<h1>Not Found</h1>", "'<h1>Not Found</h1>'"),
    (502, "", b"Bad Gateway", "'Bad Gateway'"),
])
def test_an_answer_no_receiver_gives_says_check_the_url(status, headers, body, said):
    """A redirect was called "a malformed response (not JSON)", a proxy's 404 page
    "mirror: <h1>Not Found</h1>": neither says that something else answers at that URL."""
    def answer(conn, until):
        conn.sendall(b"HTTP/1.1 %d X\r\n%sContent-Length: %d\r\n\r\n%s"
                     % (status, headers.encode(), len(body), body))
    server = SlowServer(answer)
    with pytest.raises(MirrorError) as e:
        mirror(server.url, 10.0).info()
    assert str(e.value) == (f"the mirror at {server.url} answered HTTP {status} to /v1/info "
                            f"({said}), which a 'mountfs serve-mirror' receiver never does: "
                            f"check the URL (and any proxy in front of it)")


def test_ctrl_c_while_a_command_waits_on_a_mirror_is_one_line_and_130(tmp_path):
    """click's own answer to Ctrl-C was "Aborted!" and status 1, which for `verify` means
    "the mirror differs". Here verify waits on a mirror that never answers."""
    from conftest import as_typed_at_a_terminal, cli
    cli("mountfs", "mkfs", tmp_path / "store")
    token = tmp_path / "token"
    token.write_text("token\n")
    token.chmod(0o600)
    server = SlowServer(silent)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cmdline.snapctl", "--store", str(tmp_path / "store"), "verify",
         "--mirror", server.url, "--token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=as_typed_at_a_terminal)
    assert server.asked.wait(60)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "snapctl: interrupted\n"), (out, err)
