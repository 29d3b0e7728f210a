"""Test support: apply a ``snapctl diff --json`` report to a plain-directory copy of FROM, the
way DistCp's diff mode would, taking new content and attributes from TO; and describe a tree
so that the result can be compared with TO.

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

import blake3

from mountfs.diff import CREATE, DELETE, MODIFY, RENAME, ChunkChange, Entry, application_order


def copy_tree(src: Path, dst: Path) -> None:
    """A faithful copy made independently of mountfs (hard links, symlinks, fifos, modes,
    owners, times in ns, xattrs): GNU ``cp -a --preserve=all``."""
    subprocess.run(["cp", "-a", "--preserve=all", str(src), str(dst)], check=True)


def entries_from_json(lines: list[dict]) -> list[Entry]:
    """Entry objects again, so that ``application_order`` (the order snapctl's users are
    told to follow) decides the order here too."""
    def chunks(d):
        if "chunks" not in d:
            return None
        return tuple(ChunkChange(c["index"], c["offset"], c["length"], c["digest"])
                     for c in d["chunks"])
    return [Entry(d["op"], d["path"], d["type"], d["ino"], to=d.get("to"), link=d.get("link"),
                  size=d.get("size"), chunks=chunks(d)) for d in lines]


def apply_report(report: list[dict], copy: Path, to_root: Path,
                 chunk_size: int | None = None) -> None:
    """Turn ``copy`` (a copy of FROM) into TO by the report alone, reading from ``to_root``
    only what the entries name. With ``chunk_size``, a MODIFY that lists chunks rewrites only
    those chunk ranges and the size: the copy then equals TO only if the list is complete."""
    staging = copy.parent / (copy.name + ".staging")
    staging.mkdir()
    touched: list[str] = []
    inodes_at_to = _inode_paths(to_root)
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
            _create(e, copy, to_root, inodes_at_to)
            touched.append(e.path)
        elif e.op == MODIFY:
            _modify(e, copy, to_root, chunk_size)
            touched.append(e.path)
    assert not os.listdir(staging), "renames left something in the staging area"
    staging.rmdir()
    # Attributes last, deepest first: applying entries inside a directory moves its mtime.
    for rel in sorted(set(touched), key=lambda p: p.count("/"), reverse=True):
        _copy_attributes(to_root / rel, copy / rel)


def _inode_paths(root: Path) -> dict[int, list[str]]:
    """TO's names per inode, to rebuild hard links inside created directories (whose
    contents the report only implies)."""
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


def _create(e: Entry, copy: Path, to_root: Path, inodes_at_to: dict) -> None:
    dst, src = copy / e.path, to_root / e.path
    if e.link is not None:
        os.link(copy / e.link, dst)
        return
    if e.type == "dir":
        dst.mkdir(exist_ok=True)                      # a rename may have made it already
        _fill_created_dir(src, dst, inodes_at_to, copy)
    elif not _linked_to_placed(src, dst, inodes_at_to, copy):
        _copy_one(src, dst)


def _linked_to_placed(src: Path, dst: Path, inodes_at_to: dict, copy: Path) -> bool:
    """Link ``dst`` to a name of the same TO file already in the copy (one a created
    directory brought, which the report implies); whether there was one."""
    st = os.lstat(src)
    other = [p for p in inodes_at_to.get(st.st_ino, []) if os.path.lexists(copy / p)]
    if not (stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and other):
        return False
    os.link(copy / other[0], dst)
    return True


def _fill_created_dir(src: Path, dst: Path, inodes_at_to: dict, copy: Path) -> None:
    """A created directory's contents are implied by its CREATE: copy what is not there yet
    (what arrived by rename is), keeping hard links to files placed earlier."""
    for name in sorted(os.listdir(src)):
        s, d = src / name, dst / name
        if os.path.lexists(d):
            continue
        if _linked_to_placed(s, d, inodes_at_to, copy):
            continue
        if stat.S_ISDIR(os.lstat(s).st_mode):
            d.mkdir()
            _fill_created_dir(s, d, inodes_at_to, copy)
            _copy_attributes(s, d)
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
    _copy_attributes(src, dst)


def _modify(e: Entry, copy: Path, to_root: Path, chunk_size: int | None) -> None:
    """A directory's MODIFY is about its own attributes (fixed at the end); a file's is
    its content too."""
    src, dst = to_root / e.path, copy / e.path
    if e.type != "file":
        return
    if chunk_size is not None and e.chunks is not None:
        _apply_chunks(e, src, dst, chunk_size)
    else:
        shutil.copyfile(src, dst)


def _apply_chunks(e: Entry, src: Path, dst: Path, chunk_size: int) -> None:
    """Rewrite only the listed chunks: their ``length`` bytes of data (checked against the
    digest), zeros for the rest of the chunk (a hole, or past its data), then the size."""
    with open(src, "rb") as s, open(dst, "r+b") as d:
        for c in e.chunks:
            assert c.offset == c.index * chunk_size, c
            s.seek(c.offset)
            data = s.read(c.length)
            assert len(data) == c.length, f"{e.path}: chunk {c} is past the end of the file"
            if c.digest is None:
                assert c.length == 0, c
            else:
                assert blake3.blake3(data).hexdigest() == c.digest, f"{e.path}: digest of {c}"
            end = max(c.offset, min(c.offset + chunk_size, e.size))
            d.seek(c.offset)
            d.write(data + bytes(max(0, end - c.offset - len(data))))
        d.truncate(e.size)


def _copy_attributes(src: Path, dst: Path) -> None:
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


def tree_state(root: Path) -> dict:
    """Everything the copy must reproduce, by path: type and mode, owner, mtime (files and
    directories), size and content, symlink target, device number, xattrs, and hard-link
    groups (numbered in walk order, so two trees compare without sharing inode numbers).
    The root itself is included; a live mount's .snapshot directory is not."""
    out: dict[str, dict] = {}
    groups: dict[int, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(n for n in dirnames
                             if not (Path(dirpath) == root and n == ".snapshot"))
        out[str(Path(dirpath).relative_to(root))] = _state(Path(dirpath), groups)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = _state(p, groups)
    return out


def _state(p: Path, groups: dict[int, int]) -> dict:
    st = os.lstat(p)
    s = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid, "mtime": st.st_mtime_ns,
         "xattrs": {k: os.getxattr(p, k, follow_symlinks=False)
                    for k in os.listxattr(p, follow_symlinks=False)}}
    if stat.S_ISREG(st.st_mode):
        s["size"] = st.st_size
        s["data"] = blake3.blake3(p.read_bytes()).hexdigest()
        if st.st_nlink > 1:
            s["link_group"] = groups.setdefault(st.st_ino, len(groups))
    elif stat.S_ISLNK(st.st_mode):
        s["target"] = os.readlink(p)
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        s["rdev"] = st.st_rdev
    return s
