"""mountfsd for real: a real mount, a real receiver on loopback, the daemon in its own process
(with its own embedded Spark), observed through snapctl status/check and the mirror."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import cli, free_port
from test_replicate import tree_state
from test_snapshots import take


def wait_for(what: str, predicate, timeout: float = 120.0, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


class Daemon:
    def __init__(self, config: Path):
        self.config = config
        self.proc = None

    def start(self) -> "Daemon":
        self.log = open(self.config.with_suffix(".log"), "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--config",
                                      str(self.config)], stdout=self.log, stderr=self.log)
        return self

    def signal(self, signum) -> None:
        self.proc.send_signal(signum)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def text(self) -> str:
        return self.config.with_suffix(".log").read_text()


@pytest.fixture
def daemon():
    started = []

    def start(config: Path) -> Daemon:
        d = Daemon(config).start()
        started.append(d)
        return d
    yield start
    for d in started:
        d.stop()


def mirrors_config(path: Path, mnt: Path, state: Path, urls: list[str],
                   token_file: Path | None = None, keep_last: int | None = None) -> Path:
    """A plain config of one filesystem snapshotting every second, with a mirror per URL
    (each with ``token_file``, if given) and ``keep_last`` retention, if given."""
    token = f'token_file = "{token_file}"\n' if token_file else ""
    retention = f"retention = {{ keep_last = {keep_last} }}\n" if keep_last else ""
    path.write_text(f'[daemon]\nstate_dir = "{state}"\n[[filesystem]]\nname = "data"\n'
                    f'mountpoint = "{mnt}"\nmin_interval = "1s"\n{retention}' +
                    "".join(f'[[filesystem.mirror]]\nurl = "{url}"\n{token}' for url in urls))
    return path


def write_config(path: Path, mnt: Path, state: Path, mirror_url: str, token_file: Path,
                 extra_fs: str = "", metrics: str = "") -> Path:
    admin = token_file.with_name("admin-token")      # the mirror's retention needs it
    admin_line = f'admin_token_file = "{admin}"' if admin.exists() else ""
    path.write_text(f"""
[daemon]
state_dir = "{state}"
{metrics}

[[filesystem]]
name = "data"
mountpoint = "{mnt}"
min_interval = "1s"
max_interval = "5s"
stall_timeout = "60s"
lag_warning = "30s"
lag_critical = "120s"
retention = {{ keep_last = 3 }}
{extra_fs}

