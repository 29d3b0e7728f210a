"""Property: for random file operations between two snapshots, the diff report applied to a
copy of FROM yields TO (names, types, contents, modes, owners, times, symlink targets, hard
links, xattrs). Half of the examples ask for --chunks and apply only the listed chunk ranges
(4 KiB chunks, so files span several), which also proves the chunk lists complete.

Each example works in a fresh subdirectory of one mount and takes its own pair of snapshots;
the whole tree is diffed and compared (earlier examples' directories are the same on both
sides, so they must not appear in the report's effect).

MOUNTFS_HYPOTHESIS_EXAMPLES raises the number of examples (default 25) for longer runs.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffapply import apply_report, copy_tree, tree_state

EXAMPLES = int(os.environ.get("MOUNTFS_HYPOTHESIS_EXAMPLES", "25"))
NAMES = ["a", "b", "c", "d", "e"]
OPS = ["write", "append", "truncate", "mkdir", "rmdir", "unlink", "rename", "link", "symlink",
       "chmod", "chown", "utime", "setxattr", "mkfifo", "rmtree"]
CHUNK = 4096
OWNERS = [0, 1000, 65534]

paths = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join)
operations = st.lists(st.tuples(st.sampled_from(OPS), paths, paths,
                                st.binary(max_size=3000), st.integers(0, 9000)),
                      min_size=1, max_size=25)
counter = itertools.count()


def do(root, op, p, q, data, n) -> None:
    """One operation under ``root``; operations that make no sense here fail with an OSError
    (the same on any filesystem) and are skipped."""
    a, b = root / p, root / q
    if op in ("write", "append", "rmtree") and a.is_fifo():
        return                  # opening a fifo waits for the other end (Python 3.11's
                                # rmtree opens its argument before checking it is a dir)
    try:
        if op == "write":
            with open(a, "r+b" if a.is_file() else "wb") as h:
                h.seek(n)
                h.write(data)
        elif op == "append":
            with open(a, "ab") as h:
                h.write(data)
        elif op == "truncate":
            os.truncate(a, n)
        elif op == "mkdir":
            os.mkdir(a)
        elif op == "rmdir":
            os.rmdir(a)
        elif op == "unlink":
            os.unlink(a)
        elif op == "rename":
            os.rename(a, b)
        elif op == "link":
            os.link(a, b)
        elif op == "symlink":
            os.symlink(q, a)
        elif op == "chmod":
            os.chmod(a, 0o600 + n % 0o177)
        elif op == "chown":
            os.chown(a, OWNERS[n % 3], OWNERS[n // 3 % 3], follow_symlinks=False)
        elif op == "mkfifo":
            os.mkfifo(a, 0o640)
        elif op == "utime":
            os.utime(a, ns=(n * 1_000_003, n * 1_000_000_007))
        elif op == "setxattr":
            os.setxattr(a, f"user.k{n % 3}", data[:100])
        elif op == "rmtree":
            shutil.rmtree(a)
    except OSError as e:
        assert e.errno != errno.EIO, f"{op} {p} {q}: EIO"


@pytest.fixture
def small_chunks(make_mount):
    return make_mount(chunk_size="4K")


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(before=operations, between=operations, chunks=st.booleans())
def test_the_report_applied_to_from_yields_to(small_chunks, tmp_path, before, between, chunks):
    m = small_chunks
    n = next(counter)
    root = m.mnt / f"ex{n}"
    root.mkdir()
    for op in before:
        do(root, *op)
    m.snapctl("create", f"from{n}")
    for op in between:
        do(root, *op)
    m.snapctl("create", f"to{n}")
    res = m.snapctl("diff", f"from{n}", f"to{n}", "--json", *(["--chunks"] if chunks else []))
    entries = [json.loads(line) for line in res.stdout.splitlines()]
    work = tmp_path / f"work{n}"
    work.mkdir()
    copy = work / "copy"
    copy_tree(m.mnt / ".snapshot" / f"from{n}", copy)
    to_root = m.mnt / ".snapshot" / f"to{n}"
    apply_report(entries, copy, to_root, chunk_size=CHUNK if chunks else None)
    assert tree_state(copy) == tree_state(to_root), entries
    shutil.rmtree(work)
