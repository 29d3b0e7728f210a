"""`snapctl restore --from` against a hostile mirror: a real HTTP server in this process
speaks the mirror protocol but answers with crafted listings and chunk data. Whatever it
sends, nothing is written outside the restore's target (checked by looking outside
afterwards), wrong data is never written, and special files need --allow-special.

One mount serves every case (each restores into its own directory name).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import blake3
import pytest
from conftest import Mount, as_typed_at_a_terminal, cli, fsck_clean

from replicator.server import compress, compress_json, decompress, pack_frames

pytestmark = pytest.mark.fuse

CHUNK = 1 << 20


class HostileMirror(ThreadingHTTPServer):
    """Answers /v1/info, /v1/export and /v1/read-chunks with whatever ``listing`` and
    ``blobs`` say (blobs: digest -> the bytes sent for it, true or not)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.listing: list = []
        self.blobs: dict[bytes, bytes] = {}
        self.info: object = None                  # /v1/info's JSON (None: a plausible one)
        self.answers: dict[str, bytes] = {}       # any other path -> the bytes it answers
        self.prefixed: dict[str, bytes] = {}      # a path's start -> the bytes it answers
        self.refusals: dict[str, int] = {}        # a path -> the 4xx it answers, or 0: the
                                                  # connection closed without an answer
        self.stall_on: bytes | None = None         # a digest whose request waits for release
        self.release = threading.Event()
        self.stalled = threading.Event()           # set once that request came
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, body: bytes, kind="application/octet-stream"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.server.info is not None:
            return self._reply(json.dumps(self.server.info).encode(), "application/json")
        self._reply(json.dumps({"format": 2, "uuid": "ab" * 16, "mirror_of": None,
                                "chunk_size": CHUNK, "buckets": 1024, "empty": False,
                                "snapshots": []}).encode(), "application/json")

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"] or 0))
        prefixed = next((answer for start, answer in self.server.prefixed.items()
                         if self.path.startswith(start)), None)
        if self.path in self.server.refusals:
            status = self.server.refusals[self.path]
            if not status:
                self.close_connection = True
                return
            self.send_response(status)
            error = json.dumps({"error": "refused by the test's mirror"}).encode()
            self.send_header("Content-Length", str(len(error)))
            self.end_headers()
            self.wfile.write(error)
        elif self.path in self.server.answers:
            self._reply(self.server.answers[self.path])
        elif prefixed is not None:
            self._reply(prefixed)
        elif self.path == "/v1/export":
            self._reply(compress_json(self.server.listing))
        elif self.path == "/v1/read-chunks":
            raw = decompress(body)
            wanted = [raw[i:i + 32] for i in range(0, len(raw), 32)]
            if self.server.stall_on in wanted:
                self.server.stalled.set()
                self.server.release.wait(60)
            self._reply(pack_frames([(d, self.server.blobs.get(d, b"")) for d in wanted]))
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def fs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    cli("mountfs", "mkfs", base / "store")
    (base / "mnt").mkdir()
    m = Mount(base / "store", base / "mnt").mount()
    (base / "token").write_text("t" * 32)
    os.chmod(base / "token", 0o600)
    server = HostileMirror()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield m, server, base
    server.shutdown()
    m.cleanup()
    fsck_clean(m.store)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory the mirror would like to write into; it must stay as it is."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "keep").write_text("mine")
    return d


def tree(p: Path) -> dict:
    out = {}
    for root, dirs, files in os.walk(p):
        for n in dirs + files:
            q = Path(root) / n
            st = os.lstat(q)
            out[str(q.relative_to(p))] = (st.st_mode, q.read_bytes() if stat.S_ISREG(st.st_mode)
                                          else None)
    return out


def restore(fs, dest: str, *extra) -> "subprocess.CompletedProcess":
    m, server, base = fs
    return cli("snapctl", "-m", m.mnt, "restore", "--from", server.url, "--token-file",
               base / "token", "s", "--to", dest, *extra, check=False)


