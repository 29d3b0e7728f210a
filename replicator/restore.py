"""``snapctl restore --from MIRROR``: bring a snapshot, or one path of it, back from a mirror.

The tree is rebuilt through the mounted filesystem with ordinary file operations, so the
source's own rules (permissions, snapshots, crash safety) apply unchanged. Chunk data the
source store still holds (same digest) is read locally; only the rest travels.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from mountfs.store import Store, StoreError

FETCH_BATCH = 64


@dataclass
class RestoreResult:
    entries: int = 0
    bytes_fetched: int = 0
    bytes_local: int = 0


def restore_from(mirror, source_store: str, mountpoint: str, snapshot: str, path: str,
                 dest: str, force: bool) -> RestoreResult:
    """Rebuild ``path`` of mirror snapshot ``snapshot`` at ``dest`` (relative to the mount)."""
    target = Path(mountpoint) / dest.lstrip("/")
    if os.path.realpath(target) == os.path.realpath(mountpoint):
        raise StoreError("restoring from a mirror over the whole tree is not supported; "
                         "restore into a directory with --to DEST")
    entries = mirror.export(snapshot, path)
    if os.path.lexists(target):
        if not force:
            raise StoreError(f"{dest!r} exists; pass --force to replace it")
        _remove(target)
    if not target.parent.is_dir():
        raise StoreError(f"the parent directory of {dest!r} does not exist")
    result = RestoreResult()
    chunk_size = mirror.info()["chunk_size"]
    local = Store.open(source_store, readonly=True, lock=False)
    try:
        for entry in entries:
            _create(mirror, local, target, entry, chunk_size, result)
        for entry in reversed(entries):          # times last, children before parents
            if "link" not in entry:
                p = _at(target, entry["path"])
                os.utime(p, ns=(entry["atime_ns"], entry["mtime_ns"]), follow_symlinks=False)
    finally:
        local.close()
    return result


def _at(target: Path, rel: str) -> Path:
    return target if rel == "." else target / rel[2:]


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def _create(mirror, local: Store, target: Path, entry: dict, chunk_size: int,
            result: RestoreResult) -> None:
    p = _at(target, entry["path"])
    result.entries += 1
    if "link" in entry:
        os.link(_at(target, entry["link"]), p)
        return
    mode = entry["mode"]
    if stat.S_ISDIR(mode):
        os.mkdir(p)
    elif stat.S_ISREG(mode):
        _write_file(mirror, local, p, entry, chunk_size, result)
    elif stat.S_ISLNK(mode):
        os.symlink(bytes.fromhex(entry["target"]), p)
    else:
        os.mknod(p, mode, entry["rdev"])
    os.chown(p, entry["uid"], entry["gid"], follow_symlinks=False)
    if not stat.S_ISLNK(mode):
        os.chmod(p, stat.S_IMODE(mode))
    for name, value in entry["xattrs"].items():
        os.setxattr(p, bytes.fromhex(name), bytes.fromhex(value), follow_symlinks=False)


def _write_file(mirror, local: Store, p: Path, entry: dict, chunk_size: int,
                result: RestoreResult) -> None:
    with open(p, "wb") as f:
        leaves = entry["chunks"]
        for start in range(0, len(leaves), FETCH_BATCH):
            batch = leaves[start:start + FETCH_BATCH]
            data = _chunk_data(mirror, local, [bytes.fromhex(d) for _, d, _ in batch], result)
            for (index, _, _), chunk in zip(batch, data, strict=True):
                f.seek(index * chunk_size)
                f.write(chunk)
        f.truncate(entry["size"])
        f.flush()
        os.fsync(f.fileno())


def _chunk_data(mirror, local: Store, digests: list[bytes], result) -> list[bytes]:
    """The data of each digest: from the source store when it still has it, else fetched."""
    found = {}
    with local.read() as txn:
        for d in digests:
            data = txn.get(d, db=local.db["blobs"])
            if data is not None:
                found[d] = bytes(data)
                result.bytes_local += len(data)
    wanted = [d for d in dict.fromkeys(digests) if d not in found]
    if wanted:
        for d, data in mirror.read_chunks(wanted):
            found[d] = data
            result.bytes_fetched += len(data)
    return [found[d] for d in digests]
