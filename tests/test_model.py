"""Model-based tests: random sequences of file operations run against a real mountfs mount
and, identically, against a plain directory on the host filesystem (the model). Both sides
must answer every operation the same way (same result, same errno), and at every snapshot
the live tree must equal the plain tree; the plain tree's state is then recorded, and every
recorded snapshot under ``.snapshot/NAME`` is compared with it again at later snapshots,
snapshot deletions, remounts and at the end of each example.

What is compared: names, types, permission bits, owners, link counts, file contents, symlink
targets, hard-link groups and extended attributes; mtimes exactly where ``utime`` set them
(values before ``SET_BEFORE``), else only that both sides have a current one. Access times
(not updated by reads: noatime) and ctimes (not settable) are not compared.

The store uses 4 KiB chunks so that writes, holes and truncations cross chunk boundaries.
Each hypothesis example works in a fresh subdirectory on both sides, with snapshot names of
its own, on one mount per test function.

Runtime is kept under a minute with ``MODEL_EXAMPLES`` examples; for a longer hunt set
``MOUNTFS_HYPOTHESIS_EXAMPLES`` (e.g. 300) in the environment.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import json
import os
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, precondition,
                                 rule, run_state_machine_as_test)

from conftest import drop_caches

CHUNK = 4096
MODEL_EXAMPLES = int(os.environ.get("MOUNTFS_HYPOTHESIS_EXAMPLES", "25"))
SET_BEFORE = 1_500_000_000 * 10**9      # utime sets times before 2017; the clock is after
NAMES = ["a", "b", "c"]
MAX_FDS = 3
MAX_REMOUNTS = 1                        # per example: a remount costs most of a second

SETTINGS = settings(
    max_examples=MODEL_EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    database=None,                      # the checkout is shared: keep .hypothesis out of it
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)

DATA = st.one_of(
    st.binary(min_size=1, max_size=40),
    st.builds(lambda byte, n: bytes([byte]) * n, st.sampled_from([0, 1, 0xAB]),
              st.integers(1, 3 * CHUNK)),
)
OFFSETS = st.one_of(st.integers(0, 4 * CHUNK),
                    st.sampled_from([0, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK - 5]))
TIMES = st.integers(0, SET_BEFORE - 1)
XATTR_NAMES = st.sampled_from(["user.a", "user.b", "user.long" + "x" * 40])
XATTR_VALUES = st.one_of(st.binary(max_size=16), st.binary(min_size=100, max_size=300))
SYMLINK_TARGETS = st.sampled_from(NAMES + ["a/b", "b/a", "nowhere", "a/b/c", ""])
RENAME_FLAGS = st.sampled_from([0, 0, 1, 2])          # plain, RENAME_NOREPLACE, RENAME_EXCHANGE
OPEN_FLAGS = st.sampled_from([os.O_RDWR, os.O_RDWR | os.O_APPEND, os.O_RDWR | os.O_TRUNC,
                              os.O_WRONLY | os.O_CREAT])

OUTCOMES: Counter = Counter()     # rule: ok / errno, printed by the test (pytest -s)

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100


def renameat2(src: str, dst: str, flags: int) -> None:
    """rename(2) with flags (os.rename has none)."""
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), src)


def outcome(fn, *args):
    """('ok', result) or ('err', errno name): what both sides must agree on."""
    try:
        return "ok", fn(*args)
    except OSError as e:
        return "err", errno.errorcode.get(e.errno, e.errno)


# ---- capturing a tree -------------------------------------------------------------------

def entry_state(path: str) -> tuple[dict, int]:
    """What we compare about one name (never following a symlink), and its inode number."""
    st_ = os.lstat(path)
    kind = "d" if stat.S_ISDIR(st_.st_mode) else "l" if stat.S_ISLNK(st_.st_mode) else \
        "f" if stat.S_ISREG(st_.st_mode) else f"other {st_.st_mode:o}"
    mtime = st_.st_mtime_ns if st_.st_mtime_ns < SET_BEFORE else "current"
    e = {"type": kind, "mode": oct(stat.S_IMODE(st_.st_mode)), "uid": st_.st_uid,
         "gid": st_.st_gid, "nlink": st_.st_nlink, "mtime": mtime}
    if kind == "f":
        with open(path, "rb") as f:
            data = f.read()
        e["size"] = st_.st_size
        e["data"] = (len(data), hashlib.blake2b(data, digest_size=12).hexdigest())
    elif kind == "l":
        e["size"] = st_.st_size
        e["target"] = os.readlink(path)
    names = [n for n in os.listxattr(path, follow_symlinks=False) if n.startswith("user.")]
    e["xattrs"] = {n: os.getxattr(path, n, follow_symlinks=False) for n in sorted(names)}
    return e, st_.st_ino


def capture(root: Path, forget: bool = False) -> dict:
    """The whole tree under ``root`` as plain data: {'entries': {relpath: state}, 'links':
    hard-link groups (paths sharing an inode)}. With ``forget``, the kernel is made to forget
    every inode before each name of a hard-linked file is stat'ed, so numbers that lived only
    as long as the kernel remembered them show up as broken links every time."""
    entries, by_ino = {}, {}
    todo = ["."]
    while todo:
        rel = todo.pop()
        e, ino = entry_state(os.path.join(root, rel))
        entries[rel] = e
        if e["type"] == "d":
            todo += [os.path.join(rel, n) if rel != "." else n
                     for n in sorted(os.listdir(os.path.join(root, rel)))]
        else:
            if forget and e["nlink"] > 1:
                drop_caches()
                ino = os.lstat(os.path.join(root, rel)).st_ino
            by_ino.setdefault(ino, []).append(rel)
    links = sorted(tuple(sorted(paths)) for paths in by_ino.values() if len(paths) > 1)
    return {"entries": entries, "links": links}


def assert_same_tree(expected: dict, actual: dict, what: str) -> None:
    """Equality with a readable account of the first differences."""
    if expected == actual:
        return
    exp, act = expected["entries"], actual["entries"]
    lines = [f"{what} differs from the model:"]
    for rel in sorted(set(exp) | set(act)):
        if exp.get(rel) != act.get(rel):
            lines.append(f"  {rel}: model {exp.get(rel)}\n  {' ' * len(rel)}  mount {act.get(rel)}")
    if expected["links"] != actual["links"]:
        lines.append(f"  hard links: model {expected['links']} mount {actual['links']}")
    raise AssertionError("\n".join(lines[:12]))


# ---- descriptors held by another process ------------------------------------------------

def fd_op(op: str, *args):
    """One operation on a descriptor, answered as ('ok', JSON-able result) or ('err', errno
    name); data travels as hex."""
    if op == "pwrite":
        args = (args[0], bytes.fromhex(args[1]), args[2])
    fn = {"open": os.open, "pwrite": os.pwrite, "ftruncate": os.ftruncate,
          "fsync": os.fsync, "close": os.close,
          "pread": lambda fd, n, off: os.pread(fd, n, off).hex(),
          "fsize": lambda fd: os.fstat(fd).st_size}[op]
    return outcome(fn, *args)


def serve_fds() -> None:
    """The holder's main loop: one JSON request per line on stdin, one answer per line."""
    for line in sys.stdin:
        print(json.dumps(fd_op(*json.loads(line))), flush=True)


