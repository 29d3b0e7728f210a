"""Snapshot names cannot spoof what `snapctl list` shows: control characters (C0, DEL, C1,
bidirectional overrides) and invalid UTF-8 are refused with one line, whether the name comes
from the command line or from a source through a mirror's receiver."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mountfs.snapshots import SnapshotError, validate_name

BAD = ["two\nlines", "esc\x1b[2Jclear", "tab\tname", "del\x7f", "c1\x85next", "c1\x9b31m",
       "rlo\u202etxt.exe"]


@pytest.mark.parametrize("name", BAD)
def test_control_characters_are_refused(mounted, name):
    res = subprocess.run([sys.executable, "-m", "cmdline.snapctl", "-m", str(mounted.mnt),
                          "create", name], capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.splitlines()) == 1 and "control character" in res.stderr
    assert mounted.snapctl("list", "--json").stdout == ""


def test_invalid_utf8_is_refused(mounted):
    res = subprocess.run([sys.executable.encode(), b"-m", b"cmdline.snapctl", b"-m",
                          bytes(mounted.mnt), b"create", b"bad\xff\xfename"],
                         capture_output=True)
    assert res.returncode == 1 and b"not valid UTF-8" in res.stderr, res.stderr
    assert len(res.stderr.splitlines()) == 1
    assert mounted.snapctl("list", "--json").stdout == ""


def test_printable_names_are_kept_as_given(mounted):
    for name in ["daily-2026-11-22", "café ☕", "with space"]:
        mounted.snapctl("create", name)
    names = [json.loads(line)["name"] for line in
             mounted.snapctl("list", "--json").stdout.splitlines()]
    assert names == ["daily-2026-11-22", "café ☕", "with space"]


def test_list_lines_up_names_of_wide_and_combining_characters(mounted):
    """A CJK character takes two columns of a terminal and a combining accent none: the
    EPOCH column starts at the same column whatever the names are made of."""
    from wcwidth import wcswidth
    names = ["plain", "日本語のスナップ", "cafe\u0301"]
    for name in names:
        mounted.snapctl("create", name)
    lines = mounted.snapctl("list").stdout.splitlines()
    assert [line.split()[0] for line in lines[1:]] == names
    epochs = [len(line) - len(line[len(name):].lstrip(" ")) for line, name in
              zip(lines[1:], names)]
    # NAME is 32 columns wide, a space, then EPOCH right-aligned in 8: one digit at column 41
    assert {wcswidth(line[:at]) for line, at in zip(lines[1:], epochs)} == {40}, lines


@pytest.mark.parametrize("name", BAD + ["bad\udcff"])
def test_the_one_rule_refuses_them_everywhere(name):
    """The receiver creates a mirror's snapshots through the same function."""
    with pytest.raises(SnapshotError):
        validate_name(name)
