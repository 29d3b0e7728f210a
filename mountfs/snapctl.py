"""``snapctl``: snapshots of a mountfs filesystem.

It finds the filesystem from ``-m MOUNTPOINT``, else from the mount holding the current
directory, and talks to the mount process through its control socket. ``--store STORE``
names a store directly; if it is not mounted, snapctl works on it offline, under the store
lock (so it can never race a mount).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import sys

import click

from . import control
from .cli import OneLineGroup
from .mount import find_mount
from .store import StoreError


class Target:
    """Where snapshot requests go: a running mount (control socket) or an offline store."""

    def __init__(self, store: str, mountpoint: str | None):
        self.store = store
        self.mountpoint = mountpoint

    @property
    def mounted(self) -> bool:
        return self._answers()

    def _answers(self) -> bool:
        """Whether a mount serves the store. A socket we may not use is a mount too (the
        request itself then says so), not an offline store to open."""
        try:
            control.request(self.store, {"op": "status"}, timeout=10)
            return True
        except control.ControlError as e:
            return str(e).startswith("permission denied")

    def fs_path(self, path: str) -> str:
        """A path relative to the filesystem root; absolute paths under the mountpoint are
        accepted too."""
        if self.mountpoint and os.path.isabs(path):
            mp = self.mountpoint.rstrip("/")
            if path == mp or path.startswith(mp + "/"):
                return path[len(mp):].lstrip("/") or "."
        return path.lstrip("/") or "."


def resolve_target(mountpoint: str | None, store: str | None) -> Target:
    if store:
        return Target(os.path.abspath(store), mountpoint)
    where = mountpoint or os.getcwd()
    info = find_mount(where)
    if info is None:
        raise StoreError(f"{where} is not in a mountfs filesystem; use -m MOUNTPOINT or "
                         f"--store STORE")
    return Target(info.store, info.mountpoint)


def syncfs(path: str) -> None:
    """Push the kernel's cached writes for the filesystem at ``path`` to the mount."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ctypes.CDLL(None, use_errno=True).syncfs(fd)
    finally:
        os.close(fd)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def fail(msg: str, code: int = 1):
    click.echo(f"snapctl: {msg}", err=True)
    sys.exit(code)


def run(target: Target, request: dict, offline) -> dict:
    """Send ``request`` to the mount, or run ``offline(store)`` on the unmounted store."""
    if target.mounted:
        return control.request(target.store, request)
    from .store import Store
    store = Store.open(target.store, holder="snapctl")
    try:
        return offline(store)
    finally:
        store.close()


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--mountpoint", type=click.Path(), help="The mounted filesystem.")
@click.option("--store", type=click.Path(), help="A store directory (mounted or not).")
@click.pass_context
def main(ctx, mountpoint, store):
    """Snapshots of a mountfs filesystem, and their mirrors.

    Snapshots are O(1) and browsable read-only at MOUNTPOINT/.snapshot/NAME. 'diff' says what
    changed between two; 'replicate', 'verify' and 'restore --from' work with mirrors;
    'status', 'check' and 'prune' show and apply what the daemon (mountfsd) does."""
    ctx.obj = {"mountpoint": mountpoint, "store": store}


def _target(ctx) -> Target:
    try:
        return resolve_target(ctx.obj["mountpoint"], ctx.obj["store"])
    except StoreError as e:
        fail(str(e))


@main.command()
@click.argument("name")
@click.pass_context
def create(ctx, name):
    """Take snapshot NAME of the live tree (everything written before it returns)."""
    try:
        snap = _create_snapshot(_target(ctx), name)
    except StoreError as e:
        fail(str(e))
    click.echo(f"created snapshot {snap['name']} (epoch {snap['epoch']})")


def _create_snapshot(target: Target, name: str) -> dict:
    from . import snapshots as snaps
    snaps.validate_name(name)
    if target.mountpoint:
        syncfs(target.mountpoint)

    def offline(store):
        with store.write() as txn:
            return {"snapshot": control.snapshot_json(snaps.create(txn, store.db, name))}
    return run(target, {"op": "create", "name": name}, offline)["snapshot"]


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def list_(ctx, as_json):
    """List snapshots, oldest first, with the chunk data written since the one before."""
    from . import snapshots as snaps
    target = _target(ctx)

    def offline(store):
        with store.read() as txn:
            return {"snapshots": [control.snapshot_json(s) for s in snaps.list_all(txn, store.db)]}
    try:
        items = run(target, {"op": "list"}, offline)["snapshots"]
    except StoreError as e:
        fail(str(e))
    if as_json:
        for s in items:
            click.echo(json.dumps(s))
        return
    if not items:
        click.echo("no snapshots")
        return
    click.echo(f"{'NAME':<32} {'EPOCH':>8} {'WRITTEN':>9}  CREATED")
    for s in items:
        created = datetime.datetime.fromtimestamp(s["created_ns"] / 1e9).isoformat(
            sep=" ", timespec="seconds")
        click.echo(f"{s['name']:<32} {s['epoch']:>8} {human_bytes(s['written']):>9}  {created}")


