"""Which snapshots to keep: the grammars users of sanoid/restic and zrepl already know.

Counts per period (sanoid, restic ``--keep-*``): ``hourly = 24`` keeps the newest snapshot of
each of the 24 most recent hours that have one (UTC); likewise ``daily``, ``weekly`` (ISO
weeks), ``monthly``, ``yearly``; ``keep_last = N`` keeps the N newest; ``within = "2d"`` keeps
everything younger than that.

Grids (zrepl): ``grid = "1x1h(keep=all) | 24x1h | 7x1d"`` lays buckets out from the newest
snapshot backwards (one hour keeping all, then 24 one-hour buckets, then 7 one-day buckets)
and keeps the K oldest of each bucket (K = 1 unless ``keep=``); older than the last bucket
goes.

A policy must keep something: counts and durations are positive, a grid's ``keep=`` too, and
an empty policy is refused (``keep_last = 1`` keeps only the newest, if that is what is
meant). A grid has at most ``MAX_GRID_BUCKETS`` buckets in all, each at most ``MAX_SPAN``
wide: a real grid (``24x1h | 30x1d | 12x30d``) has tens, and a limit keeps a typo like
``100000000000x1s`` a config error rather than a prune that never finishes.

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
MAX_GRID_BUCKETS = 5000
MAX_SPAN = 100 * 366 * 86400       # a bucket or ``within``: at most a century
NONE_KEPT = "a policy must keep something (keep_last = 1 keeps only the newest)"


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
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PolicyError(f"{key} must be a count (a whole number >= 1; leave "
                                  f"{key} out to keep none by it)")
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
    if not (policy.counts or policy.keep_last or policy.within or policy.grid):
        raise PolicyError(f"no rule keeps anything: {NONE_KEPT}")
    return policy


def parse_rules(text: str) -> Policy:
    """A policy written on a command line, in the config's words without the braces:
    ``daily = 7, keep_last = 3``. A syntax error names the column of ``text`` itself (the
    TOML parser's counts the braces this adds) and shows the form."""
    import tomllib
    opening = "r = { "
    try:
        raw = tomllib.loads(f"{opening}{text} }}")["r"]
    except tomllib.TOMLDecodeError as e:
        reason = re.sub(r"\s*\(at line 1, column (\d+)\)$",
                        lambda m: f" at column {max(1, int(m[1]) - len(opening))}", str(e))
        raise PolicyError(f"{reason}; write the rules as in the config, separated by commas, "
                          f"e.g. 'daily = 7, keep_last = 3' or 'grid = \"24x1h | 7x1d\"'") \
            from None
    return parse_policy(raw)


def parse_grid(text) -> list[GridBucket]:
    if not isinstance(text, str) or not text.strip():
        raise PolicyError("grid must be a string like '1x1h(keep=all) | 24x1h | 7x1d'")
    out = [_grid_item(part) for part in text.split("|")]
    if sum(b.repeat for b in out) > MAX_GRID_BUCKETS:
        raise PolicyError(f"grid has {sum(b.repeat for b in out)} buckets; at most "
                          f"{MAX_GRID_BUCKETS} in all (e.g. 24x1h | 30x1d | 12x30d has 66)")
    return out


def _grid_item(part: str) -> GridBucket:
    m = GRID_ITEM.match(part)
    if not m:
        raise PolicyError(f"bad grid item {part.strip()!r} (expected e.g. 24x1h or "
                          f"1x1h(keep=all))")
    item = GridBucket(int(m.group(1)), float(m.group(2)) * SECONDS[m.group(3)],
                      None if m.group(4) == "all" else int(m.group(4) or 1))
    if item.repeat < 1 or item.keep == 0:
        raise PolicyError(f"grid item {part.strip()!r} keeps nothing: {NONE_KEPT}")
    if item.repeat > MAX_GRID_BUCKETS:
        raise PolicyError(f"grid item {part.strip()!r} has {item.repeat} buckets; at most "
                          f"{MAX_GRID_BUCKETS} in all")
    if not 1 <= item.seconds <= MAX_SPAN:
        raise PolicyError(f"grid item {part.strip()!r}: a bucket must be 1s to 36600d wide")
    return item


def _duration(value) -> float:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$", value) if isinstance(value, str) \
        else None
    if not m:
        raise PolicyError(f"within must be a duration like '2d' (got {value!r})")
    seconds = float(m.group(1)) * SECONDS[m.group(2)]
    if not 1 <= seconds <= MAX_SPAN:
        raise PolicyError(f"within must be 1s to 36600d (got {value!r})")
    return seconds


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
    """Buckets laid out back from the newest snapshot; each snapshot finds its own bucket
    by arithmetic, so the work and memory follow the snapshots, not the buckets."""
    if not newest_first:
        return
    buckets: dict[int, tuple[GridBucket, list[Decision]]] = {}
    for d in newest_first:
        found = _grid_bucket(grid, newest_first[0].created_ns - d.created_ns)
        if found is not None:
            buckets.setdefault(found[0], (found[1], []))[1].append(d)
    for n, (item, inside) in buckets.items():
        oldest_first = sorted(inside, key=lambda d: d.created_ns)
        for d in oldest_first if item.keep is None else oldest_first[:item.keep]:
            d.reasons.append(f"grid bucket {n + 1} ({item.seconds:g}s)")


def _grid_bucket(grid: list[GridBucket], age_ns: int) -> tuple[int, GridBucket] | None:
    """The bucket (index, item) holding a snapshot ``age_ns`` older than the newest: bucket
    k of an item spans ages [k * width, (k + 1) * width). None: older than the grid."""
    first = 0
    for item in grid:
        width = int(item.seconds * 1e9)
        if age_ns < item.repeat * width:
            return first + age_ns // width, item
        age_ns -= item.repeat * width
        first += item.repeat
    return None
