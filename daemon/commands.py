"""``snapctl status``, ``snapctl check`` and ``snapctl prune``: the daemon's view for people
and for monitoring. The figures come from the store (true even when the daemon is down),
plus the daemon's status file for what only it knows (last success, last error)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict

import click

from mountfs.clitools import CONTEXT, DURATION, fail, mountpoint_option, target_options
from mountfs.mountinfo import find_mount, mounted_at
from mountfs.snapnames import DAEMON_PREFIX, is_stamped
from mountfs.store import StoreError
from mountfs.units import counted, human_bytes

from . import config as config_mod
from .status import daemon_alive, read_state, state_path, store_figures

DEFAULT_STATE_DIR = "/run/mountfs"
UNKNOWN = 3                  # Nagios: the check could not run


class CannotRun(Exception):
    """What keeps status/check/prune from running at all (no config, not in a mount)."""


def _filesystems(ctx, config_path: str | None):
    """(name, mountpoint, store, configured mirror urls, state file, fs config) for each
    filesystem: from --config, else the one given by -m / the current directory (its
    configured mirrors then come from the daemon's status file; without one, every mirror
    the store holds a base for counts). --store names no mount and no config: refused
    rather than ignored, which would have reported the current directory's filesystem."""
    if ctx.obj.get("store"):
        mounted = mounted_at(ctx.obj["store"])
        where = f"-m {mounted}, where it is mounted" if mounted else \
            f"mount it and pass -m MOUNTPOINT (it is not mounted now)"
        raise CannotRun(f"--store does not apply to status and check, which report mounted "
                        f"filesystems: use {where}, or --config FILE")
    if config_path:
        try:
            cfg = config_mod.load(config_path)
        except config_mod.ConfigError as e:
            raise CannotRun(str(e)) from None
        out = []
        for fs in cfg.filesystems:
            info = find_mount(fs.mountpoint)
            out.append((fs.name, fs.mountpoint, info.store if info else None,
                        [m.url for m in fs.mirrors], state_path(cfg.state_dir, fs.name), fs))
        return out
    where = ctx.obj.get("mountpoint") or os.getcwd()
    info = find_mount(where)
    if info is None:
        raise CannotRun(f"{where} is not in a mountfs filesystem; use -m MOUNTPOINT or "
                        f"--config FILE")
    state_dir = os.environ.get("MOUNTFS_STATE_DIR", DEFAULT_STATE_DIR)
    for path in sorted(_json_files(state_dir)):
        state = read_state(path)
        if state is not None and state.mountpoint == info.mountpoint:
            return [(state.filesystem, info.mountpoint, info.store, state.configured, path,
                     None)]
    return [(os.path.basename(info.mountpoint), info.mountpoint, info.store, None, None, None)]


def _json_files(state_dir: str) -> list[str]:
    try:
        return [os.path.join(state_dir, n) for n in os.listdir(state_dir) if n.endswith(".json")]
    except OSError:
        return []


def _report(name, mountpoint, store, urls, state_file) -> dict:
    state = read_state(state_file) if state_file else None
    out = {"filesystem": name, "mountpoint": mountpoint, "mounted": store is not None,
           "daemon": None, "newest": None, "mirrors": {}, "other_mirrors": {}}
    if state is not None:
        out["daemon"] = {"pid": state.pid, "running": daemon_alive(state),
                         "updated_ns": state.updated_ns, "last_snapshot": state.last_snapshot,
                         "last_error": state.last_error}
    if store is None:
        return out
    figures = store_figures(store, urls)
    out["newest"] = figures.newest
    for url, f in figures.mirrors.items():
        entry = asdict(f)
        if state is not None and url in state.mirrors:
            entry.update(asdict(state.mirrors[url]))
        out["mirrors"][url] = entry
    out["other_mirrors"] = {url: asdict(f) for url, f in figures.others.items()}
    return out


def _ago(ns: int | None) -> str:
    return "never" if not ns else f"{(time.time_ns() - ns) / 1e9:.0f} s ago"


BASE_DELETED = ("its base was deleted on the source (lag unknown; the next replicate "
                "reconciles it)")


def _mirror_line(url: str, m: dict) -> str:
    lag = "never replicated" if m["lag_seconds"] is None else f"lag {m['lag_seconds']:.0f} s"
    base = BASE_DELETED if m.get("base_deleted") else f"base {m['base']}, {lag}"
    return (f"  {url}: {base}, pending {human_bytes(m['pending_bytes'])} in "
            f"{counted(m['pending_snapshots'], 'snapshot')}")