@main.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Delete it even if it is a mirror's replication "
              "base (the next cycle to that mirror then reconciles by hash buckets).")
@click.pass_context
def delete(ctx, name, force):
    """Delete snapshot NAME; its space is reclaimed in the background."""
    from . import gc
    from . import snapshots as snaps
    target = _target(ctx)

    def offline(store):
        with store.write() as txn:
            snaps.delete(txn, store.db, name, force)
        gc.run_to_completion(store)
        return {}
    try:
        run(target, {"op": "delete", "name": name, "force": force}, offline)
    except StoreError as e:
        fail(str(e))
    click.echo(f"deleted snapshot {name}")


@main.command("diff")
@click.argument("from_snap", metavar="FROM")
@click.argument("to_snap", metavar="TO", default=".")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry, per line.")
@click.option("--chunks", is_flag=True,
              help="For modified files, list the changed chunks (index, offset, length, digest).")
@click.option("--stat", "as_stat", is_flag=True, help="Counts and bytes per kind of change.")
@click.pass_context
def diff_(ctx, from_snap, to_snap, as_json, chunks, as_stat):
    """What changed from snapshot FROM to snapshot TO ('.' is the live tree, the default).

    \b
    + ./path          created (a new directory's contents are implied)
    - ./path          deleted (FROM path)
    R ./old -> ./new  renamed (the same inode; old is a FROM path)
    M ./path          content or attributes changed

    The text report is sorted by path; --json streams entries as they are found (parents
    before children), in bounded memory however large the diff.

    Found in time proportional to the changes: unchanged subtrees are never visited.
    Applying the report to a copy of FROM (renames and deletes first, then creates and
    modifies) yields TO."""
    from . import diff as diffmod
    from . import snapshots as snaps
    from .store import Store
    target = _target(ctx)
    try:
        if to_snap == "." and target.mounted:
            if target.mountpoint:
                syncfs(target.mountpoint)
            control.request(target.store, {"op": "flush"})
        store = Store.open(target.store, readonly=True, lock=False, readahead=False)
    except StoreError as e:
        fail(str(e))
    try:
        with store.read() as txn:
            def epoch(name):
                return snaps.live_epoch(txn, store.db) if name == "." else \
                    snaps.get(txn, store.db, name).epoch
            lo, hi = epoch(from_snap), epoch(to_snap)
            if lo > hi:
                fail(f"FROM ({from_snap}) is newer than TO ({to_snap}); swap them")
            entries = diffmod.diff(txn, store.db, store.chunk_size, lo, hi,
                                   with_chunks=chunks or as_stat)
            if as_stat:
                _print_stat(entries)
            elif as_json:
                for e in entries:
                    click.echo(json.dumps(e.to_json()))
            else:
                for e in sorted(entries, key=diffmod.Entry.sort_key):
                    click.echo(e.text())
    except StoreError as e:
        fail(str(e))
    finally:
        store.close()


def _print_stat(entries) -> None:
    """Entries and bytes per op: the sizes of created and deleted files (not the implied
    contents of created or deleted directories), the changed chunks of modified ones."""
    counts = {op: 0 for op in ("create", "delete", "rename", "modify")}
    nbytes = dict.fromkeys(counts, 0)
    for e in entries:
        counts[e.op] += 1
        if e.chunks is not None:
            nbytes[e.op] += sum(c.length for c in e.chunks)
        elif e.size is not None:
            nbytes[e.op] += e.size
    for op in counts:
        click.echo(f"{op:<8} {counts[op]:>10} entries {nbytes[op]:>14} bytes")


@main.command()
@click.argument("name")
@click.argument("path", required=False)
@click.option("--to", "dest", help="Restore PATH under this path instead of over itself.")
@click.option("--force", is_flag=True,
              help="Replace an existing destination, or discard live changes on a rollback.")
@click.option("--from", "mirror_url", metavar="MIRROR_URL",
              help="Bring NAME (or PATH of it) back from this mirror instead.")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help="Bearer token for an http(s) mirror (else $MOUNTFS_TOKEN).")
@click.option("--ca-file", type=click.Path(dir_okay=False),
              help="Trust only this CA certificate for an https mirror.")