def d(path: str, mode=0o755) -> dict:
    return {"path": path, "mode": stat.S_IFDIR | mode, "uid": 0, "gid": 0, "atime_ns": 0,
            "mtime_ns": 0, "size": 0, "rdev": 0, "target": "", "xattrs": {}}


def f(path: str, data: bytes = b"", mode=0o644, length=None, sent=None, **kw) -> tuple:
    """A file entry and the blob the server sends for it (``sent`` instead of the truth)."""
    digest = blake3.blake3(data).digest()
    entry = {**d(path), "mode": stat.S_IFREG | mode, "size": len(data),
             "chunks": [[0, digest.hex(), len(data) if length is None else length]]
             if data else [], **kw}
    return entry, {digest: data if sent is None else sent}


def link(path: str, target: str) -> dict:
    return {**d(path), "mode": stat.S_IFLNK | 0o777, "target": target.encode().hex()}


def serve(fs, *items) -> None:
    _, server, _ = fs
    server.listing, server.blobs = [], {}
    for item in items:
        entry, blobs = item if isinstance(item, tuple) else (item, {})
        server.listing.append(entry)
        server.blobs.update(blobs)


def refused(res, *words) -> None:
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
    for w in words:
        assert w in res.stderr, res.stderr


def test_a_faithful_listing_is_restored(fs):
    """The control case: the hostile server can restore, so the refusals below are real."""
    m = fs[0]
    serve(fs, d("."), d("./sub", 0o750), f("./sub/a", b"hello" * 1000, mode=0o640),
          link("./ln", "sub/a"), {"path": "./hard", "link": "./sub/a"})
    res = restore(fs, "good")
    assert res.returncode == 0, res.stderr
    assert (m.mnt / "good/sub/a").read_bytes() == b"hello" * 1000
    assert os.readlink(m.mnt / "good/ln") == "sub/a"
    assert os.stat(m.mnt / "good/hard").st_ino == os.stat(m.mnt / "good/sub/a").st_ino
    assert stat.S_IMODE(os.stat(m.mnt / "good/sub").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(m.mnt / "good/sub/a").st_mode) == 0o640


@pytest.mark.parametrize("case", ["double-slash", "dotdot", "absolute", "symlink-parent",
                                  "link-outside", "under-a-file", "twice", "top-not-first"])
def test_escaping_listings_write_nothing_outside(fs, outside, case):
    m = fs[0]
    esc = os.path.relpath(outside, m.mnt / case)
    listings = {
        "double-slash": [d("."), f("./" + str(outside) + "/x", b"pwn")],
        "dotdot": [d("."), f("./" + esc + "/x", b"pwn")],
        "absolute": [d("."), f(str(outside / "x"), b"pwn")],
        "symlink-parent": [d("."), link("./esc", str(outside)), f("./esc/x", b"pwn")],
        "link-outside": [d("."), {"path": "./x", "link": "./" + esc + "/keep"}],
        "under-a-file": [d("."), f("./a", b"1"), f("./a/x", b"pwn")],
        "twice": [d("."), f("./a", b"1"), f("./a", b"2")],
        "top-not-first": [f("./x", b"pwn"), d(".")],
    }
    before = tree(outside)
    serve(fs, *listings[case])
    refused(restore(fs, case), "refused the mirror's listing")
    assert tree(outside) == before
    assert not (m.mnt / case).exists()          # checked before anything was written


@pytest.mark.parametrize("case", ["wrong-digest", "wrong-length", "short-data"])
def test_wrong_chunk_data_is_never_written(fs, case):
    m = fs[0]
    data = b"true data " * 100
    items = {"wrong-digest": f("./x", data, sent=b"evil data " * 100),
             "wrong-length": f("./x", data, length=10),
             "short-data": f("./x", data, sent=data[:-1])}
    serve(fs, d("."), items[case])
    res = restore(fs, case)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    x = m.mnt / case / "x"
    assert not x.exists() or x.read_bytes() not in (b"evil data " * 100, data[:-1])
    assert not x.exists() or x.stat().st_size in (0, len(data)) and \
        x.read_bytes().strip(b"\0") == b""


