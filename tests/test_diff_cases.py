"""snapctl diff on the cases that break naive diffs (the DistCp snapshot-diff article and
HDFS's tests): each checks the exact report, then applies it to a copy of FROM and compares
the result with TO."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat

import blake3
import pytest

from diffapply import apply_report, copy_tree, tree_state


def report(m, frm="s1", to="s2", *extra) -> list[dict]:
    res = m.snapctl("diff", frm, to, "--json", *extra)
    return [json.loads(line) for line in res.stdout.splitlines()]


def summary(entries) -> set:
    """Entries as (op, path[, to]) for exact comparisons (ignoring inode numbers)."""
    return {(e["op"], e["path"]) + ((e["to"],) if e["op"] == "rename" else ())
            for e in entries}


def check_applies(m, tmp_path, entries, frm="s1", to="s2", chunk_size=None) -> None:
    """Apply the report to an independent copy of FROM and compare the result with TO."""
    copy = tmp_path / "copy"
    copy_tree(m.mnt / ".snapshot" / frm, copy)
    to_root = m.mnt / ".snapshot" / to if to != "." else m.mnt
    apply_report(entries, copy, to_root, chunk_size=chunk_size)
    assert tree_state(copy) == tree_state(to_root)
    shutil.rmtree(copy)


def run_case(m, tmp_path, setup, change, live=False) -> set:
    """The summary of ``build_case``'s report."""
    return summary(build_case(m, tmp_path, setup, change, live))


def build_case(m, tmp_path, setup, change, live=False) -> list[dict]:
    """FROM state, snapshot s1, the changes, snapshot s2; the report applied to a copy of s1
    must give s2. With ``live``, the report against the live tree (unchanged since s2) must
    be the same and apply as well."""
    setup(m.mnt)
    m.snapctl("create", "s1")
    change(m.mnt)
    m.snapctl("create", "s2")
    entries = report(m)
    check_applies(m, tmp_path, entries)
    if live:
        live_entries = report(m, "s1", ".")
        assert summary(live_entries) == summary(entries)
        check_applies(m, tmp_path, live_entries, to=".")
    return entries


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
    got = run_case(mounted, tmp_path, setup, change, live=True)
    assert got == {("modify", "."), ("create", "./newdir")}


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
    got = run_case(mounted, tmp_path, setup, change, live=True)
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


def test_three_cycle_and_a_directory_swap_with_changes_inside(mounted, tmp_path):
    def setup(r):
        for n in "abc":
            (r / n).write_text(n * 3)
        for n in "xy":
            (r / n).mkdir()
            (r / n / "f").write_text(n)

    def change(r):
        os.rename(r / "a", r / "t")                   # a -> b -> c -> a
        os.rename(r / "c", r / "a")
        os.rename(r / "b", r / "c")
        os.rename(r / "t", r / "b")
        os.rename(r / "x", r / "t")                   # x <-> y, then change both insides
        os.rename(r / "y", r / "x")
        os.rename(r / "t", r / "y")
        (r / "y/f").write_text("was x/f")
        (r / "x/new").write_text("in the old y")
    got = run_case(mounted, tmp_path, setup, change, live=True)
    assert got == {("modify", "."), ("rename", "./a", "./b"), ("rename", "./b", "./c"),
                   ("rename", "./c", "./a"), ("rename", "./x", "./y"),
                   ("rename", "./y", "./x"), ("modify", "./y/f"), ("modify", "./x"),
                   ("create", "./x/new")}


def test_changes_within_the_window_collapse(mounted, tmp_path):
    """Only the net change shows: created+deleted is nothing, created+modified is one
    CREATE, modified+deleted one DELETE, created+renamed one CREATE at the final path."""
    def setup(r):
        (r / "d").mkdir()
        (r / "doomed").write_text("old")

    def change(r):
        (r / "d/tmp").write_text("gone again")
        os.unlink(r / "d/tmp")
        (r / "d/grown").write_text("1")
        (r / "d/grown").write_text("12")
        (r / "doomed").write_text("modified first")
        os.unlink(r / "doomed")
        (r / "d/born").write_text("b")
        os.rename(r / "d/born", r / "moved")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("modify", "./d"), ("create", "./d/grown"),
                   ("delete", "./doomed"), ("create", "./moved")}


def test_a_directory_renamed_into_its_former_descendant(mounted, tmp_path):
    """HDFS's testDiffReportWithRename: dir1/foo/bar -> dir2/bar, then dir1/foo ->
    dir2/bar/foo. Two independent renames with full paths at each end."""
    def setup(r):
        (r / "dir1/foo/bar").mkdir(parents=True)
        (r / "dir1/foo/bar/file").write_text("f")
        (r / "dir2").mkdir()

    def change(r):
        os.rename(r / "dir1/foo/bar", r / "dir2/bar")
        os.rename(r / "dir1/foo", r / "dir2/bar/foo")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("rename", "./dir1/foo", "./dir2/bar/foo"),
                   ("rename", "./dir1/foo/bar", "./dir2/bar"), ("modify", "./dir1"),
                   ("modify", "./dir2"), ("modify", "./dir2/bar/foo"),
                   ("modify", "./dir2/bar")}