[[filesystem.mirror]]
url = "{mirror_url}"
token_file = "{token_file}"
{admin_line}
retention = {{ keep_last = 2 }}
""")
    return path


def status(m, config: Path) -> dict:
    res = m.snapctl("status", "--config", config, "--json", check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def mirror_is_current(m, config: Path, url: str) -> bool:
    s = status(m, config)
    mirror = s["mirrors"].get(url)
    return bool(mirror) and mirror["base"] == s["newest"] and mirror["lag_seconds"] == 0


def assert_mirror_holds(mirror_store: Path, snapshot: str, want: dict, tmp_path: Path):
    mnt = tmp_path / f"check-{snapshot}"
    mnt.mkdir()
    cli("mountfs", "mount", "--read-only", mirror_store, mnt)
    try:
        assert tree_state(mnt / ".snapshot" / snapshot) == want
    finally:
        cli("mountfs", "umount", mnt)


def test_daemon_keeps_a_mirror_current_through_an_outage(mounted, receiver, daemon, tmp_path):
    m = mounted
    r = receiver()
    port = free_port()
    config = write_config(tmp_path / "data.toml", m.mnt, tmp_path / "state", r.url,
                          tmp_path / "token", metrics=f'metrics_listen = "127.0.0.1:{port}"')
    d = daemon(config)
    # a stream of changes; the mirror converges
    for i in range(6):
        (m.mnt / f"file{i}").write_bytes(os.urandom(10_000 + i))
        time.sleep(0.4)
    wait_for("the mirror to catch up", lambda: mirror_is_current(m, config, r.url))
    s = status(m, config)
    assert s["daemon"]["running"] and s["mirrors"][r.url]["cycles_total"] >= 1
    check = m.snapctl("check", "--config", config, check=False)
    assert check.returncode == 0 and check.stdout.startswith("OK: data -> ")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert f'mountfs_replication_lag_seconds{{filesystem="data",mirror="{r.url}"}} 0.0' \
        in metrics
    assert "mountfs_replication_sent_bytes_total" in metrics

    # retention: at most 3 local snapshots (the base is one of them)
    wait_for("local pruning", lambda: len(m.snapctl("list", "--json").stdout.splitlines()) <= 3)

    # the mirror goes away: snapshots go on, errors show, then it comes back and catches up
    r.stop()
    for i in range(3):
        (m.mnt / f"while-down{i}").write_text(f"written while the mirror was down {i}")
        time.sleep(1.2)
    wait_for("the outage to show", lambda: status(m, config)["mirrors"][r.url]["last_error"])
    assert status(m, config)["mirrors"][r.url]["lag_seconds"] > 0
    r2 = receiver()
    assert r2.port != r.port
    config = write_config(config, m.mnt, tmp_path / "state", r2.url, tmp_path / "token",
                          metrics=f'metrics_listen = "127.0.0.1:{port}"')
    d.signal(signal.SIGHUP)                                    # reload: the mirror moved
    wait_for("the mirror to catch up after the outage",
             lambda: mirror_is_current(m, config, r2.url))
    newest = status(m, config)["newest"]
    want = tree_state(m.mnt / ".snapshot" / newest)
    assert "reloaded" in d.text()
    assert d.stop() == 0
    r2.stop()
    assert_mirror_holds(tmp_path / "mirror", newest, want, tmp_path)
    assert cli("mountfs", "fsck", "-q", tmp_path / "mirror", check=False).returncode == 0


def test_daemon_killed_mid_cycle_converges_after_restart(mounted, receiver, daemon, tmp_path):
    m = mounted
    r = receiver()
    config = write_config(tmp_path / "data.toml", m.mnt, tmp_path / "state", r.url,
                          tmp_path / "token", extra_fs="spark_threshold = 0")
    for i in range(16):
        (m.mnt / f"big{i}").write_bytes(os.urandom(1 << 20))
    d = daemon(config)
    wait_for("a cycle to start sending", lambda: "snapshot" in d.text(), timeout=60)
    time.sleep(2.0)
    assert "replicated" not in d.text()                        # the first cycle is running
    d.proc.kill()                                              # kill -9 in the middle
    d.proc.wait()
    assert status(m, config)["mirrors"][r.url]["base"] is None   # nothing half-committed
    d2 = daemon(config)
    wait_for("convergence after the restart", lambda: mirror_is_current(m, config, r.url))
    newest = status(m, config)["newest"]
    want = tree_state(m.mnt / ".snapshot" / newest)
    d2.stop()
    r.stop()
    assert_mirror_holds(tmp_path / "mirror", newest, want, tmp_path)
    assert cli("mountfs", "fsck", "-q", tmp_path / "mirror", check=False).returncode == 0


@pytest.mark.parametrize("body, message", [
    ('[[filesystem]]\nname = "x"\nmountpoint = "/m"\nmin_interval = "soon"\n',
     ':4: filesystem[0].min_interval: expected a duration'),
    ('[[filesystem]]\nname = "x"\nmountpoint = "/m"\nretension = { daily = 7 }\n',
     ':4: filesystem[0].retension: unknown key'),
    ('[[filesystem]]\nname = "x"\nmountpoint = "/m"\nretention = { daily = -1 }\n',
     ':4: filesystem[0].retention: daily must be a count'),
    ('[[filesystem]]\nname = "x"\nmountpoint = "/m"\n[[filesystem.mirror]]\nurl = "ftp://x"\n',
     ':5: filesystem[0].mirror[0].url: expected file:///path or http(s)://host:port'),
    ('[[filesystem]]\nname = "x"\n', 'filesystem[0].mountpoint: missing'),
    ('[daemon\n', 'Expected'),
    ('', 'no [[filesystem]] configured'),
])
def test_a_bad_config_is_refused_with_key_and_line(tmp_path, body, message):
    config = tmp_path / "bad.toml"
    config.write_text(body)
    res = subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith(f"mountfsd: {config}")
    assert message in res.stderr and "Traceback" not in res.stderr


def one_line_failure(*args: str) -> str:
    """Run mountfsd, which must fail with status 2 and one line on stderr; that line."""
    res = subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    return res.stderr.strip()


def test_a_metrics_address_that_cannot_be_used_is_one_line(tmp_path):
    """--check refuses what can never work; a start refuses what cannot work on this host
    now (a port in use, a name that does not resolve), naming the key: no traceback for
    systemd to restart into."""
    config = tmp_path / "d.toml"

    def metrics_at(address: str) -> str:
        config.write_text(f'[daemon]\nstate_dir = "{tmp_path}"\nmetrics_listen = "{address}"\n'
                          f'[[filesystem]]\nname = "x"\nmountpoint = "{tmp_path}"\n')
        return str(config)
    for address, message in (("127.0.0.1:99999", "port 99999 is out of range 1-65535"),
                             ("127.0.0.1:0", "port 0 is out of range"),
                             ("localhost", "expected HOST:PORT")):
        err = one_line_failure("--check", "--config", metrics_at(address))
        assert err.startswith(f"mountfsd: {config}:3: daemon.metrics_listen: {message}"), err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = one_line_failure("--config", metrics_at(f"127.0.0.1:{port}"))
    assert err == (f"mountfsd: {config}: daemon.metrics_listen: cannot listen on "
                   f"127.0.0.1:{port}: Address already in use; choose a free port or an "
                   f"address of this host"), err
    err = one_line_failure("--config", metrics_at("nosuchhost.invalid:9812"))
    assert "daemon.metrics_listen: cannot listen on nosuchhost.invalid:9812: " in err, err


def test_check_is_critical_for_a_mirror_never_replicated(mounted, tmp_path):
    config = write_config(tmp_path / "data.toml", mounted.mnt, tmp_path / "state",
                          "file:///nonexistent", tmp_path / "token")
    res = mounted.snapctl("check", "--config", config, check=False)
    assert res.returncode == 2
    assert res.stdout.strip() == "CRITICAL: data -> file:///nonexistent: never replicated"


def test_a_slow_mirror_keeps_its_base_while_a_fast_one_moves_on(mounted, receiver, daemon,
                                                                tmp_path):
    m = mounted
    fast, slow = receiver(), receiver(store=tmp_path / "slow-mirror")
    config = mirrors_config(tmp_path / "two.toml", m.mnt, tmp_path / "state",
                            [fast.url, slow.url], tmp_path / "token", keep_last=1)
    (m.mnt / "first").write_text("1")
    d = daemon(config)
    wait_for("both mirrors", lambda: all(mirror_is_current(m, config, u)
                                         for u in (fast.url, slow.url)))
    slow_base = status(m, config)["mirrors"][slow.url]["base"]
    slow.stop()                                            # the slow mirror goes away
    for i in range(4):
        (m.mnt / f"later{i}").write_text(str(i))
        time.sleep(1.3)
    wait_for("the fast mirror", lambda: mirror_is_current(m, config, fast.url))
    # the slow base and the newest (a snapshot a retry to the slow mirror is sending stays
    # until that try fails)
    local = wait_for("the prune", lambda: len(snapshot_names(m)) == 2 and snapshot_names(m))
    assert slow_base in local                              # held: not pruned by keep_last 1
    slow.start()                                           # back, same address
    wait_for("the slow mirror to catch up", lambda: mirror_is_current(m, config, slow.url))
    s = status(m, config)["mirrors"][slow.url]
    assert s["last_cycle"]["base"] == slow_base            # one incremental diff from its base
    d.stop()


@contextlib.contextmanager
def mute_mirror():
    """The URL of a receiver that accepts connections and never answers (a hung host): an
    HTTP call to it waits for its read timeout. Accepted sockets stay open until the end."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept():
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(server.accept()[0])
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        done.set()
        thread.join()
        server.close()
        for conn in accepted:
            conn.close()


