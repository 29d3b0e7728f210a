"""Reaching a mirror by URL. ``file:///path`` is a store this host can open; both kinds offer
the same calls: info, missing, a sink for the Spark tasks, commit and rollback."""

from __future__ import annotations

from pathlib import Path

from mountfs.store import Store, StoreError
from mountfs.urls import file_url_path, url_problem

from . import mirror
from .changeset import Changeset


def open_mirror(url: str, chunk_size: int, token: str | None = None,
                ca_file: str | None = None, create: bool = True):
    """The mirror at ``url``; with ``create``, a ``file://`` mirror that does not exist yet
    is created with the source's chunk size."""
    path = local_path(url)
    if path is not None:
        return LocalMirror(path, chunk_size, create)
    from .client import HttpMirror
    return HttpMirror(url, token, ca_file)


def local_path(url: str) -> Path | None:
    """The path a ``file://`` URL names (None for http(s)), refusing in one line a URL that
    ``mountfs.urls.url_problem`` finds wrong: in ``file://var/tmp/x`` "var" is a host and the path
    /tmp/x, in ``file:///m#2`` the path is /m; neither is the directory the user named."""
    if problem := url_problem(url):
        raise StoreError(f"mirror URL {url}: {problem}")
    if not url.startswith("file:"):
        return None
    return Path(file_url_path(url))


class FileSink:
    """Stages chunks straight into a mirror store on a path (what a Spark task calls)."""

    def __init__(self, path: str):
        self.path = path

    def put(self, chunks) -> tuple[int, int]:
        store = Store.open(self.path, lock=False, readahead=False)
        try:
            with store.write() as txn:
                return mirror.stage(txn, store.db, chunks)
        finally:
            store.close()

    def missing(self, digests: list[bytes]) -> list[bytes]:
        store = Store.open(self.path, readonly=True, lock=False, readahead=False)
        try:
            with store.read() as txn:
                return mirror.missing(txn, store.db, digests)
        finally:
            store.close()


class LocalMirror:
    """A mirror store on a local or network path, held under its store lock for the cycle."""

    def __init__(self, path: Path, chunk_size: int, create: bool = True):
        path = path.absolute()
        try:
            if create and not (path / "data.mdb").exists():
                if path.exists() and (not path.is_dir() or any(path.iterdir())):
                    raise StoreError(f"{path} exists and is not a mountfs store")
                Store.mkfs(path, chunk_size)
            self.store = Store.open(path, holder="replication", readahead=False)
        except OSError as e:
            raise StoreError(f"cannot use {path} as a mirror store: {e.strerror}; choose a "
                             f"directory this host can create and write") from None
        self.sink = FileSink(str(path))
        self.url = path.as_uri()

    def info(self) -> dict:
        return {**mirror.info(self.store), "rights": "admin"}     # a directory of our own

    def missing(self, digests: list[bytes]) -> list[bytes]:
        with self.store.read() as txn:
            return mirror.missing(txn, self.store.db, digests)

    def commit(self, source_uuid: bytes, base_uuid: str | None, snap: mirror.SnapshotRef,
               cs: Changeset, reconcile: bool = False) -> None:
        with self.store.write() as txn:
            mirror.commit(txn, self.store.db, self.store.chunk_size, source_uuid, base_uuid,
                          snap, cs, reconcile)
        self.store.sync()
        mirror.purge_deleted(self.store)
        self.store.sync()

    def stage_part(self, transfer: bytes, index: int, raw: bytes) -> None:
        with self.store.write() as txn:
            mirror.stage_part(txn, self.store.db, self.store.chunk_size, transfer, index, raw)

    def commit_parts(self, source_uuid: bytes, base_uuid: str | None,
                     snap: mirror.SnapshotRef, transfer: bytes, digests: list[bytes],
                     reconcile: bool = False, force: bool = False) -> None:
        """Commit the changeset staged as parts (stage_part), read back part by part."""
        mirror.commit_staged(self.store, source_uuid, base_uuid, snap, transfer, digests,
                             reconcile, force)
        self.store.sync()
        mirror.purge_deleted(self.store)
        self.store.sync()

    def rollback_to(self, base_uuid: str) -> None:
        with self.store.write() as txn:
            mirror.rollback_to(txn, self.store.db, self.store.chunk_size, base_uuid)
        self.store.sync()

    def stage(self, chunks) -> tuple[int, int]:
        with self.store.write() as txn:
            return mirror.stage(txn, self.store.db, chunks)

    def delete_snapshot(self, name: str) -> None:
        mirror.delete_snapshot(self.store, name)

    def export(self, snapshot: str, path: str) -> list[dict]:
        return mirror.export(self.store, snapshot, path)

    def read_chunks(self, digests: list[bytes]) -> list[tuple[bytes, bytes]]:
        return mirror.read_chunks(self.store, digests)

    def bucket_hashes(self, snap_uuid: str | None, recompute: bool = False) -> list[bytes]:
        return mirror.bucket_hashes(self.store, snap_uuid, recompute)

    def bucket_items(self, snap_uuid: str | None, wanted: list[int]) -> dict:
        return mirror.bucket_items(self.store, snap_uuid, wanted)

    def scrub(self) -> dict[str, list[bytes]]:
        return mirror.scrub(self.store)

    def replace_chunks(self, chunks) -> None:
        with self.store.write() as txn:
            mirror.replace_chunks(txn, self.store.db, chunks)
        self.store.sync()

    def repair(self, base_uuid: str, cs: Changeset) -> None:
        with self.store.write() as txn:
            mirror.repair(txn, self.store.db, self.store.chunk_size, base_uuid, cs)
        self.store.sync()
        mirror.purge_deleted(self.store)

    def close(self) -> None:
        self.store.close()
