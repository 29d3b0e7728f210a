"""Replication through a real Spark standalone cluster whose executor is "another host".

The master and worker come from pyspark's own installation (``bin/spark-class``), started
once for this module. The worker runs in a mount namespace where a tmpfs hides the source
store's directory, and in a network namespace of its own; the mirror's receiver runs in a
third namespace. veth pairs join source <-> worker, source <-> receiver and worker <->
receiver (addresses 10.231.71-73.x/30, only inside these namespaces), so every chunk crosses
an interface: fetched by the executor from the source's chunk endpoint, pushed to the
receiver. The mirror is then compared with the source snapshot through a read-only mount.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from conftest import TOKEN, Mount, cli, free_port
from test_daemon import mirror_is_current, status, wait_for, write_config
from test_replicate import assert_mirror_equals, churn, populate, staged_count


class Net:
    """This run's names and addresses: slot N owns namespaces mfs11-N-w/-r, links m11-N-*
    and 10.231.(74+3N .. 76+3N).0/30, claimed atomically (``ip netns add`` fails when the
    namespace exists), so that runs in other checkouts at the same time cannot collide."""

    def claim(self) -> "Net":
        for n in range(59):
            self.ns_worker, self.ns_receiver = f"mfs11-{n}-w", f"mfs11-{n}-r"
            if ip("netns", "add", self.ns_worker, check=False).returncode == 0:
                break
        else:
            raise AssertionError("no free network slot for the cluster test")
        self.w0, self.w1, self.r0, self.r1, self.x0, self.x1 = (
            f"m11-{n}-{k}" for k in ("w0", "w1", "r0", "r1", "x0", "x1"))
        a, b, c = (f"10.231.{74 + 3 * n + i}" for i in range(3))
        self.source_w, self.worker_s = f"{a}.1", f"{a}.2"      # source <-> worker
        self.source_r, self.receiver_s = f"{b}.1", f"{b}.2"    # source <-> receiver (URL)
        self.worker_r, self.receiver_w = f"{c}.1", f"{c}.2"    # worker <-> receiver
        return self

    def remove(self) -> None:
        for ns in (self.ns_worker, self.ns_receiver):
            ip("netns", "del", ns, check=False)
        for link in (self.w0, self.r0):
            ip("link", "del", link, check=False)


NET = Net()
SNAPCTL = str(Path(sys.executable).parent / "snapctl")

pytestmark = [pytest.mark.fuse, pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("java"),
    reason="needs root, iproute2 and java")]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


# Run in a namespace's own mount namespace: drop its copies of every FUSE mount (copies would
# keep those file systems alive, so their umount would wait for us), then hide "$1" under a
# tmpfs if given, then exec the rest.
ISOLATE = r"""awk '$3 ~ /^fuse(\.|$)/ {print $2}' /proc/self/mounts |
while read -r m; do umount -l "$m"; done
if [ -n "$1" ]; then mount -t tmpfs -o size=1m mfs11-hidden "$1" || exit 1; fi
shift; exec "$@"
"""


def in_namespace(ns: str, cmd: list, hidden: Path | None = None) -> list:
    return ["ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "slave", "sh", "-c",
            ISOLATE, "sh", str(hidden or ""), *map(str, cmd)]


@pytest.fixture(scope="module")
def network():
    """Three namespaces' worth of veth links; the worker reaches the receiver's address
    through its own link to it (no forwarding anywhere)."""
    NET.claim()
    ip("netns", "add", NET.ns_receiver)
    for ns in (NET.ns_worker, NET.ns_receiver):
        ip("-n", ns, "link", "set", "lo", "up")
    for here, there, ns, mine, theirs in (
            (NET.w0, NET.w1, NET.ns_worker, NET.source_w, NET.worker_s),
            (NET.r0, NET.r1, NET.ns_receiver, NET.source_r, NET.receiver_s)):
        ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", ns)
        ip("addr", "add", f"{mine}/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", ns, "addr", "add", f"{theirs}/30", "dev", there)
        ip("-n", ns, "link", "set", there, "up")
    ip("-n", NET.ns_worker, "link", "add", NET.x0, "type", "veth", "peer", "name",
       NET.x1, "netns", NET.ns_receiver)
    ip("-n", NET.ns_worker, "addr", "add", f"{NET.worker_r}/30", "dev", NET.x0)
    ip("-n", NET.ns_worker, "link", "set", NET.x0, "up")
    ip("-n", NET.ns_receiver, "addr", "add", f"{NET.receiver_w}/30", "dev", NET.x1)
    ip("-n", NET.ns_receiver, "link", "set", NET.x1, "up")
    ip("-n", NET.ns_worker, "route", "add", f"{NET.receiver_s}/32", "dev", NET.x0,
       "src", NET.worker_r)
    yield NET
    NET.remove()


@pytest.fixture(scope="module")
def source_store(tmp_path_factory) -> Path:
    """The source store, in a directory of its own that the worker cannot see."""
    store = tmp_path_factory.mktemp("cluster-source") / "store"
    cli("mountfs", "mkfs", store)
    return store


@pytest.fixture(scope="module")
def source(cluster, source_store, tmp_path_factory):
    """The source mounted (after the worker started, so its namespace holds no copy of the
    mount)."""
    m = Mount(source_store, tmp_path_factory.mktemp("cluster-mnt")).mount()
    yield m
    m.cleanup()


class Cluster:
    def __init__(self, top: Path, hidden: Path):
        import pyspark
        self.home = Path(pyspark.__file__).parent
        self.top = top
        self.port, self.ui = free_port(), free_port()
        self.url = f"spark://{NET.source_w}:{self.port}"
        self.conf_dir = top / "conf"
        self.conf_dir.mkdir()
        (self.conf_dir / "spark-defaults.conf").write_text(
            f"spark.driver.host {NET.source_w}\nspark.driver.bindAddress {NET.source_w}\n"
            f"spark.executor.memory 512m\nspark.cores.max 2\n")
        env = dict(os.environ, SPARK_HOME=str(self.home), SPARK_LOG_DIR=str(top),
                   SPARK_NO_DAEMONIZE="1")
        spark_class = str(self.home / "bin" / "spark-class")
        self.master = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", NET.source_w,
             "--port", str(self.port), "--webui-port", str(self.ui)],
            env=dict(env, SPARK_LOCAL_IP=NET.source_w), stdout=open(top / "master.log", "w"),
            stderr=subprocess.STDOUT)
        wait_for("the Spark master", lambda: listening(NET.source_w, self.port))
        self.hidden, self.spark_env = hidden, env
        self.start_worker()

    def start_worker(self, home: Path | None = None) -> None:
        """The worker, from pyspark's installation or from ``home`` (another SPARK_HOME)."""
        home = home or self.home
        self.worker = subprocess.Popen(
            in_namespace(NET.ns_worker, [str(home / "bin" / "spark-class"),
                                     "org.apache.spark.deploy.worker.Worker",
                                     "--host", NET.worker_s, "--cores", "2", "--memory", "1g",
                                     "--work-dir", self.top / "work", self.url], self.hidden),
            env=dict(self.spark_env, SPARK_LOCAL_IP=NET.worker_s, SPARK_HOME=str(home)),
            stdout=open(self.top / "worker.log", "a"), stderr=subprocess.STDOUT)
        wait_for("the worker to register", lambda: self.alive_workers() == 1)

    def kill_worker_host(self) -> None:
        """Every process of the worker's namespace (worker, executor, Python workers) dies
        at once, as when its host loses power."""
        pids = ip("netns", "pids", NET.ns_worker).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.worker.wait()
        wait_for("the master to drop the dead worker", lambda: self.alive_workers() == 0)

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://{NET.source_w}:{self.ui}/json", timeout=5) as r:
            return json.load(r)

    def alive_workers(self) -> int:
        try:
            return sum(w["state"] == "ALIVE" for w in self.state()["workers"])
        except OSError:
            return 0

    def env(self) -> dict:
        return dict(os.environ, SPARK_CONF_DIR=str(self.conf_dir),
                    MOUNTFS_SPARK_LOG=str(self.top / "driver.log"))

    def stop(self) -> None:
        for proc in (self.worker, self.master):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture(scope="module")
