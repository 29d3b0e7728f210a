"""snapctl diff on the cases that break naive diffs (the DistCp snapshot-diff article and
HDFS's tests): each checks the exact report, then applies it to a copy of FROM and compares
the result with TO.

Most cases share one mount (a mount per test would cost more than the tests): each works in
its own directory with its own two snapshots, and paths in the expected reports are relative
to that directory ("." is the case's directory). The diff is still of the whole tree, and
the copy compared with TO is of the whole tree.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import stat

import blake3
import pytest

from conftest import Mount, cli, fsck_clean
from diffapply import apply_report, copy_tree, tree_state

_numbers = itertools.count()


class Case:
    """One test's part of a mount: a directory (``name``; None for the whole mount) and the
    snapshots ``s1`` and ``s2`` around its changes."""

    def __init__(self, m: Mount, tmp_path, name: str | None = None):
        self.m, self.tmp = m, tmp_path
        self.prefix = f"./{name}" if name else "."
        self.root = m.mnt / name if name else m.mnt
        self.s1, self.s2 = (f"{name}-s1", f"{name}-s2") if name else ("s1", "s2")
        self.root.mkdir(exist_ok=True)

    def snap(self, name: str) -> None:
        self.m.snapctl("create", name)

    def report(self, frm=None, to=None, *extra) -> list[dict]:
        res = self.m.snapctl("diff", frm or self.s1, to or self.s2, "--json", *extra)
        return [json.loads(line) for line in res.stdout.splitlines()]

    def rel(self, path: str) -> str:
        """A report path made relative to the case's directory (others stay as they are,
        and so show up as unexpected)."""
        if path == self.prefix:
            return "."
        if self.prefix != "." and path.startswith(self.prefix + "/"):
            return "." + path[len(self.prefix):]
        return path

    def summary(self, entries) -> set:
        """Entries as (op, path[, to]) for exact comparisons (inode numbers left out)."""
        return {(e["op"], self.rel(e["path"]))
                + ((self.rel(e["to"]),) if e["op"] == "rename" else ()) for e in entries}

    def check_applies(self, entries, to=None, chunk_size=None) -> None:
        """Apply the report to an independent copy of FROM, compare the result with TO."""
        to = to or self.s2
        copy = self.tmp / "copy"
        copy_tree(self.m.mnt / ".snapshot" / self.s1, copy)
        to_root = self.m.mnt / ".snapshot" / to if to != "." else self.m.mnt
        apply_report(entries, copy, to_root, chunk_size=chunk_size)
        assert tree_state(copy) == tree_state(to_root)
        shutil.rmtree(copy)

    def build(self, setup, change, live=False) -> list[dict]:
        """FROM state, snapshot s1, the changes, snapshot s2; the report applied to a copy
        of s1 must give s2. With ``live``, the report against the live tree (unchanged
        since s2) must be the same and apply as well."""
        setup(self.root)
        self.snap(self.s1)
        change(self.root)
        self.snap(self.s2)
        entries = self.report()
        self.check_applies(entries)
        if live:
            live_entries = self.report(self.s1, ".")
            assert self.summary(live_entries) == self.summary(entries)
            self.check_applies(live_entries, to=".")
        return entries

    def run(self, setup, change, live=False) -> set:
        return self.summary(self.build(setup, change, live))


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory):
    """One mount for the cases of this module; fsck must pass after them."""
    base = tmp_path_factory.mktemp("diff-cases")
    store, mnt = base / "store", base / "mnt"
    cli("mountfs", "mkfs", store)
    mnt.mkdir()
    m = Mount(store, mnt).mount()
    yield m
    m.cleanup()
    fsck_clean(store)


@pytest.fixture
def case(shared_mount, tmp_path) -> Case:
    return Case(shared_mount, tmp_path, f"case{next(_numbers)}")


def test_create_then_move_into_a_created_directory(case):
    def setup(r):
        (r / "old").mkdir()

    def change(r):
        (r / "f").write_text("new file")
        (r / "d").mkdir()
        (r / "d/inner").write_text("x")
        (r / "newdir").mkdir()
        os.rename(r / "f", r / "newdir/f")
        os.rename(r / "d", r / "newdir/d")
    got = case.run(setup, change, live=True)
    assert got == {("modify", "."), ("create", "./newdir")}


def test_existing_dir_moved_into_created_dir_then_replaced(case):
    def setup(r):
        (r / "a/b").mkdir(parents=True)
        (r / "a/b/file").write_text("old")

    def change(r):
        (r / "c").mkdir()
        os.rename(r / "a/b", r / "c/b")
        shutil.rmtree(r / "c/b")
        (r / "c/b").mkdir()
        (r / "c/b/file").write_text("brand new")
    got = case.run(setup, change)
    assert got == {("modify", "."), ("modify", "./a"), ("delete", "./a/b"), ("create", "./c")}


def test_renames_at_several_levels_with_changes_below(case):
    def setup(r):
        (r / "foo/bar").mkdir(parents=True)
        (r / "foo/bar/data").write_text("1")
        (r / "foo/keep").write_text("k")

    def change(r):
        os.rename(r / "foo", r / "foo2")
        os.rename(r / "foo2/bar", r / "foo2/bar2")
        (r / "foo2/bar2/data").write_text("2")
        (r / "foo2/bar2/added").write_text("a")
    got = case.run(setup, change, live=True)
    assert got == {("modify", "."), ("rename", "./foo", "./foo2"),
                   ("rename", "./foo/bar", "./foo2/bar2"), ("modify", "./foo2"),
                   ("modify", "./foo2/bar2"), ("modify", "./foo2/bar2/data"),
                   ("create", "./foo2/bar2/added")}


def test_swap_and_cycle(case):
    def setup(r):
        for n in "abc":
            (r / n).write_text(n)

    def change(r):
        os.rename(r / "a", r / "tmp")                 # a <-> b
        os.rename(r / "b", r / "a")
        os.rename(r / "tmp", r / "b")
        os.rename(r / "c", r / "tmp2")                 # c -> tmp2 -> c (out and back)
        os.rename(r / "tmp2", r / "c")
    got = case.run(setup, change)
    assert got == {("modify", "."), ("rename", "./a", "./b"), ("rename", "./b", "./a")}


def test_three_cycle_and_a_directory_swap_with_changes_inside(case):
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
    got = case.run(setup, change, live=True)
    assert got == {("modify", "."), ("rename", "./a", "./b"), ("rename", "./b", "./c"),
                   ("rename", "./c", "./a"), ("rename", "./x", "./y"),
                   ("rename", "./y", "./x"), ("modify", "./y/f"), ("modify", "./x"),
                   ("create", "./x/new")}


def test_changes_within_the_window_collapse(case):
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
    got = case.run(setup, change)
    assert got == {("modify", "."), ("modify", "./d"), ("create", "./d/grown"),
                   ("delete", "./doomed"), ("create", "./moved")}


def test_a_directory_renamed_into_its_former_descendant(case):
    """HDFS's testDiffReportWithRename: dir1/foo/bar -> dir2/bar, then dir1/foo ->
    dir2/bar/foo. Two independent renames with full paths at each end."""
    def setup(r):
        (r / "dir1/foo/bar").mkdir(parents=True)
        (r / "dir1/foo/bar/file").write_text("f")
        (r / "dir2").mkdir()

    def change(r):
        os.rename(r / "dir1/foo/bar", r / "dir2/bar")
        os.rename(r / "dir1/foo", r / "dir2/bar/foo")
    got = case.run(setup, change)
    assert got == {("rename", "./dir1/foo", "./dir2/bar/foo"),
                   ("rename", "./dir1/foo/bar", "./dir2/bar"), ("modify", "./dir1"),
                   ("modify", "./dir2"), ("modify", "./dir2/bar/foo"),
                   ("modify", "./dir2/bar")}


def test_renamed_then_the_targets_ancestor_deleted(case):
    """HDFS's testDiffReportWithRenameAndDelete: the moved file is gone at TO, so it is a
    DELETE at its FROM path, not a rename."""
    def setup(r):
        (r / "dir1/foo").mkdir(parents=True)
        (r / "dir1/foo/file").write_text("f")
        (r / "dir2/bar").mkdir(parents=True)

    def change(r):
        os.rename(r / "dir1/foo/file", r / "dir2/bar/file")
        shutil.rmtree(r / "dir2/bar")
    got = case.run(setup, change)
    assert got == {("modify", "./dir1/foo"), ("delete", "./dir1/foo/file"),
                   ("modify", "./dir2"), ("delete", "./dir2/bar")}


def test_a_rename_out_and_back_in(case):
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
    got = case.run(setup, change)
    assert got == {("modify", "."), ("modify", "./d"), ("modify", "./d/f")}


def test_rename_over_a_file_that_is_replaced(case):
    def setup(r):
        (r / "src").write_text("source")
        (r / "dst").write_text("victim")

    def change(r):
        os.rename(r / "src", r / "dst")
    got = case.run(setup, change)
    assert got == {("modify", "."), ("delete", "./dst"), ("rename", "./src", "./dst")}


def test_delete_then_recreate_is_a_new_inode(case):
    def setup(r):
        (r / "f").write_text("old")
        (r / "d").mkdir()

    def change(r):
        os.unlink(r / "f")
        (r / "f").write_text("new")
        os.rmdir(r / "d")
        (r / "d").mkdir()
    got = case.run(setup, change)
    assert got == {("modify", "."), ("delete", "./f"), ("create", "./f"), ("delete", "./d"),
                   ("create", "./d")}


@pytest.mark.parametrize("order", ["rename-then-modify", "modify-then-rename"])
def test_rename_and_modify(case, order):
    def setup(r):
        (r / "f").write_text("v1")

    def change(r):
        if order == "rename-then-modify":
            os.rename(r / "f", r / "g")
            (r / "g").write_text("v2")
        else:
            (r / "f").write_text("v2")
            os.rename(r / "f", r / "g")
    got = case.run(setup, change)
    assert got == {("modify", "."), ("rename", "./f", "./g"), ("modify", "./g")}


def test_a_directory_emptied_and_deleted(case):
    def setup(r):
        (r / "d/sub").mkdir(parents=True)
        for i in range(5):
            (r / f"d/sub/f{i}").write_text(str(i))

    def change(r):
        shutil.rmtree(r / "d")
    assert case.run(setup, change) == {("modify", "."), ("delete", "./d")}


def test_links_symlinks_specials_xattr_and_mode_changes(case):
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
    entries = case.build(setup, change)
    assert case.summary(entries) == {
        ("modify", "."), ("create", "./f-link"), ("create", "./sym"), ("create", "./fifo"),
        ("create", "./null"), ("modify", "./g"), ("modify", "./h"), ("create", "./newdir"),
        ("rename", "./k", "./newdir/l"), ("delete", "./p2")}
    by_path = {case.rel(e["path"]): e for e in entries}
    assert case.rel(by_path["./f-link"]["link"]) == "./f"
    assert {p: by_path[p]["type"] for p in ("./sym", "./fifo", "./null", "./p2")} == {
        "./sym": "symlink", "./fifo": "fifo", "./null": "chardev", "./p2": "file"}


def test_a_file_created_with_several_names(case):
    """An inode born in the interval with several names: one CREATE where its record
    locates it (the name linked last), a CREATE with ``link`` to that for each other listed
    name, also when the link's path sorts first or the first name is inside a directory
    created alongside (whose contents the report implies); a consumer that places an
    implied name by its inode links it too. Found by the diff property (two copies)."""
    def setup(r):
        (r / "old").write_text("o")

    def change(r):
        (r / "m").write_text("three names")
        os.link(r / "m", r / "z")
        os.link(r / "m", r / "a")                   # the record's location: sorts first
        (r / "b").write_text("inside")
        (r / "adir").mkdir()
        os.link(r / "b", r / "adir/f")              # the record's: inside a created dir
        (r / "cdir").mkdir()
        (r / "cdir/f").write_text("implied")
        os.link(r / "cdir/f", r / "c")              # the record's: after an implied name
    entries = case.build(setup, change)
    by_path = {case.rel(e["path"]): e for e in entries}
    assert {p: case.rel(e["link"]) if e.get("link") else None
            for p, e in by_path.items() if e["op"] == "create"} == {
        "./a": None, "./m": "./a", "./z": "./a", "./adir": None, "./b": "./adir/f",
        "./cdir": None, "./c": None}
    stats = case.m.snapctl("diff", case.s1, case.s2, "--stat", "--json").stdout
    assert json.loads(stats)["create"]["file_size_change"] == \
        len("three names") + len("inside") + len("implied")   # each file once, however named
    text = case.m.snapctl("diff", case.s1, case.s2).stdout.splitlines()
    p = case.prefix
    assert {f"+ {p}/m (hard link to {p}/a)", f"+ {p}/b (hard link to {p}/adir/f)",
            f"+ {p}/c"} <= set(text)


def test_stat_counts_a_deleted_file_once_however_named(case):
    """--stat's size change counts a deleted file once: its two names both DELETE entries,
    or one of them inside a deleted directory."""
    def setup(r):
        (r / "h").write_text("twelve bytes")
        os.link(r / "h", r / "h2")
        (r / "d").mkdir()
        (r / "d/f").write_text("five!")
        os.link(r / "d/f", r / "g")

    def change(r):
        for name in ("h", "h2", "g", "d/f"):
            os.unlink(r / name)
        os.rmdir(r / "d")
    entries = case.build(setup, change)
    assert sorted(case.rel(e["path"]) for e in entries if e["op"] == "delete") == \
        ["./d", "./g", "./h", "./h2"]
    stats = case.m.snapctl("diff", case.s1, case.s2, "--stat", "--json").stdout
    assert json.loads(stats)["delete"]["file_size_change"] == -len("twelve bytes") - len("five!")


def test_stat_does_not_count_a_file_moved_into_a_new_directory_or_out_of_a_gone_one(case):
    """--stat: a file moved into a created directory was not created, and one moved out of
    a deleted directory was not deleted (their RENAMEs say so): README's own example, where
    the size change was +8 for a 2-byte append. A moved file that also grew counts its
    growth once, as a MODIFY."""
    def setup(r):
        (r / "greeting").write_text("hello\n")
        (r / "old").mkdir()
        (r / "old/keep").write_text("nine byte")
        (r / "grows").write_text("abc")
        (r / "log").write_text("1\n")

    def change(r):
        (r / "new").mkdir()
        os.rename(r / "greeting", r / "new/greeting")
        os.rename(r / "old/keep", r / "keep")
        os.rmdir(r / "old")
        os.rename(r / "grows", r / "new/grows")
        with open(r / "new/grows", "a") as f:
            f.write("defg")
        with open(r / "log", "a") as f:
            f.write("x\n")
    entries = case.build(setup, change)
    assert {(e["op"], case.rel(e["path"])) for e in entries if e["op"] != "rename"} == {
        ("modify", "."), ("create", "./new"), ("delete", "./old"), ("modify", "./new/grows"),
        ("modify", "./log")}
    stats = json.loads(case.m.snapctl("diff", case.s1, case.s2, "--stat", "--json").stdout)
    assert stats["create"] == {"entries": 1, "chunk_bytes_written": 0, "file_size_change": 0}
    assert stats["delete"]["file_size_change"] == 0
    assert stats["modify"]["file_size_change"] == len("defg") + len("x\n")
    assert sum(stats[op]["file_size_change"] for op in stats) == len("defg") + len("x\n")


def snapshot_writes(r, snapshot, snap):
    """Every way to change something under .snapshot (each must fail): ``snapshot`` is the
    snapshot's root, ``snap`` the case's directory in it, ``r`` the live one."""
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
        "new snapshot by mkdir": lambda: os.mkdir(snapshot.parent / "made-by-mkdir"),
        "remove a snapshot by rmdir": lambda: os.rmdir(snapshot),
        "rename a snapshot": lambda: os.rename(snapshot, snapshot.parent / "renamed"),
    }


def test_changes_under_snapshot_are_impossible_and_nothing_is_reported(case):
    r = case.root
    (r / "f").write_text("x")
    (r / "d").mkdir()
    case.snap(case.s1)
    (r / "live").write_text("l")
    snapshot = case.m.mnt / ".snapshot" / case.s1
    snap = snapshot / r.name
    before = tree_state(snap)
    for what, attempt in snapshot_writes(r, snapshot, snap).items():
        with pytest.raises(OSError) as err:
            attempt()
        assert err.value.errno in (errno.EROFS, errno.EPERM, errno.EACCES, errno.EXDEV), what
    assert tree_state(snap) == before
    assert not (r / "stolen").exists() and (r / "live").read_text() == "l"
    os.unlink(r / "live")
    case.snap(case.s2)
    assert tree_state(snap) == before
    # live was created and removed again: only the directory's times changed
    assert case.summary(case.report()) == {("modify", ".")}


def test_no_change_is_an_empty_report(case):
    (case.root / "f").write_text("x")
    case.snap(case.s1)
    case.snap(case.s2)
    assert case.report() == []
    assert case.report(case.s1, case.s1) == []
    assert case.report(case.s2, ".") == []
    res = case.m.snapctl("diff", case.s1, case.s2, check=False)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == ""


def test_diff_against_the_live_tree(case):
    r = case.root
    (r / "a").write_text("1")
    (r / "d").mkdir()
    case.snap(case.s1)
    os.rename(r / "d", r / "d2")
    (r / "d2/new").write_text("n")
    with open(r / "a", "a") as h:                     # still open: the diff flushes it
        h.write("2")
        h.flush()
        entries = case.report(case.s1, ".")
        assert case.summary(entries) == {("modify", "."), ("modify", "./a"),
                                         ("rename", "./d", "./d2"), ("modify", "./d2"),
                                         ("create", "./d2/new")}
    case.check_applies(entries, to=".")


def test_a_file_deleted_while_open_is_a_delete(case):
    (case.root / "f").write_text("x")
    case.snap(case.s1)
    with open(case.root / "f", "rb") as h:
        os.unlink(case.root / "f")
        case.snap(case.s2)                        # the inode still exists, with no name
        assert h.read() == b"x"
        entries = case.report()
    assert case.summary(entries) == {("modify", "."), ("delete", "./f")}
    case.check_applies(entries)


def test_chunk_lists_are_complete(make_mount, tmp_path):
    """Applying only the listed chunk ranges (and the new size) to the FROM copy gives TO:
    overwrites, appends past the end, a shrink, and a shrink-then-grow that leaves a hole
    where data was."""
    cs = 4096
    m = make_mount(chunk_size="4K")
    case = Case(m, tmp_path)
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
    entries = case.report("s1", "s2", "--chunks")
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
    case.check_applies(entries, chunk_size=cs)


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
    (entry,) = Case(m, tmp_path).report("s1", "s2", "--chunks")
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
    res = mounted.snapctl("diff", "s1", "s2", check=False)      # exit 0 whatever the diff
    assert res.returncode == 0
    assert res.stdout.splitlines() == ["M .", "R ./a -> ./a2", "- ./b", "+ ./c", "M ./z/m"]
    res = mounted.snapctl("diff", "s1", "s2", "--stat", check=False)
    assert res.returncode == 0
    # entries; chunk bytes written (a created file's data, a modified one's changed chunks);
    # the change in file sizes
    assert [line.split() for line in res.stdout.splitlines()[1:]] == [
        ["create", "1", "3", "+3"],
        ["delete", "1", "0", "-1"],
        ["rename", "1", "0", "+0"],
        ["modify", "2", "5000", "+0"]]
    res = mounted.snapctl("diff", "s2", "s1", check=False)
    assert res.returncode == 1 and "newer than TO" in res.stderr and res.stdout == ""
    res = mounted.snapctl("diff", "nope", "s1", check=False)
    assert res.returncode == 1 and res.stderr.strip() == "snapctl: no snapshot named 'nope'"
    res = mounted.snapctl("diff", "s1", "nope", "--json", check=False)
    assert res.returncode == 1 and res.stderr.strip() == "snapctl: no snapshot named 'nope'"
