"""How long one call to a mirror may take, enforced at its socket, and stopping calls at once.

A socket read timeout bounds only the gap between two bytes: a hostile or broken mirror that
sends one byte every few seconds (in its TLS handshake, its headers or its body) would hold
a call, and the replication cycle waiting on it, for ever (Python's ssl module bounds a TLS
handshake as a whole by the connect timeout; nothing bounds the rest). So each call (``CallDeadline``)
has ``seconds`` to answer, plus one second per ``MIN_RATE`` bytes moved either way (the rule
a receiver applies to request bodies): an honest slow link keeps its call, a drip loses it.

The HTTP client's connections go through ``Transport`` (an httpx transport on an httpcore
pool whose network backend wraps every socket). One watchdog thread per process shuts down
the socket of a call past its deadline; ``abort_calls`` shuts down every call in flight (a
daemon told to stop: a thread blocked in a read cannot be cancelled otherwise). The blocked
read then fails, and the caller reads why from the call's ``CallDeadline``."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
import weakref

import httpcore
import httpx

MIN_RATE = 64 << 10          # bytes/s a call must average once its answer time is over
WRITE_PIECE = 64 << 10       # a request body is written (and counted) in pieces this big
WATCH_SECONDS = 0.5          # how often the watchdog looks at the calls in flight


class CallDeadline:
    """One call's time: ``seconds`` plus the bytes it moved at MIN_RATE. ``why`` says, once
    it is over, whether it expired or was aborted (None while it runs or if it finished)."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.seconds = seconds
        self.moved = 0
        self.finished = False
        self.why: str | None = None

    def over(self, now: float) -> bool:
        return now > self.start + self.seconds + self.moved / MIN_RATE

    def expire(self) -> None:
        self.why = (f"no complete answer after {time.monotonic() - self.start:.0f} s "
                    f"({self.moved} bytes moved; a mirror has {self.seconds:g} s to answer, "
                    f"then must keep up {MIN_RATE >> 10} KiB/s)")

    def abort(self) -> None:
        self.why = "the call was aborted: this process is stopping"


_local = threading.local()            # the calling thread's CallDeadline, if in a call


@contextlib.contextmanager
def call_deadline(seconds: float):
    """The deadline of the calls this thread makes inside the ``with`` (one call)."""
    deadline = CallDeadline(seconds)
    outer, _local.deadline = getattr(_local, "deadline", None), deadline
    try:
        yield deadline
    finally:
        deadline.finished = True
        _local.deadline = outer


class _Stream(httpcore.NetworkStream):
    """A connection's socket, counting what each call moves through it, registered with the
    watchdog while open. The watchdog shuts it down by its descriptor (the same before and
    after TLS wraps it), under a lock that ``close`` takes: never a descriptor that was
    closed and handed to another socket meanwhile."""

    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner
        self._fd = inner.get_extra_info("socket").fileno()
        self._lock = threading.Lock()
        self._open = True
        self.deadline = getattr(_local, "deadline", None)
        _watchdog.add(self)

    def _call(self) -> CallDeadline | None:
        self.deadline = getattr(_local, "deadline", None)
        return self.deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        deadline = self._call()
        data = self._inner.read(max_bytes, timeout)
        if deadline is not None:
            deadline.moved += len(data)
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        deadline = self._call()
        view = memoryview(buffer)
        for at in range(0, len(view), WRITE_PIECE):
            piece = view[at:at + WRITE_PIECE]
            self._inner.write(piece, timeout)
            if deadline is not None:
                deadline.moved += len(piece)

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        self._call()
        try:
            tls = _Stream(self._inner.start_tls(ssl_context, server_hostname, timeout))
        finally:
            self._forget()            # the TLS stream owns the descriptor from here
        return tls

    def close(self) -> None:
        self._forget()
        with self._lock:
            self._inner.close()

    def _forget(self) -> None:
        with self._lock:
            self._open = False
        _watchdog.discard(self)

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)

    def shut_down(self) -> None:
        """Wake whatever blocks on the socket (from another thread): reads end, writes fail."""
        with self._lock:
            if not self._open:
                return
            sock = socket.socket(fileno=self._fd)
            try:
                with contextlib.suppress(OSError):      # the peer closed it already
                    sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()


class _Backend(httpcore.SyncBackend):
    def connect_tcp(self, *args, **kwargs) -> httpcore.NetworkStream:
        return _Stream(super().connect_tcp(*args, **kwargs))


class _Watchdog:
    """The open streams, and the thread that shuts down those past their call's deadline."""

    def __init__(self):
        self._lock = threading.Lock()
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self._pid = None              # the process whose thread runs (none after a fork)

    def add(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.add(stream)
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._watch, name="mirror-call-deadlines",
                                 daemon=True).start()

    def discard(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def in_calls(self) -> list[tuple[_Stream, CallDeadline]]:
        with self._lock:
            streams = list(self._streams)
        return [(s, d) for s in streams
                if (d := s.deadline) is not None and not d.finished and d.why is None]

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            now = time.monotonic()
            for stream, deadline in self.in_calls():
                if deadline.over(now):
                    deadline.expire()
                    stream.shut_down()


_watchdog = _Watchdog()


def abort_calls() -> int:
    """Make every call to a mirror in flight in this process fail now; how many there were."""
    calls = _watchdog.in_calls()
    for stream, deadline in calls:
        deadline.abort()
        stream.shut_down()
    return len(calls)


class Transport(httpx.BaseTransport):
    """httpx's transport, on sockets the watchdog sees (see the module's docstring)."""

    def __init__(self, ssl_context: ssl.SSLContext):
        self._pool = httpcore.ConnectionPool(ssl_context=ssl_context, network_backend=_Backend())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port,
                             target=url.raw_path),
            headers=request.headers.raw, content=request.stream,
            extensions=request.extensions)
        with _as_httpx():
            response = self._pool.handle_request(core)
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_Body(response), extensions=response.extensions)

    def close(self) -> None:
        self._pool.close()


class _Body(httpx.SyncByteStream):
    def __init__(self, response: httpcore.Response):
        self._response = response

    def __iter__(self):
        with _as_httpx():
            yield from self._response.stream

    def close(self) -> None:
        self._response.close()


@contextlib.contextmanager
def _as_httpx():
    """httpcore's errors as httpx's of the same name, which the client's callers catch."""
    try:
        yield
    except httpcore.TimeoutException as e:
        raise getattr(httpx, type(e).__name__, httpx.TimeoutException)(str(e)) from e
    except httpcore.NetworkError as e:
        raise getattr(httpx, type(e).__name__, httpx.NetworkError)(str(e)) from e
    except (httpcore.ProtocolError, httpcore.UnsupportedProtocol, httpcore.ProxyError) as e:
        raise getattr(httpx, type(e).__name__, httpx.TransportError)(str(e)) from e