def test_snapshots_go_on_while_a_mirror_never_answers(mounted, daemon, tmp_path):
    """A cycle stuck on a mirror that never answers holds up neither the snapshots nor the
    local prune, and the prune keeps the snapshot that cycle is sending (keep_last = 1
    alone would delete it as soon as a newer one is taken); SIGTERM then ends the daemon
    (it ran on for the 600 s of the read timeout)."""
    m = mounted
    token = tmp_path / "token"
    token.write_text("token\n")
    token.chmod(0o600)
    with mute_mirror() as (url, accepted):
        config = mirrors_config(tmp_path / "mute.toml", m.mnt, tmp_path / "state", [url],
                                token, keep_last=1)
        (m.mnt / "first").write_text("first")
        d = daemon(config)
        wait_for("the first snapshot", lambda: snapshot_names(m), timeout=60)
        sending = snapshot_names(m)[0]
        wait_for("its cycle to reach the mirror", lambda: accepted, timeout=60)
        for i in range(4):
            (m.mnt / f"later{i}").write_text(str(i))
            time.sleep(1.2)
        wait_for("snapshots while the cycle hangs",
                 lambda: d.text().count("data: snapshot auto-") >= 3, timeout=60)
        wait_for("a local prune while the cycle hangs", lambda: "data: pruned" in d.text(),
                 timeout=60)
        wait_for("what it sends and the newest", lambda: len(snapshot_names(m)) == 2)
        assert snapshot_names(m)[0] == sending
        assert status(m, config)["mirrors"][url]["base"] is None       # still sending
        assert "replicated" not in d.text()
        # SIGTERM with the call still hanging (a worker thread cannot be cancelled): after
        # the grace period the call is shut down and the daemon ends, before systemd's kill
        assert d.stop() == 0, d.text()
    assert "aborting it" in d.text() and "the call was aborted" in d.text(), d.text()