def test_setuid_files_and_devices_need_allow_special(fs):
    m = fs[0]
    assert os.geteuid() == 0, "runs as root, as CI does"
    serve(fs, d("."), f("./suid", b"#!/bin/sh\n", mode=0o4755))
    refused(restore(fs, "suid"), "set-uid", "--allow-special")
    assert not (m.mnt / "suid").exists()
    serve(fs, d("."), {**d("./dev"), "mode": stat.S_IFCHR | 0o666, "rdev": os.makedev(1, 3)})
    refused(restore(fs, "dev"), "device node", "--allow-special")
    serve(fs, d("."), f("./cap", b"x", xattrs={b"security.capability".hex(): "01" * 20}))
    refused(restore(fs, "cap"), "capabilities")
    serve(fs, d("."), f("./suid", b"#!/bin/sh\n", mode=0o4755),
          {**d("./dev"), "mode": stat.S_IFCHR | 0o666, "rdev": os.makedev(1, 3)})
    res = restore(fs, "special", "--allow-special")
    assert res.returncode == 0, res.stderr
    assert os.stat(m.mnt / "special/suid").st_mode & stat.S_ISUID
    assert stat.S_ISCHR(os.lstat(m.mnt / "special/dev").st_mode)


@pytest.mark.parametrize("bad", [{"mode": "x"}, {"uid": -1}, {"size": 2**64},
                                 {"mode": stat.S_IFREG | 0o644, "chunks": [[2**40, "00" * 32, 1]]},
                                 {"xattrs": {"": "00"}}, {"xattrs": {b"user.a\0b".hex(): ""}},
                                 {"mode": stat.S_IFLNK | 0o777, "target": ""}])
def test_out_of_range_values_are_refused_in_one_line(fs, bad):
    serve(fs, d("."), {**f("./x", b"data")[0], **bad})
    refused(restore(fs, "range"), "refused the mirror's listing")
    assert not (fs[0].mnt / "range").exists()


def test_a_file_goes_into_a_directory_never_over_it(fs):
    """The rule of a local restore holds for --from too: DEST/ is a directory to restore
    into; a file never replaces a directory, even with --force."""
    m, server, base = fs
    (m.mnt / "whole").mkdir()
    for i in range(9):
        (m.mnt / f"whole/e{i}").write_text(str(i))
    serve(fs, f(".", b"1\n"))

    def restore_log(dest, *extra):
        return cli("snapctl", "-m", m.mnt, "restore", "--from", server.url, "--token-file",
                   base / "token", "s", "log", "--to", dest, *extra, check=False)
    refused(restore_log("whole", "--force"), "'whole' is a directory and 'log' a file: to "
            "restore the file into it, use --to whole/log")
    assert sorted(os.listdir(m.mnt / "whole")) == [f"e{i}" for i in range(9)]
    res = restore_log("whole/")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"restored ./log of s from {server.url} to ./whole/log: ")
    assert sorted(os.listdir(m.mnt / "whole")) == [f"e{i}" for i in range(9)] + ["log"]
    assert (m.mnt / "whole/log").read_bytes() == b"1\n"


# ---- replicate and verify against a mirror whose answers have the wrong shape -------------

def snapshots(m) -> list[dict]:
    return [json.loads(line) for line in
            m.snapctl("list", "--json").stdout.splitlines() if line.strip()]


def plausible(**kw) -> dict:
    return {"format": 2, "uuid": "cd" * 16, "mirror_of": None, "chunk_size": CHUNK,
            "buckets": 1024, "empty": True, "snapshots": [], "rights": "admin", **kw}


def against(fs, command: str, info, answers=None, *extra):
    m, server, base = fs
    server.info, server.answers = info, answers or {}
    try:
        option = "--to" if command == "replicate" else "--mirror"
        return cli("snapctl", "-m", m.mnt, command, option, server.url, "--token-file",
                   base / "token", *extra, check=False)
    finally:
        server.info, server.answers = None, {}


