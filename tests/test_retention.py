"""Retention rules (daemon/retention.py) on snapshot histories with known dates."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.retention import PolicyError, decide, parse_grid, parse_policy

NOW = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.timezone.utc)


def ns(**delta) -> int:
    return int((NOW - dt.timedelta(**delta)).timestamp() * 1e9)


def kept(policy: dict, snaps: list[tuple[str, int]], **kw) -> dict[str, list[str]]:
    return {d.name: d.reasons for d in decide(parse_policy(policy), snaps,
                                              int(NOW.timestamp() * 1e9), **kw) if d.keep}


def test_hourly_and_daily_keep_the_newest_of_each_period():
    snaps = [(f"h{i}", ns(minutes=30 * i)) for i in range(12, -1, -1)]   # every 30 min, 6 h
    got = kept({"hourly": 3}, snaps)
    # newest of 12:00, of 11:xx and of 10:xx (h0 at 12:00, h1 at 11:30, h3 at 10:30)
    assert set(got) == {"h0", "h1", "h3"}
    assert got["h3"] == ["hourly 3/3"]
    daily = [(f"d{i}", ns(days=i, hours=1)) for i in range(10, -1, -1)]
    assert set(kept({"daily": 7}, daily)) == {f"d{i}" for i in range(7)}


def test_a_grid_keeps_the_oldest_of_each_bucket():
    snaps = [(f"s{i}", ns(minutes=20 * i)) for i in range(20, -1, -1)]   # ~7 h
    got = kept({"grid": "1x1h(keep=all) | 3x1h"}, snaps)
    assert {"s0", "s1", "s2"} <= set(got)                      # the first hour: all
    assert len([n for n, r in got.items() if any("bucket 2" in x for x in r)]) == 1
    assert "s20" not in got                                    # older than the last bucket


def test_users_snapshots_bases_and_the_newest_stay():
    snaps = [("manual", ns(days=30)), ("auto-a", ns(days=20)), ("auto-b", ns(days=1))]
    got = kept({"keep_last": 1}, snaps, own=lambda n: n.startswith("auto-"),
               protected={"auto-a": "replication base of http://x"})
    assert got == {"manual": ["made by a user (prune_user is off)"],
                   "auto-a": ["replication base of http://x"],
                   "auto-b": ["newest", "keep_last 1"]}
    got = kept({"keep_last": 1, "prune_user": True}, snaps, own=lambda n: n.startswith("auto-"))
    assert "manual" not in got


@pytest.mark.parametrize("raw, message", [
    ({"daily": -1}, "daily must be a count"), ({"daly": 3}, "unknown rule 'daly'"),
    ({"within": "soon"}, "within must be a duration"), ({"prune_user": "yes"}, "true or false"),
    ({"grid": "24h"}, "bad grid item"),
    ({}, "no rule keeps anything: a policy must keep something .keep_last = 1"),
    ({"prune_user": True}, "no rule keeps anything"),
    ({"hourly": 0}, "hourly must be a count .a whole number >= 1"),
    ({"keep_last": 0}, "keep_last must be a count"),
    ({"within": "0s"}, "within must be 1s to 36600d"),
    ({"within": "9" * 400 + "d"}, "within must be 1s to 36600d"),
    ({"grid": "0x0s"}, "grid item '0x0s' keeps nothing"),
    ({"grid": "1x1h(keep=0)"}, "keeps nothing"),
    ({"grid": "1x0s"}, "a bucket must be 1s to 36600d wide"),
    ({"grid": "1x" + "9" * 400 + "s"}, "a bucket must be 1s to 36600d wide"),
    ({"grid": "100000000000x1s"}, "has 100000000000 buckets; at most 5000"),
    ({"grid": "3000x1h | 3000x1d"}, "grid has 6000 buckets; at most 5000 in all"),
])
def test_bad_policies_are_refused(raw, message):
    with pytest.raises(PolicyError, match=message):
        parse_policy(raw)


def test_grid_syntax():
    g = parse_grid("1x1h(keep=all) | 24x1h | 14x1d(keep=2)")
    assert [(b.repeat, b.seconds, b.keep) for b in g] == [(1, 3600, None), (24, 3600, 1),
                                                         (14, 86400, 2)]


def test_a_real_zrepl_grid_is_accepted():
    assert sum(b.repeat for b in parse_grid("1x1h(keep=all) | 24x1h | 30x1d | 12x30d")) == 67


def test_grid_buckets_are_half_open_towards_the_past():
    """A snapshot exactly one bucket older than the newest falls in the next bucket."""
    snaps = [("old", ns(hours=2)), ("edge", ns(hours=1)), ("new", ns())]
    got = kept({"grid": "2x1h"}, snaps)
    assert got == {"new": ["newest", "grid bucket 1 (3600s)"],
                   "edge": ["grid bucket 2 (3600s)"]}


def test_a_huge_grid_costs_memory_by_snapshots_not_buckets():
    """A policy built past the parser's limit must still not build a list per bucket:
    10**11 buckets under a 1 GB address-space limit, in a child process."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
            "from daemon.retention import GridBucket, Policy, decide\n"
            "snaps = [(f's{i}', i * 10**9) for i in range(100)]\n"
            "ds = decide(Policy(grid=[GridBucket(10**11, 1.0, 1)]), snaps, 10**12)\n"
            "print(sum(d.keep for d in ds))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr[-500:]
    assert res.stdout.strip() == "100"