def test_prune_dry_run_says_why(mounted, tmp_path):
    """Only names of the daemon's own form are its: 'auto-manual' is a user's."""
    own = [f"auto-2026010{i}T000000.000000Z" for i in (1, 2, 3)]
    mounted.snapctl("create", "mine")
    mounted.snapctl("create", "auto-manual")
    for name in own:                                   # as the daemon takes them
        take(mounted, name)
    config = tmp_path / "p.toml"
    config.write_text(f'[[filesystem]]\nname = "p"\nmountpoint = "{mounted.mnt}"\n'
                      f'snapshot_prefix = "auto-"\nretention = {{ keep_last = 2 }}\n')
    out = mounted.snapctl("prune", "--config", config, "--dry-run").stdout.splitlines()
    assert out == ["keep  mine: made by a user (prune_user is off)",
                   "keep  auto-manual: made by a user (prune_user is off)",
                   f"prune {own[0]} (dry run)",
                   f"keep  {own[1]}: keep_last 2",
                   f"keep  {own[2]}: newest, keep_last 2"]
    mounted.snapctl("prune", "--config", config)
    assert snapshot_names(mounted) == ["mine", "auto-manual", *own[1:]]


def test_the_daemon_prunes_only_snapshots_it_made(mounted, daemon, tmp_path):
    """The daemon's prefix alone does not make a snapshot the daemon's: a user's
    'auto-manual' survives its pruning."""
    m = mounted
    m.snapctl("create", "auto-manual")
    config = tmp_path / "own.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n\n[[filesystem]]\n'
                      f'name = "own"\nmountpoint = "{m.mnt}"\nmin_interval = "1s"\n'
                      f'retention = {{ keep_last = 1 }}\n')
    d = daemon(config)
    for i in range(2):                                 # two snapshots of its own, one pruned
        (m.mnt / f"f{i}").write_text(str(i))
        wait_for("the daemon's snapshot", lambda: d.text().count("own: snapshot auto-") > i)
    wait_for("the daemon to prune its first", lambda: "own: pruned auto-2" in d.text())
    assert "auto-manual" in snapshot_names(m) and "pruned auto-manual" not in d.text()


