"""Replication and status as a user meets them (issue 9, points 6 to 14): every command run
as a separate process, as a user would, against real mounts, mirrors and receivers."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import TOKEN, as_typed_at_a_terminal, cli, free_port
from test_daemon import daemon, mirror_is_current, wait_for, write_config  # noqa: F401 (fixture)
from test_replicate import tamper

TOP = Path(__file__).resolve().parent.parent


def snapshots(m) -> list[str]:
    return [json.loads(line)["name"] for line in m.snapctl("list", "--json").stdout.splitlines()]


def one_line_error(res: subprocess.CompletedProcess, code: int = 1) -> str:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    return res.stderr.strip()


def replicate(m, url: str, *args, env=None):
    return cli("snapctl", "-m", m.mnt, "replicate", "--to", url, *args, check=False, env=env)


# ---- 6: status and check without --config; UNKNOWN when a check cannot run ----------------

def test_a_check_that_cannot_run_is_unknown(tmp_path):
    res = cli("snapctl", "check", check=False)                 # not inside a mountfs mount
    assert res.returncode == 3 and res.stdout.startswith("UNKNOWN: "), res
    res = cli("snapctl", "check", "--config", tmp_path / "missing.toml", check=False)
    assert res.returncode == 3 and res.stdout.startswith("UNKNOWN: "), res
    assert "cannot read" in res.stdout


def test_status_and_check_refuse_store_instead_of_ignoring_it(make_mount, tmp_path):
    """They report a mount or a config's filesystems; a --store was silently dropped. The
    refusal names where the store is mounted, or says that it is not."""
    m = make_mount()
    for store, where in ((tmp_path / "store", "mount it and pass -m MOUNTPOINT (it is not "
                                              "mounted now)"),
                         (m.store, f"-m {m.mnt}, where it is mounted")):
        for args, rc, out in ((("status",), 2, "stderr"), (("check",), 3, "stdout")):
            res = cli("snapctl", "--store", store, *args, check=False)
            text = getattr(res, out).strip()
            assert res.returncode == rc and "\n" not in text, res
            assert text.endswith(f"--store does not apply to status and check, which report "
                                 f"mounted filesystems: use {where}, or --config FILE"), text


# ---- 7 and 10: failed replicates leave nothing behind and say one line -------------------

def test_failed_replicates_are_one_line_and_leave_no_snapshot(mounted, receiver, tmp_path):
    m = mounted
    (m.mnt / "f").write_text("data")
    m.snapctl("create", "mine")
    not_a_store = tmp_path / "not-a-store"
    not_a_store.mkdir()
    (not_a_store / "x").write_text("x")
    wrong_token = tmp_path / "wrong-token"
    wrong_token.write_text("not-the-token-at-all-0123456789")
    wrong_token.chmod(0o600)
    r = receiver()
    with_token = dict(os.environ, MOUNTFS_TOKEN=TOKEN)
    cases = [
        ((f"http://127.0.0.1:{free_port()}",), with_token, "cannot reach the mirror"),
        ((r.url, "--token-file", wrong_token), None, "refused the token (401)"),
        ((r.url, "--token-file", tmp_path / "no-such-token"), None, "cannot read token file"),
        ((f"https://127.0.0.1:{r.port}",), with_token, "cannot reach the mirror"),   # TLS
        ((f"file://{not_a_store}",), None, "is not a mountfs store"),
        (("file:///proc/foo",), None, "/proc/foo"),
        (("file:///etc/passwd",), None, "/etc/passwd"),
    ]
    for args, env, message in cases:
        err = one_line_error(replicate(m, *args, env=env))
        assert err.startswith("snapctl: ") and message in err, (args, err)
        assert snapshots(m) == ["mine"], args
    assert not os.path.exists("/proc/foo") and (not_a_store / "x").read_text() == "x"


def test_a_run_that_fails_after_its_snapshot_removes_it(mounted, tmp_path):
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "f").write_text("1")
    res = replicate(m, f"file://{mirror}", "--json")
    assert res.returncode == 0, res.stderr
    base = json.loads(res.stdout)["snapshot"]
    tamper(mirror)                                   # the mirror changed since its base
    (m.mnt / "f").write_text("2")
    err = one_line_error(replicate(m, f"file://{mirror}"))
    assert "has changed since its copy" in err
    assert snapshots(m) == [base]                    # the refused run's snapshot is gone


def test_a_replicate_another_one_beat_to_the_mirror_says_so(mounted, tmp_path):
    """Two runs chose the same base; the first committed. The second's commit was told its
    parts were "expired or never sent" (the winner's commit had dropped them), or, had it
    got that far, to roll the mirror back with --force, which would undo the winner's
    snapshot. The loser is played here by a commit against the old base, as it reaches the
    mirror."""
    from mountfs.store import Store
    from replicator import mirror as mirror_mod
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "f").write_text("1")
    first = json.loads(replicate(m, f"file://{mirror}", "--json").stdout)["snapshot"]
    (m.mnt / "f").write_text("2")
    winner = json.loads(replicate(m, f"file://{mirror}", "--json").stdout)["snapshot"]
    store = Store.open(mirror)
    try:
        info = mirror_mod.info(store)
        base = next(s["uuid"] for s in info["snapshots"] if s["name"] == first)
        with pytest.raises(mirror_mod.MirrorError) as e:
            mirror_mod.commit_staged(store, bytes.fromhex(info["mirror_of"]), base,
                                     mirror_mod.SnapshotRef("loser", "33" * 16, 1),
                                     os.urandom(16), [b"\0" * 32])
    finally:
        store.close()
    assert str(e.value) == (f"the mirror received snapshot {winner!r} after this run chose "
                            f"its base {first!r} (another replicate committed first); re-run "
                            f"to send from it")
    (m.mnt / "f").write_text("3")
    assert replicate(m, f"file://{mirror}").returncode == 0      # which works


def test_replicate_removes_its_earlier_snapshots_that_no_mirror_needs(mounted, tmp_path):
    """Every run takes a repl- snapshot; they piled up (prune keeps them as "made by a
    user"), each pinning what it held. A run now removes those of earlier runs that no
    mirror holds as its base: with two mirrors, each one's base stays; a user's own
    snapshots, and a name that only looks like the form, are never touched."""
    m = mounted
    m.snapctl("create", "mine")
    m.snapctl("create", "repl-manual")
    names = []
    for i, mirror in enumerate(["a", "a", "b", "a"]):
        (m.mnt / "f").write_text(str(i))
        res = replicate(m, f"file://{tmp_path}/{mirror}", "--json")
        assert res.returncode == 0, res.stderr
        names.append(json.loads(res.stdout)["snapshot"])
    # a's bases were names[0], then [1], then [3]; b's is names[2]
    assert snapshots(m) == ["mine", "repl-manual", names[2], names[3]]
    (m.mnt / "f").write_text("last")
    res = replicate(m, f"file://{tmp_path}/b")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == ("removed 1 snapshot(s) of earlier runs that no "
                                           "mirror holds as its base any more")
    assert snapshots(m)[:3] == ["mine", "repl-manual", names[3]] and len(snapshots(m)) == 4


def test_replicates_started_together_take_distinct_snapshots(mounted, tmp_path):
    m = mounted
    (m.mnt / "f").write_text("x")
    procs = [subprocess.Popen([sys.executable, "-m", "cmdline.snapctl", "-m", str(m.mnt),
                               "replicate", "--to", f"file://{tmp_path}/mirror{i}", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    names = {json.loads(out)["snapshot"] for out, _ in results}
    # Names are taken before the snapshots are created, so their order may differ from the
    # order of creation that 'list' reports: compare as sets.
    assert len(names) == 3 and names == set(snapshots(m))


# ---- 9: a mirror inside the source ---------------------------------------------------------

def test_a_mirror_inside_the_source_is_refused(mounted):
    m = mounted
    (m.mnt / "sub").mkdir()
    for target in (m.mnt / "sub" / "mirror", m.mnt / "sub", m.store / "mirror"):
        err = one_line_error(replicate(m, f"file://{target}"))
        assert "is inside the source" in err, err
    assert list((m.mnt / "sub").iterdir()) == [] and not (m.store / "mirror").exists()
    assert snapshots(m) == []


# ---- a replication target that is no mirror, a file URL with a host -----------------------

def test_a_store_with_files_of_its_own_is_not_replaced(make_mount, tmp_path):
    """A new user replicated to another mountfs store (made by mkfs, written, not a mirror)
    and lost its files. Refused in one line that names it and --force, leaving it as it
    was; --force makes it a mirror."""
    m, other = make_mount(), make_mount()
    (m.mnt / "f").write_text("source")
    (other.mnt / "f0").write_text("precious")
    other.umount()
    err = one_line_error(replicate(m, f"file://{other.store}"))
    assert err == (f"snapctl: {other.store.as_uri()} is a mountfs store with files of its "
                   f"own, not a mirror: replicating would replace them; pass --force to make "
                   f"it a mirror of this filesystem, or choose another directory")
    assert snapshots(m) == []
    other.mount()
    assert (other.mnt / "f0").read_text() == "precious"
    other.umount()
    res = replicate(m, f"file://{other.store}", "--force")
    assert res.returncode == 0 and "(reconciled by hash buckets)" in res.stdout, res.stderr
    res = cli("mountfs", "mount", other.store, other.mnt, check=False)
    assert res.returncode == 1 and "is a mirror" in res.stderr


def test_a_file_url_with_a_host_is_refused(mounted, tmp_path):
    """In file://var/tmp/x "var" is the host and the path /tmp/x: replicate and verify
    refuse it, naming the URL meant, and write nowhere."""
    m = mounted
    top, rest = str(tmp_path / "x").lstrip("/").split("/", 1)
    for command, option, code in (("replicate", "--to", 1), ("verify", "--to", 2),
                                  ("verify", "--mirror", 2)):
        res = cli("snapctl", "-m", m.mnt, command, option, f"file://{top}/{rest}", check=False)
        err = one_line_error(res, code)
        assert f"names the host {top!r}" in err and f"file:///{top}/{rest}" in err, err
    assert snapshots(m) == []
    assert not (tmp_path / "x").exists() and not Path("/", rest).exists()


def test_what_a_user_may_mistype_for_replicate_is_one_line_and_leaves_nothing(mounted,
                                                                            tmp_path):
    """An outside review's cases: each was a traceback (a malformed URL, a token an HTTP
    header cannot carry, --batch-size 0, which also left its snapshot), or a mirror made
    where the user did not point (file:///m#2 made /m)."""
    m = mounted
    (tmp_path / "tok").write_text("t\u00f8ken" * 4)
    (tmp_path / "tok").chmod(0o600)
    (tmp_path / "empty").write_text("")
    (tmp_path / "empty").chmod(0o600)
    cases = [
        (("--to", f"file://{tmp_path}/m", "--batch-size", "0"), 2, "must be more than 0"),
        (("--to", "http://[::1"), 1, "mirror URL http://[::1: Invalid IPv6 URL"),
        (("--to", "http://127.0.0.1:9", "--token-file", tmp_path / "tok"), 1,
         "the mirror's token has a character a bearer token cannot carry"),
        (("--to", "http://127.0.0.1:9", "--token-file", tmp_path / "empty"), 1,
         "no token for the mirror (none given, or an empty token file)"),
        (("--to", f"file://{tmp_path}/m#2"), 1, "no ?query or #fragment allowed"),
        (("--to", f"file://{tmp_path}/m?x"), 1, "no ?query or #fragment allowed"),
    ]
    for args, code, says in cases:
        err = one_line_error(cli("snapctl", "-m", m.mnt, "replicate", *args, check=False), code)
        assert says in err, (args, err)
    assert snapshots(m) == []
    assert sorted(os.listdir(tmp_path)) == ["empty", "mnt0", "store0", "tok"]
    cli("snapctl", "-m", m.mnt, "replicate", "--to", f"file://{tmp_path}/a%20b")
    assert (tmp_path / "a b" / "data.mdb").exists()          # %20 is a space, as in any URL


def test_serve_mirror_refuses_durations_that_would_break_every_cycle(tmp_path):
    """--staging-expiry 0 was accepted, and every commit then found its chunks dropped."""
    for option in ("--staging-expiry", "--body-timeout"):
        res = cli("mountfs", "serve-mirror", tmp_path / "mirror", "--listen", "127.0.0.1:9",
                  "--token-file", tmp_path / "tok", option, "0", check=False)
        assert "must be more than 0" in one_line_error(res, 2)
    assert not (tmp_path / "mirror").exists()



def test_replicate_from_a_read_only_mount_is_refused_before_it_makes_a_mirror(store, tmp_path):
    """A read-only mount cannot record the mirror's base: the run had sent everything to a
    new mirror, then failed. Refused first, in one line naming the ways that work; no
    mirror is made."""
    ro, mirror = tmp_path / "ro", tmp_path / "mirror"
    ro.mkdir()
    cli("snapctl", "--store", store, "create", "rich")
    cli("mountfs", "mount", "--read-only", store, ro)
    try:
        err = one_line_error(cli("snapctl", "-m", ro, "replicate", "--snapshot", "rich",
                                 "--to", f"file://{mirror}", check=False))
        assert err == f"snapctl: {ro} is mounted read-only: replicate records the mirror's " \
            f"base on the source; run it on the writable mount, or with --store {store} " \
            f"while the store is not mounted"
    finally:
        cli("mountfs", "umount", ro)
    assert not mirror.exists()
    cli("snapctl", "--store", store, "replicate", "--snapshot", "rich", "--to",
        f"file://{mirror}")                            # the way it names works
    assert (mirror / "data.mdb").exists()


# ---- 8: configured mirrors, others apart, forget-mirror -------------------------------------

def test_only_configured_mirrors_count_and_forget_mirror_drops_one(mounted, tmp_path):
    m = mounted
    kept, gone = f"file://{tmp_path}/kept", f"file://{tmp_path}/gone"
    token = tmp_path / "token"
    token.write_text(TOKEN)
    (m.mnt / "f").write_text("1")
    m.snapctl("create", "s1")
    assert replicate(m, gone, "--snapshot", "s1").returncode == 0
    (m.mnt / "f").write_text("2")
    m.snapctl("create", "s2")
    assert replicate(m, kept, "--snapshot", "s2").returncode == 0
    time.sleep(2.5)                                  # 'gone' lags more than 2 s
    config = write_config(tmp_path / "data.toml", m.mnt, tmp_path / "state", kept, token)
    config.write_text(config.read_text().replace('lag_warning = "30s"', 'lag_warning = "1s"')
                      .replace('lag_critical = "120s"', 'lag_critical = "2s"'))

    report = json.loads(m.snapctl("status", "--config", config, "--json").stdout)
    assert list(report["mirrors"]) == [kept] and list(report["other_mirrors"]) == [gone]
    text = m.snapctl("status", "--config", config).stdout
    assert "not configured" in text and gone in text.split("not configured")[1]
    res = m.snapctl("check", "--config", config, check=False)
    assert res.returncode == 0 and res.stdout.startswith(f"OK: data -> {kept}: lag 0s"), res

    # without a config (and no daemon): every mirror replicated to counts; the line names the
    # one over the threshold first
    res = m.snapctl("check", "--warning", "1s", "--critical", "2s", check=False)
    assert res.returncode == 2, res
    assert re.match(rf"CRITICAL: \S+ -> {gone}: lag \d+s \(over critical 2s\); ", res.stdout)
    assert one_line_error(m.snapctl("delete", "s1", check=False)).endswith("pass --force")

    assert m.snapctl("forget-mirror", gone).stdout.strip() == \
        f"forgot mirror {gone} (its base snapshot is no longer held)"
    res = m.snapctl("check", "--warning", "1s", "--critical", "2s", check=False)
    assert res.returncode == 0 and gone not in res.stdout, res
    m.snapctl("delete", "s1")                        # no longer held
    err = one_line_error(m.snapctl("forget-mirror", gone, check=False))
    assert err.startswith(f"snapctl: no mirror {gone} is recorded")


# ---- 6, 13: the daemon's status file without --config, across a restart; quiet httpx -------

def test_status_without_config_reads_the_daemon_and_survives_its_restart(mounted, receiver,
                                                                          daemon, tmp_path):
    m, r, state, port = mounted, receiver(), tmp_path / "state", free_port()
    config = write_config(tmp_path / "data.toml", m.mnt, state, r.url, tmp_path / "token",
                          metrics=f'metrics_listen = "127.0.0.1:{port}"')
    (m.mnt / "f").write_text("hello")
    by_hand = f"file://{tmp_path}/by-hand"           # replicated to once, not configured
    assert replicate(m, by_hand).returncode == 0
    (m.mnt / "g").write_text("changed since")
    d = daemon(config)
    wait_for("the mirror", lambda: mirror_is_current(m, config, r.url))
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert f'mirror="{r.url}"' in metrics and by_hand not in metrics
    env = dict(os.environ, MOUNTFS_STATE_DIR=str(state))
    res = cli("snapctl", "-m", m.mnt, "status", env=env)
    assert f"{r.url}: base auto-" in res.stdout and "last success never" not in res.stdout
    res = cli("snapctl", "-m", m.mnt, "check", env=env, check=False)
    assert res.returncode == 0 and res.stdout.startswith(f"OK: data -> {r.url}: lag 0s"), res
    assert d.stop() == 0
    assert "HTTP Request" not in d.text()            # httpx at INFO: not one line a request

    d2 = daemon(config)
    wait_for("the new daemon's status", lambda: json.loads(
        (state / "data.json").read_text())["pid"] == d2.proc.pid)
    report = json.loads(cli("snapctl", "-m", m.mnt, "status", "--json", env=env).stdout)
    assert report["mirrors"][r.url]["last_success_ns"] is not None
    assert report["mirrors"][r.url]["cycles_total"] >= 1

    config.write_text(config.read_text().split("[[filesystem.mirror]]")[0])
    d2.signal(signal.SIGHUP)                         # the mirror is no longer configured
    wait_for("its metrics to go", lambda: r.url not in urllib.request.urlopen(
        f"http://127.0.0.1:{port}/metrics").read().decode())


# ---- 11: progress on a terminal; client and receiver count alike ---------------------------

def run_on_a_terminal(args: list[str], timeout: float = 300) -> tuple[int, str]:
    """Run ``args`` with stderr on a pseudo-terminal; (status, what the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=slave)
    os.close(slave)
    shown, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 4096)
            except OSError:                          # the child closed the terminal
                break
            if not data:
                break
            shown += data
        elif proc.poll() is not None:
            break
    os.close(master)
    proc.stdout.read()
    return proc.wait(timeout=timeout), shown.decode(errors="replace")


def test_a_replicate_on_a_terminal_shows_what_it_does_and_its_progress(mounted, tmp_path):
    m = mounted
    for i in range(6):
        (m.mnt / f"f{i}").write_bytes(os.urandom(1 << 20))
    status, shown = run_on_a_terminal(
        [sys.executable, "-m", "cmdline.snapctl", "-m", str(m.mnt), "replicate", "--to",
         f"file://{tmp_path}/mirror", "--batch-size", "1M", "--spark-threshold", "1G"])
    assert status == 0, shown
    assert "listing the snapshot for a full copy" in shown
    assert "asking the mirror which of 6 chunks it lacks" in shown
    assert re.search(r"sending 6 chunks: +\d+%.*B/s", shown), shown    # tqdm: bytes, rate


def test_client_and_receiver_report_the_same_counts(mounted, receiver, tmp_path):
    m, r = mounted, receiver()
    (m.mnt / "d").mkdir()
    for i in range(5):
        (m.mnt / "d" / f"f{i}").write_text(str(i))
        os.link(m.mnt / "d" / f"f{i}", m.mnt / f"link{i}")
    env = dict(os.environ, MOUNTFS_TOKEN=TOKEN)
    res = replicate(m, r.url, "--json", env=env)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    r.stop()
    logged = re.search(r"committed snapshot (\S+) \((\d+) names and (\d+) inodes changed\)",
                       r.log())
    assert logged, "the receiver did not log its commit"
    assert logged.groups() == (summary["snapshot"], str(summary["entries"]),
                               str(summary["inodes"]))
    assert (summary["entries"], summary["inodes"]) == (11, 7)      # names; root, d, 5 files


# ---- 12: diff --stat counts what changed ---------------------------------------------------

def test_diff_stat_counts_the_bytes_that_changed(mounted):
    m = mounted
    (m.mnt / "d").mkdir()
    for i in range(62):
        (m.mnt / "d" / f"f{i}").write_bytes(b"x" * 10)
    (m.mnt / "big").write_bytes(os.urandom(100_000))
    m.snapctl("create", "s1")
    subprocess.run(["rm", "-rf", str(m.mnt / "d")], check=True)
    with open(m.mnt / "big", "ab") as f:
        f.write(b"123456789")
    (m.mnt / "new").mkdir()
    (m.mnt / "new" / "n").write_bytes(b"y" * 1000)
    m.snapctl("create", "s2")
    rows = {line.split()[0]: line.split()[1:]
            for line in m.snapctl("diff", "s1", "s2", "--stat").stdout.splitlines()[1:]}
    assert rows["delete"] == ["1", "0", "-620"]               # 62 files of 10 bytes
    assert rows["modify"] == ["2", "100009", "+9"]            # the one chunk of big, rewritten
    assert rows["create"] == ["1", "1000", "+1000"]           # new/ and what it holds
    assert rows["rename"] == ["0", "0", "+0"]
    as_json = json.loads(m.snapctl("diff", "s1", "s2", "--stat", "--json").stdout)
    assert as_json["modify"] == {"entries": 2, "chunk_bytes_written": 100009,
                                 "file_size_change": 9}


# ---- 13: interfaces agree with their docs --------------------------------------------------

def test_commands_take_options_where_the_docs_put_them(store, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cli("mountfs", "mount", store, mnt, "-v")                 # README: mount ... -v
    try:
        assert "created snapshot x" in cli("snapctl", "create", "-m", mnt, "x").stdout
        assert "x" in cli("snapctl", "list", "--store", store, "-m", mnt).stdout
        res = cli("snapctl", "-m", mnt, "check", "--warning", "5m", "--critical", "1h",
                  check=False)
        assert res.stdout.startswith("OK: "), res                # no mirror: OK
        err = one_line_error(cli("snapctl", "-m", mnt, "check", "--warning", "soon",
                                 check=False), code=2)
        assert "expected a duration like 30s, 5m" in err
    finally:
        cli("mountfs", "umount", mnt)
    assert "Usage: snapctl diff [OPTIONS] FROM [TO]" in cli("snapctl", "diff", "--help").stdout


def test_options_that_contradict_or_do_nothing_are_refused(store, tmp_path):
    """A new user's slips, each one line: -m and --store naming different filesystems (the
    request went to -m, a delete would have hit it), -m of a path that does not exist,
    --chunks without --json (silently ignored), and a critical lag shorter than the warning
    one (which the config refuses)."""
    mnt, other = tmp_path / "mnt", tmp_path / "other.store"
    mnt.mkdir()
    cli("mountfs", "mkfs", other)
    cli("mountfs", "mount", store, mnt)
    try:
        cli("snapctl", "-m", mnt, "create", "s1")
        err = one_line_error(cli("snapctl", "-m", mnt, "--store", other, "delete", "s1",
                                 check=False))
        assert err == f"snapctl: -m {mnt} and --store {other} name different filesystems; " \
            f"give one of them"
        assert "s1" in cli("snapctl", "-m", mnt, "list").stdout          # nothing deleted
        err = one_line_error(cli("snapctl", "-m", tmp_path / "nonexist", "list", check=False))
        assert err == f"snapctl: {tmp_path / 'nonexist'} does not exist; -m takes the " \
            f"filesystem's mountpoint"
        err = one_line_error(cli("snapctl", "-m", mnt, "diff", "s1", "--chunks", check=False))
        assert err == "snapctl: --chunks lists changed chunk ranges in the --json report; " \
            "add --json"
        res = cli("snapctl", "-m", mnt, "check", "--warning", "1h", "--critical", "1m",
                  check=False)
        assert (res.returncode, res.stdout) == (3, "UNKNOWN: --critical (60 s) is shorter "
                                                   "than --warning (3600 s); a critical lag "
                                                   "must be at least the warning one\n")
    finally:
        cli("mountfs", "umount", mnt)


def test_version_and_help_everywhere():
    for tool in ("mountfs", "snapctl", "mountfsd"):
        res = subprocess.run([Path(sys.executable).parent / tool, "--version"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and re.fullmatch(rf"{tool} \d+\.\d+\.\d+\n", res.stdout), res
    for tool in ("mountfs", "snapctl"):
        text = cli(tool, "--help").stdout
        assert "..." not in text.split("Commands:")[1], text   # descriptions are not cut
    res = subprocess.run([sys.executable, "-m", "daemon.cli", "--bogus"], capture_output=True,
                         text=True, timeout=60)
    assert one_line_error(res, code=2).startswith("mountfsd: No such option '--bogus'")
    res = subprocess.run([sys.executable, "-m", "daemon.cli"], capture_output=True, text=True,
                         timeout=60)
    assert one_line_error(res, code=2).startswith("mountfsd: give NAME")


def test_commands_of_other_tools_say_what_to_run_instead():
    """A zfs user's `snapctl destroy`, `rollback` or `send`: one line naming the command
    that does it (click's "did you mean" only finds names spelt alike), status 2; a
    misspelt real command still gets click's suggestion."""
    for tool, name, hint in (("snapctl", "destroy", "'snapctl delete NAME'"),
                             ("snapctl", "rollback", "'snapctl restore NAME --force'"),
                             ("snapctl", "send", "'snapctl replicate --to URL'"),
                             ("mountfs", "unmount", "'mountfs umount MOUNTPOINT'"),
                             ("mountfs", "scrub", "'mountfs fsck STORE'")):
        err = one_line_error(cli(tool, name, "x", check=False), code=2)
        assert err.startswith(f"{tool}: there is no '{name}' command; {hint}"), err
    err = one_line_error(cli("snapctl", "delet", "x", check=False), code=2)
    assert "Did you mean 'delete'?" in err, err


def test_install_systemd_help_installs_nothing(tmp_path):
    env = dict(os.environ, DEST=str(tmp_path / "units"), CONFIG_DIR=str(tmp_path / "etc"))
    res = subprocess.run(["bash", TOP / "scripts/install-systemd", "--help"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "install-systemd NAME STORE MOUNTPOINT" in res.stdout
    assert not (tmp_path / "units").exists() and not (tmp_path / "etc").exists()


def test_one_parser_for_sizes_and_durations_and_a_thorough_check(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    config = write_config(tmp_path / "data.toml", mnt, tmp_path / "state",
                          "http://backup:8765", token, extra_fs='spark_threshold = "16M"')

    def check():
        return subprocess.run([sys.executable, "-m", "daemon.cli", "--check", "--config",
                               str(config)], capture_output=True, text=True, timeout=60)
    assert check().returncode == 0, check().stderr
    token.unlink()
    assert one_line_error(check(), code=2).endswith(
        f"mirror http://backup:8765: token_file {token} does not exist or cannot be read")
    token.write_text(TOKEN)
    token.chmod(0o600)
    mnt.rmdir()
    assert one_line_error(check(), code=2).endswith(
        f"filesystem 'data': mountpoint {mnt} does not exist or is not a directory")
    # a duration the config refuses, the command line refuses too, in the same words
    for args in (["replicate", "--to", "file:///nowhere", "--stall-timeout", "0"],
                 ["replicate", "--to", "file:///nowhere", "--stall-timeout", "400d"],
                 ["check", "--warning", "0s"]):
        err = one_line_error(cli("snapctl", "-m", mnt, *args, check=False), code=2)
        assert f"must be more than 0 and at most 366d (got '{args[-1]}')" in err, err


# ---- 14: the docs stand on their own -------------------------------------------------------

def test_readme_points_only_inside_the_project():
    readme = (TOP / "README.md").read_text()
    assert "../" not in readme
    for path in re.findall(r"`((?:docs|scripts|systemd)/[\w./@-]+)`", readme):
        assert (TOP / path).exists(), path
    for key in ("ca_file", "stall_timeout"):
        assert key in readme


# ---- 10: Ctrl-C during a Spark transfer ----------------------------------------------------

@pytest.mark.parametrize("sig, how, status", [
    (signal.SIGINT, "interrupted", 130),               # Ctrl-C: the whole foreground job
    (signal.SIGTERM, "interrupted by SIGTERM", 143),   # kill, timeout: the command only
    (signal.SIGHUP, "interrupted by SIGHUP", 129),     # a dropped ssh session: the job
], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_an_interrupted_spark_transfer_is_one_line_and_the_rerun_resumes(mounted, tmp_path,
                                                                         sig, how, status):
    """SIGTERM and SIGHUP ended the run at once (status 143 or 129, no word) and left its
    snapshot, pinning everything it held, where Ctrl-C cleaned up."""
    from test_replicate import staged_count
    m, mirror = mounted, tmp_path / "mirror"
    for i in range(40):
        (m.mnt / f"f{i}").write_bytes(os.urandom(1 << 20))
    args = [sys.executable, "-m", "cmdline.snapctl", "-m", str(m.mnt), "replicate", "--to",
            f"file://{mirror}", "--batch-size", "1M", "--spark-threshold", "0"]
    # its own process group, as a shell gives a foreground job
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=as_typed_at_a_terminal)
    deadline = time.monotonic() + 240
    while staged_count(mirror) == 0 and proc.poll() is None:
        assert time.monotonic() < deadline, "the transfer never started"
        time.sleep(0.05)
    if sig == signal.SIGTERM:
        proc.send_signal(sig)
    else:
        os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, (out, err)
    assert err.strip() == (f"snapctl: {how}; chunks that arrived are kept on the mirror: "
                           "run the same command again to resume")
    assert snapshots(m) == []                        # the run's snapshot went with it
    staged = staged_count(mirror)
    res = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["bytes_sent"] <= (40 - staged) * (1 << 20)


# ---- README's commands work as written -----------------------------------------------------

COMMANDS = ("mountfs ", "snapctl ", "echo ", "cat ", "mkdir ", "mv ")


def readme_steps(section: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines README shows under it) of the first sh block of
    ``## section``; comments after two spaces are dropped."""
    text = (TOP / "README.md").read_text().split(f"## {section}\n", 1)[1]
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith(COMMANDS):
            steps.append((line.split("  #")[0].strip(), []))
        elif steps and line.strip() and not line.startswith(("export ", "#")):
            steps[-1][1].append(line)
    return steps


def test_readme_commands_work_as_written(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    (tmp_path / "data").mkdir()

    def run(command: str, shown: list[str]) -> None:
        command = command.replace("/srv/store", str(tmp_path / "store")) \
            .replace("/mnt/data", str(tmp_path / "data"))
        res = subprocess.run(["bash", "-c", command], env=env, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, (command, res.stdout, res.stderr)
        if shown:
            assert res.stdout.splitlines() == shown, (command, res.stdout)

    try:
        for command, shown in readme_steps("Using it"):
            run(command, shown)
        run("mountfs mount /srv/store /mnt/data", [])
        for command, shown in readme_steps("What changed between two snapshots"):
            run(command, shown)
    finally:
        subprocess.run([Path(sys.executable).parent / "mountfs", "umount", tmp_path / "data"],
                       capture_output=True, timeout=120)


def test_a_mirror_replaced_at_the_same_url_is_reported_at_its_new_base(mounted, tmp_path):
    import shutil
    m, mirror = mounted, tmp_path / "mirror"
    (m.mnt / "f").write_text("1")
    m.snapctl("create", "old")
    assert replicate(m, f"file://{mirror}", "--snapshot", "old").returncode == 0
    shutil.rmtree(mirror)                            # the mirror is replaced by a new store
    (m.mnt / "f").write_text("2")
    m.snapctl("create", "new")
    assert replicate(m, f"file://{mirror}", "--snapshot", "new").returncode == 0
    report = json.loads(m.snapctl("status", "--json").stdout)
    assert report["mirrors"][f"file://{mirror}"]["base"] == "new"
    m.snapctl("forget-mirror", f"file://{mirror}")  # drops both records of that URL
    m.snapctl("delete", "old")
    m.snapctl("delete", "new")