def test_renamed_then_the_targets_ancestor_deleted(mounted, tmp_path):
    """HDFS's testDiffReportWithRenameAndDelete: the moved file is gone at TO, so it is a
    DELETE at its FROM path, not a rename."""
    def setup(r):
        (r / "dir1/foo").mkdir(parents=True)
        (r / "dir1/foo/file").write_text("f")
        (r / "dir2/bar").mkdir(parents=True)

    def change(r):
        os.rename(r / "dir1/foo/file", r / "dir2/bar/file")
        shutil.rmtree(r / "dir2/bar")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "./dir1/foo"), ("delete", "./dir1/foo/file"),
                   ("modify", "./dir2"), ("delete", "./dir2/bar")}


def test_a_rename_out_and_back_in(mounted, tmp_path):
    def setup(r):
        (r / "d/sub").mkdir(parents=True)
        (r / "d/f").write_text("1")
        (r / "d/sub/g").write_text("2")

    def change(r):
        os.rename(r / "d/f", r / "f")                  # out of d, changed outside, back
        (r / "f").write_text("changed while out")
        os.rename(r / "f", r / "d/f")
        os.rename(r / "d/sub", r / "sub")              # a directory out and back in
        os.rename(r / "sub", r / "d/sub")
    got = run_case(mounted, tmp_path, setup, change)
    assert got == {("modify", "."), ("modify", "./d"), ("modify", "./d/f")}


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
        for n in "fghk":
            (r / n).write_text(n)
        (r / "p").write_text("linked twice")
        os.link(r / "p", r / "p2")

    def change(r):
        os.link(r / "f", r / "f-link")                 # a new name for an old inode
        os.symlink("g", r / "sym")
        os.mkfifo(r / "fifo")
        os.mknod(r / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        os.setxattr(r / "g", "user.tag", b"1")         # xattr only
        os.chmod(r / "h", 0o600)                       # mode only
        (r / "newdir").mkdir()                          # k's only name moves by link+unlink
        os.link(r / "k", r / "newdir/l")
        os.unlink(r / "k")
        os.unlink(r / "p2")                             # one of two names goes
    entries = build_case(mounted, tmp_path, setup, change)
    assert summary(entries) == {
        ("modify", "."), ("create", "./f-link"), ("create", "./sym"), ("create", "./fifo"),
        ("create", "./null"), ("modify", "./g"), ("modify", "./h"), ("create", "./newdir"),
        ("rename", "./k", "./newdir/l"), ("delete", "./p2")}
    by_path = {e["path"]: e for e in entries}
    assert by_path["./f-link"]["link"] == "./f"
    assert {p: by_path[p]["type"] for p in ("./sym", "./fifo", "./null", "./p2")} == {
        "./sym": "symlink", "./fifo": "fifo", "./null": "chardev", "./p2": "file"}


def snapshot_writes(r):
    """Every way to change something under .snapshot (each must fail)."""
    snap = r / ".snapshot/s1"
    return {
        "write": lambda: (snap / "f").write_text("y"),
        "create": lambda: (snap / "new").write_text("y"),
        "truncate": lambda: os.truncate(snap / "f", 0),
        "mkdir": lambda: os.mkdir(snap / "dir"),
        "rmdir": lambda: os.rmdir(snap / "d"),
        "unlink": lambda: os.unlink(snap / "f"),
        "rename inside": lambda: os.rename(snap / "f", snap / "g"),
        "rename in": lambda: os.rename(r / "live", snap / "live"),
        "rename out": lambda: os.rename(snap / "f", r / "stolen"),
        "link": lambda: os.link(snap / "f", snap / "f2"),
        "symlink": lambda: os.symlink("f", snap / "sym"),
        "chmod": lambda: os.chmod(snap / "f", 0o777),
        "utime": lambda: os.utime(snap / "f", ns=(1, 1)),
        "setxattr": lambda: os.setxattr(snap / "f", "user.k", b"v"),
        "new snapshot by mkdir": lambda: os.mkdir(r / ".snapshot/s9"),
        "remove a snapshot by rmdir": lambda: os.rmdir(snap),
    }


def test_changes_under_snapshot_are_impossible_and_nothing_is_reported(mounted, tmp_path):
    r = mounted.mnt
    (r / "f").write_text("x")
    (r / "d").mkdir()
    mounted.snapctl("create", "s1")
    (r / "live").write_text("l")
    before = tree_state(r / ".snapshot/s1")
    for what, attempt in snapshot_writes(r).items():
        with pytest.raises(OSError) as err:
            attempt()
        assert err.value.errno in (errno.EROFS, errno.EPERM, errno.EACCES, errno.EXDEV), what
    assert tree_state(r / ".snapshot/s1") == before
    assert not (r / "stolen").exists() and (r / "live").read_text() == "l"
    os.unlink(r / "live")
    mounted.snapctl("create", "s2")
    assert tree_state(r / ".snapshot/s1") == before
    # live was created and removed again, both in the root: only the root's times changed
    assert summary(report(mounted)) == {("modify", ".")}


def test_no_change_is_an_empty_report(mounted):
    (mounted.mnt / "f").write_text("x")
    mounted.snapctl("create", "s1")
    mounted.snapctl("create", "s2")
    assert report(mounted) == []
    assert report(mounted, "s1", "s1") == []
    assert report(mounted, "s2", ".") == []
    res = mounted.snapctl("diff", "s1", "s2")
    assert res.returncode == 0 and res.stdout == ""


def test_diff_against_the_live_tree(mounted, tmp_path):
    r = mounted.mnt
    (r / "a").write_text("1")
    (r / "d").mkdir()
    mounted.snapctl("create", "s1")
    os.rename(r / "d", r / "d2")
    (r / "d2/new").write_text("n")
    with open(r / "a", "a") as h:                     # still open: the diff flushes it
        h.write("2")
        h.flush()
        entries = report(mounted, "s1", ".")
        assert summary(entries) == {("modify", "."), ("modify", "./a"),
                                    ("rename", "./d", "./d2"), ("modify", "./d2"),
                                    ("create", "./d2/new")}
    check_applies(mounted, tmp_path, entries, to=".")


def test_chunk_lists_are_complete(make_mount, tmp_path):
    """Applying only the listed chunk ranges (and the new size) to the FROM copy gives TO:
    overwrites, appends past the end, a shrink, and a shrink-then-grow that leaves a hole
    where data was."""
    cs = 4096
    m = make_mount(chunk_size="4K")
    r = m.mnt
    for name in ("over", "grow", "shrink", "hole"):
        (r / name).write_bytes(bytes(range(256)) * 40)          # 10240 bytes: chunks 0-2
    m.snapctl("create", "s1")
    with open(r / "over", "r+b") as h:                          # inside chunk 1 only
        h.seek(cs + 10)
        h.write(b"X" * 100)
    with open(r / "grow", "r+b") as h:                          # chunk 2, then 4 after a gap
        h.seek(10240)
        h.write(b"tail")
        h.seek(4 * cs + 7)
        h.write(b"far")
    os.truncate(r / "shrink", cs + 5)
    os.truncate(r / "hole", 100)                                # chunks 1, 2 cut away ...
    os.truncate(r / "hole", 3 * cs)                             # ... and read as zeros again
    m.snapctl("create", "s2")
    entries = report(m, "s1", "s2", "--chunks")
    files = {e["path"]: e for e in entries if e["type"] == "file"}
    assert set(files) == {"./over", "./grow", "./shrink", "./hole"}
    assert all(e["op"] == "modify" for e in files.values())
    indices = {p: [c["index"] for c in e["chunks"]] for p, e in files.items()}
    assert indices["./over"] == [1]
    assert indices["./grow"] == [2, 4]
    assert files["./grow"]["size"] == 4 * cs + 10
    assert files["./shrink"]["size"] == cs + 5
    assert indices["./shrink"] == [1, 2] and indices["./hole"] == [0, 1, 2]
    holes = [c for p in ("./shrink", "./hole") for c in files[p]["chunks"] if c["index"] == 2]
    assert all(c["length"] == 0 and c["digest"] is None for c in holes)   # cut away: holes
    assert files["./shrink"]["chunks"][0]["length"] == 5
    check_applies(m, tmp_path, entries, chunk_size=cs)


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
    (m / "z").mkdir()
    (m / "z/m").write_bytes(b"0" * 5000)
    mounted.snapctl("create", "s1")
    (m / "c").write_text("333")
    os.unlink(m / "b")
    os.rename(m / "a", m / "a2")
    with open(m / "z/m", "r+b") as h:
        h.write(b"abc")
    mounted.snapctl("create", "s2")
    res = mounted.snapctl("diff", "s1", "s2")
    assert res.returncode == 0
    assert res.stdout.splitlines() == ["M .", "R ./a -> ./a2", "- ./b", "+ ./c", "M ./z/m"]
    res = mounted.snapctl("diff", "s1", "s2", "--stat")
    assert res.returncode == 0
    # bytes: created and deleted file sizes; for a modify, the data of its changed chunks
    assert [line.split() for line in res.stdout.splitlines()] == [
        ["create", "1", "entries", "3", "bytes"],
        ["delete", "1", "entries", "1", "bytes"],
        ["rename", "1", "entries", "0", "bytes"],
        ["modify", "2", "entries", "5000", "bytes"]]
    res = mounted.snapctl("diff", "s2", "s1", check=False)
    assert res.returncode == 1 and "newer than TO" in res.stderr and res.stdout == ""
    res = mounted.snapctl("diff", "nope", "s1", check=False)
    assert res.returncode == 1 and res.stderr.strip() == "snapctl: no snapshot named 'nope'"
    res = mounted.snapctl("diff", "s1", "nope", "--json", check=False)
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