BAD_INFO = [
    {},
    [],
    plausible(snapshots=None),
    plausible(format="2"),
    plausible(chunk_size=True),
    plausible(uuid="not a uuid"),
    plausible(empty=1),
    plausible(snapshots=[{"name": "s", "uuid": "ab" * 16}]),
    plausible(snapshots=[{"name": "s", "uuid": "ab" * 16, "epoch": 1, "created_ns": 1,
                          "changed_since": "no"}]),
]


@pytest.mark.parametrize("info", BAD_INFO, ids=range(len(BAD_INFO)))
def test_replicate_refuses_a_malformed_info_in_one_line_and_leaves_nothing(fs, info):
    m, server, _ = fs
    before = snapshots(m)
    res = against(fs, "replicate", info)
    refused(res, server.url, "/v1/info")
    assert snapshots(m) == before         # the repl- snapshot it took is gone again


@pytest.mark.parametrize("info", BAD_INFO[:3], ids=range(3))
def test_verify_refuses_a_malformed_info_in_one_line(fs, info):
    res = against(fs, "verify", info)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
    assert fs[1].url in res.stderr and "/v1/info" in res.stderr, res.stderr


@pytest.mark.parametrize("answer", [b"x" * 32, b"x" * 31, b"", b"y" * 64 * 1024])
def test_replicate_refuses_missing_digests_it_did_not_ask_for(fs, answer):
    m, server, _ = fs
    (m.mnt / "payload").write_bytes(os.urandom(3000))
    before = snapshots(m)
    res = against(fs, "replicate", plausible(), {"/v1/missing": answer})
    if answer == b"":                     # "nothing lacking" is a valid answer: the fake
        assert "/v1/missing" not in res.stderr    # refuses the part that follows (404)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    else:
        refused(res, server.url, "/v1/missing")
    assert snapshots(m) == before


@pytest.mark.parametrize("answer", [b"x" * 32, b"", b"x" * 32 * 1025])
def test_verify_refuses_bucket_hashes_of_the_wrong_length(fs, answer):
    m, server, _ = fs
    m.snapctl("create", "verified")
    try:
        snap = next(s for s in snapshots(m) if s["name"] == "verified")
        info = plausible(mirror_of=None, empty=False, snapshots=[
            {"name": "verified", "uuid": snap["uuid"], "epoch": 1, "created_ns": 1,
             "changed_since": False}])
        res = against(fs, "verify", info, {"/v1/buckets": answer})
        assert res.returncode == 2, (res.stdout, res.stderr)
        assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
        assert server.url in res.stderr and "/v1/buckets" in res.stderr, res.stderr
    finally:
        m.snapctl("delete", "verified")


@pytest.mark.parametrize("status, kept", [(409, False), (0, True)], ids=["refused", "cut-off"])
def test_a_refused_commit_removes_the_runs_snapshot_one_cut_off_keeps_it(fs, status, kept):
    """A commit the mirror refused outright (a 4xx) left the run's repl- snapshot, pinning
    what it held, as if the mirror might hold it; one whose answer never came may have been
    applied, so its snapshot stays (the next run finds it there, or sends it again)."""
    m, server, _ = fs
    (m.mnt / "committed").write_bytes(os.urandom(3000))
    before = snapshots(m)
    server.prefixed, server.refusals = {"/v1/parts/": b'{"ok": true}'}, \
        {"/v1/commit-parts": status}
    try:
        res = against(fs, "replicate", plausible(), {"/v1/missing": b"",
                                                     "/v1/chunks": b'{"stored": 0, "bytes": 0}'})
    finally:
        server.prefixed, server.refusals = {}, {}
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1, res.stderr
    assert ("refused by the test's mirror" in res.stderr) != kept, res.stderr
    after = snapshots(m)
    if kept:
        assert len(after) == len(before) + 1 and after[-1]["name"].startswith("repl-")
        m.snapctl("delete", after[-1]["name"])
    else:
        assert after == before


