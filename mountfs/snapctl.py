"""``snapctl``'s own commands on snapshots: create, list, delete, diff, restore.

The ``snapctl`` command line is composed above (``cmdline.snapctl``) from these and the
replicator's and the daemon's commands. It finds the filesystem from ``-m MOUNTPOINT``,
else from the mount holding the current directory, and talks to the mount process through
its control socket. ``--store STORE``
names a store directly; if it is not mounted, snapctl works on it offline, under the store
lock (so it can never race a mount).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import posixpath

import click

from . import control
from .clitools import (CONTEXT, MOUNTPOINT, LazyGroup, escaped, fail, padded,
                       target_options, version_option)
from .mountinfo import find_mount
from .errors import StoreError
from .units import counted, human_bytes


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
        request itself then says so), not an offline store to open; a stopped mount is
        said at once, as every command says it."""
        try:
            control.request(self.store, {"op": "status"}, timeout=10,
                            mountpoint=self.mountpoint)
            return True
        except control.MountStopped:
            raise
        except control.ControlError as e:
            return str(e).startswith("permission denied")

    def fs_path(self, path: str) -> str:
        """A path relative to the filesystem root; absolute paths under the mountpoint are
        accepted too (with --store, an absolute path starts at the root). One that leads
        elsewhere is refused: taken as relative, '/tmp/x' or '../x' would have quietly named
        a place in the filesystem the user did not mean."""
        rel = path
        if self.mountpoint and os.path.isabs(path):
            mp = self.mountpoint.rstrip("/")
            if path != mp and not path.startswith(mp + "/"):
                raise StoreError(f"{path!r} is outside the filesystem mounted at {mp}: give "
                                 f"a path under it, or one relative to its root")
            rel = path[len(mp):]
        rel = rel.lstrip("/") or "."
        if posixpath.normpath(rel).split("/")[0] == "..":
            raise StoreError(f"{path!r} leads outside the filesystem's root; paths are "
                             f"relative to the root")
        return rel

    def dest_path(self, dest: str) -> str:
        """A restore's DEST as ``fs_path`` gives it, keeping a final '/' (restore into that
        directory), which the mountpoint itself given as DEST would otherwise lose."""
        to = self.fs_path(dest)
        return to + "/" if dest.endswith("/") and not to.endswith("/") else to


def resolve_target(mountpoint: str | None, store: str | None) -> Target:
    """The filesystem a command acts on. Both -m and --store must name the same one: the
    request goes to the mount at -m, so a --store naming another would be silently ignored
    (and a delete would hit the wrong filesystem)."""
    if store and mountpoint:
        info = find_mount(mountpoint)
        if info is None or os.path.realpath(info.store) != os.path.realpath(store):
            raise StoreError(f"-m {mountpoint} and --store {store} name different "
                             f"filesystems; give one of them")
    if store:
        return Target(os.path.abspath(store), mountpoint)
    where = mountpoint or os.getcwd()
    info = find_mount(where)            # first: a stat of a stopped mount would hang
    if info is None and not os.path.exists(where):
        raise StoreError(f"{where} does not exist; -m takes the filesystem's mountpoint")
    if info is None and mountpoint:
        raise StoreError(f"{where} is not a mounted mountfs filesystem: mount it first "
                         f"('mountfs mount STORE {where}'), or name the store itself with "
                         f"--store STORE")
    if info is None:
        raise StoreError(f"the current directory {where} is not in a mountfs filesystem; "
                         f"pass -m MOUNTPOINT, or --store STORE for an unmounted store")
    return Target(info.store, info.mountpoint)


def syncfs(path: str, store: str) -> None:
    """Push the kernel's cached writes for the filesystem at ``path`` to the mount (unless
    its process is stopped: the syncfs would wait for it)."""
    control.check_running(path, store)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):   # dead, or dying now
            raise StoreError(f"the mount at {path} is dead (its process is gone): run "
                             f"'mountfs umount {path}', then mount {store} again") from None
        raise StoreError(f"{path}: {e.strerror}") from None
    try:
        ctypes.CDLL(None, use_errno=True).syncfs(fd)
    finally:
        os.close(fd)


def run(target: Target, request: dict, offline) -> dict:
    """Send ``request`` to the mount, or run ``offline(store)`` on the unmounted store."""
    if target.mounted:
        return control.request(target.store, request, mountpoint=target.mountpoint)
    from .store import Store
    store = Store.open(target.store, holder="snapctl")
    try:
        return offline(store)
    finally:
        store.close()