def cluster(network, source_store, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"), source_store.parent)
    yield c
    c.stop()


class NsReceiver:
    """``mountfs serve-mirror`` inside the receiver's namespace."""

    def __init__(self, store: Path, token_file: Path):
        self.store, self.port = store, free_port()
        self.url = f"http://{NET.receiver_s}:{self.port}"
        self.log = store.parent / f"{store.name}.receiver.log"   # a file: a pipe nobody reads
        with open(self.log, "ab") as log:                        # would block a chatty server
            self.proc = subprocess.Popen(
                in_namespace(NET.ns_receiver, [sys.executable, "-m", "cmdline.mountfs",
                                           "serve-mirror", store, "--listen",
                                           f"0.0.0.0:{self.port}", "--token-file",
                                           token_file]),
                stdout=subprocess.DEVNULL, stderr=log, cwd=Path(__file__).parent.parent)
        wait_for("the receiver", lambda: self.proc.poll() is not None or
                 listening(NET.receiver_s, self.port))
        assert self.proc.poll() is None, self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)   # see conftest.Receiver.stop
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def receiver(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    r = NsReceiver(tmp_path / "mirror", token_file)
    r.token_file = token_file
    yield r
    r.stop()


def replicate(m: Mount, cluster: Cluster, r: NsReceiver, snapshot: str, *extra: str):
    return subprocess.run(
        [SNAPCTL, "-m", str(m.mnt), "replicate", "--to", r.url, "--token-file",
         str(r.token_file), "--snapshot", snapshot, "--spark-master", cluster.url,
         "--spark-threshold", "0", "--json", *extra],
        capture_output=True, text=True, env=cluster.env(), timeout=600,
        cwd=Path(__file__).parent.parent)


def test_the_worker_cannot_see_the_source_store(cluster, source):
    hidden = Path(f"/proc/{cluster.worker.pid}/root") / str(source.store).lstrip("/")
    assert (source.store / "data.mdb").exists() and not hidden.exists()
    mounts = Path(f"/proc/{cluster.worker.pid}/mounts").read_text()
    assert " fuse" not in mounts           # no copy of the source's (or anyone's) mount


def test_full_copy_and_incremental_run_on_the_remote_worker(cluster, source, receiver,
                                                            tmp_path):
    m = source
    populate(m.mnt)
    m.snapctl("create", "c1")
    first = replicate(m, cluster, receiver, "c1")
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout)
    assert summary["base"] is None and summary["bytes_sent"] > 0
    assert set(summary["executors"]) == {NET.worker_s}     # its address toward the source
    assert summary["executors"][NET.worker_s]["bytes"] == summary["bytes_sent"]
    churn(m.mnt)
    m.snapctl("create", "c2")
    second = replicate(m, cluster, receiver, "c2")
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["base"] == "c1" and set(summary["executors"]) == {NET.worker_s}
    apps = cluster.state()["completedapps"]
    assert len(apps) >= 2 and all(a["state"] == "FINISHED" for a in apps)
    receiver.stop()
    assert_mirror_equals(m, receiver.store, "c1", tmp_path, latest=False)
    assert_mirror_equals(m, receiver.store, "c2", tmp_path)


