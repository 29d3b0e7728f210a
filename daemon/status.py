"""How far behind each mirror is, and what the daemon last did: shared by the daemon (status
file, metrics, systemd STATUS), ``snapctl status`` and ``snapctl check``.

The figures that matter come from the store itself, so they are true even when the daemon is
dead: a mirror's base is the snapshot held for it (``snapctl replicate`` and the daemon record
it); the lag is zero when nothing changed since the base, else the age of the base (the
mirror's view is that old: the recovery point), unknown when the base was deleted (``snapctl
delete --force``: the mirror stays listed, as never replicated, until the next cycle
reconciles it); pending bytes are the chunk bytes written since the base. The daemon adds
what only it knows (last success, last error, last cycle) in ``STATE_DIR/NAME.json``,
written atomically.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from mountfs import schema as S
from mountfs import snapshots as snaps
from mountfs.namespace import View, written
from mountfs.store import Store


@dataclass
class MirrorFigures:
    url: str
    base: str | None                 # the snapshot the mirror holds, None: never replicated
    base_created_ns: int | None
    lag_seconds: float | None        # None: never replicated
    pending_bytes: int
    pending_snapshots: int
    base_deleted: bool = False       # its base was deleted (--force): the next cycle reconciles


@dataclass
class StoreFigures:
    newest: str | None
    newest_created_ns: int | None
    changed_since_newest: bool
    mirrors: dict[str, MirrorFigures] = field(default_factory=dict)
    others: dict[str, MirrorFigures] = field(default_factory=dict)   # held, not configured


def store_figures(store_path: str, urls: list[str] | None,
                  now_ns: int | None = None) -> StoreFigures:
    """Replication figures of the configured mirrors ``urls`` (None: every mirror the store
    holds a base for) in ``mirrors``, and of mirrors replicated to by hand but not
    configured in ``others``, from the store alone: O(snapshots)."""
    now_ns = now_ns or time.time_ns()
    # metadata only: without readahead, as the daemon's cycles whose environment it shares
    store = Store.open(store_path, readonly=True, lock=False, readahead=False)
    try:
        with store.read() as txn:
            dbs = store.db
            all_snaps = snaps.list_all(txn, dbs)
            live = snaps.live_epoch(txn, dbs)
            root = View(txn, dbs, live, store.chunk_size).get(S.ROOT_INO)
            by_uuid = {s.uuid: s for s in all_snaps}
            bases: dict = {}           # a URL replicated to again after its store was
            for _, snap_uuid, label in snaps.holds(txn, dbs):     # replaced: the newest base
                held = by_uuid.get(snap_uuid)     # None: the base was deleted (--force)
                if label not in bases or (held and (bases[label] is None or
                                                    held.epoch > bases[label].epoch)):
                    bases[label] = held
            out = StoreFigures(all_snaps[-1].name if all_snaps else None,
                               all_snaps[-1].created_ns if all_snaps else None,
                               root.mepoch > (all_snaps[-1].epoch if all_snaps else 0))
            configured = list(bases) if urls is None else list(urls)
            for url in dict.fromkeys(configured + list(bases)):
                base = bases.get(url)
                after = [s for s in all_snaps if base is None or s.epoch > base.epoch]
                epochs = [s.epoch for s in after] + [live]
                changed = base is None or root.mepoch > base.epoch
                lag = None if base is None else \
                    (max(0.0, (now_ns - base.created_ns) / 1e9) if changed else 0.0)
                group = out.mirrors if url in configured else out.others
                group[url] = MirrorFigures(
                    url, base.name if base else None, base.created_ns if base else None, lag,
                    sum(written(txn, dbs, e) for e in epochs), len(after),
                    base_deleted=url in bases and base is None)
            return out
    finally:
        store.close()


# ---- the daemon's own record ----------------------------------------------------------------

@dataclass
class MirrorState:
    last_success_ns: int | None = None
    last_error: str | None = None
    last_error_ns: int | None = None
    failures: int = 0                     # consecutive
    next_try_ns: int | None = None
    last_cycle: dict | None = None        # the replicator's summary of the last success
    cycles_total: int = 0
    errors_total: int = 0
    stalled_total: int = 0
    bytes_sent_total: int = 0
    diff_seconds: float | None = None
    verify_mismatched: int | None = None


@dataclass
class DaemonState:
    filesystem: str
    mountpoint: str
    store: str | None = None
    pid: int = field(default_factory=os.getpid)
    updated_ns: int = 0
    last_snapshot: str | None = None
    last_error: str | None = None
    configured: list[str] = field(default_factory=list)      # mirror URLs of the config
    mirrors: dict[str, MirrorState] = field(default_factory=dict)

    def mirror(self, url: str) -> MirrorState:
        return self.mirrors.setdefault(url, MirrorState())


def state_path(state_dir: str, name: str) -> Path:
    return Path(state_dir) / f"{name}.json"


def write_state(state_dir: str, state: DaemonState) -> None:
    """Atomically (write + rename), so a reader never sees half a file."""
    state.updated_ns = time.time_ns()
    path = state_path(state_dir, state.filesystem)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    os.replace(tmp, path)


def read_state(path: str | os.PathLike) -> DaemonState | None:
    """The daemon's record, or None when there is none or it cannot be read (fields this
    version does not know are ignored: the file may come from another version)."""
    try:
        raw = json.loads(Path(path).read_text())
        mirrors = {u: MirrorState(**_known(MirrorState, m))
                   for u, m in raw.pop("mirrors", {}).items()}
        return DaemonState(**_known(DaemonState, raw), mirrors=mirrors)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _known(cls, raw: dict) -> dict:
    names = {f.name for f in fields(cls)} - {"mirrors"}
    return {k: v for k, v in raw.items() if k in names}


def daemon_alive(state: DaemonState) -> bool:
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