# What users of zfs, zrepl and sanoid type, and what snapctl does instead.
INSTEAD = {
    "snapshot": "'snapctl create NAME' takes a snapshot",
    "destroy": "'snapctl delete NAME' deletes a snapshot",
    "rm": "'snapctl delete NAME' deletes a snapshot",
    "ls": "'snapctl list' lists the snapshots",
    "rollback": "'snapctl restore NAME --force' rolls the whole tree back to snapshot NAME",
    "send": "'snapctl replicate --to URL' sends what changed to a mirror",
    "receive": "'mountfs serve-mirror' receives into a mirror; 'snapctl replicate' sends",
    "recv": "'mountfs serve-mirror' receives into a mirror; 'snapctl replicate' sends",
}


@click.group(cls=LazyGroup, context_settings=CONTEXT, instead=INSTEAD)
@click.option("-m", "--mountpoint", type=MOUNTPOINT, metavar="PATH",
              help="The mounted filesystem.")
@click.option("--store", type=click.Path(), help="A store directory (mounted or not).")
@version_option("snapctl")
@click.pass_context
def main(ctx, mountpoint, store):
    """Snapshots of a mountfs filesystem, and their mirrors.

    Snapshots are O(1) and browsable read-only at MOUNTPOINT/.snapshot/NAME. 'diff' says what
    changed between two; 'replicate', 'verify' and 'restore --from' work with mirrors;
    'status', 'check' and 'prune' show and apply what the daemon (mountfsd) does."""
    ctx.obj = {"mountpoint": mountpoint, "store": store}


def target_of(ctx) -> Target:
    try:
        return resolve_target(ctx.obj["mountpoint"], ctx.obj["store"])
    except StoreError as e:
        fail(str(e))


@main.command()
@click.argument("name")
@target_options
@click.pass_context
def create(ctx, name):
    """Take snapshot NAME of the live tree (everything written before this command started).

    Names of the form of mountfsd's own (auto-YYYYmmddTHHMMSS.ffffffZ) are refused: the
    daemon would prune them as its own."""
    from .snapnames import refuse_daemon_name
    try:
        refuse_daemon_name(name)
        snap = create_snapshot(target_of(ctx), name)
    except StoreError as e:
        fail(str(e))
    click.echo(f"created snapshot {escaped(snap['name'])} (epoch {snap['epoch']})")


def create_snapshot(target: Target, name: str) -> dict:
    """Take snapshot ``name`` (the mount checks the name; so does the offline path)."""
    if target.mountpoint:
        syncfs(target.mountpoint, target.store)

    def offline(store):
        from . import gc
        from . import snapshots as snaps
        with store.write() as txn:
            gc.settle_purges(txn, store.db, store.chunk_size)
            return {"snapshot": control.snapshot_json(snaps.create(txn, store.db, name))}
    return run(target, {"op": "create", "name": name}, offline)["snapshot"]


@main.command("list")
@target_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def list_(ctx, as_json):
    """List snapshots, oldest first, with the chunk data written since the one before."""
    from . import snapshots as snaps
    where = target_of(ctx)

    def offline(store):
        with store.read() as txn:
            return {"snapshots": [control.snapshot_json(s) for s in snaps.list_all(txn, store.db)]}
    try:
        items = run(where, {"op": "list"}, offline)["snapshots"]
    except StoreError as e:
        fail(str(e))
    if as_json:
        for s in items:
            click.echo(json.dumps(s))
        return
    if not items:
        click.echo("no snapshots")
        return
    import datetime
    click.echo(f"{'NAME':<32} {'EPOCH':>8} {'WRITTEN':>9}  CREATED")
    for s in items:
        created = datetime.datetime.fromtimestamp(s["created_ns"] / 1e9).isoformat(
            sep=" ", timespec="seconds")
        click.echo(f"{padded(escaped(s['name']), 32)} {s['epoch']:>8} "
                   f"{human_bytes(s['written']):>9}  {created}")


@main.command()
@click.argument("name")
@target_options
@click.option("--force", is_flag=True, help="Delete it even if it is a mirror's replication "
              "base (status and check report that mirror's base as deleted until the next "
              "cycle to it, which reconciles by hash buckets), or if "
              "files or directories under .snapshot/NAME are open (their next read fails "
              "with ESTALE).")
@click.pass_context
def delete(ctx, name, force):
    """Delete snapshot NAME; its space is reclaimed in the background. Refused while a
    program has a file or directory under .snapshot/NAME open (a backup reading it)."""
    try:
        delete_snapshot(target_of(ctx), name, force)
    except StoreError as e:
        fail(str(e))
    click.echo(f"deleted snapshot {escaped(name)}")


def delete_snapshot(where: Target, name: str, force: bool = False) -> None:
    from . import gc
    from . import snapshots as snaps

    def offline(store):
        with store.write() as txn:
            snaps.delete(txn, store.db, name, force)
        gc.run_to_completion(store)
        return {}
    run(where, {"op": "delete", "name": name, "force": force}, offline)