def test_a_snapshot_being_read_is_kept_until_it_is_closed(mounted, daemon, tmp_path):
    """Retention never deletes a snapshot under a program reading it (a backup copying
    .snapshot/NAME): `snapctl prune` keeps it and says why, the daemon keeps it and prunes
    it at a later pass, once the file is closed."""
    own = [f"auto-2026010{i}T000000.000000Z" for i in (1, 2)]
    (mounted.mnt / "f").write_text("being backed up")
    for name in own:
        take(mounted, name)
    config = tmp_path / "busy.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n\n[[filesystem]]\n'
                      f'name = "busy"\nmountpoint = "{mounted.mnt}"\nmin_interval = "1s"\n'
                      f'retention = {{ keep_last = 1 }}\n')
    with open(mounted.mnt / ".snapshot" / own[0] / "f") as reader:
        out = mounted.snapctl("prune", "--config", config).stdout.splitlines()
        assert out[0] == f"keep  {own[0]}: in use (files or directories under " \
                         f".snapshot/{own[0]} are open)"
        d = daemon(config)
        wait_for("the daemon to keep it", lambda: f"busy: kept {own[0]} for now" in d.text())
        assert own[0] in snapshot_names(mounted) and reader.read() == "being backed up"
    (mounted.mnt / "g").write_text("a change: the daemon snapshots and prunes again")
    wait_for("the daemon to prune it", lambda: f"busy: pruned {own[0]}" in d.text())


def test_a_name_of_the_daemons_form_is_refused(mounted):
    res = mounted.snapctl("create", "auto-20260101T000000.000000Z", check=False)
    assert (res.returncode, res.stdout) == (1, "")
    assert res.stderr == "snapctl: 'auto-20260101T000000.000000Z' has the form of mountfsd's " \
        "own snapshot names (auto-YYYYmmddTHHMMSS.ffffffZ): the daemon would treat it as its " \
        "own and prune it; choose another name\n"
    assert snapshot_names(mounted) == []


def snapshot_names(m) -> list[str]:
    return [json.loads(x)["name"] for x in m.snapctl("list", "--json").stdout.splitlines()]


def test_an_unexpected_error_from_one_mirror_fails_that_mirror_alone(mounted, tmp_path,
                                                                     monkeypatch, caplog):
    """A mirror whose cycle fails with an error nobody expected (a bug) gets its own backoff
    and a one-line last_error, with the traceback in the log; the other mirror is still
    replicated to and the steps go on normally (snapshots keep their pace)."""
    import trio

    from daemon import config as config_mod, service

    m = mounted
    bad, good = tmp_path / "bad-mirror", tmp_path / "good-mirror"
    config = mirrors_config(tmp_path / "d.toml", m.mnt, tmp_path / "state",
                            [f"file://{bad}", f"file://{good}"])
    real = service.replicate

    def replicate(store, endpoint, name, **kw):
        if str(bad) in endpoint.url:
            raise KeyError("format")
        return real(store, endpoint, name, **kw)
    monkeypatch.setattr(service, "replicate", replicate)
    (m.mnt / "a").write_text("a")
    cfg = config_mod.load(config)
    loop = service.FilesystemLoop(cfg.filesystems[0], cfg, None)
    bad_state = loop.state.mirror(f"file://{bad}")
    good_state = loop.state.mirror(f"file://{good}")

    async def until_both_cycled():
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(loop.run)               # does not raise
                while not (bad_state.failures and good_state.cycles_total):
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
    with caplog.at_level(logging.INFO, logger="mountfsd"):
        trio.run(until_both_cycled)
    assert bad_state.failures == 1 and bad_state.next_try_ns is not None
    assert bad_state.last_error == "unexpected error: KeyError: 'format'"
    assert "Traceback" in caplog.text and "KeyError" in caplog.text
    assert good_state.failures == 0 and good_state.cycles_total == 1
    assert loop.state.last_error is None and loop.state.last_snapshot
    assert mirror_is_current(m, config, f"file://{good}")
