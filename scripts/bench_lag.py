#!/usr/bin/env python3
"""Replication lag under a steady trickle of writes, and the daemon's cost when idle (issue 5).

For DURATION seconds, every second: FILES small files of 1 KiB and one file of MIB MiB are
written and closed in the mount while mountfsd (min_interval 1 s) replicates to a
`mountfs serve-mirror` receiver on loopback. A file's lag is the time from its close to the
moment the first mirror snapshot holding it (a source snapshot created after the close) is
seen on the mirror. Baseline, in the same run: the same trickle into a plain directory copied
by `rsync -a` in a loop (lag: close to the end of the first pass that started after it). Then
the daemon's CPU and memory over IDLE seconds with nothing written, for the daemon alone and
with its child processes (the Spark JVM and its Python workers, once a cycle has used Spark).

    .venv/bin/python scripts/bench_lag.py [--duration 120] [--quick] [--spark-threshold N]
                                          [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TOP = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TOKEN = "bench-token-0123456789abcdef"
sys.path.insert(0, str(TOP))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trickle(root: Path, seconds: float, files: int, mib: int, closes: list) -> None:
    """Write the load, one batch a second; append (name, close time) for every file."""
    end, n = time.time() + seconds, 0
    while time.time() < end:
        tick = time.time()
        for _ in range(files):
            p = root / f"small{n:07d}"
            p.write_bytes(os.urandom(1024))
            closes.append((p.name, time.time()))
            n += 1
        p = root / f"big{n:07d}"
        p.write_bytes(os.urandom(mib << 20))
        closes.append((p.name, time.time()))
        n += 1
        time.sleep(max(0.0, 1.0 - (time.time() - tick)))


def percentiles(values: list[float]) -> dict:
    values = sorted(values)
    return {"count": len(values), "p50": statistics.median(values),
            "p95": values[int(0.95 * (len(values) - 1))], "max": values[-1]}


class MirrorWatch:
    """Polls the receiver every 0.1 s and records when each mirror snapshot first appears."""

    def __init__(self, url: str):
        self.url, self.seen, self.errors = url, {}, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from replicator.client import HttpMirror
        while not self.stop.is_set():
            try:
                mirror = HttpMirror(self.url, TOKEN)
                try:
                    for s in mirror.info()["snapshots"]:
                        self.seen.setdefault(s["name"], time.time())
                finally:
                    mirror.close()
            except Exception:                        # receiver not up yet, or busy
                self.errors += 1
            time.sleep(0.1)

    def wait_for(self, mnt: Path, closed: float, timeout: float) -> bool:
        """Wait until a mirror snapshot created after ``closed`` has been seen."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(c >= closed for n, c in snapshots(mnt) if n in self.seen):
                return True
            time.sleep(0.5)
        return False


def snapshots(mnt: Path) -> list[tuple[str, float]]:
    """(name, creation time in s) of the source's snapshots."""
    out = subprocess.run([BIN / "snapctl", "-m", mnt, "list", "--json"], check=True,
                         capture_output=True, text=True).stdout
    return [(d["name"], d["created_ns"] / 1e9) for d in map(json.loads, out.splitlines())]


def file_lags(closes: list, snaps: list, seen: dict) -> list[float]:
    """Per file: first appearance on the mirror of a snapshot created after its close."""
    lags = []
    for _, closed in closes:
        holders = [seen[s] for s, created in snaps if created >= closed and s in seen]
        if holders:
            lags.append(min(holders) - closed)
    return lags


def start_daemon(work: Path, mnt: Path, url: str, token: Path, threshold: int | None):
    extra = "" if threshold is None else f"spark_threshold = {threshold}\n"
    config = work / "lag.toml"
    config.write_text(f'[daemon]\nstate_dir = "{work}/state"\n[[filesystem]]\nname = "lag"\n'
                      f'mountpoint = "{mnt}"\nmin_interval = "1s"\n{extra}'
                      f'[[filesystem.mirror]]\nurl = "{url}"\ntoken_file = "{token}"\n')
    return subprocess.Popen([BIN / "mountfsd", "-v", "--config", config],
                            stdout=subprocess.DEVNULL, stderr=open(work / "daemon.log", "w"))


def cycle_seconds(log: Path) -> list[float]:
    """Durations of the daemon's replication cycles (diff, chunks, commit) from its log."""
    pattern = re.compile(r"-> \S+: replicated .* ([0-9.]+) s$")
    return [float(m.group(1)) for line in log.read_text().splitlines()
            if (m := pattern.search(line))]


