"""The client side of an ``http(s)://`` mirror (see replicator.server for the API).

The mirror is not trusted either: every response is read with a hard cap on its size (raw
and decompressed), and a body that is not what the call expects is a one-line error."""

from __future__ import annotations

import contextlib
import ssl

import httpx

from mountfs import schema as S
from mountfs.store import StoreError

from .calltime import Transport, call_deadline
from .changeset import Changeset
from .mirror import MirrorError, SnapshotRef
from .server import (MAX_BODY, compress, compress_json, decompress, loads, pack_frames,
                     unpack_frames)


class MirrorUnreachable(MirrorError):
    """A call whose answer never came whole (the connection failed, the deadline passed, the
    answer overran its cap): what the mirror did with it is not known."""


TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=600.0, pool=10.0)


def commit_timeout(parts: int) -> httpx.Timeout:
    """How long a commit may take to answer: the receiver applies and checks every part
    before it replies (a million-file first copy, ~200 parts, takes minutes), so the wait
    grows with the parts rather than cutting a commit that is working."""
    return httpx.Timeout(connect=10.0, read=600.0 + 10.0 * parts, write=600.0, pool=10.0)


def _client(url: str, token: str | None, ca_file: str | None) -> httpx.Client:
    if not token:
        raise StoreError("no token for the mirror (none given, or an empty token file): "
                         "pass --token-file FILE or set MOUNTFS_TOKEN")
    if not all(" " < c <= "~" for c in token):
        raise StoreError("the mirror's token has a character a bearer token cannot carry "
                         "(a space, a control character or a non-ASCII one such as a "
                         "typographic quote): fix its token file or MOUNTFS_TOKEN")
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}",
                                               "Accept-Encoding": "identity"},
                        timeout=TIMEOUT, transport=Transport(_tls_context(ca_file)))


def _tls_context(ca_file: str | None) -> ssl.SSLContext:
    """httpx's default trust store, or only ``ca_file`` (a self-signed receiver's cert)."""
    if ca_file is None:
        return httpx.create_ssl_context()
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise StoreError(f"cannot use CA file {ca_file}: {e}") from None


def _call(client: httpx.Client, method: str, path: str, body: bytes | None = None,
          limit: int = MAX_BODY, timeout: httpx.Timeout | None = None):
    """One request; the response is held only up to ``limit`` bytes. The whole call has
    the timeout's read time, plus a second per ``calltime.MIN_RATE`` bytes moved: a
    mirror that answers a byte at a time does not hold it (or a daemon's cycle) for ever."""
    timeout = timeout or client.timeout
    with call_deadline(timeout.read) as deadline:
        try:
            with client.stream(method, path, content=body, timeout=timeout) as streamed:
                data = bytearray()
                for piece in streamed.iter_raw():
                    data += piece
                    if len(data) > limit:
                        raise MirrorUnreachable(f"the mirror at {client.base_url} sent a "
                                                f"response over {limit} bytes; refused")
                res = httpx.Response(streamed.status_code, headers=streamed.headers,
                                     content=bytes(data))
        except httpx.HTTPError as e:
            if deadline.why is not None:
                raise MirrorUnreachable(f"the mirror at {client.base_url}: {deadline.why}") \
                    from None
            raise MirrorUnreachable(f"cannot reach the mirror at {client.base_url}: "
                                    f"{e}{_tls_hint(e)}") from None
    if res.status_code == 401:
        raise MirrorError(f"the mirror at {client.base_url} refused the token (401)")
    if not 200 <= res.status_code < 300:
        raise _refusal(client.base_url, path, res)
    return res


def _tls_hint(e: httpx.HTTPError) -> str:
    """What to do about the two TLS failures a user meets first."""
    if "CERTIFICATE_VERIFY_FAILED" in str(e):
        return ("; the mirror's certificate is not one this host trusts: for a self-signed "
                "receiver pass --ca-file (ca_file in mountfsd's config) with its certificate")
    if "WRONG_VERSION_NUMBER" in str(e):
        return "; the receiver does not speak TLS there: is it served over http:// ?"
    return ""


def _refusal(url, path: str, res: httpx.Response) -> MirrorError:
    """A receiver refuses with its reason as JSON ``error``; any other answer that is not a
    success comes from something else at that URL (a proxy, another server, a redirect)."""
    with contextlib.suppress(ValueError, KeyError, TypeError, RecursionError):
        return MirrorError(f"mirror: {' '.join(str(res.json()['error']).split())[:300]}")
    where = res.headers.get("location")
    said = f"a redirect to {where[:200]!r}" if where else \
        repr(" ".join(res.text.split())[:100])
    return MirrorError(f"the mirror at {url} answered HTTP {res.status_code} to {path} "
                       f"({said}), which a 'mountfs serve-mirror' receiver never does: "
                       f"check the URL (and any proxy in front of it)")