def test_a_replicate_that_fails_on_a_bug_still_removes_its_snapshot(fs, monkeypatch):
    """Not only the errors it expects: whatever ends a run before the commit removes the
    repl- snapshot it took (the bug's traceback still shows)."""
    from click.testing import CliRunner

    from cmdline.snapctl import main
    from replicator import cycle

    def broken(*args, **kw):
        raise RuntimeError("a bug in the cycle")
    monkeypatch.setattr(cycle, "replicate", broken)
    m, server, base = fs
    before = snapshots(m)
    res = CliRunner().invoke(main, ["-m", str(m.mnt), "replicate", "--to", server.url,
                                    "--token-file", str(base / "token")])
    assert isinstance(res.exception, RuntimeError), res.output
    assert snapshots(m) == before


# ---- --force replaces the destination only with a complete tree ------------------------------

def old_tree(m, name: str) -> dict:
    """A destination with work that no snapshot holds: what a failed restore must keep."""
    top = m.mnt / name
    (top / "sub").mkdir(parents=True)
    for i in range(20):
        (top / f"f{i}").write_text(f"old {i}\n")
    (top / "sub/NEW-WORK.txt").write_text("precious work, never snapshotted\n")
    os.chmod(top, 0o751)
    return snapshot_of(top)


def snapshot_of(p: Path) -> dict:
    st = os.lstat(p)
    return {".": (st.st_mode, st.st_mtime_ns), **tree(p)} if stat.S_ISDIR(st.st_mode) \
        else {".": (st.st_mode, p.read_bytes())}


def leftovers(m, name: str) -> list[str]:
    return [n for n in os.listdir(m.mnt) if n.startswith(f".{name}.mountfs-")]


def new_listing(salt: str, bad: str | None = None) -> list:
    """A tree of 30 files (data the source store does not hold yet, as ``salt`` differs);
    ``bad``: the mirror sends wrong data for that one."""
    items = [d("."), d("./sub", 0o750)]
    for i in range(30):
        data = f"new {i} {salt}\n".encode() * 100
        items.append(f(f"./n{i}", data, sent=b"evil" * 200 if f"./n{i}" == bad else None))
    return items


def test_a_failed_force_restore_leaves_the_directory_as_it_was(fs):
    """The mirror sends a bad chunk for the 25th file: the restore stops, and the old
    directory (with work no snapshot holds) is all there, mode and all; no partial tree is
    left under its name or beside it. A good --force restore then replaces it."""
    m = fs[0]
    before = old_tree(m, "keepdir")
    serve(fs, *new_listing("keepdir", bad="./n24"))
    res = restore(fs, "keepdir", "--force")
    assert snapshot_of(m.mnt / "keepdir") == before
    assert leftovers(m, "keepdir") == []
    refused(res, "wrong data for a chunk of ./n24", "'keepdir' was left as it was")
    serve(fs, *new_listing("keepdir"))
    res = restore(fs, "keepdir", "--force")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"restored all of s from {fs[1].url} to ./keepdir: ")
    assert res.stdout.strip().endswith("; replaced ./keepdir (21 entries)"), \
        res.stdout                          # README: what --force replaced is named (20 + sub)
    assert sorted(os.listdir(m.mnt / "keepdir")) == sorted(["sub"] + [f"n{i}" for i in range(30)])
    assert (m.mnt / "keepdir/n29").read_bytes() == b"new 29 keepdir\n" * 100
    assert stat.S_IMODE(os.stat(m.mnt / "keepdir").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(m.mnt / "keepdir/sub").st_mode) == 0o750
    assert leftovers(m, "keepdir") == []


def test_a_failed_force_restore_of_a_big_file_keeps_the_old_file(fs):
    """Chunk 3 of 4 is bad: the old file keeps every byte (no prefix of the new one)."""
    m = fs[0]
    (m.mnt / "big").write_bytes(b"my only copy\n")
    chunks = [os.urandom(CHUNK) for _ in range(4)]
    digests = [blake3.blake3(c).digest() for c in chunks]
    entry = {**d("."), "mode": stat.S_IFREG | 0o644, "size": 4 * CHUNK,
             "chunks": [[i, digests[i].hex(), CHUNK] for i in range(4)]}
    _, server, _ = fs
    server.listing = [entry]
    server.blobs = {dg: (b"x" * CHUNK if i == 2 else c)
                    for i, (dg, c) in enumerate(zip(digests, chunks))}
    res = restore(fs, "big", "--force")
    assert (m.mnt / "big").read_bytes() == b"my only copy\n"
    assert leftovers(m, "big") == []
    refused(res, "wrong data for a chunk of .", "'big' was left as it was")
    server.blobs = dict(zip(digests, chunks))
    res = restore(fs, "big", "--force")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("; replaced ./big"), res.stdout
    assert (m.mnt / "big").read_bytes() == b"".join(chunks)
    assert leftovers(m, "big") == []


