"""The replicator's commands: ``snapctl replicate``, ``verify``, ``restore --from``,
``forget-mirror`` and ``mountfs serve-mirror``.

Only click and the bottom package's command-line helpers are imported here; the replication
machinery (Spark, httpx, the mirror code) is imported by the command that runs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys

import click

from mountfs import snapctl
from mountfs.clitools import (CONTEXT, DURATION, INTERRUPTED, LISTEN, POSITIVE_SIZE, SIZE, escaped,
                              fail, target_options)
from mountfs.errors import StoreError
from mountfs.interrupts import Interrupted, signals_raise

TOKEN_HELP = "Bearer token for an http(s) mirror (else $MOUNTFS_TOKEN)."
CA_HELP = "Trust only this CA certificate for an https mirror (a self-signed receiver)."


def _token(token_file: str | None) -> str | None:
    if token_file:
        return read_token_file(token_file, strict=False)
    return os.environ.get("MOUNTFS_TOKEN")


def _chunk_size(where: snapctl.Target) -> int:
    from mountfs.store import Store
    source = Store.open(where.store, readonly=True, lock=False)
    try:
        return source.chunk_size
    finally:
        source.close()


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def refuse_mirror_inside_source(where: snapctl.Target, url: str) -> None:
    """A ``file://`` mirror inside the source's mount or store would replicate the
    filesystem into itself (and grow with every cycle)."""
    from replicator.endpoints import local_path
    named = local_path(url)
    if named is None:
        return
    path = os.path.realpath(named)
    for top, what in ((where.mountpoint, "mounted filesystem"), (where.store, "store")):
        if top and _inside(path, os.path.realpath(top)):
            raise StoreError(f"the mirror {named} is inside the source {what} {top}; "
                             f"choose a directory outside it")
    from mountfs.mountinfo import find_mount
    info = find_mount(path)
    if info is not None and os.path.realpath(info.store) == os.path.realpath(where.store):
        raise StoreError(f"the mirror {named} is inside the source filesystem "
                         f"(mounted at {info.mountpoint}); choose a directory outside it")


def refuse_read_only_source(where: snapctl.Target) -> None:
    """Before any mirror is made or touched: a run records the mirror's new base on the
    source, which a read-only mount refuses, so the run would have sent everything and then
    failed."""
    if where.mountpoint and os.statvfs(where.mountpoint).f_flag & os.ST_RDONLY:
        fail(f"{where.mountpoint} is mounted read-only: replicate records the mirror's base "
             f"on the source; run it on the writable mount, or with --store "
             f"{where.store} while the store is not mounted")


def open_checked_mirror(where: snapctl.Target, url: str, token_file, ca_file,
                        create: bool = True):
    """The mirror, opened and asked for its state: a mirror that cannot be reached, refuses
    the token or is not a store fails here, before anything is done on the source."""
    from replicator.endpoints import open_mirror
    refuse_mirror_inside_source(where, url)
    mirror = open_mirror(url, _chunk_size(where), token=_token(token_file), ca_file=ca_file,
                         create=create)
    try:
        mirror.info()
    except BaseException:
        mirror.close()
        raise
    return mirror


def _spark_master(value: str | None) -> str | None:
    """``--spark-master`` (or MOUNTFS_SPARK_MASTER), refused before anything is done."""
    from .masters import master_problem
    if value is not None and (problem := master_problem(value)):
        raise click.BadParameter(problem, param_hint="'--spark-master' / MOUNTFS_SPARK_MASTER")
    return value


def _new_snapshot_name() -> str:
    """``repl-`` and the UTC time to the microsecond."""
    from mountfs.snapnames import stamped_name
    return stamped_name("repl-")


def _take_snapshot(where) -> str:
    """Take a snapshot named by ``_new_snapshot_name``. Runs started together can pick the
    same microsecond (seen in the suite: two of three): the one that loses takes the next
    name."""
    tries = 10
    while True:
        try:
            return snapctl.create_snapshot(where, _new_snapshot_name())["name"]
        except StoreError as e:
            tries -= 1
            if "already exists" not in str(e) or not tries:
                raise


@click.command(context_settings=CONTEXT)
@target_options
@click.option("--to", "--mirror", "mirror_url", required=True, metavar="MIRROR_URL",
              help="file:///path/to/store, or http(s)://host:port (serve-mirror).")
@click.option("--snapshot", "name", help="Send this snapshot (default: take one of the live "
              "tree now, named repl-YYYYmmddTHHMMSS.ffffffZ; removed again if the run fails, "
              "or by a later run once no mirror holds it as its base).")
@click.option("--force", is_flag=True,
              help="If the mirror changed since the base, roll it back to the base; if "
              "MIRROR_URL is a store with files of its own (not a mirror, not fresh from "
              "mkfs), replace its live tree and make it a mirror (http(s): admin token).")
@click.option("--spark-master", metavar="URL", envvar="MOUNTFS_SPARK_MASTER",
              callback=lambda ctx, param, value: _spark_master(value),
              help="Spark master (spark://, yarn, k8s://); default: embedded local[*].")
@click.option("--token-file", type=click.Path(dir_okay=False), help=TOKEN_HELP)
@click.option("--ca-file", type=click.Path(dir_okay=False), help=CA_HELP)
@click.option("--batch-size", type=POSITIVE_SIZE, default="32M", show_default=True,
              help="Bytes of chunks per Spark task (K, M, G suffixes).")
@click.option("--spark-threshold", type=SIZE, default="16M", show_default=True,
              help="Send at most this much without starting Spark (0: always use Spark).")
@click.option("--stall-timeout", type=DURATION, default="5m", show_default=True,
              help="Cancel a transfer that makes no progress for this long (30s, 5m, ...; "
                   "a re-run resumes).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.pass_context
def replicate(ctx, mirror_url, name, force, spark_master, token_file, ca_file, batch_size,
              spark_threshold, stall_timeout, as_json):
    """Send a snapshot to a mirror: only what changed since the newest snapshot both hold.

    Renames and deletes, creates and modifies, then the snapshot of the same name, are
    committed on the mirror in one transaction: the mirror is at its old snapshot or the new
    one, never in between. Only chunks the mirror lacks travel (a Spark job). An interrupted
    run (Ctrl-C: exit status 130) can simply be run again: chunks that arrived are not sent
    twice. On a terminal, progress (bytes, rate, ETA) is shown on stderr."""
    from replicator.cycle import COMMITTING
    where = snapctl.target_of(ctx)
    refuse_read_only_source(where)
    ours = None                           # the snapshot this run took, if any
    progress = Progress(enabled=not as_json and sys.stderr.isatty())
    try:
        with signals_raise((signal.SIGHUP, signal.SIGTERM)):   # as Ctrl-C: cleaned up
            mirror = open_checked_mirror(where, mirror_url, token_file, ca_file)
            try:
                if name is None:
                    ours = name = _take_snapshot(where)
                try:
                    result = _cycle(where, mirror, name, force, spark_master, batch_size,
                                    spark_threshold, stall_timeout, progress)
                except BaseException as e:
                    if progress.last_phase == COMMITTING and not _refused(e):
                        ours = None       # the mirror may hold it now: it must stay
                    raise
                ours = None               # the mirror's base from now on
                snapctl.hold(where, mirror.info()["uuid"], result.hold, mirror_url)
            finally:
                progress.close()
                mirror.close()
    except (KeyboardInterrupt, Interrupted) as e:
        _interrupted(where, ours, e)
    except (StoreError, OSError) as e:
        _drop(where, ours)
        fail(_message(e))
    except Exception as e:                # a Spark failure: one line, not a traceback
        from replicator.transfer import TransferFailed
        _drop(where, ours)                # whatever failed: the run leaves nothing behind
        if not isinstance(e, TransferFailed):
            raise                         # a bug: its traceback is what finds it
        fail(f"transfer failed: {e}")
    click.echo(json.dumps(result.to_json()) if as_json else result.summary())
    _done_whatever_comes()
    removed = _drop_earlier_runs(where, name)
    if removed and not as_json:
        click.echo(f"removed {len(removed)} snapshot(s) of earlier runs that no mirror holds "
                   f"as its base any more")


def _drop_earlier_runs(where: snapctl.Target, sent: str) -> list[str]:
    """The repl- snapshots of earlier runs, older than the one just sent, that no mirror
    holds as its base: they were only the means of sending (syncoid's rule), and would pile
    up, each pinning what it held. A base is kept (deleting it needs --force), as is a
    snapshot a program is reading; a user's own snapshots are never touched."""
    if not where.mounted:
        return []
    from mountfs.snapnames import is_stamped
    try:
        names = [s["name"] for s in _snapshots_of(where)]
    except (StoreError, OSError) as e:    # the run succeeded: its summary stands
        click.echo(f"snapctl: earlier runs' snapshots not looked at: {_message(e)}", err=True)
        return []
    older = names[:names.index(sent)] if sent in names else []
    removed = []
    for name in older:
        if is_stamped(name, "repl-"):
            try:
                snapctl.delete_snapshot(where, name)
                removed.append(name)
            except (StoreError, OSError):
                pass                  # a base, or being read: kept, as it should be
    return removed


def _snapshots_of(where: snapctl.Target) -> list[dict]:
    """The mounted filesystem's snapshots, oldest first."""
    from mountfs import control
    return control.request(where.store, {"op": "list"},
                           mountpoint=where.mountpoint)["snapshots"]


def _refused(e: BaseException) -> bool:
    """Whether the mirror refused the commit outright (it said so, or a file:// mirror's
    transaction raised): it holds nothing of this run, so the run's snapshot can go. A
    commit cut off on the wire may have been applied: its snapshot stays."""
    from .client import MirrorUnreachable
    from .mirror import MirrorError
    return isinstance(e, MirrorError) and not isinstance(e, MirrorUnreachable)


def _done_whatever_comes() -> None:
    """The run is complete and said so: Ctrl-C, SIGTERM or SIGHUP while Spark shuts down as
    Python exits would only print py4j's tracebacks over a success, so they end the process
    at once, with the success's status."""
    def leave(signum, frame):
        sys.stdout.flush()
        os._exit(0)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, leave)