@main.command("diff")
@target_options
@click.argument("from_snap", metavar="FROM")
@click.argument("to_snap", metavar="[TO]", default=".", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry, per line.")
@click.option("--chunks", is_flag=True,
              help="For modified files, list the changed chunks (index, offset, length, digest).")
@click.option("--stat", "as_stat", is_flag=True, help="Per kind of change: entries, bytes of "
              "the chunks written, and the change in file sizes (with --json: one object).")
@click.pass_context
def diff_(ctx, from_snap, to_snap, as_json, chunks, as_stat):
    """What changed from snapshot FROM to snapshot TO ('.' is the live tree, the default).

    \b
    + ./path          created (a new directory's contents are implied)
    + ./b (hard link to ./a)  a new name of the file at ./a
    - ./path          deleted (FROM path)
    R ./old -> ./new  renamed (the same inode; old is a FROM path)
    M ./path          content or attributes changed

    The text report is sorted by path; --json streams entries as they are found (parents
    before children), in bounded memory however large the diff. The text report escapes
    names as 'ls --quoting-style=escape' does: a backslash is \\\\, a newline \\n, a tab
    \\t, other characters that do not print \\xHH (a byte: an escape sequence, a name
    that is not UTF-8) or \\uHHHH (a character); --json shows names as they are.

    Found in time proportional to the changes: unchanged subtrees are never visited.
    Applying the report to a copy of FROM (renames and deletes first, then creates and
    modifies) yields TO."""
    from . import diff as diffmod
    from . import snapshots as snaps
    from .store import Store
    if chunks and not (as_json or as_stat):
        fail("--chunks lists changed chunk ranges in the --json report; add --json")
    where = target_of(ctx)
    try:
        if to_snap == "." and where.mounted:
            if where.mountpoint:
                syncfs(where.mountpoint, where.store)
            control.request(where.store, {"op": "flush"}, mountpoint=where.mountpoint)
        store = Store.open(where.store, readonly=True, lock=False, readahead=False)
    except StoreError as e:
        fail(str(e))
    try:
        with store.read() as txn:
            def epoch(name):
                return snaps.readable_live_epoch(txn, store.db) if name == "." else \
                    snaps.get(txn, store.db, name).epoch
            lo, hi = epoch(from_snap), epoch(to_snap)
            if lo > hi:
                fail(f"FROM ({from_snap}) is newer than TO ({to_snap}); swap them")
            entries = diffmod.diff(txn, store.db, store.chunk_size, lo, hi,
                                   with_chunks=chunks or as_stat)
            if as_stat:
                from .namespace import View
                _print_stat(entries, View(txn, store.db, lo, store.chunk_size),
                            View(txn, store.db, hi, store.chunk_size), as_json)
            elif as_json:
                for e in entries:
                    click.echo(json.dumps(e.to_json()))
            else:
                for e in sorted(entries, key=diffmod.Entry.sort_key):
                    click.echo(e.text(escaped))
    except StoreError as e:
        fail(str(e))
    finally:
        store.close()


def _print_stat(entries, before, after, as_json: bool) -> None:
    """Per kind of change: entries, the bytes of the chunks written (whole chunks: what a
    mirror may need), and how file sizes changed. ``before`` and ``after`` are Views of
    FROM and TO: the old size of a modified file, and the files inside a created or deleted
    directory (implied by its one entry, counted here). A file with several names counts
    once, whether its names are entries or lie inside a created or deleted directory; a
    file moved into a created directory, or out of a deleted one, was neither created nor
    deleted (its RENAME says where it went), so neither counts it."""
    ops = ("create", "delete", "rename", "modify")
    counts, written, grown = dict.fromkeys(ops, 0), dict.fromkeys(ops, 0), dict.fromkeys(ops, 0)
    counted = {"create": set(), "delete": set()}      # file inodes whose size is in the sums
    for e in entries:
        counts[e.op] += 1
        if e.link is not None:
            continue                                  # another name: no data of its own
        if e.op == "create":
            size = _size_once(after, before, e, counted[e.op])
            written[e.op] += size
            grown[e.op] += size
        elif e.op == "delete":
            grown[e.op] -= _size_once(before, after, e, counted[e.op])
        elif e.op == "modify" and e.type == "file":
            written[e.op] += sum(c.length for c in e.chunks or ())
            grown[e.op] += (e.size or 0) - before.get(e.ino).size
    if as_json:
        click.echo(json.dumps({op: {"entries": counts[op], "chunk_bytes_written": written[op],
                                    "file_size_change": grown[op]} for op in ops}))
        return
    click.echo(f"{'CHANGE':<8} {'ENTRIES':>10} {'CHUNK BYTES WRITTEN':>20} "
               f"{'FILE SIZE CHANGE':>17}")
    for op in ops:
        click.echo(f"{op:<8} {counts[op]:>10} {written[op]:>20} {grown[op]:>+17}")


def _size_once(view, other, e, counted: set) -> int:
    """Bytes of entry ``e``'s file, or of the regular files under it if it is a directory,
    leaving out the inodes in ``counted`` (and adding the rest to it) and, under a
    directory, the files that have a name in ``other`` too (the view at the diff's other
    end: they moved rather than came or went)."""
    if e.type != "dir":
        if e.ino in counted:
            return 0
        counted.add(e.ino)
        return e.size or 0
    import stat
    total, todo = 0, [e.ino]
    while todo:
        for _, child in view.listdir(todo.pop()):
            rec = view.get(child)
            if stat.S_ISDIR(rec.mode):
                todo.append(child)
            elif stat.S_ISREG(rec.mode) and child not in counted and \
                    not _named_in(other, child):
                counted.add(child)
                total += rec.size
    return total


def _named_in(view, ino: int) -> bool:
    rec = view.inode(ino)
    return rec is not None and rec.nlink > 0


@main.command()
@click.argument("name")
@click.argument("path", required=False)
@target_options
@click.option("--to", "dest", help="Restore PATH under this path instead of over itself; a "
              "DEST ending in '/' is an existing directory to restore PATH into.")
@click.option("--force", is_flag=True, help="Replace an existing destination of the same kind "
              "(file by file, directory by directory), or discard live changes on a rollback.")
@click.pass_context
def restore(ctx, name, path, dest, force):
    """Roll the live tree back to snapshot NAME, or bring back PATH from it.

    \b
    snapctl restore daily                      roll the whole tree back
    snapctl restore daily docs/report.txt      bring one file (or tree) back in place
    snapctl restore daily docs --to docs.old   bring it back under another name
    snapctl restore daily docs/a.txt --to tmp/ bring it back into tmp/ (as tmp/a.txt)

    An existing destination is replaced only with --force, and never by something of
    another kind: a directory is never replaced by a file, nor a file by a directory.
    Metadata is re-pointed; no chunk data is copied. PATH and DEST are relative to the
    filesystem root (absolute paths under the mountpoint work too)."""
    where = target_of(ctx)
    if dest and not path:
        fail("--to needs a PATH to restore")
    try:
        if path is None:
            reply = _rollback(where, name, force)
            click.echo(f"rolled back to {escaped(name)} "
                       f"({counted(reply['changed_inodes'], 'inode')} changed)")
            return
        src = where.fs_path(path)
        reply = _restore_path(where, name, src, where.dest_path(dest) if dest else src, force)
    except StoreError as e:
        fail(str(e))
    dest = escaped(reply["dest"])
    replaced = "" if reply["replaced"] is None else f"; replaced ./{dest}" + (
        f" ({counted(reply['replaced_entries'], 'entry', 'entries')})"
        if reply["replaced"] == "directory" else "")
    click.echo(f"restored ./{escaped(src)} from {escaped(name)} to ./{dest} "
               f"({counted(reply['copied'], 'inode')}){replaced}")


def _rollback(where: Target, name: str, force: bool) -> dict:
    from . import snapshots as snaps

    def offline(store):
        with store.write() as txn:
            snap = snaps.get(txn, store.db, name)
            done = snaps.rollback(txn, store.db, store.chunk_size, snap, force)
        return {"changed_inodes": len(done.inodes)}
    return run(where, {"op": "rollback", "name": name, "force": force}, offline)


def _restore_path(where: Target, name: str, src: str, to: str, force: bool) -> dict:
    from . import snapshots as snaps

    def offline(store):
        with store.write() as txn:
            snap = snaps.get(txn, store.db, name)
            return snaps.restore_path(txn, store.db, store.chunk_size, snap, src, to,
                                      force).to_json()
    return run(where, {"op": "restore", "name": name, "path": src, "dest": to,
                       "force": force}, offline)


def hold(target: Target, mirror_uuid: str, name: str, label: str) -> None:
    """Record the mirror's new base on the source, so that it is kept from deletion."""
    from . import snapshots as snaps

    def offline(store):
        with store.write() as txn:
            snaps.set_hold(txn, store.db, bytes.fromhex(mirror_uuid), name, label)
        return {}
    run(target, {"op": "hold", "mirror": mirror_uuid, "name": name, "label": label}, offline)



def forget_mirror(target: Target, label: str) -> int:
    """Drop the hold of the mirror recorded as ``label``; how many were dropped."""
    from . import snapshots as snaps

    def offline(store):
        with store.write() as txn:
            return {"dropped": snaps.drop_holds(txn, store.db, label)}
    return run(target, {"op": "forget_mirror", "label": label}, offline)["dropped"]


if __name__ == "__main__":
    main(prog_name="snapctl")