def _json(raw: bytes, url: str):
    """A JSON response from the mirror at ``url``; anything else is the mirror's fault,
    said once."""
    try:
        return loads(raw)
    except (ValueError, UnicodeError):
        raise MirrorError(f"the mirror at {url} sent a malformed response (not JSON)") \
            from None


def _wrong(url: str, what: str, problem: str) -> MirrorError:
    """An answer of the wrong shape from the mirror at ``url``: one line naming both."""
    return MirrorError(f"the mirror at {url} sent a malformed {what} answer: {problem}")


_INFO = {"format": (int,), "uuid": (str,), "mirror_of": (str, type(None)),
         "chunk_size": (int,), "buckets": (int,), "empty": (bool,), "snapshots": (list,)}
_SNAPSHOT = {"name": (str,), "uuid": (str,), "epoch": (int,), "created_ns": (int,),
             "changed_since": (bool,)}
_UUIDS = ("uuid", "mirror_of")            # a str there is 32 lowercase hex digits


def _fields(value, fields: dict, where: str) -> str | None:
    """What is wrong with the JSON object ``value`` against ``fields`` (key -> the types its
    value may have), or None."""
    if not isinstance(value, dict):
        return f"{where.rstrip('.') or 'the answer'} is not an object"
    for key, types in fields.items():
        if key not in value:
            return f"{where}{key} is missing"
        v = value[key]
        if type(v) not in types:          # exact: JSON true is no number, 1 no boolean
            return f"{where}{key} is {_json_type(v)}, not {_json_type(types[0]())}"
        if key in _UUIDS and isinstance(v, str) and not _is_uuid(v):
            return f"{where}{key} is not a uuid (32 hex digits)"
        if type(v) is int and v < 0:
            return f"{where}{key} is negative"
    return None


def _json_type(v) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object", type(None): "null"}.get(type(v), "?")


def _is_uuid(v: str) -> bool:
    return len(v) == 32 and all(c in "0123456789abcdef" for c in v)


def checked_info(url: str, info) -> dict:
    """The mirror's ``/v1/info`` with every key the source reads, of the type it reads."""
    problem = _fields(info, _INFO, "")
    if problem is None:
        if info["format"] not in S.MIRROR_FORMATS:
            raise MirrorError(f"the mirror at {url} keeps store format {info['format']}, "
                              f"this source's is {S.FORMAT_VERSION}")
        if not 0 < info["chunk_size"] or not 0 < info["buckets"]:
            problem = "'chunk_size' and 'buckets' must be positive"
        elif "rights" in info and info["rights"] not in ("admin", "replicate"):
            problem = "'rights' is neither 'admin' nor 'replicate'"
    for i, snap in enumerate(info["snapshots"] if problem is None else []):
        problem = _fields(snap, _SNAPSHOT, f"snapshots[{i}].")
        if problem is not None:
            break
    if problem is not None:
        raise _wrong(url, "/v1/info", problem)
    return info


@contextlib.contextmanager
def _malformed(what: str, url: str):
    """A response that does not have the shape the call expects: one line, not a trace."""
    try:
        yield
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        raise MirrorError(f"the mirror at {url} sent a malformed {what} response") from None


class HttpSink:
    """What a Spark task uses to stage chunks on the receiver (picklable: it holds only the
    URL and the token, and opens its own connection)."""

    remote = True                  # reachable from executors on any host
    timeout: float | None = None   # per request, when a task must fail before a watchdog

    def __init__(self, url: str, token: str, ca_file: str | None):
        self.url = url
        self.token = token
        self.ca_file = ca_file

    def _client(self) -> httpx.Client:
        client = _client(self.url, self.token, self.ca_file)
        if self.timeout:
            client.timeout = httpx.Timeout(self.timeout, connect=min(10.0, self.timeout))
        return client

    def put(self, chunks) -> tuple[int, int]:
        with self._client() as client:
            reply = _json(_call(client, "POST", "/v1/chunks", pack_frames(chunks)).content,
                          self.url)
        with _malformed("chunks", self.url):
            return int(reply["stored"]), int(reply["bytes"])

    def missing(self, digests: list[bytes]) -> list[bytes]:
        """Which of ``digests`` the mirror lacks (a retried task sends only those): each
        one of those asked for, at most once."""
        with self._client() as client:
            raw = _call(client, "POST", "/v1/missing", compress(b"".join(digests))).content
        if len(raw) % 32 or len(raw) > 32 * len(digests):
            raise _wrong(self.url, "/v1/missing", f"{len(raw)} bytes for {len(digests)} "
                         f"digests asked (32 bytes each, at most one per digest asked)")
        lacking = [raw[i:i + 32] for i in range(0, len(raw), 32)]
        asked = set(digests)
        if len(set(lacking)) != len(lacking) or not asked.issuperset(lacking):
            raise _wrong(self.url, "/v1/missing", "a digest that was not asked for, or one "
                         "twice")
        return lacking


