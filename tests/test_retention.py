"""Retention rules (daemon/retention.py) on snapshot histories with known dates."""

from __future__ import annotations

import datetime as dt

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
    got = kept({"keep_last": 0}, snaps, own=lambda n: n.startswith("auto-"),
               protected={"auto-a": "replication base of http://x"})
    assert got == {"manual": ["made by a user (prune_user is off)"],
                   "auto-a": ["replication base of http://x"], "auto-b": ["newest"]}
    got = kept({"keep_last": 0, "prune_user": True}, snaps, own=lambda n: n.startswith("auto-"))
    assert "manual" not in got


@pytest.mark.parametrize("raw, message", [
    ({"daily": -1}, "daily must be a count"), ({"daly": 3}, "unknown rule 'daly'"),
    ({"within": "soon"}, "within must be a duration"), ({"prune_user": "yes"}, "true or false"),
    ({"grid": "24h"}, "bad grid item"),
])
def test_bad_policies_are_refused(raw, message):
    with pytest.raises(PolicyError, match=message):
        parse_policy(raw)


def test_grid_syntax():
    g = parse_grid("1x1h(keep=all) | 24x1h | 14x1d(keep=2)")
    assert [(b.repeat, b.seconds, b.keep) for b in g] == [(1, 3600, None), (24, 3600, 1),
                                                         (14, 86400, 2)]
