"""snapctl diff on the cases that break naive diffs (the DistCp snapshot-diff article and
HDFS's tests): each checks the exact report, then applies it to a copy of FROM and compares
the result with TO."""

from __future__ import annotations

import json
import os
import shutil

import blake3
import pytest

from diffapply import apply_report, copy_tree
from test_replicate import tree_state


def report(m, frm="s1", to="s2", *extra) -> list[dict]:
    res = m.snapctl("diff", frm, to, "--json", *extra)
    return [json.loads(line) for line in res.stdout.splitlines()]


def summary(entries) -> set:
    """Entries as (op, path[, to]) for exact comparisons (ignoring inode numbers)."""
    return {(e["op"], e["path"]) + ((e["to"],) if e["op"] == "rename" else ())
            for e in entries}


def check_applies(m, tmp_path, entries, frm="s1", to="s2") -> None:
    copy = tmp_path / "copy"
    copy_tree(m.mnt / ".snapshot" / frm, copy)
    to_root = m.mnt / ".snapshot" / to if to != "." else m.mnt
    apply_report(entries, copy, to_root)
    want = tree_state(to_root)
    want.pop(".snapshot", None)
    assert tree_state(copy) == want


def run_case(m, tmp_path, setup, change) -> set:
    setup(m.mnt)
    m.snapctl("create", "s1")
    change(m.mnt)
    m.snapctl("create", "s2")
    entries = report(m)
    check_applies(m, tmp_path, entries)
    return summary(entries)


def test_create_then_move_into_a_created_directory(mounted, tmp_path):
    def setup(r):
        (r / "old").mkdir()

    def change(r):
        (r / "f").write_text("new file")
        (r / "d").mkdir()
        (r / "d/inner").write_text("x")
        (r / "newdir").mkdir()
        os.rename(r / "f", r / "newdir/f")
        os.rename(r / "d", r / "newdir/d")
    assert run_case(mounted, tmp_path, setup, change) == {("modify", "."), ("create", "./newdir")}


def test_existing_dir_moved_into_created_dir_then_replaced(mounted, tmp_path):
    def setup(r):
        (r / "a/b").mkdir(parents=True)
        (r / "a/b/file").write_text("old")

    def change(r):
        (r / "c").mkdir()
        os.rename(r / "a/b", r / "c/b")
        shutil.rmtree(r / "c/b")
        (r / "c/b").mkdir()
        (r / "c/b/file").write_text("brand new")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("modify", "./a"), ("delete", "./a/b"), ("create", "./c")}


def test_renames_at_several_levels_with_changes_below(mounted, tmp_path):
    def setup(r):
        (r / "foo/bar").mkdir(parents=True)
        (r / "foo/bar/data").write_text("1")
        (r / "foo/keep").write_text("k")

    def change(r):
        os.rename(r / "foo", r / "foo2")
        os.rename(r / "foo2/bar", r / "foo2/bar2")
        (r / "foo2/bar2/data").write_text("2")
        (r / "foo2/bar2/added").write_text("a")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("rename", "./foo", "./foo2"),
                   ("rename", "./foo/bar", "./foo2/bar2"), ("modify", "./foo2"),
                   ("modify", "./foo2/bar2"), ("modify", "./foo2/bar2/data"),
                   ("create", "./foo2/bar2/added")}


def test_swap_and_cycle(mounted, tmp_path):
    def setup(r):
        for n in "abc":
            (r / n).write_text(n)

    def change(r):
        os.rename(r / "a", r / "tmp")                 # a <-> b
        os.rename(r / "b", r / "a")
        os.rename(r / "tmp", r / "b")
        os.rename(r / "c", r / "tmp2")                 # c -> tmp2 -> c (out and back)
        os.rename(r / "tmp2", r / "c")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("rename", "./a", "./b"), ("rename", "./b", "./a")}


def test_rename_over_a_file_that_is_replaced(mounted, tmp_path):
    def setup(r):
        (r / "src").write_text("source")
        (r / "dst").write_text("victim")

    def change(r):
        os.rename(r / "src", r / "dst")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("delete", "./dst"), ("rename", "./src", "./dst")}


def test_delete_then_recreate_is_a_new_inode(mounted, tmp_path):
    def setup(r):
        (r / "f").write_text("old")
        (r / "d").mkdir()

    def change(r):
        os.unlink(r / "f")
        (r / "f").write_text("new")
        os.rmdir(r / "d")
        (r / "d").mkdir()
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("delete", "./f"), ("create", "./f"), ("delete", "./d"),
                   ("create", "./d")}


@pytest.mark.parametrize("order", ["rename-then-modify", "modify-then-rename"])
def test_rename_and_modify(mounted, tmp_path, order):
    def setup(r):
        (r / "f").write_text("v1")

    def change(r):
        if order == "rename-then-modify":
            os.rename(r / "f", r / "g")
            (r / "g").write_text("v2")
        else:
            (r / "f").write_text("v2")
            os.rename(r / "f", r / "g")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("rename", "./f", "./g"), ("modify", "./g")}