class HttpMirror:
    """A mirror behind ``mountfs serve-mirror``."""

    def __init__(self, url: str, token: str | None, ca_file: str | None = None,
                 max_response: int = MAX_BODY):
        self.url = url.rstrip("/")
        self.client = _client(self.url, token, ca_file)
        self.sink = HttpSink(self.url, token, ca_file)
        self.limit = max_response         # bytes of one response, raw and decompressed
        self.buckets: int | None = None   # as its last /v1/info said

    def _call(self, method: str, path: str, body: bytes | None = None) -> httpx.Response:
        return _call(self.client, method, path, body, self.limit)

    def info(self) -> dict:
        info = checked_info(self.url, _json(self._call("GET", "/v1/info").content, self.url))
        self.buckets = info["buckets"]
        return info

    def missing(self, digests: list[bytes]) -> list[bytes]:
        return self.sink.missing(digests)

    def commit(self, source_uuid: bytes, base_uuid: str | None, snap: SnapshotRef,
               cs: Changeset, reconcile: bool = False) -> None:
        self._call("POST", "/v1/commit", compress_json({
            "source_uuid": source_uuid.hex(), "base_uuid": base_uuid, "reconcile": reconcile,
            "snapshot": {"name": snap.name, "uuid": snap.uuid, "created_ns": snap.created_ns},
            "changeset": cs.to_json()}))

    def stage_part(self, transfer: bytes, index: int, raw: bytes) -> None:
        _call(self.client, "POST", f"/v1/parts/{transfer.hex()}/{index}", compress(raw))

    def commit_parts(self, source_uuid: bytes, base_uuid: str | None, snap: SnapshotRef,
                     transfer: bytes, digests: list[bytes], reconcile: bool = False,
                     force: bool = False) -> None:
        _call(self.client, "POST", "/v1/commit-parts", compress_json({
            "source_uuid": source_uuid.hex(), "base_uuid": base_uuid, "reconcile": reconcile,
            "force": force,
            "snapshot": {"name": snap.name, "uuid": snap.uuid, "created_ns": snap.created_ns},
            "transfer": transfer.hex(), "parts": [d.hex() for d in digests]}),
            timeout=commit_timeout(len(digests)))

    def rollback_to(self, base_uuid: str) -> None:
        self._call("POST", "/v1/rollback", compress_json({"base_uuid": base_uuid}))

    def stage(self, chunks) -> tuple[int, int]:
        return self.sink.put(chunks)

    def delete_snapshot(self, name: str) -> None:
        self._call("POST", "/v1/delete-snapshot", compress_json({"name": name}))

    def export(self, snapshot: str, path: str) -> list[dict]:
        res = self._call("POST", "/v1/export",
                         compress_json({"snapshot": snapshot, "path": path}))
        return _json(decompress(res.content, self.limit), self.url)

    def read_chunks(self, digests: list[bytes]) -> list[tuple[bytes, bytes]]:
        res = self._call("POST", "/v1/read-chunks", compress(b"".join(digests)))
        return unpack_frames(res.content, self.limit)

    def bucket_hashes(self, snap_uuid: str | None, recompute: bool = False) -> list[bytes]:
        body = compress_json({"snapshot": snap_uuid, "recompute": recompute})
        raw = self._call("POST", "/v1/buckets", body).content
        if self.buckets is None:
            self.info()                   # how many buckets it keeps: what to expect
        if len(raw) != 32 * self.buckets:
            raise _wrong(self.url, "/v1/buckets", f"{len(raw)} bytes where its {self.buckets} "
                         f"buckets take {32 * self.buckets}")
        return [raw[i:i + 32] for i in range(0, len(raw), 32)]

    def bucket_items(self, snap_uuid: str | None, wanted: list[int]) -> dict:
        res = self._call("POST", "/v1/bucket-items",
                         compress_json({"snapshot": snap_uuid, "buckets": wanted}))
        body = _json(decompress(res.content, self.limit), self.url)
        with _malformed("bucket-items", self.url):
            items = {int(b): {bytes.fromhex(i): bytes.fromhex(h) for i, h in its.items()}
                     for b, its in body.items()}
        if set(items) != set(wanted):
            raise _wrong(self.url, "/v1/bucket-items", "not the buckets asked for")
        return items

    def scrub(self) -> dict[str, list[bytes]]:
        found = _json(self._call("POST", "/v1/scrub").content, self.url)
        with _malformed("scrub", self.url):
            return {k: [bytes.fromhex(d) for d in v] for k, v in found.items()}

    def replace_chunks(self, chunks) -> None:
        self._call("POST", "/v1/replace-chunks", pack_frames(chunks))

    def repair(self, base_uuid: str, cs: Changeset) -> None:
        self._call("POST", "/v1/repair",
                   compress_json({"base_uuid": base_uuid, "changeset": cs.to_json()}))

    def close(self) -> None:
        self.client.close()

