"""Negative lookups answered from memory (``mountfs/newdirs.py``): in a directory the mount
made, a name no call of the mount's put there is "no such name" without reading the tree.

The danger is the other way round: a name that exists answered as missing, so that a file
would look lost. Every way a name can appear in such a directory is made here, then the
kernel is made to forget its names (``drop_caches``) so that each is looked up again."""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import Path

import pytest
from conftest import Mount, drop_caches
from test_snapshots import take

from mountfs.newdirs import NewDirs

# ---- the bookkeeping alone -------------------------------------------------------------------


def test_a_directory_made_is_known_complete_and_each_name_named_is_not_absent():
    dirs = NewDirs()
    assert not dirs.absent(7, b"x")                 # not made here: unknown
    dirs.made(7, dirs.begin())
    assert dirs.absent(7, b"x")
    dirs.naming(7, b"x")
    assert not dirs.absent(7, b"x")
    assert dirs.absent(7, b"y")
    dirs.naming(8, b"y")                            # not held: nothing to do
    assert not dirs.absent(8, b"y")


def test_a_change_behind_the_kernel_drops_everything_and_refuses_what_began_before_it():
    dirs = NewDirs()
    dirs.made(1, dirs.begin())
    since = dirs.begin()                            # a MKDIR sent ...
    dirs.behind(starting=True)                      # ... while a rollback starts
    assert not dirs.absent(1, b"x")
    dirs.made(2, since)
    dirs.made(3, dirs.begin())                      # made during the rollback
    assert not dirs.absent(2, b"x") and not dirs.absent(3, b"x")
    dirs.behind(starting=False)
    dirs.made(2, since)                             # the MKDIR's answer after it ended
    assert not dirs.absent(2, b"x")
    dirs.made(4, dirs.begin())
    assert dirs.absent(4, b"x")


def test_the_bound_evicts_the_directories_made_longest_ago():
    dirs = NewDirs(max_names=6)                     # a directory counts as one
    for ino in (1, 2, 3):
        dirs.made(ino, dirs.begin())
    dirs.naming(1, b"a")
    dirs.naming(1, b"b")
    dirs.naming(1, b"c")                            # full: 3 directories + 3 names
    assert dirs.count == 6
    dirs.naming(1, b"d")                            # 2, the oldest but 1, goes first
    assert not dirs.absent(2, b"z") and dirs.absent(3, b"z") and dirs.absent(1, b"z")
    assert not dirs.absent(1, b"d") and dirs.count == 6
    dirs.made(4, dirs.begin())                      # 3 goes, then 1 (the oldest)
    assert not dirs.absent(3, b"z") and dirs.absent(4, b"z")
    assert dirs.count <= 6
    single = NewDirs(max_names=2)
    single.made(1, single.begin())
    single.naming(1, b"a")
    single.naming(1, b"b")                          # no room even alone: not held
    assert not single.absent(1, b"z") and single.count == 0


# ---- through the mount -----------------------------------------------------------------------

def appeared(d: Path, names: list[str]) -> None:
    """``d`` holds exactly ``names``, each found by a LOOKUP after the kernel forgot it."""
    drop_caches()
    for name in names:              # first: a listing (READDIRPLUS) would tell the kernel
        os.lstat(d / name)
    assert sorted(os.listdir(d)) == sorted(names)


@pytest.mark.fuse
def test_every_way_a_name_appears_in_a_new_directory_is_found_after_the_kernel_forgets(
        mounted: Mount):
    m = mounted
    d, other = m.mnt / "d", m.mnt / "other"
    d.mkdir()                               # made by this mount: its names known here
    other.mkdir()
    for name in ("moved", "linked", "swapped", "source"):
        (other / name).write_text(name)
    made = ["file", "dir", "fifo", "sym", "link", "moved", "swapped", "restored"]
    for name in made:
        assert not os.path.lexists(d / name)      # negative entries the kernel keeps
    (d / "file").write_text("file")
    (d / "dir").mkdir()
    os.mkfifo(d / "fifo")
    os.symlink("file", d / "sym")
    os.link(other / "linked", d / "link")
    os.rename(other / "moved", d / "moved")
    appeared(d, made[:6])
    # the directory made inside is known too, and a name made there is found
    (d / "dir" / "inner").write_text("inner")
    appeared(d / "dir", ["inner"])
    # RENAME_NOREPLACE: the name appears as with a plain rename
    _renameat2(other / "swapped", d / "swapped", noreplace=True)
    appeared(d, made[:7])
    # a restore puts names behind the kernel's back
    take(m, "s")
    m.snapctl("restore", "s", "other/source", "--to", "d/restored")
    appeared(d, made)
    assert (d / "restored").read_text() == "source"
    assert stat.S_ISFIFO(os.lstat(d / "fifo").st_mode)
    # names never made stay missing, and one removed goes
    os.unlink(d / "file")
    drop_caches()
    assert not os.path.lexists(d / "file") and not os.path.lexists(d / "never")


@pytest.mark.fuse
def test_a_rollback_brings_back_the_names_of_a_new_directory(mounted: Mount):
    m = mounted
    d = m.mnt / "d"
    d.mkdir()
    (d / "kept").write_text("kept")
    take(m, "s")
    os.rename(d / "kept", m.mnt / "away")
    (d / "later").write_text("later")
    m.snapctl("restore", "s", "--force")
    drop_caches()
    assert sorted(os.listdir(d)) == ["kept"]
    assert (d / "kept").read_text() == "kept" and not os.path.lexists(d / "later")
    (d / "after").write_text("after")           # the directory is not known any more
    drop_caches()
    assert (d / "after").read_text() == "after"


def _renameat2(src, dst, noreplace: bool) -> None:
    """renameat2(2) with RENAME_NOREPLACE, which os.rename cannot ask for."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, flags = -100, 1 if noreplace else 0
    if libc.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dst))
