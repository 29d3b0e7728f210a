"""The daemon's config refuses what would hurt later (a prune that deletes everything or
never ends, a crash in the daemon, a status file outside state_dir) with one line naming
the key and its line; loading survives hostile files; one filesystem's failure never ends
the daemon."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from daemon import config as config_mod
from daemon.config import ConfigError, load

ROOT = Path(__file__).resolve().parent.parent


def body(fs: str = "", mirror: str | None = None, daemon: str = "") -> str:
    """A config with the daemon's keys at line 2, the filesystem's name at line 4, its
    other keys from line 6 and the mirror's from line 8, so that lines can be asserted."""
    text = f'[daemon]\n{daemon}\n[[filesystem]]\nname = "x"\nmountpoint = "/m"\n{fs}\n'
    if mirror is not None:
        text += f"[[filesystem.mirror]]\n{mirror}\n"
    return text


def refusal(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "c.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as e:
        load(path)
    message = str(e.value)
    assert "\n" not in message
    return message.removeprefix(f"{path}:")


@pytest.mark.parametrize("fs, message", [
    ('retention = { grid = "100000000000x1s" }',
     "6: filesystem[0].retention: grid item '100000000000x1s' has 100000000000 buckets; "
     "at most 5000"),
    ("retention = {}", "6: filesystem[0].retention: no rule keeps anything"),
    ("retention = { hourly = 0 }", "6: filesystem[0].retention: hourly must be a count"),
    ('retention = { grid = "0x0s" }', "6: filesystem[0].retention: grid item '0x0s' keeps"),
    ('retention = { grid = "1x1h(keep=0)" }', "6: filesystem[0].retention: grid item"),
    ("stall_timeout = 0", "6: filesystem[0].stall_timeout: must be more than 0 and at most "
     "366d (got 0)"),
    ('lag_critical = "400d"', "6: filesystem[0].lag_critical: must be more than 0"),
    ("max_interval = 1e308", "6: filesystem[0].max_interval: must be more than 0"),
    ("min_interval = inf", "6: filesystem[0].min_interval: must be more than 0"),
    ('min_interval = "1h"', "6: filesystem[0].min_interval: must not be longer than "
     "max_interval (15m by default; set max_interval too)"),
    ('lag_warning = "2h"', "6: filesystem[0].lag_warning: must not be longer than "
     "lag_critical (1h by default; set lag_critical too)"),
    ('min_interval = "1h"\nmax_interval = "30m"',
     "7: filesystem[0].max_interval: must not be shorter than min_interval"),
])
def test_durations_and_retention_are_refused_against_the_key_written(tmp_path, fs, message):
    assert refusal(tmp_path, body(fs)).startswith(message)


@pytest.mark.parametrize("url, message", [
    ("https://[::1", "Invalid IPv6 URL"),
    ("http://", "no valid host"),
    ("http://localhost:99999", "out of range"),
    ("http://localhost:0", "port 0 is out of range"),
    ("http://exa mple:80", "no valid host"),
    ("http://user:secret@backup:8765", "no user@"),
    ("http://backup:8765/?x=1", "no ?query"),
    ("file:///", "name a directory of the mirror's own"),
    ("file:///srv/..", "name a directory of the mirror's own"),
    ("file://srv/mirror", "names the host 'srv'"),
    ("ftp://x", "expected file:///path or http(s)://host:port"),
])
def test_mirror_urls_are_checked(tmp_path, url, message):
    got = refusal(tmp_path, body(mirror=f'url = "{url}"'))
    assert got.startswith("8: filesystem[0].mirror[0].url: ") and message in got, got


@pytest.mark.parametrize("url", ["https://backup:8765", "http://[::1]:8765",
                                 "https://10.0.0.5", "http://mirror-host.example.org:80/base",
                                 "file:///srv/mirror", "file://localhost/srv/mirror"])
def test_good_mirror_urls_pass(tmp_path, url):
    path = tmp_path / "c.toml"
    path.write_text(body(mirror=f'url = "{url}"'))
    assert load(path).filesystems[0].mirrors[0].url == url


@pytest.mark.parametrize("name", ["../escaped-status", "a/b", ".hidden", "", "x" * 101,
                                  "tab\there"])
def test_a_name_is_never_a_path(tmp_path, name):
    text = body().replace('name = "x"', f'name = "{name}"')
    assert refusal(tmp_path, text).startswith("4: filesystem[0].name: ")


def test_state_dir_is_absolute_and_a_directory(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for state_dir, message in (("run/mountfs", "must be an absolute path"),
                               (a_file, f"{a_file} is not a directory"),
                               (a_file / "sub", f"{a_file} is not a directory")):
        got = refusal(tmp_path, body(daemon=f'state_dir = "{state_dir}"'))
        assert got.startswith(f"2: daemon.state_dir: {message}"), got
    path = tmp_path / "ok.toml"
    path.write_text(body(daemon=f'state_dir = "{tmp_path}/new/state"'))
    assert load(path).state_dir == f"{tmp_path}/new/state"


@pytest.mark.parametrize("where, key, line", [
    ("fs", "mountpoint", "5: filesystem[0].mountpoint"),
    ("mirror", "token_file", "9: filesystem[0].mirror[0].token_file"),
    ("mirror", "ca_file", "9: filesystem[0].mirror[0].ca_file"),
    ("mirror", "admin_token_file", "9: filesystem[0].mirror[0].admin_token_file")])
def test_paths_in_a_config_are_absolute(tmp_path, where, key, line):
    """Under systemd the daemon runs from /, by hand from the shell's directory: a relative
    path would name a different file in each."""
    mirror = 'url = "file:///srv/mirror"'
    if where == "fs":
        text = body(mirror=mirror).replace('mountpoint = "/m"', f'{key} = "data/mnt"')
        wrong = "data/mnt"
    else:
        text = body(mirror=f'{mirror}\n{key} = "etc/token"')
        wrong = "etc/token"
    got = refusal(tmp_path, text)
    assert got.startswith(f"{line}: must be an absolute path (got '{wrong}'; write "
                          f"'{os.path.abspath(wrong)}'"), got
    path = tmp_path / "ok.toml"
    path.write_text(text.replace(f'"{wrong}"', f'"/{wrong}"'))
    assert load(path).filesystems[0].name == "x"


def test_a_refusal_names_the_line_of_the_table_it_is_in(tmp_path):
    """The line was the first ``key =`` anywhere in the file, so a bad value in the second
    [[filesystem]] or [[filesystem.mirror]] was pointed at a good one in the first."""
    two = body('min_interval = "10s"') + '[[filesystem]]\nname = "y"\nmountpoint = "/n"\n' \
        'min_interval = "10x"\n'
    assert refusal(tmp_path, two).startswith("10: filesystem[1].min_interval: expected a "
                                             "duration"), two
    mirrors = body("retention = { daily = 7 }", 'url = "file:///a"') + \
        '[[filesystem.mirror]]\nurl = "file:///b"\nretention = { daily = 0 }\n'
    assert refusal(tmp_path, mirrors).startswith("11: filesystem[0].mirror[1].retention: "
                                                 "daily must be a count"), mirrors


def test_a_config_that_is_not_utf8_names_line_and_offset(tmp_path):
    text = body().encode().replace(b'"/m"', b'"/m\xff"')
    offset = text.index(b"\xff")
    assert refusal(tmp_path, text) == (f"5: not UTF-8 (byte 0xff at offset {offset}); save "
                                       f"the file as UTF-8")


def test_a_huge_config_is_not_read_whole(tmp_path):
    path = tmp_path / "c.toml"
    with open(path, "wb") as f:
        f.write(body().encode())
        f.truncate(1 << 30)                 # sparse: 1 GiB that would cost 2 GB to parse
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        load(path)


def test_a_fifo_or_a_directory_is_refused_at_once(tmp_path):
    """A FIFO would block the open (and the read) forever: mountfsd --check must answer."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    res = subprocess.run([sys.executable, "-m", "daemon.cli", "--check", "--config",
                          str(fifo)], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert res.returncode == 2
    assert res.stderr == f"mountfsd: {fifo}: not a regular file; name the config file itself\n"
    with pytest.raises(ConfigError, match=f"^{tmp_path}: not a regular file"):
        load(tmp_path)


def check(tmp_path: Path, mirror: str, env: dict | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "c.toml"
    path.write_text(body(mirror=mirror).replace('"/m"', f'"{tmp_path}"'))
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--check", "--config",
                           str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "MOUNTFS_TOKEN": "", **(env or {})})


def test_check_wants_a_token_for_an_http_mirror_and_a_file_for_token_file(tmp_path):
    res = check(tmp_path, 'url = "https://backup:8765"')
    assert res.returncode == 2
    assert res.stderr.endswith(": mirror https://backup:8765: token_file missing; an http(s) "
                               "mirror needs the replicate token (or $MOUNTFS_TOKEN in the "
                               "daemon's environment)\n")
    assert check(tmp_path, 'url = "https://backup:8765"',
                 {"MOUNTFS_TOKEN": "t"}).returncode == 0
    res = check(tmp_path, f'url = "https://backup:8765"\ntoken_file = "{tmp_path}"')
    assert res.returncode == 2 and "chmod" not in res.stderr
    assert res.stderr.endswith(f"token_file {tmp_path} is not a regular file; name the "
                               f"file itself\n")
    assert len(res.stderr.splitlines()) == 1


def test_check_fails_in_one_line_where_the_daemon_crashed(tmp_path):
    for mirror in ('url = "https://[::1"', 'retention = { grid = "100000000000x1s" }'):
        res = check(tmp_path, f'url = "file:///srv/m"\n{mirror}' if "grid" in mirror
                    else mirror)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert "Traceback" not in res.stderr


def test_one_filesystems_failure_never_ends_the_daemon(tmp_path, caplog):
    """A state_dir that became a file after the config was checked: the loop logs one line
    and retries; it neither raises nor stops."""
    from daemon.service import FilesystemLoop
    a_file = tmp_path / "file"
    a_file.write_text("")
    fs = config_mod.FilesystemConfig("x", str(tmp_path / "not-mounted"))
    loop = FilesystemLoop(fs, config_mod.Config("c.toml", state_dir=str(a_file)), None)

    async def run_a_while():
        with trio.move_on_after(1.5):
            await loop.run()
    with caplog.at_level(logging.ERROR, logger="mountfsd"):
        trio.run(run_a_while)
    failed = [m for m in caplog.messages if m.startswith("x: FileExistsError: ")]
    assert failed and all("(retry in " in m for m in failed), caplog.messages


@pytest.mark.parametrize("text, message", [
    (body(daemon='spark_master = "nonsense"'),
     "2: daemon.spark_master: not a Spark master: 'nonsense'; expected local"),
    (body(daemon='spark_master = "spark://master"'),
     "2: daemon.spark_master: not a Spark master"),
    (body(mirror='url = "file:///srv/m"') + '[[filesystem.mirror]]\nurl = "file:///srv/m/"\n',
     "10: filesystem[0].mirror[1].url: the same as filesystem[0].mirror[0]'s"),
    (body() + '[[filesystem]]\nname = "y"\nmountpoint = "/m/"\n',
     "9: filesystem[1].mountpoint: the same as filesystem[0]'s"),
    (body() + '[[filesystem]]\nname = "x"\nmountpoint = "/n"\n',
     "8: filesystem[1].name: the same as filesystem[0]'s"),
    ('[daemon]\n[filesystem]\nname = "x"\nmountpoint = "/m"\n',
     "2: write [[filesystem]] (one table per filesystem), not [filesystem]"),
])
def test_what_would_fail_every_cycle_is_refused_at_load(tmp_path, text, message):
    """A Spark master that cannot start, a mirror listed twice (two cycles racing to one
    mirror), two loops on one mountpoint, and a single [filesystem] table (which was called
    "no [[filesystem]] configured"): refused at load, naming the line."""
    got = refusal(tmp_path, text)
    assert got.startswith(message), got


@pytest.mark.parametrize("master", ["local", "local[*]", "local[2]", "spark://h:7077",
                                    "spark://a:7077,b:7077", "yarn", "k8s://https://k:6443"])
def test_spark_masters_spark_takes_pass(tmp_path, master):
    path = tmp_path / "c.toml"
    path.write_text(body(daemon=f'spark_master = "{master}"'))
    assert load(path).spark_master == master