@click.pass_context
def restore(ctx, name, path, dest, force, mirror_url, token_file, ca_file):
    """Roll the live tree back to snapshot NAME, or bring back PATH from it.

    \b
    snapctl restore daily                      roll the whole tree back
    snapctl restore daily docs/report.txt      bring one file (or tree) back in place
    snapctl restore daily docs --to docs.old   bring it back under another name
    snapctl restore --from URL daily --to back copy snapshot daily back from a mirror

    Metadata is re-pointed; no chunk data is copied. PATH and DEST are relative to the
    filesystem root (absolute paths under the mountpoint work too). From a mirror, the
    tree is rebuilt through the mount; only chunks the source lacks travel."""
    from . import snapshots as snaps
    target = _target(ctx)
    if mirror_url:
        _restore_from_mirror(target, mirror_url, name, path, dest, force, token_file, ca_file)
        return
    if dest and not path:
        fail("--to needs a PATH to restore")
    try:
        if path is None:
            def offline(store):
                with store.write() as txn:
                    snap = snaps.get(txn, store.db, name)
                    done = snaps.rollback(txn, store.db, store.chunk_size, snap, force)
                return {"changed_inodes": len(done.inodes)}
            reply = run(target, {"op": "rollback", "name": name, "force": force}, offline)
            click.echo(f"rolled back to {name} ({reply['changed_inodes']} inodes changed)")
            return
        src = target.fs_path(path)
        to = target.fs_path(dest) if dest else src

        def offline(store):
            with store.write() as txn:
                snap = snaps.get(txn, store.db, name)
                top, copied, _ = snaps.restore_path(txn, store.db, store.chunk_size, snap,
                                                    src, to, force)
            return {"copied": copied}
        reply = run(target, {"op": "restore", "name": name, "path": src, "dest": to,
                             "force": force}, offline)
    except StoreError as e:
        fail(str(e))
    click.echo(f"restored ./{src} from {name} to ./{to} ({reply['copied']} inodes)")



@main.command()
@click.option("--to", "mirror_url", required=True, metavar="MIRROR_URL",
              help="file:///path/to/store, or http(s)://host:port (serve-mirror).")
@click.option("--snapshot", "name", help="Send this snapshot (default: take one of the live "
              "tree now, named repl-YYYYmmddTHHMMSSZ).")
@click.option("--force", is_flag=True,
              help="If the mirror changed since the base, roll it back to the base.")
@click.option("--spark-master", metavar="URL", envvar="MOUNTFS_SPARK_MASTER",
              help="Spark master (spark://, yarn, k8s://); default: embedded local[*].")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help="Bearer token for an http(s) mirror (else $MOUNTFS_TOKEN).")
@click.option("--ca-file", type=click.Path(dir_okay=False),
              help="Trust only this CA certificate for an https mirror (self-signed).")
@click.option("--batch-size", default="32M", show_default=True,
              help="Bytes of chunks per Spark task (K, M, G suffixes).")
@click.option("--spark-threshold", default="16M", show_default=True,
              help="Send at most this much without starting Spark (0: always use Spark).")
