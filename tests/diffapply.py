"""Test support: apply a ``snapctl diff --json`` report to a plain-directory copy of FROM, the
way DistCp's diff mode would, taking new content and attributes from TO.

This is the correctness criterion of the diff (DESIGN.md): the copy must then equal TO in
names, types, contents, modes, owners, times, symlink targets, hard links and xattrs. Only
what the report names is touched, so a missing entry shows up as a difference.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

from mountfs.diff import CREATE, DELETE, MODIFY, RENAME, Entry, application_order


def copy_tree(src: Path, dst: Path) -> None:
    """A faithful copy (hard links, xattrs, owners, times, special files): cp -a."""
    subprocess.run(["cp", "-a", "--preserve=all", str(src), str(dst)], check=True)


def entries_from_json(lines: list[dict]) -> list[Entry]:
    return [Entry(d["op"], d["path"], d["type"], d["ino"], to=d.get("to"), link=d.get("link"),
                  size=d.get("size"), chunks=None) for d in lines]


def apply_report(report: list[dict], copy: Path, to_root: Path) -> None:
    staging = copy.parent / (copy.name + ".staging")
    staging.mkdir()
    touched: list[str] = []
    inodes_at_to = _inode_paths(to_root)
    placed: dict[int, str] = {}                       # TO inode -> a path holding it in copy
    staged: dict[tuple[str, str], str] = {}
    for e in application_order(entries_from_json(report)):
        if e.op == DELETE:
            _remove(copy / e.path)
        elif e.op == RENAME and (e.path, e.to) not in staged:   # first: leave the old place
            staged[(e.path, e.to)] = str(len(staged))
            os.rename(copy / e.path, staging / staged[(e.path, e.to)])
        elif e.op == RENAME:                                    # then: arrive
            target = copy / e.to
            target.parent.mkdir(parents=True, exist_ok=True)   # into a dir created later
            os.rename(staging / staged[(e.path, e.to)], target)
            touched.append(e.to)
        elif e.op == CREATE:
            _create(e, copy, to_root, placed, inodes_at_to)
            touched.append(e.path)
        elif e.op == MODIFY:
            _modify(e, copy, to_root)
            touched.append(e.path)
    assert not os.listdir(staging), "renames left something in the staging area"
    staging.rmdir()
    for rel in sorted(set(touched), key=lambda p: p.count("/"), reverse=True):
        _copy_attributes(to_root / rel, copy / rel, recursive=False)


def _inode_paths(root: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out.setdefault(os.lstat(p).st_ino, []).append("./" + str(p.relative_to(root)))
    return out


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def _create(e: Entry, copy: Path, to_root: Path, placed: dict, inodes_at_to: dict) -> None:
    dst, src = copy / e.path, to_root / e.path
    if e.link is not None:
        os.link(copy / e.link, dst)
        return
    if e.type == "dir":
        dst.mkdir(exist_ok=True)                      # a rename may have made it already
        _fill_created_dir(src, dst, placed, inodes_at_to, copy)
    else:
        _copy_one(src, dst)
    placed[os.lstat(src).st_ino] = e.path


def _fill_created_dir(src: Path, dst: Path, placed, inodes_at_to, copy: Path) -> None:
    """A created directory's contents are implied by its CREATE: copy what is not there yet
    (what arrived by rename is), keeping hard links to files placed earlier."""
    for name in sorted(os.listdir(src)):
        s, d = src / name, dst / name
        if os.path.lexists(d):
            continue
        st = os.lstat(s)
        other = [p for p in inodes_at_to.get(st.st_ino, []) if os.path.lexists(copy / p)]
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and other:
            os.link(copy / other[0], d)
            continue
        if stat.S_ISDIR(st.st_mode):
            d.mkdir()
            _fill_created_dir(s, d, placed, inodes_at_to, copy)
            _copy_attributes(s, d, recursive=False)
        else:
            _copy_one(s, d)


def _copy_one(src: Path, dst: Path) -> None:
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dst)
    elif stat.S_ISDIR(st.st_mode):
        dst.mkdir()
    else:
        os.mknod(dst, st.st_mode, st.st_rdev)
    _copy_attributes(src, dst, recursive=False)


def _modify(e: Entry, copy: Path, to_root: Path) -> None:
    src, dst = to_root / e.path, copy / e.path
    if e.type == "file":
        shutil.copyfile(src, dst)


def _copy_attributes(src: Path, dst: Path, recursive: bool) -> None:
    st = os.lstat(src)
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    have = set(os.listxattr(dst, follow_symlinks=False))
    want = {k: os.getxattr(src, k, follow_symlinks=False)
            for k in os.listxattr(src, follow_symlinks=False)}
    for k in have - want.keys():
        os.removexattr(dst, k, follow_symlinks=False)
    for k, v in want.items():
        os.setxattr(dst, k, v, follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
