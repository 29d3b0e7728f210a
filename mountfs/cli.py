"""``mountfs``: create, mount, unmount and check stores."""

from __future__ import annotations

import logging
import os
import sys

import click

from .clitools import CONTEXT, MOUNTPOINT, SIZE, LazyGroup, fail, version_option
from .store import StoreError



def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        stream=sys.stderr)


# What users of other filesystems' tools type, and what mountfs does instead.
INSTEAD = {
    "unmount": "'mountfs umount MOUNTPOINT' unmounts",
    "create": "'mountfs mkfs STORE' creates a store; snapshots are 'snapctl create NAME'",
    "init": "'mountfs mkfs STORE' creates a store",
    "scrub": "'mountfs fsck STORE' checks every invariant and chunk digest",
    "snapshot": "snapshots are 'snapctl create NAME'",
}


@click.group(cls=LazyGroup, context_settings=CONTEXT, instead=INSTEAD)
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
@version_option("mountfs")
@click.pass_context
def main(ctx, verbose):
    """mountfs: a snapshotting filesystem on LMDB, mounted through FUSE.

    \b
    mountfs mkfs /srv/store            create an empty store
    mountfs mount /srv/store /mnt/data mount it (returns once the mount is live)
    snapctl -m /mnt/data create daily  take a snapshot (see 'snapctl --help')
    mountfs umount /mnt/data           flush and unmount
    mountfs fsck /srv/store            check every invariant of an unmounted store
    """
    ctx.obj = {"verbose": verbose}


@main.command()
@click.argument("store", type=click.Path())
@click.option("--chunk-size", "size", type=SIZE, default="1M", show_default=True,
              help="Size of the content-addressed chunks files are cut into (power of two).")
def mkfs(store, size):
    """Create an empty store in directory STORE (new or empty)."""
    from .store import Store
    try:
        Store.mkfs(store, size)
    except StoreError as e:
        fail(str(e))
    click.echo(f"created store {os.path.abspath(store)} (chunk size {size} bytes)")


@main.command()
@click.argument("store", type=click.Path())
@click.argument("mountpoint", type=MOUNTPOINT)
@click.option("--foreground", "-f", is_flag=True, help="Stay attached; log to stderr.")
@click.option("--allow-other", is_flag=True,
              help="Let other users in (permissions are still enforced by mode bits).")
@click.option("--read-only", is_flag=True, help="Mount without writes (EROFS on every write).")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages (as 'mountfs -v').")
@click.option("--ready-fd", type=int, hidden=True)
@click.pass_context
def mount(ctx, store, mountpoint, foreground, allow_other, read_only, verbose, ready_fd):
    """Mount STORE at MOUNTPOINT. Returns once the mount is ready."""
    from .mount import mount_background, run_foreground
    verbose = verbose or ctx.obj["verbose"]
    hidden = _hidden_note(mountpoint) if ready_fd is None else ""
    if not foreground:
        try:
            pid = mount_background(store, mountpoint, allow_other, read_only, verbose)
        except StoreError as e:
            fail(str(e))
        click.echo(f"mounted {os.path.abspath(store)} at {os.path.abspath(mountpoint)} "
                   f"(pid {pid}){hidden}")
        return
    if hidden:
        click.echo(f"mountfs mount: note: {hidden.removeprefix('; ')}", err=True)
    setup_logging(verbose)

    def ready(err):
        if ready_fd is not None:
            os.write(ready_fd, b"READY\n" if err is None else f"ERROR {err}\n".encode())
            os.close(ready_fd)

    try:
        run_foreground(store, mountpoint, allow_other, read_only, ready=ready)
    except StoreError as e:
        if ready_fd is not None:
            ready(str(e))
        fail(str(e))


def _hidden_note(mountpoint: str) -> str:
    """What mounting over a directory that has files hides (as mount(8) does, silently:
    a user who mounts over their data must not believe it gone), or "". Not looked at if
    something is mounted there: a stopped mount would hang the listing, and the mount
    refuses that mountpoint anyway."""
    from .mountinfo import canonical, mounts
    path = canonical(mountpoint)
    if any(m.mountpoint == path for m in mounts()):
        return ""
    try:
        with os.scandir(mountpoint) as entries:
            count = sum(1 for _ in entries)
    except OSError:
        return ""           # the mount itself says what is wrong with it
    if not count:
        return ""
    what = "1 entry already in {} is" if count == 1 else f"{count} entries already in {{}} are"
    return (f"; {what.format(os.path.abspath(mountpoint))} hidden (not deleted) until "
            f"'mountfs umount {mountpoint}'")


@main.command()
@click.argument("mountpoint", type=MOUNTPOINT)
@click.option("--timeout", default=120.0, show_default=True,
              help="Seconds to wait for the mount process to flush and exit.")
def umount(mountpoint, timeout):
    """Flush and unmount MOUNTPOINT; returns when the data is safe in the store."""
    from .mount import umount as do_umount
    try:
        do_umount(mountpoint, timeout)
    except StoreError as e:
        fail(str(e))


@main.command()
@click.argument("store", type=click.Path())
def promote(store):
    """Make mirror STORE a writable source (after losing the original).

    Its snapshots stay; it can then be mounted read-write and replicated elsewhere."""
    from . import schema as S
    from .store import Store
    try:
        st = Store.open(store, holder="promote")
    except StoreError as e:
        fail(str(e))
    try:
        if st.mirror_of is None:
            fail(f"{store} is not a mirror")
        with st.write() as txn:
            if S.from_u64(txn.get(b"next_ino", db=st.db["meta"])) > S.MAX_INO + 1:
                fail(f"{store}: its inode counter is beyond {S.MAX_INO} (a hostile or "
                     f"corrupt mirror); run 'mountfs fsck {store}' and restore from it instead")
            txn.delete(b"mirror_of", db=st.db["meta"])
            txn.delete(b"rolled_back_to", db=st.db["meta"])
    finally:
        st.close()
    click.echo(f"promoted {os.path.abspath(store)}: it is now a writable source")


@main.command()
@click.argument("store", type=click.Path())
@click.option("--quiet", "-q", is_flag=True, help="Print only problems.")
def fsck(store, quiet):
    """Check every invariant of STORE and every chunk's digest. Never repairs.

    Exit status 0 when the store is consistent, 1 when a problem was found."""
    from .fsck import check
    from .store import Store
    try:
        # Read-only and under the lock: no writer may change the store while it is checked,
        # and read-only mounts of it (which take no lock) are fine beside us.
        st = Store.open(store, readonly=True, lock=True, holder="fsck")
    except StoreError as e:
        fail(str(e), 2)
    try:
        report = check(st, progress=None if quiet else lambda m: click.echo(m, err=True))
    finally:
        st.close()
    for problem in report.problems:
        click.echo(f"PROBLEM: {problem}")
    if not quiet or report.problems:
        click.echo(report.summary())
    sys.exit(1 if report.problems else 0)


if __name__ == "__main__":
    main(prog_name="mountfs")
