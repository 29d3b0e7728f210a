"""The daemon: for each configured filesystem, snapshot when it changed, replicate to every
mirror, prune, and report.

Structure (trio): per filesystem, under a nursery that SIGHUP restarts with a freshly checked
config and SIGTERM/SIGINT cancel, one task that checks for changes, snapshots, prunes and
publishes the status every POLL_SECONDS (and at once when a cycle ends), and beside it one
task per mirror that, woken after each of those steps, replicates the newest snapshot when
its mirror is behind. So a cycle in flight (a mirror that never answers, a first copy that
takes an hour) holds up neither the snapshots nor the other mirrors; the prune keeps the
snapshots being sent. The tasks change the state only on the trio thread. Everything
blocking (control-socket requests, the replication cycle with its Spark job, store reads,
the status file) runs in worker threads, so the loop only schedules; those threads share
the store's read-only environment (mountfs.store), and the Spark jobs of cycles running at
once take turns (replicator.transfer). A cycle in flight when the daemon is told to stop is
allowed ``STOP_GRACE`` seconds to finish; then its Spark jobs are cancelled, which leaves
the mirror at its base (a cycle commits in one transaction or not at all).

Each mirror has its own base (held on the source, so local pruning never removes it) and its
own backoff: a mirror that is down is retried with exponential backoff and jitter while
snapshots keep being taken; when it comes back, one diff from its base catches it up.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import signal
import time
from typing import NamedTuple

import trio

from mountfs import control
from mountfs.mountinfo import find_mount
from mountfs.snapnames import is_stamped, stamped_name
from mountfs.store import Store, StoreError
from replicator import transfer
from replicator.calltime import abort_calls
from replicator.cycle import replicate
from replicator.endpoints import open_mirror

from . import config as config_mod
from .metrics import Metrics
from mountfs.sdnotify import notify, watchdog_interval
from .retention import decide
from .status import (DaemonState, StoreFigures, read_state, state_path, store_figures,
                     write_state)

log = logging.getLogger("mountfsd")

POLL_SECONDS = 1.0
BACKOFF_BASE = 2.0
BACKOFF_CAP = 300.0
STOP_GRACE = 30.0


def backoff_delay(failures: int) -> float:
    """Exponential backoff with jitter: about 2, 4, 8 ... s, at most 5 min."""
    return min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (failures - 1)) * random.uniform(0.5, 1.5)


class Seen(NamedTuple):
    """What a step read of the store, for the mirror tasks; ``asked`` (monotonic) is when the
    reading began, so that a task does not act on figures older than its last cycle."""
    store: str
    figures: StoreFigures
    asked: float


class FilesystemLoop:
    def __init__(self, fs: config_mod.FilesystemConfig, daemon: config_mod.Config,
                 metrics: Metrics | None):
        self.fs = fs
        self.daemon = daemon
        self.metrics = metrics
        self.state = _previous_state(daemon.state_dir, fs)
        self.last_snapshot_at = 0.0            # monotonic; 0: none by this process yet
        self.sending: dict[str, str] = {}      # mirror URL -> snapshot its cycle sends
        self.seen: Seen | None = None          # the last step's figures
        self.stepped = trio.lowlevel.ParkingLot()   # the mirror tasks wait for a step
        self.cycled = trio.lowlevel.ParkingLot()    # the steps wait for a cycle's end

    async def run(self) -> None:
        """The steps, and beside them one replication task per mirror."""
        async with trio.open_nursery() as nursery:
            for mirror in self.fs.mirrors:
                nursery.start_soon(self.replicate_when_behind, mirror)
            await self.step_forever()

    async def step_forever(self) -> None:
        """Publish, then step and publish every POLL_SECONDS, and at once when a cycle ends
        (its result is published, the base it replaced pruned). Whatever fails here (a status
        file that cannot be written, a bug) is this filesystem's: one log line and a retry
        after a backoff, never the end of the daemon and of the other filesystems' loops."""
        failures = 0
        work = self.publish_now            # the status file appears before the first step
        while True:
            try:
                await work()
                failures, delay = 0, POLL_SECONDS
            except Exception as e:          # noqa: BLE001 - trio.Cancelled is no Exception
                failures += 1
                delay = backoff_delay(failures)
                self.state.last_error = f"{type(e).__name__}: {e}"
                log.error("%s: %s (retry in %.0f s)", self.fs.name, self.state.last_error,
                          delay)
            work = self.cycle
            with trio.move_on_after(delay):
                await (trio.sleep_forever() if failures else self.cycled.park())

    async def cycle(self) -> None:
        """One step, its expected failures (not mounted, unreachable) kept as the last
        error, then the status published."""
        try:
            await self.step()
            self.state.last_error = None
        except (StoreError, control.ControlError, OSError) as e:
            self.state.last_error = str(e)
            log.error("%s: %s", self.fs.name, e)
        await self.publish_now()

    async def publish_now(self) -> None:
        """The worker thread writes a copy: the mirror tasks change the state meanwhile."""
        await trio.to_thread.run_sync(self.publish, copy.deepcopy(self.state))

    async def step(self) -> None:
        """Snapshot when due, prune, then wake the mirror tasks with the store's figures.
        They are read after the prune, so no cycle starts on a snapshot it deletes."""
        store = self._store()
        self.state.store = store
        status = await _request(store, {"op": "status"})
        since = time.monotonic() - self.last_snapshot_at
        if (status["changed"] and since >= self.fs.min_interval) or \
                (status["dirty_bytes"] and since >= self.fs.max_interval):
            await self.snapshot(store)
        if self.fs.retention is not None:
            await self.prune_local(store)
        asked = time.monotonic()
        figures = await trio.to_thread.run_sync(store_figures, store,
                                                [m.url for m in self.fs.mirrors])
        self.seen = Seen(store, figures, asked)
        self.stepped.unpark_all()

    def _store(self) -> str:
        info = find_mount(self.fs.mountpoint)
        if info is None or os.path.realpath(info.mountpoint) != \
                os.path.realpath(self.fs.mountpoint):
            raise StoreError(f"{self.fs.mountpoint} is not a mounted mountfs filesystem")
        return info.store

    async def snapshot(self, store: str) -> None:
        name = stamped_name(self.fs.snapshot_prefix)
        await _request(store, {"op": "create", "name": name})
        self.last_snapshot_at = time.monotonic()
        self.state.last_snapshot = name
        if self.metrics:
            self.metrics.snapshots.labels(self.fs.name).inc()
        log.info("%s: snapshot %s", self.fs.name, name)

    # ---- replication -----------------------------------------------------------------------

    async def replicate_when_behind(self, mirror: config_mod.MirrorConfig) -> None:
        """This mirror's task: after each step, one cycle to the newest snapshot when the
        mirror is behind it and its backoff has passed. Figures asked for before its last
        cycle ended would still show the old base (and send the same snapshot again)."""
        ended = 0.0
        while True:
            await self.stepped.park()
            seen = self.seen
            if seen.asked > ended and self._behind_and_due(mirror, seen.figures):
                await self.replicate(seen.store, mirror, seen.figures.newest)
                ended = time.monotonic()
                self.cycled.unpark_all()

    def _behind_and_due(self, mirror: config_mod.MirrorConfig, figures: StoreFigures) -> bool:
        behind = figures.newest is not None and \
            figures.mirrors[mirror.url].base != figures.newest
        return behind and (self.state.mirror(mirror.url).next_try_ns or 0) <= time.time_ns()

    async def replicate(self, store: str, mirror: config_mod.MirrorConfig, name: str) -> None:
        """One cycle (a worker thread) and the hold of its snapshot as the mirror's base;
        until that hold, the local prune keeps the snapshot (``sending``)."""
        self.sending[mirror.url] = name
        try:
            result, mirror_uuid = await trio.to_thread.run_sync(
                self._cycle, store, mirror, name)
            await _request(store, {"op": "hold", "mirror": mirror_uuid, "name": result.hold,
                                   "label": mirror.url})
        except Exception as e:              # noqa: BLE001 - this mirror's, whatever it is
            self._failed(mirror, e)
        else:
            self._replicated(mirror, result)
        finally:
            del self.sending[mirror.url]

    def _failed(self, mirror: config_mod.MirrorConfig, e: Exception) -> None:
        """One mirror's failure is that mirror's alone: its own backoff, while the other
        mirrors, the local prune and the snapshots go on. An error we do not expect is a
        bug: its traceback goes to the log, its one line to last_error."""
        ms = self.state.mirror(mirror.url)
        labels = (self.fs.name, mirror.url)
        if isinstance(e, (StoreError, transfer.TransferFailed, OSError)):
            message = str(e)
        else:
            log.error("%s -> %s: unexpected error (a bug)", self.fs.name, mirror.url,
                      exc_info=e)
            message = f"unexpected error: {type(e).__name__}: {e}"
        message = " ".join(message.split()) or type(e).__name__
        ms.failures += 1
        ms.errors_total += 1
        ms.last_error, ms.last_error_ns = message, time.time_ns()
        ms.next_try_ns = time.time_ns() + int(backoff_delay(ms.failures) * 1e9)
        if isinstance(e, transfer.TransferStalled):
            ms.stalled_total += 1
            if self.metrics:
                self.metrics.stalled.labels(*labels).inc()
        if self.metrics:
            self.metrics.errors.labels(*labels).inc()
        log.warning("%s -> %s: %s (retry in %.0f s)", self.fs.name, mirror.url, message,
                    (ms.next_try_ns - time.time_ns()) / 1e9)

    def _replicated(self, mirror: config_mod.MirrorConfig, result) -> None:
        ms = self.state.mirror(mirror.url)
        labels = (self.fs.name, mirror.url)
        ms.failures, ms.next_try_ns, ms.last_error = 0, None, None
        ms.last_success_ns = time.time_ns()
        ms.last_cycle = result.to_json()
        ms.cycles_total += 1
        ms.bytes_sent_total += result.bytes_sent
        ms.diff_seconds = result.diff_seconds
        if self.metrics:
            self.metrics.bytes_sent.labels(*labels).inc(result.bytes_sent)
            self.metrics.cycle_seconds.labels(*labels).observe(result.seconds)
            for executor, figures in result.executors.items():
                self.metrics.executor_rate.labels(*labels, executor).set(
                    figures["bytes_per_second"])
        log.info("%s -> %s: %s", self.fs.name, mirror.url, result.summary())

    def _cycle(self, store: str, mirror: config_mod.MirrorConfig, name: str):
        """One blocking replication cycle (a worker thread), then the mirror's retention."""
        source = Store.open(store, readonly=True, lock=False, readahead=False)
        chunk_size = source.chunk_size
        source.close()
        endpoint = open_mirror(mirror.url, chunk_size, token=_token(mirror),
                               ca_file=mirror.ca_file)
        try:
            result = replicate(store, endpoint, name, master=self.daemon.spark_master,
                               stall_seconds=self.fs.stall_timeout,
                               inline_bytes=self.fs.spark_threshold)
            mirror_uuid = endpoint.info()["uuid"]
            if mirror.retention is not None:
                self._prune_mirror(endpoint, mirror, chunk_size)
            return result, mirror_uuid
        finally:
            endpoint.close()

    def _prune_mirror(self, endpoint, mirror: config_mod.MirrorConfig, chunk_size: int) -> None:
        """Retention on the mirror. An http(s) mirror's replicate token cannot delete
        (append-only): pruning there uses admin_token_file, or is left to the mirror host."""
        admin = None
        if mirror.url.startswith("http") and mirror.admin_token_file:
            try:
                with open(mirror.admin_token_file) as f:
                    token = f.read().strip()
            except OSError as e:
                log.warning("%s -> %s: cannot read admin_token_file %s (%s); not pruned",
                            self.fs.name, mirror.url, mirror.admin_token_file, e.strerror)
                return
            admin = open_mirror(mirror.url, chunk_size, token=token, ca_file=mirror.ca_file)
        elif mirror.url.startswith("http"):
            log.warning("%s -> %s: mirror retention needs admin_token_file (or 'snapctl "
                        "prune --store' on the mirror host); not pruned", self.fs.name,
                        mirror.url)
            return
        try:
            held = endpoint.info()["snapshots"]
            for d in decide(mirror.retention, [(s["name"], s["created_ns"]) for s in held],
                            time.time_ns(), own=self._own):
                if not d.keep:
                    (admin or endpoint).delete_snapshot(d.name)
                    log.info("%s -> %s: pruned %s on the mirror", self.fs.name, mirror.url,
                             d.name)
        finally:
            if admin is not None:
                admin.close()

    # ---- local retention and reporting -----------------------------------------------------

    def _own(self, name: str) -> bool:
        return is_stamped(name, self.fs.snapshot_prefix)

    async def prune_local(self, store: str) -> None:
        """Delete what retention does not keep; a snapshot a program is reading (files open
        under .snapshot/NAME) is kept until a later prune finds it closed, one a cycle is
        sending until that cycle ends (retention may not keep it: no longer the newest)."""
        for d in await trio.to_thread.run_sync(local_decisions, store, self.fs,
                                               dict(self.sending)):
            if not d.keep:
                try:
                    await _request(store, {"op": "delete", "name": d.name})
                except control.SnapshotInUse:
                    log.info("%s: kept %s for now: files or directories under "
                             ".snapshot/%s are open", self.fs.name, d.name, d.name)
                    continue
                log.info("%s: pruned %s", self.fs.name, d.name)

    def publish(self, state: DaemonState) -> None:
        """Status file, metrics and systemd STATUS from the store's figures (worker thread)."""
        lags = []
        if state.store:
            try:
                figures = store_figures(state.store, [m.url for m in self.fs.mirrors])
            except StoreError:
                figures = None
            for url, f in (figures.mirrors.items() if figures else []):
                lags.append(f"{url} lag {f.lag_seconds:.0f}s" if f.lag_seconds is not None
                            else f"{url} never replicated")
                if self.metrics:
                    labels = (self.fs.name, url)
                    self.metrics.lag.labels(*labels).set(
                        f.lag_seconds if f.lag_seconds is not None else float("inf"))
                    self.metrics.pending_bytes.labels(*labels).set(f.pending_bytes)
                    self.metrics.pending_snapshots.labels(*labels).set(f.pending_snapshots)
                    ms = state.mirrors.get(url)
                    if ms and ms.last_success_ns:
                        self.metrics.last_success.labels(*labels).set(ms.last_success_ns / 1e9)
        if self.metrics:
            self.metrics.keep_only(self.fs.name, [m.url for m in self.fs.mirrors])
        write_state(self.daemon.state_dir, state)
        notify(STATUS=f"{self.fs.name}: " + ("; ".join(lags) or "no mirrors") +
               (f"; error: {state.last_error}" if state.last_error else ""))