def _cycle(where, mirror, name, force, spark_master, batch_bytes, inline_bytes,
           stall_seconds, progress):
    from replicator.cycle import replicate as run_cycle
    from replicator.transfer import spark_log_path
    _log_to(spark_log_path())
    return run_cycle(where.store, mirror, name, force=force, master=spark_master,
                     batch_bytes=batch_bytes, stall_seconds=stall_seconds,
                     progress=progress.update if progress.enabled else None,
                     inline_bytes=inline_bytes, phase=progress.phase)


def _log_to(path: str) -> None:
    """Python's log records go to the Spark log file, not the terminal: py4j logs through
    the root logger (``logging.exception``), which would otherwise print tracebacks on
    stderr when the JVM goes away (Ctrl-C reaches it too). What the user must see is
    printed by the command itself, in one line."""
    root = logging.getLogger()
    if not root.handlers:
        handler = _SparkLogHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: "
                                               "%(message)s"))
        root.addHandler(handler)


class _SparkLogHandler(logging.FileHandler):
    """Records to the Spark log, opened as ``open_spark_log`` does, and only once one comes
    (py4j's when Spark is in trouble, a warning): a run with nothing to log makes no file."""

    def __init__(self, path: str):
        super().__init__(path, delay=True)

    def _open(self):
        from replicator.transfer import open_spark_log
        return os.fdopen(open_spark_log(self.baseFilename), "a", encoding=self.encoding,
                         errors=self.errors)