def daemon_lags(work: Path, args) -> dict:
    store, mnt = work / "store", work / "mnt"
    mnt.mkdir()
    subprocess.run([BIN / "mountfs", "mkfs", store], check=True, capture_output=True)
    subprocess.run([BIN / "mountfs", "mount", store, mnt], check=True, capture_output=True)
    token = work / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)                        # serve-mirror refuses a token others can read
    url = f"http://127.0.0.1:{free_port()}"
    receiver = subprocess.Popen([BIN / "mountfs", "serve-mirror", work / "mirror", "--listen",
                                 url.split("//")[1], "--token-file", token],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemon = start_daemon(work, mnt, url, token, args.spark_threshold)
    watch = MirrorWatch(url)
    try:
        warm = mnt / "warm-up"                       # first cycle: full copy, Spark start
        warm.write_bytes(os.urandom(args.mib << 20))
        if not watch.wait_for(mnt, time.time(), 180):
            tail = (work / "daemon.log").read_text().splitlines()[-10:]
            raise SystemExit("the warm-up never reached the mirror; daemon log:\n"
                             + "\n".join(tail))
        cycles_before = len(cycle_seconds(work / "daemon.log"))
        closes: list = []
        started = time.time()
        trickle(mnt, args.duration, args.files, args.mib, closes)
        written = time.time() - started
        if not watch.wait_for(mnt, closes[-1][1], 180):
            print("warning: the mirror did not catch up within 180 s", file=sys.stderr)
        time.sleep(1)
        watch.stop.set()
        result = percentiles(file_lags(closes, snapshots(mnt), watch.seen))
        result["files"] = len(closes)
        result["rate_files_s"] = len(closes) / written
        result["cycles"] = percentiles(cycle_seconds(work / "daemon.log")[cycles_before:])
        result["idle"] = idle_cost(daemon.pid, args.idle)
        return result
    finally:
        watch.stop.set()
        daemon.terminate()
        daemon.wait(timeout=90)
        receiver.terminate()
        receiver.wait(timeout=60)
        subprocess.run([BIN / "mountfs", "umount", mnt], capture_output=True)


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def cpu_seconds(pid: int) -> float:
    """utime + stime + the reaped children's cutime + cstime of one process."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def idle_cost(pid: int, seconds: float) -> dict:
    """CPU (% of one core) and RSS of the daemon, alone and with its descendants."""
    time.sleep(5)
    tree = process_tree(pid)
    alone, total, t = cpu_seconds(pid), sum(map(cpu_seconds, tree)), time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t
    tree_after = process_tree(pid)
    return {"seconds": seconds, "children": len(tree_after) - 1,
            "cpu_percent_daemon": 100 * (cpu_seconds(pid) - alone) / elapsed,
            "cpu_percent_tree": 100 * (sum(map(cpu_seconds, tree_after)) - total) / elapsed,
            "rss_mib_daemon": rss_mib(pid),
            "rss_mib_tree": sum(map(rss_mib, tree_after))}


def rsync_lags(work: Path, args) -> dict:
    src, dst = work / "plain-src", work / "plain-dst"
    src.mkdir()
    dst.mkdir()
    passes: list[tuple[float, float]] = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            start = time.time()
            subprocess.run(["rsync", "-a", f"{src}/", f"{dst}/"], capture_output=True)
            passes.append((start, time.time()))
    syncer = threading.Thread(target=loop, daemon=True)
    syncer.start()
    closes: list = []
    trickle(src, args.duration, args.files, args.mib, closes)
    while not any(start >= closes[-1][1] for start, _ in passes):
        time.sleep(0.2)
    stop.set()
    syncer.join()
    result = percentiles([min(end for start, end in passes if start >= closed) - closed
                          for _, closed in closes])
    result["passes"] = percentiles([end - start for start, end in passes])
    return result


def report(args, mine: dict, base: dict) -> None:
    print(f"trickle: {args.files} files of 1 KiB + {args.mib} MiB per second for "
          f"{args.duration:.0f} s ({mine['files']} files, {mine['rate_files_s']:.1f} files/s "
          f"achieved); spark_threshold "
          f"{'default' if args.spark_threshold is None else args.spark_threshold}")
    print(f"{'lag (s)':<8} {'mountfsd':>9} {'rsync loop':>11} {'x rsync':>8}  target")
    for key, target in (("p50", 5), ("p95", 15), ("max", None)):
        verdict = "" if target is None else \
            f"< {target} s {'PASS' if mine[key] < target else 'MISS'}"
        print(f"{key:<8} {mine[key]:>9.2f} {base[key]:>11.2f} "
              f"{mine[key] / base[key]:>8.1f}  {verdict}")
    print(f"files held by the mirror: {mine['count']} of {mine['files']}")
    c, r = mine["cycles"], base["passes"]
    print(f"daemon cycles: {c['count']}, p50 {c['p50']:.2f} s, max {c['max']:.2f} s; "
          f"rsync passes: {r['count']}, p50 {r['p50']:.2f} s, max {r['max']:.2f} s")
    i = mine["idle"]
    print(f"idle for {i['seconds']:.0f} s: CPU {i['cpu_percent_daemon']:.2f}% of one core "
          f"(daemon), {i['cpu_percent_tree']:.2f}% (with its {i['children']} child processes); "
          f"RSS {i['rss_mib_daemon']:.0f} MiB (daemon), {i['rss_mib_tree']:.0f} MiB (with them)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120, help="seconds of trickle")
    ap.add_argument("--files", type=int, default=50, help="small files per second")
    ap.add_argument("--mib", type=int, default=5, help="MiB of the big file per second")
    ap.add_argument("--idle", type=float, default=60, help="seconds of idle measurement")
    ap.add_argument("--spark-threshold", type=int,
                    help="the daemon's spark_threshold in bytes (0: every cycle uses Spark; "
                         "default: the daemon's default)")
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--quick", action="store_true", help="20 s of trickle, 15 s idle")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.idle = 20, 15
    work = Path(tempfile.mkdtemp(prefix="bench-lag-", dir=args.workdir))
    try:
        mine = daemon_lags(work, args)
        base = rsync_lags(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, mine, base)
    if args.json:
        Path(args.json).write_text(json.dumps({"mountfsd": mine, "rsync": base,
                                               "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