def _previous_state(state_dir: str, fs: config_mod.FilesystemConfig) -> DaemonState:
    """The record an earlier run of the daemon left (a restart, a reload), so that last
    successes, errors and counters survive it; mirrors no longer configured are dropped."""
    urls = [m.url for m in fs.mirrors]
    state = DaemonState(fs.name, fs.mountpoint, configured=urls)
    old = read_state(state_path(state_dir, fs.name))
    if old is not None and old.mountpoint == fs.mountpoint:
        state.last_snapshot = old.last_snapshot
        state.mirrors = {url: m for url, m in old.mirrors.items() if url in urls}
        for m in state.mirrors.values():
            m.failures, m.next_try_ns = 0, None        # a new process tries at once
    return state


def local_decisions(store: str, fs: config_mod.FilesystemConfig,
                    sending: dict[str, str] | None = None):
    """What the local retention keeps, and why (``snapctl prune`` shows the same);
    ``sending`` maps mirror URLs to the snapshots the daemon's cycles in flight send."""
    from mountfs import snapshots as snaps
    source = Store.open(store, readonly=True, lock=False, readahead=False)
    try:
        with source.read() as txn:
            all_snaps = snaps.list_all(txn, source.db)
            protected = snaps.bases(txn, source.db)
    finally:
        source.close()
    for url, name in (sending or {}).items():
        protected.setdefault(name, f"being sent to {url}")
    return decide(fs.retention, [(s.name, s.created_ns) for s in all_snaps], time.time_ns(),
                  own=lambda n: is_stamped(n, fs.snapshot_prefix), protected=protected)