def test_a_file_mirror_with_a_cluster_master_is_refused_up_front(cluster, source, tmp_path):
    res = subprocess.run(
        [SNAPCTL, "-m", str(source.mnt), "replicate", "--to", f"file://{tmp_path}/m",
         "--spark-master", cluster.url, "--spark-threshold", "0"],
        capture_output=True, text=True, env=cluster.env(), timeout=120)
    assert res.returncode == 1
    assert res.stderr.count("\n") == 1 and "file:// mirror cannot be written by the " \
        "executors" in res.stderr and "serve-mirror" in res.stderr, res.stderr


def test_mountfsd_cycles_through_the_cluster(cluster, source, receiver, tmp_path):
    m = source
    (m.mnt / "daemon-file").write_bytes(os.urandom(3_000_000))
    port = free_port()
    config = write_config(tmp_path / "d.toml", m.mnt, tmp_path / "state", receiver.url,
                          receiver.token_file, extra_fs='spark_threshold = "0"',
                          metrics=f'spark_master = "{cluster.url}"\n'
                                  f'metrics_listen = "127.0.0.1:{port}"')
    log = open(tmp_path / "daemon.log", "w")
    d = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--config", str(config)],
                         stdout=log, stderr=subprocess.STDOUT, env=cluster.env(),
                         cwd=Path(__file__).parent.parent)
    try:
        wait_for("a daemon cycle through the cluster",
                 lambda: mirror_is_current(m, config, receiver.url))
        newest = status(m, config)["newest"]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        assert (f'mountfs_replication_executor_bytes_per_second{{executor="{NET.worker_s}",'
                f'filesystem="data",mirror="{receiver.url}"}}') in metrics, metrics
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(timeout=120)
    text = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in text, text
    receiver.stop()
    assert_mirror_equals(m, receiver.store, newest, tmp_path, latest=False)


# ---- failures: each one line, nothing half-applied, a re-run converges -----------------------

