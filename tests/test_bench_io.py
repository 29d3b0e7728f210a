"""scripts/bench_io.py, the issue-12 benchmark, as a user runs it: a run killed with SIGKILL
cannot unmount what it mounted; the next run must clear it, so that no store stays mounted
(a process holding its memory) under a work directory nobody owns any more."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, str(REPO / "scripts" / "bench_io.py"), "--quick", "--only", "small"]


def mountfs_mounts_under(path: Path) -> dict[Path, int | None]:
    """Each mountfs mountpoint under ``path`` -> the pid of the process serving it (None:
    a dead mount)."""
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo if "mountfs" in line.split(" - ")[1]]
    return {Path(point): serving(point) for point in points
            if point.startswith(str(path) + "/")}


def serving(point: str) -> int | None:
    """The pid of the mount process serving ``point`` (its command line names it)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--ready-fd" in argv and point.encode() in argv:
            return int(proc.name)
    return None


def wait_for(what, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what.__doc__ or what}")


@pytest.fixture
def workdir(tmp_path):
    """A --workdir; whatever stays mounted under it (the test failed) is unmounted after."""
    yield tmp_path
    for mnt in mountfs_mounts_under(tmp_path):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


@pytest.mark.fuse
def test_the_next_run_clears_what_a_killed_run_left(workdir):
    tmp_path = workdir
    killed = subprocess.Popen([*BENCH, "--workdir", str(tmp_path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        left = wait_for(lambda: mountfs_mounts_under(tmp_path))
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert mountfs_mounts_under(tmp_path) == left         # nobody cleared them: the case
    (workdir,) = [p for p in tmp_path.iterdir() if p.name.startswith("bench-io-")]

    after = subprocess.run([*BENCH, "--workdir", str(tmp_path)], capture_output=True,
                           text=True, timeout=600)

    assert after.returncode == 0, after.stderr
    assert f"bench_io: removed {workdir} and its 1 mount(s), left by a killed run " \
           f"(pid {killed.pid})" in after.stdout
    assert mountfs_mounts_under(tmp_path) == {}
    assert list(tmp_path.iterdir()) == []
    assert None not in left.values()
    for pid in left.values():               # unmounted, the mount's process exits
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or
                 Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                 timeout=60)


def test_a_run_does_not_touch_a_directory_it_cannot_attribute(tmp_path):
    """Another live run's directory, or one without a run's pid, stays."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_io
    mine = tmp_path / "bench-io-live"
    mine.mkdir()
    (mine / bench_io.RUN_PID).write_text(f"{os.getpid()}\n")
    foreign = tmp_path / "bench-io-foreign"
    foreign.mkdir()
    (foreign / "data").write_text("not a benchmark's")

    bench_io.remove_left_workdirs(tmp_path, "bench-io")

    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-io-foreign", "bench-io-live"]
    assert (foreign / "data").read_text() == "not a benchmark's"


@pytest.mark.parametrize("only", [[], ["--only", "git"], ["--only", "seq", "--only", "small"]])
def test_a_floor_that_keeps_nothing_is_refused_where_data_is_read_back(tmp_path, only):
    """--floor-discard measures writes; an untar, a git checkout or files read back on a
    floor that keeps no data would measure nothing real (git would fail on zeros)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_io.py"),
                           "--floor-discard", *only, "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "bench_io.py: error: --floor-discard goes with --only seq (and rand): a floor that "
        "keeps no data cannot hold an untarred tree, a git repository or files read back")
    assert not any(tmp_path.iterdir())


def test_the_stores_own_ingest_commits_every_value_and_leaves_nothing(tmp_path, monkeypatch):
    """``store_ingest``, the bound printed under the sequential figure, writes into a real
    store opened as the writer opens it, full chunks into the chunk file as the writer
    stores them: every value is committed (read back here before the store goes, through
    a wrapped ``Store.close``), and nothing is left behind."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_io
    from mountfs import chunkfile
    from mountfs.store import Store
    seen = {}
    close = Store.close

    def counting_close(store):
        with store.read() as txn:
            keys = [bytes(k) for table in ("blobs", "slots")
                    for k in txn.cursor(db=store.db[table]).iternext(values=False)]
            seen["values"] = [bytes(chunkfile.get(txn, store.db, k)) for k in keys]
            seen["in_slots"] = txn.stat(store.db["slots"])["entries"]
        close(store)

    monkeypatch.setattr(Store, "close", counting_close)
    figure = bench_io.store_ingest(tmp_path, 5 << 20, 1 << 20)
    assert figure["write_mbs"] > 0
    assert len(seen["values"]) == 5 and seen["in_slots"] == 5
    assert all(len(v) == 1 << 20 for v in seen["values"])
    assert len({v for v in seen["values"]}) == 5        # unique, as write_file's data
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--same-cpu needs two CPUs")
def test_same_cpu_puts_the_caller_with_the_filesystem_and_its_writer_elsewhere(monkeypatch):
    """--same-cpu: during a timed run the benchmark and every thread of the filesystem's
    process are on the first CPU it may use, the process's children (its writer) on the
    others; the benchmark gets its own CPUs back after the run."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_io
    mine = os.sched_getaffinity(0)
    first, others = {min(mine)}, mine - {min(mine)}
    monkeypatch.setattr(bench_io, "SAME_CPU", [mine])
    monkeypatch.setattr(bench_io, "kept", lambda measure, *args: measure(*args))
    # a "filesystem": two threads, and a child process with a thread of its own
    fs = subprocess.Popen([sys.executable, "-c", """
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c",
    "import threading, time; "
    "threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"])
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(child.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(fs.stdout.readline())
        wait_for(lambda: len(list(Path(f"/proc/{child}/task").iterdir())) == 2, timeout=10)
        seen = {}

        def measure():
            seen["self"] = os.sched_getaffinity(0)
            for pid in (fs.pid, child):
                seen[pid] = [os.sched_getaffinity(int(t.name))
                             for t in Path(f"/proc/{pid}/task").iterdir()]
            return {}

        bench_io.placed(measure, fs.pid)

        assert seen["self"] == first
        assert seen[fs.pid] == [first, first]
        assert seen[child] == [others, others]
        assert os.sched_getaffinity(0) == mine
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        fs.kill()
        fs.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="the benchmark's setup drops the page cache")
def test_the_timed_checkout_starts_from_an_index_with_no_racily_clean_entry(tmp_path):
    """git compares modification times in whole seconds and reads again every file modified
    in the second its index was written. The setup's checkout leaves the index written a
    second later than any file it wrote, so the timed checkout reads no file again: before,
    it re-read those the setup wrote in its last second, a random number."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_io
    work = type("Work", (), {"path": tmp_path})()
    repo, a, _ = bench_io.synthetic_repo(work, 300)
    (tmp_path / "root").mkdir()
    clone = bench_io.checkout_clone(repo, a, tmp_path / "root", None)
    listed = subprocess.run(["git", "-C", str(clone), "ls-files", "--debug"],
                            capture_output=True, text=True, check=True).stdout
    seconds = [int(s) for s in re.findall(r"^  mtime: (\d+):", listed, re.MULTILINE)]
    assert len(seconds) == int(subprocess.run(
        ["git", "-C", str(clone), "ls-files"], capture_output=True, text=True,
        check=True).stdout.count("\n"))
    index_second = int((clone / ".git" / "index").stat().st_mtime)
    assert max(seconds) < index_second