def _message(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f" {e.filename}" if e.filename else ""
        return f"{e.strerror.lower()}:{where}" if where else e.strerror.lower()
    return str(e)


def _drop(where: snapctl.Target, name: str | None) -> None:
    """Delete the snapshot a failed run took, so that failures leave nothing behind."""
    if name is None:
        return
    try:
        snapctl.delete_snapshot(where, name)
    except StoreError as e:
        click.echo(f"snapctl: could not remove snapshot {name} taken by this run: {e}",
                   err=True)


def _interrupted(where: snapctl.Target, ours: str | None, e: BaseException) -> None:
    """Ctrl-C (status 130), SIGTERM (143) or SIGHUP (129): the run's snapshot removed, one
    line. The terminal's SIGINT also reached the Spark JVM, whose broken connection would
    otherwise print pages of py4j errors as Python exits: cancel what is left, silence it,
    and leave without running exit handlers."""
    logging.disable(logging.CRITICAL)
    transfer = sys.modules.get("replicator.transfer")     # loaded: Spark may be running
    if transfer is not None:
        _quiet_stderr(transfer.spark_log_path())
        try:
            transfer.cancel_all()
        except Exception:
            pass                          # the JVM may be gone already: nothing to cancel
    _drop(where, ours)
    how = str(e) if isinstance(e, Interrupted) else "interrupted"
    click.echo(f"snapctl: {how}; chunks that arrived are kept on the mirror: run the "
               "same command again to resume", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(e.status if isinstance(e, Interrupted) else INTERRUPTED)


def _quiet_stderr(log_path: str) -> None:
    """Send file descriptor 2 (where py4j and the JVM write) to the Spark log; keep our own
    messages on the terminal through a duplicate."""
    from replicator.transfer import open_spark_log
    try:
        fd = open_spark_log(log_path)
    except (StoreError, OSError):
        return                            # not a file of ours: stderr stays the terminal
    saved = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(saved, "w", buffering=1)


class Progress:
    """What a long replicate shows on a terminal (stderr): the phase it is in (finding the
    changes, asking the mirror, starting Spark), then bytes sent, rate and ETA (tqdm)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.last_phase = None

    def phase(self, text: str) -> None:
        self.last_phase = text
        if self.enabled and self.bar is None:
            click.echo(f"snapctl: {text}", err=True)

    def update(self, done_bytes: int, total_bytes: int, chunks: int) -> None:
        if self.bar is None:
            from tqdm import tqdm
            cols, rows = _terminal_size()
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=f"sending {chunks} chunks", file=sys.stderr, leave=False,
                            ncols=cols, nrows=rows, mininterval=0.5)
        self.bar.update(done_bytes - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _terminal_size() -> tuple[int, int]:
    """(columns, lines) of the terminal; 80x24 for one that reports no size (a fresh pty,
    where tqdm would otherwise draw nothing)."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except OSError:
        return 80, 24
    return size.columns or 80, size.lines or 24


@click.command(context_settings=CONTEXT)
@target_options
@click.option("--mirror", "--to", "mirror_url", required=True, metavar="MIRROR_URL",
              help="file:///path/to/store, or http(s)://host:port (either name: "
                   "the one replicate takes works here too).")
@click.option("--snapshot", "name", help="Snapshot to compare (default: the newest both hold).")
@click.option("--full", is_flag=True, help="Recompute every bucket from the items on both "
              "sides and re-read every chunk on the mirror (slow; finds silent corruption).")
@click.option("--repair", is_flag=True, help="Re-send exactly what differs.")
@click.option("--token-file", type=click.Path(dir_okay=False), help=TOKEN_HELP)
@click.option("--ca-file", type=click.Path(dir_okay=False), help=CA_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.pass_context
def verify(ctx, mirror_url, name, full, repair, token_file, ca_file, as_json):
    """Check that a mirror holds exactly the source's snapshot, cheaply.

    Compares K bucket hashes (1024 by default) of the snapshot on both sides, then only the
    buckets that differ, item by item. Exit status 0 when the mirror matches, 1 when it
    differs (after --repair: when differences remain), 2 when the check could not run."""
    from replicator.verify import verify as run_verify
    where = snapctl.target_of(ctx)
    try:
        mirror = open_checked_mirror(where, mirror_url, token_file, ca_file, create=False)
        try:
            result = run_verify(where.store, mirror, name, full=full, repair=repair)
        finally:
            mirror.close()
    except (StoreError, OSError) as e:
        fail(_message(e), 2)
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
        scrubbed = "".join(f", {len(digests)} {kind}" for kind, digests
                           in result.bad_chunks.items())
        click.echo(f"mirror {state} at snapshot {result.snapshot}"
                   f"{' after repair' if result.repaired else ''}: "
                   f"{result.buckets} buckets compared, mismatched: {mismatched}"
                   + (f"; chunk data scrubbed{scrubbed}" if result.bad_chunks else ""))
    sys.exit(0 if result.clean else 1)


def _with_mirror_source(local: click.Command) -> click.Command:
    """``snapctl restore`` with ``--from MIRROR_URL`` added to the bottom package's own."""
    params = [
        click.Option(["--from", "mirror_url"], metavar="MIRROR_URL",
                     help="Bring NAME (or PATH of it) back from this mirror instead."),
        click.Option(["--token-file"], type=click.Path(dir_okay=False), help=TOKEN_HELP),
        click.Option(["--ca-file"], type=click.Path(dir_okay=False), help=CA_HELP),
        click.Option(["--allow-special"], is_flag=True,
                     help="With --from: also restore set-uid/set-gid files, file "
                          "capabilities and device nodes (root only; refused otherwise)."),
    ]

    @click.pass_context
    def callback(ctx, mirror_url, token_file, ca_file, allow_special, **kwargs):
        if mirror_url is None:
            return ctx.invoke(local.callback, **kwargs)
        _restore_from_mirror(snapctl.target_of(ctx), mirror_url, kwargs["name"],
                             kwargs["path"], kwargs["dest"], kwargs["force"], token_file,
                             ca_file, allow_special)

    return click.Command(local.name, params=local.params + params, callback=callback,
                         context_settings=CONTEXT, help=local.help + """

    \b
    snapctl restore --from URL daily --to back copy snapshot daily back from a mirror

    From a mirror, the tree is rebuilt through the mount; only chunks the source lacks
    travel.""")


def _restore_from_mirror(where, url, name, path, dest, force, token_file, ca_file,
                         allow_special):
    from replicator.restore import restore_from
    if not where.mountpoint:
        fail("restore --from writes through the mounted filesystem: mount the store and "
             "pass -m MOUNTPOINT")
    try:
        rel = where.fs_path(path) if path else "."
        to = where.dest_path(dest) if dest else rel
        mirror = open_checked_mirror(where, url, token_file, ca_file, create=False)
        try:
            result = restore_from(mirror, where.store, where.mountpoint, name, rel, to,
                                  force, allow_special)
        finally:
            mirror.close()
    except StoreError as e:
        fail(str(e))
    except OSError as e:
        fail(f"restore from the mirror failed: {_message(e)}")
    replaced = "" if result.replaced is None else f"; replaced ./{escaped(result.dest)}" + (
        f" ({result.replaced_entries} entries)" if result.replaced == "directory" else "")
    what = "all" if rel in (".", "") else f"./{escaped(rel)}"
    click.echo(f"restored {what} of {escaped(name)} from {url} to "
               f"./{escaped(result.dest)}: "
               f"{result.entries} entries, "
               f"{result.bytes_fetched} bytes fetched, {result.bytes_local} bytes found "
               f"locally{replaced}")
    if result.left_out:
        click.echo(f"snapctl: warning: {len(result.left_out)} special files left out or "
                   f"stripped of set-id bits (e.g. {escaped(result.left_out[0])}): only root "
                   f"can restore them, with --allow-special", err=True)


restore = _with_mirror_source(snapctl.restore)


@click.command("forget-mirror", context_settings=CONTEXT)
@click.argument("url")
@target_options
@click.pass_context
def forget_mirror(ctx, url):
    """Forget mirror URL: drop its replication base, so that status, check and metrics no
    longer report it and its base snapshot may be pruned.

    For a mirror that was deleted or replaced. Replicating to it again later reconciles it
    by hash buckets (or sends everything to an empty one)."""
    where = snapctl.target_of(ctx)
    try:
        dropped = snapctl.forget_mirror(where, url)
    except StoreError as e:
        fail(str(e))
    if not dropped:
        fail(f"no mirror {url} is recorded on this filesystem ('snapctl status' lists them)")
    click.echo(f"forgot mirror {url} (its base snapshot is no longer held)")


@click.command("serve-mirror", context_settings=CONTEXT)
@click.argument("store", type=click.Path())
@click.option("--listen", type=LISTEN, default="127.0.0.1:8765", show_default=True,
              metavar="HOST:PORT", help="Address to listen on.")
@click.option("--token-file", required=True, type=click.Path(dir_okay=False),
              help="File holding the replicate token: it can only ADD snapshots (append-"
              "only: no rollback, no snapshot deletion). Give it to the source.")
@click.option("--admin-token-file", type=click.Path(dir_okay=False),
              help="File holding the admin token, which may also roll back (replicate "
              "--force) and prune snapshots. Keep it off the source, or leave it out and "
              "prune on this host with 'snapctl prune --store'.")
@click.option("--max-request", type=SIZE, default="1G", show_default=True,
              help="Largest request body, compressed or not (413 beyond).")
@click.option("--max-staged", type=SIZE, help="Most chunk bytes held staged but not "
              "committed (default: no fixed cap; a first copy stages all its data before "
              "its one commit).")
@click.option("--keep-free", type=SIZE, default="2G", show_default=True,
              help="Staging never leaves less than this free on the mirror's disk.")
@click.option("--staging-expiry", type=DURATION, default="1d", show_default=True,
              help="Drop staged chunks of a cycle that sent nothing for this long "
              "(abandoned; 30m, 1d, ...).")
@click.option("--body-timeout", type=DURATION, default="5m", show_default=True,
              help="Grace time to send a request body (30s, 5m, ...); after it a body must "
              "have averaged 64 KiB/s, or it is cut off (408).")
@click.option("--tls-cert", type=click.Path(dir_okay=False), help="Serve HTTPS with this "
              "certificate (PEM); needs --tls-key.")
@click.option("--tls-key", type=click.Path(dir_okay=False), help="The certificate's key.")
@click.option("--chunk-size", type=SIZE, default="1M", show_default=True,
              help="Chunk size if STORE does not exist yet (must match the source's).")
@click.option("--force", is_flag=True, help="Serve STORE even if it is a store with files "
              "of its own, not a mirror (replicate --force with the admin token then makes "
              "it one).")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages (as 'mountfs -v').")
@click.pass_context
def serve_mirror(ctx, store, listen, token_file, admin_token_file, max_request, max_staged,
                 keep_free, staging_expiry, body_timeout, tls_cert, tls_key, chunk_size,
                 force, verbose):
    """Receive replication into mirror STORE over HTTP(S) (created if missing).

    Sources replicate with 'snapctl replicate --to https://HOST:PORT --token-file FILE
    --ca-file CERT'. Every request must carry a token; the replicate token can only add
    snapshots (append-only), the admin token may also roll back and prune. Without
    --tls-cert, listen on loopback only. The store stays locked while this runs. A store
    with files of its own (not a mirror, not fresh from mkfs) is served only with --force."""
    import trio

    from mountfs.cli import setup_logging
    from mountfs.store import Store
    from replicator.mirror import StagingLimits, info, overwrites
    from replicator.server import Limits, bind, serve
    setup_logging(verbose or (ctx.obj or {}).get("verbose", False))
    if bool(tls_cert) != bool(tls_key):
        fail("--tls-cert and --tls-key go together")
    token = read_token_file(token_file)
    admin_token = read_token_file(admin_token_file) if admin_token_file else None
    if admin_token == token:
        fail("the admin token must differ from the replicate token")
    if not tls_cert and not _is_loopback(listen.host):
        click.echo(f"WARNING: serving on {listen} without TLS: the token and every byte of "
                   f"the mirror cross the network in clear; use --tls-cert/--tls-key",
                   err=True)
    limits = Limits(max_body=max_request, body_seconds=body_timeout,
                    staging=StagingLimits(max_staged, staging_expiry, keep_free))
    try:
        sock = bind(listen)         # first: a mirror store is never created for nothing
    except OSError as e:
        fail(f"--listen: {listen.cannot_listen(e)}")
    try:
        if not os.path.exists(os.path.join(store, "data.mdb")):
            Store.mkfs(store, chunk_size)
        st = Store.open(store, holder=f"serving a mirror on {listen}", readahead=False)
        held = info(st)
    except StoreError as e:
        fail(str(e))
    if not force and overwrites(held["mirror_of"], held["empty"]):
        st.close()
        fail(f"{os.path.abspath(store)} is a mountfs store with files of its own, not a "
             f"mirror: serving it would offer them to be replaced; serve a new or empty "
             f"directory, or pass --force to serve this store all the same")
    scheme = "https" if tls_cert else "http"
    click.echo(f"serving mirror {os.path.abspath(store)} on {scheme}://{listen}", err=True)
    try:
        trio.run(functools.partial(serve, st, token, sock, tls_cert, tls_key,
                                   admin_token=admin_token, limits=limits))
    except* KeyboardInterrupt:      # Ctrl-C: also when it lands in a connection's task
        pass
    finally:
        st.close()


def read_token_file(path: str, strict: bool = True) -> str:
    """A token from a file only its owner should read: a token readable by group or others
    is as good as published, so the receiver refuses such a file (``strict``) and a client
    warns."""
    try:
        with open(path) as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                msg = f"token file {path} is readable by group or others; run 'chmod 600 {path}'"
                if strict:
                    fail(msg)
                click.echo(f"warning: {msg}", err=True)
            token = f.read().strip()
    except OSError as e:
        fail(f"cannot read token file {path}: {e.strerror}")
    if strict and len(token) < 16:
        fail(f"the token in {path} is too short (16 characters at least)")
    return token


def _is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