def test_a_directory_emptied_and_deleted(mounted, tmp_path):
    def setup(r):
        (r / "d/sub").mkdir(parents=True)
        for i in range(5):
            (r / f"d/sub/f{i}").write_text(str(i))

    def change(r):
        shutil.rmtree(r / "d")
    assert run_case(mounted, tmp_path, setup, change) == {("modify", "."), ("delete", "./d")}


def test_links_symlinks_specials_xattr_and_mode_changes(mounted, tmp_path):
    def setup(r):
        (r / "f").write_text("x")
        (r / "g").write_text("y")
        (r / "h").write_text("z")

    def change(r):
        os.link(r / "f", r / "f-link")
        os.symlink("g", r / "sym")
        os.mkfifo(r / "fifo")
        os.setxattr(r / "g", "user.tag", b"1")         # xattr only
        os.chmod(r / "h", 0o600)                       # mode only
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("create", "./f-link"), ("create", "./sym"),
                   ("create", "./fifo"), ("modify", "./g"), ("modify", "./h")}
    links = [e for e in report(mounted) if e["path"] == "./f-link"]
    assert links[0]["link"] == "./f"
    types = {e["path"]: e["type"] for e in report(mounted)}
    assert types["./sym"] == "symlink" and types["./fifo"] == "fifo"


def test_nothing_changed_and_the_snapshot_tree_is_read_only(mounted, tmp_path):
    (mounted.mnt / "f").write_text("x")
    mounted.snapctl("create", "s1")
    with pytest.raises(OSError):
        (mounted.mnt / ".snapshot/s1/f").write_text("y")
    mounted.snapctl("create", "s2")
    assert report(mounted) == []
    assert report(mounted, "s1", "s1") == []
    assert report(mounted, "s2", ".") == []


def test_diff_against_the_live_tree(mounted, tmp_path):
    (mounted.mnt / "a").write_text("1")
    mounted.snapctl("create", "s1")
    with open(mounted.mnt / "a", "a") as h:            # still open: the diff flushes it
        h.write("2")
        h.flush()
        entries = report(mounted, "s1", ".")
    assert summary(entries) == {("modify", "./a")}


def test_changed_chunks_of_a_large_sparse_file(make_mount, tmp_path):
    m = make_mount(chunk_size="64K")
    with open(m.mnt / "sparse", "wb") as h:
        h.truncate(4 << 30)                             # 4 GiB, all holes
        h.seek(7 * 65536)
        h.write(b"a" * 1000)
    m.snapctl("create", "s1")
    new = os.urandom(100)
    with open(m.mnt / "sparse", "r+b") as h:
        h.seek(30000 * 65536 + 5)
        h.write(new)
    m.snapctl("create", "s2")
    (entry,) = report(m, "s1", "s2", "--chunks")
    chunk = (m.mnt / ".snapshot/s2/sparse").open("rb")
    chunk.seek(30000 * 65536)
    data = chunk.read(65536)
    chunk.close()
    assert entry["op"] == "modify" and entry["size"] == 4 << 30
    # a chunk stores its bytes up to the last one written (the rest of it reads as zeros)
    assert entry["chunks"] == [{"index": 30000, "offset": 30000 * 65536, "length": 105,
                                "digest": blake3.blake3(data[:105]).hexdigest()}]
    assert data[5:105] == new


def test_text_stat_and_errors(mounted):
    m = mounted.mnt
    (m / "b").write_text("1")
    (m / "a").write_text("2")
    mounted.snapctl("create", "s1")
    (m / "c").write_text("333")
    os.unlink(m / "b")
    os.rename(m / "a", m / "a2")
    mounted.snapctl("create", "s2")
    text = mounted.snapctl("diff", "s1", "s2").stdout.splitlines()
    assert text == ["M .", "R ./a -> ./a2", "- ./b", "+ ./c"]
    stat_lines = mounted.snapctl("diff", "s1", "s2", "--stat").stdout.splitlines()
    assert stat_lines[0].split() == ["create", "1", "entries", "3", "bytes"]
    assert stat_lines[1].split() == ["delete", "1", "entries", "1", "bytes"]
    res = mounted.snapctl("diff", "s2", "s1", check=False)
    assert res.returncode == 1 and "newer than TO" in res.stderr
    res = mounted.snapctl("diff", "nope", "s1", check=False)
    assert res.returncode == 1 and res.stderr.strip() == "snapctl: no snapshot named 'nope'"


def test_a_file_deleted_while_open_is_a_delete(mounted, tmp_path):
    (mounted.mnt / "f").write_text("x")
    mounted.snapctl("create", "s1")
    with open(mounted.mnt / "f", "rb") as h:
        os.unlink(mounted.mnt / "f")
        mounted.snapctl("create", "s2")          # the inode still exists, with no name
        assert h.read() == b"x"
        entries = report(mounted)
    assert summary(entries) == {("modify", "."), ("delete", "./f")}
    check_applies(mounted, tmp_path, entries)
