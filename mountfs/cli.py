"""``mountfs``: create, mount, unmount and check stores."""

from __future__ import annotations

import logging
import os
import sys

import click

from .store import StoreError

SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in SIZE_UNITS else ""
    try:
        return int(t[:-1] if unit else t) * SIZE_UNITS[unit]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 1M, 256K)")


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        stream=sys.stderr)


def fail(msg: str, code: int = 1):
    click.echo(f"mountfs: {msg}", err=True)
    sys.exit(code)


class OneLineUsageError(click.UsageError):
    """A usage error shown as one line naming the command, like every other error (click's
    own form is four lines: usage, a hint, a blank line, then the error)."""

    def show(self, file=None) -> None:
        msg = self.format_message().rstrip(".")
        if self.ctx is not None:
            path = self.ctx.command_path
            msg = f"{path}: {msg} (see '{path} --help')"
        click.echo(msg, err=True)


class OneLineGroup(click.Group):
    """A command group (mountfs, snapctl) whose usage errors, its own or its commands', are
    one line on stderr with status 2."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise _one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _one_line(e) from None


def _one_line(e: click.UsageError) -> click.UsageError:
    if isinstance(e, (OneLineUsageError, click.exceptions.NoArgsIsHelpError)):
        return e                                  # no arguments at all: the help is right
    return OneLineUsageError(e.format_message(), e.ctx)


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
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
@click.option("--chunk-size", default="1M", show_default=True,
              help="Size of the content-addressed chunks files are cut into (power of two).")
def mkfs(store, chunk_size):
    """Create an empty store in directory STORE (new or empty)."""
    from .store import Store
    size = parse_size(chunk_size)
    try:
        Store.mkfs(store, size)
    except StoreError as e:
        fail(str(e))
    click.echo(f"created store {os.path.abspath(store)} (chunk size {size} bytes)")


@main.command()
@click.argument("store", type=click.Path())
@click.argument("mountpoint", type=click.Path())
@click.option("--foreground", "-f", is_flag=True, help="Stay attached; log to stderr.")
@click.option("--allow-other", is_flag=True,
              help="Let other users in (permissions are still enforced by mode bits).")
@click.option("--read-only", is_flag=True, help="Mount without writes (EROFS on every write).")
@click.option("--ready-fd", type=int, hidden=True)
@click.pass_context
def mount(ctx, store, mountpoint, foreground, allow_other, read_only, ready_fd):
    """Mount STORE at MOUNTPOINT. Returns once the mount is ready."""
    from .mount import mount_background, run_foreground
    verbose = ctx.obj["verbose"]
    if not foreground:
        try:
            pid = mount_background(store, mountpoint, allow_other, read_only, verbose)
        except StoreError as e:
            fail(str(e))
        click.echo(f"mounted {os.path.abspath(store)} at {os.path.abspath(mountpoint)} "
                   f"(pid {pid})")
        return
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


@main.command()
@click.argument("mountpoint", type=click.Path())
@click.option("--timeout", default=120.0, show_default=True,
              help="Seconds to wait for the mount process to flush and exit.")
def umount(mountpoint, timeout):
    """Flush and unmount MOUNTPOINT; returns when the data is safe in the store."""
    from .mount import umount as do_umount
    try:
        do_umount(mountpoint, timeout)
    except StoreError as e:
        fail(str(e))


@main.command("serve-mirror")
@click.argument("store", type=click.Path())
@click.option("--listen", default="127.0.0.1:8765", show_default=True, metavar="HOST:PORT",
              help="Address to listen on.")
@click.option("--token-file", required=True, type=click.Path(dir_okay=False),
              help="File holding the bearer token clients must present.")
@click.option("--tls-cert", type=click.Path(dir_okay=False), help="Serve HTTPS with this "
              "certificate (PEM); needs --tls-key.")
@click.option("--tls-key", type=click.Path(dir_okay=False), help="The certificate's key.")
@click.option("--chunk-size", default="1M", show_default=True,
              help="Chunk size if STORE does not exist yet (must match the source's).")
@click.pass_context
def serve_mirror(ctx, store, listen, token_file, tls_cert, tls_key, chunk_size):
    """Receive replication into mirror STORE over HTTP(S) (created if missing).

    Sources replicate with 'snapctl replicate --to http://HOST:PORT --token-file FILE'.
    Every request must carry the token; the store stays locked while this runs."""
    import trio
    from replicator.server import serve
    from .store import Store
    setup_logging(ctx.obj["verbose"])
    if bool(tls_cert) != bool(tls_key):
        fail("--tls-cert and --tls-key go together")
    try:
        token = open(token_file).read().strip()
    except OSError as e:
        fail(f"cannot read token file {token_file}: {e.strerror}")
    if len(token) < 16:
        fail(f"the token in {token_file} is too short (16 characters at least)")
    try:
        if not os.path.exists(os.path.join(store, "data.mdb")):
            Store.mkfs(store, parse_size(chunk_size))
        st = Store.open(store, holder=f"serving a mirror on {listen}")
    except StoreError as e:
        fail(str(e))
    scheme = "https" if tls_cert else "http"
    click.echo(f"serving mirror {os.path.abspath(store)} on {scheme}://{listen}", err=True)
    try:
        trio.run(serve, st, token, listen, tls_cert, tls_key)
    except KeyboardInterrupt:
        pass
    finally:
        st.close()


@main.command()
@click.argument("store", type=click.Path())
def promote(store):
    """Make mirror STORE a writable source (after losing the original).

    Its snapshots stay; it can then be mounted read-write and replicated elsewhere."""
    from .store import Store
    try:
        st = Store.open(store, holder="promote")
    except StoreError as e:
        fail(str(e))
    try:
        if st.mirror_of is None:
            fail(f"{store} is not a mirror")
        with st.write() as txn:
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
        st = Store.open(store, readonly=False, lock=True, holder="fsck")
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
    main()