class Holder:
    """A helper process that opens and holds the mount's descriptors for us."""

    def __init__(self):
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import test_model; test_model.serve_fds()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def call(self, op: str, *args):
        self.proc.stdin.write(json.dumps([op, *args]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the descriptor holder died"
        return tuple(json.loads(line))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# ---- the state machine ------------------------------------------------------------------

class ModelMachine(RuleBasedStateMachine):
    """Every rule does one operation on both sides; ``mount`` and ``plain_base`` are bound
    by the test function (one mount per test, one fresh subdirectory per example)."""

    mount = None
    plain_base: Path = None
    holder: Holder = None
    examples = itertools.count()

    def __init__(self):
        super().__init__()
        self.n = next(self.examples)
        self.sub = f"ex{self.n}"
        self.plain = self.plain_base / self.sub
        self.snaps: dict[str, dict] = {}        # snapshot name -> recorded model tree
        self.snap_seq = itertools.count()
        self.fds: list[tuple[int, int, str]] = []   # (plain fd, mount fd, path)
        self.remounts = 0

    @property
    def live(self) -> Path:
        return self.mount.mnt / self.sub

    @initialize()
    def make_roots(self):
        """The same small seed tree on both sides, so that every rule has something to
        act on even in examples where hypothesis leaves the creating rules out."""
        for root in (self.plain, self.live):
            os.mkdir(root, 0o755)
            os.chmod(root, 0o755)
            (root / "a").write_bytes(bytes(range(256)) * (CHUNK // 256) + b"tail")
            os.mkdir(root / "b", 0o755)
            (root / "b" / "c").write_bytes(b"seed")
            os.chmod(root / "a", 0o644)
            os.chmod(root / "b" / "c", 0o644)

    def both(self, what: str, fn, *args):
        """Run fn(root, *args) on both sides; they must agree. Returns the model's result."""
        want = outcome(fn, str(self.plain), *args)
        got = outcome(fn, str(self.live), *args)
        assert got == want, f"{what}{args}: model {want}, mount {got}"
        OUTCOMES[f"{what}: {want[0] if want[0] == 'ok' else want[1]}"] += 1
        return want

    # ---- choosing paths ---------------------------------------------------------------

    def tree_names(self) -> tuple[list[str], list[str], list[str]]:
        """(directories, files, symlinks) of the model tree, relative, the root excluded."""
        kinds = {"d": [], "f": [], "l": []}
        for rel in capture_names(self.plain):
            if rel != ".":
                mode = os.lstat(os.path.join(self.plain, rel)).st_mode
                kinds["d" if stat.S_ISDIR(mode) else "l" if stat.S_ISLNK(mode) else "f"].append(rel)
        return sorted(kinds["d"]), sorted(kinds["f"]), sorted(kinds["l"])

    def pick(self, data, usual: list[str], odd: list[str]) -> str:
        """A path from ``usual``; one time in eight from ``odd`` (names that should fail,
        or go through symlinks); while handles are open, one time in three a name of an
        open file (where buffered writes meet other operations). Shrinks towards usual."""
        choices = list(dict.fromkeys(usual))
        hot = sorted({path for _, _, path in self.fds} & set(usual))
        which = data.draw(st.integers(0, 23), label="which")
        if hot and which % 3 == 2:
            choices = hot
        elif (not choices or which == 22) and odd:       # 22 % 3 != 2: never hot
            choices = list(dict.fromkeys(odd))
        if not choices:
            choices = ["nowhere"]
        return data.draw(st.sampled_from(choices), label="path")

    def fresh_names(self, dirs) -> list[str]:
        return [n if d == "." else f"{d}/{n}" for d in ["."] + dirs for n in NAMES
                if not os.path.lexists(os.path.join(self.plain, d, n))]

    def pick_existing(self, data, root_ok=False) -> str:
        """An existing name; sometimes a missing one or one under a file."""
        dirs, files, links = self.tree_names()
        return self.pick(data, files + dirs + links + (["."] if root_ok else []),
                         ["nowhere"] + [f"{o}/a" for o in files + links])

    def pick_any(self, data) -> str:
        """A new name in an existing directory, or an existing name (create over it); sometimes
        a name under a file or symlink (ENOTDIR, symlink traversal)."""
        dirs, files, links = self.tree_names()
        return self.pick(data, self.fresh_names(dirs) + files + dirs + links,
                         [f"{o}/{n}" for o in files + links for n in NAMES[:1]])

    def pick_file(self, data) -> str:
        """An existing file or a new name (where writes go); sometimes a symlink or a
        directory."""
        dirs, files, links = self.tree_names()
        return self.pick(data, files + self.fresh_names(dirs), links + dirs)

    # ---- data -------------------------------------------------------------------------

    @rule(data=st.data(), off=OFFSETS, buf=DATA, how=st.sampled_from(["pwrite", "trunc",
                                                                     "append"]),
          mode=st.sampled_from([0o644, 0o600, 0o4755]))
    def write_file(self, data, off, buf, how, mode):
        """open(O_CREAT), write at an offset (past EOF makes a hole), close."""
        path = self.pick_file(data)
        flags = os.O_WRONLY | os.O_CREAT | {"pwrite": 0, "trunc": os.O_TRUNC,
                                            "append": os.O_APPEND}[how]

        def write(root, path, off, buf):
            fd = os.open(os.path.join(root, path), flags, mode)
            try:
                return os.write(fd, buf) if how == "append" else os.pwrite(fd, buf, off)
            finally:
                os.close(fd)
        self.both("write_file", write, path, off, buf)

    @rule(data=st.data(), size=OFFSETS)
    def truncate(self, data, size):
        self.both("truncate", lambda root, p, n: os.truncate(os.path.join(root, p), n),
                  self.pick_existing(data), size)

    @rule(data=st.data(), offset=OFFSETS, size=st.integers(1, 2 * CHUNK))
    def read_file(self, data, offset, size):
        """A read through a new handle (sees the buffered writes of open handles)."""
        def read(root, p, off, n):
            with open(os.path.join(root, p), "rb") as f:
                f.seek(off)
                return f.read(n)
        self.both("read_file", read, self.pick_existing(data), offset, size)

    # ---- open handles: buffered writes across other operations ---------------------------
    # The mount's descriptors live in a helper process (``holder``): a process that forks
    # and execs (as this one does to run snapctl) closes its copies of its descriptors,
    # and each close is a FUSE flush that would commit the buffered writes we want the
    # snapshot to find.

    def fd_both(self, op, pfd, mfd, *args):
        want, got = fd_op(op, pfd, *args), self.holder.call(op, mfd, *args)
        assert got == want, f"{op}{args}: model {want}, mount {got}"
        OUTCOMES[f"fd_{op}: {want[0] if want[0] == 'ok' else want[1]}"] += 1
        return want

    @precondition(lambda self: len(self.fds) < MAX_FDS)
    @rule(data=st.data(), flags=OPEN_FLAGS)
    def fd_open(self, data, flags):
        path = self.pick_file(data)
        want = fd_op("open", os.path.join(self.plain, path), flags, 0o644)
        got = self.holder.call("open", os.path.join(self.live, path), flags, 0o644)
        OUTCOMES[f"fd_open: {want[0] if want[0] == 'ok' else want[1]}"] += 1
        if want[0] == "ok" and got[0] == "ok":
            self.fds.append((want[1], got[1], path))
            return
        if want[0] == "ok":
            os.close(want[1])
        if got[0] == "ok":
            self.holder.call("close", got[1])
        assert got == want, f"open({path!r}, {flags:o}): model {want}, mount {got}"

    def pick_fd(self, data) -> tuple[int, int, str]:
        return data.draw(st.sampled_from(self.fds), label="fd")

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), off=OFFSETS, buf=DATA)
    def fd_write(self, data, off, buf):
        pfd, mfd, _ = self.pick_fd(data)
        self.fd_both("pwrite", pfd, mfd, buf.hex(), off)

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), off=OFFSETS, size=st.integers(1, 2 * CHUNK))
    def fd_read(self, data, off, size):
        pfd, mfd, _ = self.pick_fd(data)
        self.fd_both("pread", pfd, mfd, size, off)

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), size=OFFSETS)
    def fd_truncate(self, data, size):
        pfd, mfd, _ = self.pick_fd(data)
        self.fd_both("ftruncate", pfd, mfd, size)

    @precondition(lambda self: self.fds)
    @rule(data=st.data())
    def fd_fstat(self, data):
        """Size of an open file, with unflushed writes."""
        pfd, mfd, _ = self.pick_fd(data)
        self.fd_both("fsize", pfd, mfd)

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), sync=st.booleans())
    def fd_close(self, data, sync):
        pfd, mfd, path = self.pick_fd(data)
        self.fds.remove((pfd, mfd, path))
        if sync:
            self.fd_both("fsync", pfd, mfd)
        self.fd_both("close", pfd, mfd)

    def close_all(self):
        while self.fds:
            pfd, mfd, _ = self.fds.pop()
            os.close(pfd)
            self.holder.call("close", mfd)

    # ---- names ------------------------------------------------------------------------

    @rule(data=st.data(), mode=st.sampled_from([0o755, 0o700, 0o2775, 0o1777]))
    def mkdir(self, data, mode):
        self.both("mkdir", lambda root, p: os.mkdir(os.path.join(root, p), mode), self.pick_any(data))

    @rule(data=st.data())
    def rmdir(self, data):
        self.both("rmdir", lambda root, p: os.rmdir(os.path.join(root, p)), self.pick_existing(data))

    @rule(data=st.data())
    def unlink(self, data):
        self.both("unlink", lambda root, p: os.unlink(os.path.join(root, p)), self.pick_existing(data))

    @rule(data=st.data(), flags=RENAME_FLAGS)
    def rename(self, data, flags):
        """Files and directories, over existing targets, with NOREPLACE and EXCHANGE."""
        src, dst = self.pick_existing(data), self.pick_any(data)
        self.both("rename", lambda root, s, d, f: renameat2(os.path.join(root, s), os.path.join(root, d),
                                                  f), src, dst, flags)

    @rule(data=st.data())
    def link(self, data):
        src, dst = self.pick_existing(data), self.pick_any(data)
        self.both("link", lambda root, s, d: os.link(os.path.join(root, s), os.path.join(root, d),
                                             follow_symlinks=False), src, dst)

    @rule(data=st.data(), dest=SYMLINK_TARGETS)
    def symlink(self, data, dest):
        self.both("symlink", lambda root, t, p: os.symlink(t, os.path.join(root, p)), dest,
                  self.pick_any(data))

    # ---- attributes -------------------------------------------------------------------

    @rule(data=st.data(), mode=st.integers(0, 0o7777))
    def chmod(self, data, mode):
        self.both("chmod", lambda root, p, m: os.chmod(os.path.join(root, p), m),
                  self.pick_existing(data, root_ok=True), mode)

    @rule(data=st.data(), atime=TIMES, mtime=TIMES, follow=st.booleans())
    def utime(self, data, atime, mtime, follow):
        self.both("utime", lambda root, p, t: os.utime(os.path.join(root, p), ns=t,
                                              follow_symlinks=follow),
                  self.pick_existing(data, root_ok=True), (atime, mtime))

    @rule(data=st.data(), name=XATTR_NAMES, value=XATTR_VALUES,
          flags=st.sampled_from([0, os.XATTR_CREATE, os.XATTR_REPLACE]), follow=st.booleans())
    def setxattr(self, data, name, value, flags, follow):
        self.both("setxattr", lambda root, p: os.setxattr(os.path.join(root, p), name, value, flags,
                                              follow_symlinks=follow),
                  self.pick_existing(data, root_ok=True))

    @rule(data=st.data(), name=XATTR_NAMES)
    def removexattr(self, data, name):
        self.both("removexattr", lambda root, p: os.removexattr(os.path.join(root, p), name),
                  self.pick_existing(data, root_ok=True))

    @rule(data=st.data(), name=XATTR_NAMES)
    def getxattr(self, data, name):
        self.both("getxattr", lambda root, p: os.getxattr(os.path.join(root, p), name),
                  self.pick_existing(data, root_ok=True))

    # ---- comparing, snapshots, remounts -----------------------------------------------

    def compare_live(self) -> dict:
        model = capture(self.plain)
        assert_same_tree(model, capture(self.live), "the live tree")
        return model

    def compare_snapshots(self) -> None:
        for name, model in self.snaps.items():
            assert_same_tree(model, capture(self.mount.mnt / ".snapshot" / name / self.sub,
                                            forget=True), f"snapshot {name}")

    @rule()
    def compare(self):
        self.compare_live()

    @rule(data=st.data(), dirty=st.booleans())
    def snapshot(self, data, dirty):
        """snapctl create, with handles possibly open and dirty (``dirty``: a write through
        one of them just before): the snapshot must hold every byte written before it
        returned."""
        if dirty:
            if not self.fds:
                self.fd_open(data, os.O_RDWR | os.O_CREAT)
            if self.fds:
                self.fd_write(data, data.draw(OFFSETS, label="off"),
                              data.draw(DATA, label="buf"))
        name = f"e{self.n}s{next(self.snap_seq)}"
        self.mount.snapctl("create", name)
        OUTCOMES[f"snapshot with {len(self.fds)} open"] += 1
        self.snaps[name] = self.compare_live()
        self.compare_snapshots()

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def delete_snapshot(self, data):
        """The collector reclaims what only the deleted snapshot saw; the others and the
        live tree must not change."""
        name = data.draw(st.sampled_from(sorted(self.snaps)), label="snapshot")
        self.mount.snapctl("delete", name)
        del self.snaps[name]
        OUTCOMES["delete_snapshot"] += 1
        assert not os.path.exists(self.mount.mnt / ".snapshot" / name)
        self.compare_snapshots()
        self.compare_live()

    @precondition(lambda self: self.remounts < MAX_REMOUNTS)
    @rule()
    def remount(self):
        """Everything (closed handles included) survives umount and mount."""
        self.remounts += 1
        OUTCOMES["remount"] += 1
        self.close_all()
        self.mount.umount()
        self.mount.mount()
        self.compare_live()
        self.compare_snapshots()

    def teardown(self):
        """Close every handle, then compare once more, unless a step already failed (a
        second report of the same difference would only confuse the shrinker)."""
        OUTCOMES["examples"] += 1
        failed = sys.exc_info()[0] is not None
        try:
            if self.fds:
                self.close_all()
            if not failed and self.mount.is_mounted() and self.live.exists():
                self.compare_live()
                self.compare_snapshots()
        finally:
            self.close_all()