def _token(mirror: config_mod.MirrorConfig) -> str | None:
    if mirror.token_file:
        with open(mirror.token_file) as f:
            return f.read().strip()
    return os.environ.get("MOUNTFS_TOKEN")


async def _request(store: str, payload: dict) -> dict:
    return await trio.to_thread.run_sync(control.request, store, payload)


# ---- the process ----------------------------------------------------------------------------

async def serve(config_path: str) -> None:
    cfg = config_mod.load(config_path)
    metrics = Metrics()
    if cfg.metrics_listen:
        _serve_metrics(metrics, cfg)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as outer:
            if watchdog_interval():
                outer.start_soon(_watchdog)
            notify(READY="1", STATUS=f"serving {len(cfg.filesystems)} filesystem(s)")
            while True:
                stop = await _run_until_signal(cfg, metrics, signals, outer)
                if stop:
                    break
                try:
                    cfg = config_mod.load(config_path)
                    log.info("reloaded %s", config_path)
                except config_mod.ConfigError as e:
                    log.error("not reloading: %s", e)
                notify(RELOADING="0", READY="1")
            outer.cancel_scope.cancel()
    notify(STOPPING="1")


def _serve_metrics(metrics: Metrics, cfg: config_mod.Config) -> None:
    """A metrics address this host cannot use is the config's to fix: one line naming the
    key (systemd would otherwise restart the daemon into the same traceback)."""
    try:
        metrics.serve(cfg.metrics_listen)
    except OSError as e:
        raise config_mod.ConfigError(f"{cfg.path}: daemon.metrics_listen: "
                                     f"{cfg.metrics_listen.cannot_listen(e)}") from None