def staged_bytes(mirror: Path) -> int:
    """Chunk bytes staged on the mirror (keys of 32 bytes: staged changeset parts, 24, are
    sent again by a re-run under its own transfer id and count in no byte figure)."""
    from mountfs.store import Store
    store = Store.open(mirror, readonly=True, lock=False)
    try:
        with store.read() as txn:
            return sum(len(txn.get(bytes(d), db=store.db["blobs"]))
                       for d, _ in txn.cursor(db=store.db["staged"]) if len(d) == 32)
    finally:
        store.close()


def settled(read, every: float = 1.0, timeout: float = 60.0):
    """``read()`` once it returns the same value twice ``every`` seconds apart."""
    deadline, last = time.monotonic() + timeout, read()
    while True:
        time.sleep(every)
        now = read()
        if now == last:
            return now
        assert time.monotonic() < deadline, "the value never settled"
        last = now


def mirror_snapshots(r: NsReceiver) -> list[str]:
    from replicator.client import HttpMirror
    mirror = HttpMirror(r.url, TOKEN)
    try:
        return [s["name"] for s in mirror.info()["snapshots"]]
    finally:
        mirror.close()


def replicating(m: Mount, cluster: Cluster, r: NsReceiver, name: str) -> subprocess.Popen:
    """24 MiB in 1 MiB files under NAME, snapshot NAME1, and its replication under way in
    1 MiB batches with a 10 s stall timeout: returned once the first chunks have arrived."""
    (m.mnt / name).mkdir()
    for i in range(24):
        (m.mnt / name / f"f{i}").write_bytes(os.urandom(1 << 20))
    m.snapctl("create", f"{name}1")
    proc = subprocess.Popen(
        [SNAPCTL, "-m", str(m.mnt), "replicate", "--to", r.url, "--token-file",
         str(r.token_file), "--snapshot", f"{name}1", "--spark-master", cluster.url,
         "--spark-threshold", "0", "--batch-size", "1M", "--stall-timeout", "10s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.env())
    try:
        wait_for("the first chunks to arrive",
                 lambda: proc.poll() is not None or staged_count(r.store) > 0)
    except BaseException:
        proc.kill()
        raise
    return proc


@pytest.fixture
def slow_link():
    """The worker's link to the receiver at 40 Mbit/s, so that a transfer lasts seconds."""
    ip("netns", "exec", NET.ns_worker, "tc", "qdisc", "add", "dev", NET.x0, "root", "tbf",
       "rate", "40mbit", "burst", "32kb", "latency", "400ms")
    yield
    ip("netns", "exec", NET.ns_worker, "tc", "qdisc", "del", "dev", NET.x0, "root",
       check=False)
    ip("-n", NET.ns_receiver, "link", "set", NET.x1, "up")


def test_a_link_cut_mid_transfer_stalls_names_the_mirror_and_resumes(cluster, source, receiver,
                                                                     slow_link):
    m = source
    proc = replicating(m, cluster, receiver, "cut")
    try:
        ip("-n", NET.ns_receiver, "link", "set", NET.x1, "down")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Either the watchdog fires ("no chunk batch finished in 10 s; ...: executor W: cannot
    # reach the mirror at URL") or, when the kernel answers "no route to host" at once, the
    # executors' own failures end the job first ("cannot reach the mirror at URL: ...").
    assert proc.returncode == 1 and err.count("\n") == 1, err
    assert f"cannot reach the mirror at {receiver.url}" in err, err
    assert "cut1" not in mirror_snapshots(receiver)
    ip("-n", NET.ns_receiver, "link", "set", NET.x1, "up")
    arrived = settled(lambda: staged_bytes(receiver.store))   # a body already received
    assert 0 < arrived < 24 << 20                             # may still be being staged
    again = replicate(m, cluster, receiver, "cut1")
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    total = summary["bytes_sent"] + summary["bytes_skipped"]
    # Nothing that arrived went twice. Not '==': a request stuck in TCP retransmission while
    # the link was down may still complete once it is up, after 'arrived' was read, and what
    # it staged is not sent again either (seen: exactly one 1 MiB batch less).
    assert total - arrived - (4 << 20) <= summary["bytes_sent"] <= total - arrived


def test_a_link_left_down_is_one_line_and_leaves_the_mirror_untouched(cluster, source,
                                                                      receiver, slow_link):
    m = source
    (m.mnt / "down").write_bytes(os.urandom(3 << 20))
    m.snapctl("create", "down1")
    before = mirror_snapshots(receiver)
    ip("-n", NET.ns_receiver, "link", "set", NET.x1, "down")
    res = replicate(m, cluster, receiver, "down1", "--stall-timeout", "30s")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert f"cannot reach the mirror at {receiver.url}" in res.stderr, res.stderr
    assert mirror_snapshots(receiver) == before and staged_count(receiver.store) == 0


def test_executors_without_python_are_one_clear_line(cluster, source, receiver):
    m = source
    (m.mnt / "nopython").write_bytes(os.urandom(100_000))
    m.snapctl("create", "nopy1")
    env = dict(cluster.env(), PYSPARK_PYTHON="/nonexistent/python3")
    res = subprocess.run(
        [SNAPCTL, "-m", str(m.mnt), "replicate", "--to", receiver.url, "--token-file",
         str(receiver.token_file), "--snapshot", "nopy1", "--spark-master", cluster.url,
         "--spark-threshold", "0", "--stall-timeout", "60s"],
        capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "/nonexistent/python3" in res.stderr, res.stderr
    assert "nopy1" not in mirror_snapshots(receiver)


def test_a_worker_that_dies_mid_job_is_one_line_and_a_rerun_converges(cluster, source,
                                                                    receiver, slow_link):
    m = source
    proc = replicating(m, cluster, receiver, "dies")
    try:
        cluster.kill_worker_host()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if cluster.alive_workers() == 0:
            cluster.start_worker()                  # the next tests need their worker
    assert proc.returncode == 1 and err.count("\n") == 1, err
    assert "no executor left" in err and NET.worker_s in err, err
    assert "dies1" not in mirror_snapshots(receiver)
    arrived = settled(lambda: staged_bytes(receiver.store))
    assert 0 < arrived < 24 << 20
    again = replicate(m, cluster, receiver, "dies1")
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    total = summary["bytes_sent"] + summary["bytes_skipped"]
    assert total - arrived - (4 << 20) <= summary["bytes_sent"] <= total - arrived
    assert "dies1" in mirror_snapshots(receiver)


def test_a_worker_cut_off_from_the_source_is_one_line_naming_the_chunk_endpoint(
        cluster, source, receiver, slow_link):
    m = source
    proc = replicating(m, cluster, receiver, "lone")
    try:
        ip("link", "set", NET.w0, "down")          # the source's side of the worker's link
        out, err = proc.communicate(timeout=300)
    finally:
        ip("link", "set", NET.w0, "up")
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and err.count("\n") == 1, err
    assert "chunk endpoint" in err and NET.source_w in err, err
    assert "lone1" not in mirror_snapshots(receiver)
    wait_for("the worker to be back", lambda: cluster.alive_workers() == 1)
    again = replicate(m, cluster, receiver, "lone1")
    assert again.returncode == 0, again.stderr
    assert "lone1" in mirror_snapshots(receiver)


def other_pyspark_home(real: Path, top: Path, version: str) -> Path:
    """A SPARK_HOME whose executors' Python gets pyspark ``version``: the installation's
    own files, but the pyspark.zip that Spark puts first on its Python workers' path is a
    copy whose version module says ``version`` (what a cluster installed separately has)."""
    home = top / f"spark-{version}"
    (home / "python" / "lib").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "python":
            (home / entry.name).symlink_to(entry)
    lib = real / "python" / "lib"
    for entry in lib.iterdir():
        if entry.name != "pyspark.zip":
            (home / "python" / "lib" / entry.name).symlink_to(entry)
    with zipfile.ZipFile(lib / "pyspark.zip") as src, \
            zipfile.ZipFile(home / "python" / "lib" / "pyspark.zip", "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "pyspark/version.py":
                data = f'__version__: str = "{version}"\n'.encode()
            dst.writestr(item, data)
    return home


def test_executors_with_another_pyspark_are_one_clear_line(cluster, source, receiver,
                                                          tmp_path):
    import pyspark
    m = source
    (m.mnt / "otherspark").write_bytes(os.urandom(300_000))
    m.snapctl("create", "other1")
    cluster.kill_worker_host()
    cluster.start_worker(other_pyspark_home(cluster.home, tmp_path, "3.4.1"))
    try:
        res = replicate(m, cluster, receiver, "other1", "--stall-timeout", "60s")
    finally:
        cluster.kill_worker_host()
        cluster.start_worker()
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert f"runs pyspark 3.4.1 but this host runs {pyspark.__version__}" in res.stderr
    assert f"install pyspark=={pyspark.__version__}" in res.stderr, res.stderr
    assert "other1" not in mirror_snapshots(receiver) and staged_count(receiver.store) == 0