@click.command(context_settings=CONTEXT)
@mountpoint_option
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The daemon's config (default: the filesystem of -m or the current dir).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per filesystem.")
@click.pass_context
def status(ctx, config_path, as_json):
    """Replication state: per configured mirror the base, the lag, pending data, the last
    cycle and the last error; mirrors replicated to by hand but not configured apart."""
    try:
        reports = [_report(*fs[:5]) for fs in _filesystems(ctx, config_path)]
    except (CannotRun, StoreError) as e:
        fail(str(e), 2)
    for r in reports:
        if as_json:
            click.echo(json.dumps(r))
            continue
        d = r["daemon"]
        daemon = "no daemon status" if d is None else \
            f"daemon {'running' if d['running'] else 'NOT RUNNING'} (pid {d['pid']})"
        click.echo(f"{r['filesystem']} ({r['mountpoint']}): "
                   f"{'newest snapshot ' + str(r['newest']) if r['mounted'] else 'NOT MOUNTED'}"
                   f"; {daemon}")
        if d and d["last_error"]:
            click.echo(f"  error: {d['last_error']}")
        for url, m in r["mirrors"].items():
            known = "last_success_ns" in m         # the daemon's record of this mirror
            click.echo(_mirror_line(url, m) +
                       (f"; last success {_ago(m['last_success_ns'])}" if known else ""))
            if m.get("last_cycle"):
                c = m["last_cycle"]
                click.echo(f"    last cycle: {c['entries']} names and {c.get('inodes', 0)} "
                           f"inodes changed, {c['bytes_sent']} bytes sent, "
                           f"{c['seconds']:.1f} s")
            if m.get("last_error"):
                click.echo(f"    last error ({_ago(m['last_error_ns'])}): {m['last_error']}")
        if r["other_mirrors"]:
            click.echo("  not configured (their bases are kept; 'snapctl forget-mirror URL' "
                       "drops one):")
            for url, m in r["other_mirrors"].items():
                click.echo("  " + _mirror_line(url, m))


@click.command(context_settings=CONTEXT)
@mountpoint_option
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The daemon's config, for its lag_warning / lag_critical thresholds.")
@click.option("--warning", type=DURATION, default="5m", show_default=True,
              help="Lag that warns, without --config (30s, 5m, 1h, or seconds).")
@click.option("--critical", type=DURATION, default="1h", show_default=True,
              help="Lag that is critical, without --config.")
@click.pass_context
def check(ctx, config_path, warning, critical):
    """Nagios-style check of every configured mirror's lag: exit 0 OK, 1 WARNING,
    2 CRITICAL, 3 UNKNOWN (the check could not run). The line names the mirrors over a
    threshold first."""
    if critical < warning:          # as the config refuses lag_critical < lag_warning
        click.echo(f"UNKNOWN: --critical ({critical:g} s) is shorter than --warning "
                   f"({warning:g} s); a critical lag must be at least the warning one")
        sys.exit(UNKNOWN)
    try:
        worst, lines = _check(ctx, config_path, warning, critical)
    except (CannotRun, StoreError) as e:
        click.echo(f"UNKNOWN: {e}")
        sys.exit(UNKNOWN)
    except Exception as e:        # a check that cannot run is UNKNOWN, never WARNING (1)
        click.echo(f"UNKNOWN: internal error: {type(e).__name__}: {e}")
        sys.exit(UNKNOWN)
    click.echo(f"{('OK', 'WARNING', 'CRITICAL')[worst]}: " + "; ".join(lines))
    sys.exit(worst)


def _check(ctx, config_path, warning, critical) -> tuple[int, list[str]]:
    worst, over, fine = 0, [], []
    for name, mp, store, urls, state_file, fs in _filesystems(ctx, config_path):
        warn, crit = (fs.lag_warning, fs.lag_critical) if fs else (warning, critical)
        r = _report(name, mp, store, urls, state_file)
        if not r["mounted"]:
            worst = 2
            over.append(f"{name}: {mp} not mounted")
            continue
        for url, m in r["mirrors"].items():
            lag = m["lag_seconds"]
            level = 2 if lag is None or lag >= crit else 1 if lag >= warn else 0
            worst = max(worst, level)
            text = f"{name} -> {url}: " + (BASE_DELETED if m.get("base_deleted") else
                                          "never replicated" if lag is None
                                          else f"lag {lag:.0f}s")
            if lag is not None and level:
                text += f" (over {'critical' if level == 2 else 'warning'} " \
                        f"{crit if level == 2 else warn:.0f}s)"
            (over if level else fine).append(text)
        if not r["mirrors"]:
            fine.append(f"{name}: no mirror")
        if r["other_mirrors"]:
            fine.append(f"{name}: {len(r['other_mirrors'])} mirror(s) not configured, "
                        f"not checked")
    return worst, over + fine