async def _run_until_signal(cfg, metrics, signals, outer) -> bool:
    """Run every filesystem loop until a signal; True when it says stop."""
    stop = False
    grace = trio.CancelScope()
    async with trio.open_nursery() as loops:
        for fs in cfg.filesystems:
            loops.start_soon(FilesystemLoop(fs, cfg, metrics).run)
        async for signum in signals:
            stop = signum != signal.SIGHUP
            if stop:
                notify(STOPPING="1")
            else:
                notify(RELOADING="1")
            log.info("%s: %s", signal.Signals(signum).name,
                     "finishing the cycle in flight" if stop else "reloading")
            outer.start_soon(_abort_after, grace, STOP_GRACE)
            loops.cancel_scope.cancel()
            break
    grace.cancel()                 # the loops are done: nothing left to abort
    return stop


async def _abort_after(scope: trio.CancelScope, seconds: float) -> None:
    """A cycle still running after the grace period is aborted (the mirror stays at its
    base): its Spark jobs are cancelled and its calls to mirrors shut down (a thread
    blocked reading a mirror that never answers cannot be cancelled otherwise), which
    makes its thread return; again every second, for a call begun after the last abort,
    until the loops are done (they cancel ``scope``)."""
    with scope:
        await trio.sleep(seconds)
        log.warning("cycle still running after %.0f s: aborting it", seconds)
        while True:
            await trio.to_thread.run_sync(transfer.cancel_all)
            abort_calls()
            await trio.sleep(1)


async def _watchdog() -> None:
    interval = watchdog_interval()
    while True:
        notify(WATCHDOG="1")
        await trio.sleep(interval)