@click.option("--stall-timeout", default=300.0, show_default=True, metavar="SECONDS",
              help="Cancel a transfer that makes no progress for this long (rerun resumes).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.pass_context
def replicate(ctx, mirror_url, name, force, spark_master, token_file, ca_file, batch_size,
              spark_threshold, stall_timeout, as_json):
    """Send a snapshot to a mirror: only what changed since the newest snapshot both hold.

    Renames and deletes, creates and modifies, then the snapshot of the same name, are
    committed on the mirror in one transaction: the mirror is at its old snapshot or the new
    one, never in between. Only chunks the mirror lacks travel (a Spark job). An interrupted
    run can simply be run again: chunks that arrived are not sent twice."""
    from replicator.cycle import replicate as run_cycle
    from replicator.endpoints import open_mirror
    from .cli import parse_size
    from .store import Store
    target = _target(ctx)
    try:
        batch_bytes = parse_size(batch_size)
        inline_bytes = parse_size(spark_threshold)
        if name is None:
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            name = _create_snapshot(target, f"repl-{stamp}")["name"]
        source = Store.open(target.store, readonly=True, lock=False)
        chunk_size = source.chunk_size
        source.close()
        mirror = open_mirror(mirror_url, chunk_size, token=_token(token_file),
                             ca_file=ca_file)
        try:
            with _progress_bar(not as_json) as progress:
                result = run_cycle(target.store, mirror, name, force=force,
                                   master=spark_master, batch_bytes=batch_bytes,
                                   stall_seconds=stall_timeout,
                                   progress=progress, inline_bytes=inline_bytes)
            _hold(target, mirror.info()["uuid"], result.snapshot, mirror_url)
        finally:
            mirror.close()
    except StoreError as e:
        fail(str(e))
    except Exception as e:          # Spark and network failures: one line, not a traceback
        from replicator.transfer import TransferFailed
        if not isinstance(e, TransferFailed):
            raise
        fail(f"transfer failed: {e}")
    click.echo(json.dumps(result.to_json()) if as_json else result.summary())



@main.command()
@click.option("--mirror", "mirror_url", required=True, metavar="MIRROR_URL",
              help="file:///path/to/store, or http(s)://host:port.")
@click.option("--snapshot", "name", help="Snapshot to compare (default: the newest both hold).")
@click.option("--full", is_flag=True, help="Recompute every bucket from the items on both "
              "sides and re-read every chunk on the mirror (slow; finds silent corruption).")
@click.option("--repair", is_flag=True, help="Re-send exactly what differs.")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help="Bearer token for an http(s) mirror (else $MOUNTFS_TOKEN).")
@click.option("--ca-file", type=click.Path(dir_okay=False),
              help="Trust only this CA certificate for an https mirror.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.pass_context
def verify(ctx, mirror_url, name, full, repair, token_file, ca_file, as_json):
    """Check that a mirror holds exactly the source's snapshot, cheaply.

    Compares K bucket hashes (1024 by default) of the snapshot on both sides, then only the
    buckets that differ, item by item. Exit status 0 when the mirror matches, 1 when it
    differs (after --repair: when differences remain), 2 when the check could not run."""
    from replicator.endpoints import open_mirror
    from replicator.verify import verify as run_verify
    from .store import Store
    target = _target(ctx)
    try:
        source = Store.open(target.store, readonly=True, lock=False)
        chunk_size = source.chunk_size
        source.close()
        mirror = open_mirror(mirror_url, chunk_size, token=_token(token_file), ca_file=ca_file,
                             create=False)
        try:
            result = run_verify(target.store, mirror, name, full=full, repair=repair)
        finally:
            mirror.close()
    except StoreError as e:
        fail(str(e), 2)
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        for d in result.differences:
            click.echo(d.text())
        for kind, digests in result.bad_chunks.items():
            for digest in digests:
                click.echo(f"chunk data {kind}: {digest}")
        state = "matches" if result.clean else "DIFFERS"
        mismatched = ", ".join(f"{w} {n}" for w, n in result.mismatched.items())
        click.echo(f"mirror {state} at snapshot {result.snapshot}"
                   f"{' after repair' if result.repaired else ''}: "
                   f"{result.buckets} buckets compared, mismatched: {mismatched}")
    sys.exit(0 if result.clean else 1)


def _restore_from_mirror(target: Target, url, name, path, dest, force, token_file, ca_file):
    from replicator.endpoints import open_mirror
    from replicator.restore import restore_from
    if not target.mountpoint:
        fail("restore --from writes through the mounted filesystem: mount the store and "
             "pass -m MOUNTPOINT")
    rel = target.fs_path(path) if path else "."
    to = target.fs_path(dest) if dest else rel
    try:
        mirror = open_mirror(url, 0, token=_token(token_file), ca_file=ca_file, create=False)
        try:
            result = restore_from(mirror, target.store, target.mountpoint, name, rel, to,
                                  force)
        finally:
            mirror.close()
    except StoreError as e:
        fail(str(e))
    except OSError as e:
        fail(f"restore from the mirror failed: {e}")
    click.echo(f"restored ./{rel} of {name} from {url} to ./{to}: {result.entries} entries, "
               f"{result.bytes_fetched} bytes fetched, {result.bytes_local} bytes found "
               f"locally")


def _hold(target: Target, mirror_uuid: str, name: str, label: str) -> None:
    """Record the mirror's new base on the source, so that it is kept from deletion."""
    from . import snapshots as snaps

    def offline(store):
        with store.write() as txn:
            snaps.set_hold(txn, store.db, bytes.fromhex(mirror_uuid), name, label)
        return {}
    run(target, {"op": "hold", "mirror": mirror_uuid, "name": name, "label": label}, offline)


def _token(token_file: str | None) -> str | None:
    if token_file:
        try:
            return open(token_file).read().strip()
        except OSError as e:
            fail(f"cannot read token file {token_file}: {e.strerror}")
    return os.environ.get("MOUNTFS_TOKEN")


class _progress_bar:
    """Bytes sent, rate and ETA on stderr (tqdm), when stderr is a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = None

    def __enter__(self):
        return self.update if self.enabled else None

    def update(self, done_bytes: int, total_bytes: int, chunks: int) -> None:
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=f"sending {chunks} chunks", file=sys.stderr, leave=False)
        self.bar.update(done_bytes - self.bar.n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def _add_daemon_commands() -> None:
    """status, check and prune belong to the daemon's view of things (daemon.commands)."""
    from daemon.commands import check, prune, status
    for command in (status, check, prune):
        main.add_command(command)


_add_daemon_commands()

if __name__ == "__main__":
    main()