def capture_names(root: Path) -> list[str]:
    """Relative paths of every name under root (not following symlinks), '.' included."""
    out, todo = [], ["."]
    while todo:
        rel = todo.pop()
        out.append(rel)
        full = os.path.join(root, rel)
        if os.path.isdir(full) and not os.path.islink(full):
            todo += [n if rel == "." else os.path.join(rel, n) for n in os.listdir(full)]
    return out


@pytest.mark.parametrize("commit_delay", ["0.005", "3600"])
def test_random_operations_match_a_plain_directory(make_mount, tmp_path, monkeypatch,
                                                   commit_delay):
    """With the default commit delay, and with one of an hour: then nothing commits but
    fsync, snapshots and remounts, so every read of an answered change must find it in the
    committer's open transaction (a change's marks missing an item would read stale)."""
    monkeypatch.setenv("MOUNTFS_COMMIT_DELAY", commit_delay)
    mount = make_mount(chunk_size="4K")
    plain = tmp_path / "plain"
    plain.mkdir()
    holder = Holder()
    machine = type("BoundModel", (ModelMachine,),
                   {"mount": mount, "plain_base": plain, "holder": holder})
    try:
        run_state_machine_as_test(machine, settings=SETTINGS)
    finally:
        holder.close()
    print("\n".join(f"{n:6d}  {k}" for k, n in sorted(OUTCOMES.items())))