@click.command(context_settings=CONTEXT)
@target_options
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The daemon's config, holding the retention policies.")
@click.option("--retention", metavar="RULES",
              help="With --store: the policy, in the config's words, e.g. 'daily = 7, "
              "keep_last = 3'.")
@click.option("--prefix", default=DAEMON_PREFIX, show_default=True,
              help="With --store: the daemon's snapshot_prefix; its snapshots are named "
              "PREFIX + UTC time (YYYYmmddTHHMMSS.ffffffZ), and others are kept unless the "
              "policy says prune_user = true.")
@click.option("--dry-run", is_flag=True, help="Only show what would go, and why the rest stays.")
@click.pass_context
def prune(ctx, config_path, retention, prefix, dry_run):
    """Apply the local retention policy of the config: list every snapshot with the rule that
    keeps it, and delete the others (never a mirror's base, never the newest).

    On a mirror's host, 'snapctl prune --store MIRROR_STORE --retention RULES' prunes the
    mirror itself (stop serve-mirror first: it holds the store); an append-only mirror's
    replicate token cannot delete snapshots, so this (or the admin token) is how a mirror
    is pruned."""
    if ctx.obj.get("store"):
        return _prune_mirror_store(ctx.obj["store"], retention, prefix, dry_run)
    if not config_path:
        fail("pass --config FILE (the daemon's retention), or --store MIRROR_STORE "
             "--retention RULES on a mirror's host", 2)
    from mountfs import control
    from .service import local_decisions
    try:
        filesystems = _filesystems(ctx, config_path)
    except CannotRun as e:
        fail(str(e), 2)
    for name, mp, store, _, _, fs in filesystems:
        if fs.retention is None:
            click.echo(f"{name}: no retention policy; nothing to prune")
            continue
        if store is None:
            fail(f"{name}: {mp} is not mounted", 2)
        try:
            _apply(local_decisions(store, fs), dry_run,
                   lambda name: control.request(store, {"op": "delete", "name": name}))
        except StoreError as e:
            fail(str(e))


def _apply(decisions, dry_run: bool, delete) -> None:
    """One line per snapshot: kept and why, or pruned; a prune is said only once
    ``delete(name)`` has done it; one a program is reading (refused as in use) is kept.
    No snapshot at all is said too: silence would read as a prune that did not run."""
    from mountfs.control import SnapshotInUse
    decisions = list(decisions)
    if not decisions:
        click.echo("no snapshots; nothing to prune")
    for d in decisions:
        if d.keep:
            click.echo(f"keep  {d.name}: {', '.join(d.reasons)}")
        elif dry_run:
            click.echo(f"prune {d.name} (dry run)")
        else:
            try:
                delete(d.name)
            except SnapshotInUse:
                click.echo(f"keep  {d.name}: in use (files or directories under "
                           f".snapshot/{d.name} are open)")
                continue
            click.echo(f"prune {d.name}")


def _prune_mirror_store(path: str, rules: str | None, prefix: str, dry_run: bool) -> None:
    """Retention applied on the mirror's host, to its store (never the newest snapshot,
    the next cycle's base; never a replication base of its own, as --config keeps them:
    the store may be a source, or a mirror that replicates on)."""
    from mountfs import snapshots as snaps
    from mountfs.store import Store
    from replicator import mirror
    from .retention import PolicyError, decide, parse_rules
    if not rules:
        fail("--store needs --retention RULES, e.g. --retention 'daily = 7, keep_last = 3'", 2)
    try:
        policy = parse_rules(rules)
    except PolicyError as e:
        fail(f"--retention {rules!r}: {e}", 2)
    try:
        store = Store.open(path, readonly=dry_run, lock=not dry_run, holder="snapctl prune")
    except StoreError as e:
        fail(f"{e} (on a mirror, stop serve-mirror while pruning)")
    try:
        with store.read() as txn:
            held, protected = snaps.list_all(txn, store.db), snaps.bases(txn, store.db)
        _apply(decide(policy, [(s.name, s.created_ns) for s in held], time.time_ns(),
                      own=lambda n: is_stamped(n, prefix), protected=protected),
               dry_run, lambda name: mirror.delete_snapshot(store, name))
    except StoreError as e:
        fail(str(e))
    finally:
        store.close()
