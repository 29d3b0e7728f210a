"""Which snapshots to keep: the grammars users of sanoid/restic and zrepl already know.

Counts per period (sanoid, restic ``--keep-*``): ``hourly = 24`` keeps the newest snapshot of
each of the 24 most recent hours that have one (UTC); likewise ``daily``, ``weekly`` (ISO
weeks), ``monthly``, ``yearly``; ``keep_last = N`` keeps the N newest; ``within = "2d"`` keeps
everything younger than that.

Grids (zrepl): ``grid = "1x1h(keep=all) | 24x1h | 7x1d"`` lays buckets out from the newest
snapshot backwards (one hour keeping all, then 24 one-hour buckets, then 7 one-day buckets)
and keeps the K oldest of each bucket (K = 1 unless ``keep=``); older than the last bucket
goes.

A snapshot is kept if any rule keeps it, and every kept one says which rule keeps it.
Snapshots the daemon did not make are never pruned unless ``prune_user = true``; a mirror's
replication base and the newest snapshot are never pruned.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field

PERIODS = ("hourly", "daily", "weekly", "monthly", "yearly")
GRID_ITEM = re.compile(r"^\s*(\d+)\s*x\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*"
                       r"(?:\(\s*keep\s*=\s*(all|\d+)\s*\))?\s*$")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class GridBucket:
    repeat: int
    seconds: float
    keep: int | None        # None: all


@dataclass
class Policy:
    counts: dict[str, int] = field(default_factory=dict)      # period -> how many
    keep_last: int = 0
    within: float = 0.0
    grid: list[GridBucket] = field(default_factory=list)
    prune_user: bool = False


@dataclass
class Decision:
    name: str
    created_ns: int
    reasons: list[str] = field(default_factory=list)

    @property
    def keep(self) -> bool:
        return bool(self.reasons)


def parse_policy(raw) -> Policy:
    if not isinstance(raw, dict):
        raise PolicyError("expected a table like { hourly = 24, daily = 7 }")
    policy = Policy()
    for key, value in raw.items():
        if key in PERIODS or key == "keep_last":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PolicyError(f"{key} must be a count (a whole number >= 0)")
            if key == "keep_last":
                policy.keep_last = value
            else:
                policy.counts[key] = value
        elif key == "within":
            policy.within = _duration(value)
        elif key == "grid":
            policy.grid = parse_grid(value)
        elif key == "prune_user":
            if not isinstance(value, bool):
                raise PolicyError("prune_user must be true or false")
            policy.prune_user = value
        else:
            raise PolicyError(f"unknown rule {key!r} (known: {', '.join(PERIODS)}, keep_last, "
                              f"within, grid, prune_user)")
    return policy


def parse_grid(text) -> list[GridBucket]:
    if not isinstance(text, str) or not text.strip():
        raise PolicyError("grid must be a string like '1x1h(keep=all) | 24x1h | 7x1d'")
    out = []
    for part in text.split("|"):
        m = GRID_ITEM.match(part)
        if not m:
            raise PolicyError(f"bad grid item {part.strip()!r} (expected e.g. 24x1h or "
                              f"1x1h(keep=all))")
        keep = None if m.group(4) == "all" else int(m.group(4) or 1)
        out.append(GridBucket(int(m.group(1)), float(m.group(2)) * SECONDS[m.group(3)], keep))
    return out


def _duration(value) -> float:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$", value) if isinstance(value, str) \
        else None
    if not m:
        raise PolicyError(f"within must be a duration like '2d' (got {value!r})")
    return float(m.group(1)) * SECONDS[m.group(2)]


def decide(policy: Policy, snapshots: list[tuple[str, int]], now_ns: int,
           own=lambda name: True, protected: dict[str, str] | None = None) -> list[Decision]:
    """For every (name, created_ns), oldest first: keep or not, and why. ``own(name)`` says
    whether the daemon made it; ``protected`` maps names to a reason they must stay."""
    decisions = [Decision(n, c) for n, c in snapshots]
    newest_first = sorted(decisions, key=lambda d: d.created_ns, reverse=True)
    for d in decisions:
        if protected and d.name in protected:
            d.reasons.append(protected[d.name])
        if not own(d.name) and not policy.prune_user:
            d.reasons.append("made by a user (prune_user is off)")
    if newest_first:
        newest_first[0].reasons.append("newest")
    for d in newest_first[:policy.keep_last]:
        d.reasons.append(f"keep_last {policy.keep_last}")
    if policy.within:
        for d in decisions:
            if now_ns - d.created_ns < policy.within * 1e9:
                d.reasons.append(f"within {policy.within:g}s")
    for period, count in policy.counts.items():
        _keep_periods(newest_first, period, count)
    if policy.grid:
        _keep_grid(newest_first, policy.grid)
    return decisions


def _period_key(created_ns: int, period: str):
    t = dt.datetime.fromtimestamp(created_ns / 1e9, dt.timezone.utc)
    return {"hourly": (t.year, t.month, t.day, t.hour), "daily": (t.year, t.month, t.day),
            "weekly": tuple(t.isocalendar()[:2]), "monthly": (t.year, t.month),
            "yearly": (t.year,)}[period]


def _keep_periods(newest_first: list[Decision], period: str, count: int) -> None:
    seen = []
    for d in newest_first:
        key = _period_key(d.created_ns, period)
        if key in seen:
            continue
        if len(seen) == count:
            return
        seen.append(key)
        d.reasons.append(f"{period} {len(seen)}/{count}")


def _keep_grid(newest_first: list[Decision], grid: list[GridBucket]) -> None:
    if not newest_first:
        return
    end = newest_first[0].created_ns
    edges = []                     # (start_ns, end_ns, keep, label), newest bucket first
    for item in grid:
        for _ in range(item.repeat):
            start = end - int(item.seconds * 1e9)
            edges.append((start, end, item.keep, f"{item.seconds:g}s"))
            end = start
    for n, (start, stop, keep, label) in enumerate(edges):
        inside = [d for d in newest_first if start < d.created_ns <= stop]
        oldest_first = sorted(inside, key=lambda d: d.created_ns)
        for d in oldest_first if keep is None else oldest_first[:keep]:
            d.reasons.append(f"grid bucket {n + 1} ({label})")