def test_a_failed_restore_to_a_new_name_leaves_nothing_there(fs):
    m = fs[0]
    serve(fs, *new_listing("fresh", bad="./n24"))
    res = restore(fs, "fresh")
    assert not os.path.lexists(m.mnt / "fresh")
    assert leftovers(m, "fresh") == []
    refused(res, "'fresh' was left as it was")


def start_stalled_restore(fs, name: str) -> subprocess.Popen:
    """A --force restore of ``name`` that waits on the mirror for ./n24's chunk, with
    ./n0 .. ./n23 already written."""
    m, server, base = fs
    items = new_listing(name)
    serve(fs, *items)
    server.stall_on = bytes.fromhex(items[2 + 24][0]["chunks"][0][1])
    server.release.clear()
    server.stalled.clear()
    proc = subprocess.Popen([sys.executable, "-m", "cmdline.snapctl", "-m", str(m.mnt),
                             "restore", "--from", server.url, "--token-file",
                             str(base / "token"), "s", "--to", name, "--force"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_typed_at_a_terminal)
    deadline = time.monotonic() + 60
    while not server.stalled.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the restore never got to ./n24: {proc.communicate()}")
    return proc


SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_an_interrupted_force_restore_leaves_the_directory_as_it_was(fs, sig):
    """A dropped ssh session (SIGHUP), a kill or Ctrl-C in the middle of a restore: the
    partial copy is removed and the destination is as it was."""
    m, server, _ = fs
    name = f"sig-{sig.name}"
    before = old_tree(m, name)
    try:
        proc = start_stalled_restore(fs, name)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        server.release.set()
        server.stall_on = None
    assert snapshot_of(m.mnt / name) == before
    assert leftovers(m, name) == []
    assert proc.returncode == 1, (out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"interrupted by {sig.name}; '{name}' was left as it was" in err, err


def test_a_killed_force_restore_leaves_the_destination_and_a_named_leftover(fs):
    """SIGKILL cannot be caught: the destination is still as it was, and what the restore
    had written lies beside it under a name that says what it is."""
    m, server, _ = fs
    before = old_tree(m, "killed")
    try:
        proc = start_stalled_restore(fs, "killed")
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        server.release.set()
        server.stall_on = None
    assert snapshot_of(m.mnt / "killed") == before
    assert leftovers(m, "killed") == [f".killed.mountfs-restore-{proc.pid}"]
    subprocess.run(["rm", "-rf", str(m.mnt / leftovers(m, "killed")[0])], check=True)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_the_swap_puts_the_new_tree_in_place_and_the_old_aside(tmp_path, monkeypatch,
                                                               exchange):
    """Where RENAME_EXCHANGE is refused, the old directory is renamed aside first; either
    way the new tree ends under the name and the old one under a name that says so."""
    from replicator import swap
    if not exchange:
        monkeypatch.setattr(swap, "renameat2", lambda fd, old, new, flags: False)
    (tmp_path / "d").mkdir()
    (tmp_path / "d/old").write_text("old")
    tmp = swap.side_name("d", "restore")
    (tmp_path / tmp).mkdir()
    (tmp_path / tmp / "new").write_text("new")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        old = swap.swap(fd, tmp, "d", True)
        assert old == f".d.mountfs-old-{os.getpid()}"
        assert os.listdir(tmp_path / "d") == ["new"]
        assert os.listdir(tmp_path / old) == ["old"]
        assert swap.discard(fd, old)
        assert sorted(os.listdir(tmp_path)) == ["d"]
    finally:
        os.close(fd)
