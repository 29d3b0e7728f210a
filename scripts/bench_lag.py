#!/usr/bin/env python3
"""Replication lag under a steady trickle of writes, and the daemon's cost when idle (issue 5).

For DURATION seconds, every second: FILES small files and one file of MIB MiB are written and
closed in the mount while mountfsd (min_interval 1 s) replicates to a `mountfs serve-mirror`
receiver on loopback. A file's lag is the time from its close to the first mirror snapshot
that holds it (a source snapshot created after the close, seen on the mirror). Baseline, in
the same run: the same trickle into a plain directory copied by `rsync -a` in a loop (lag:
close to the end of the first pass that started after it). Then the daemon's CPU and memory
over IDLE seconds with nothing written.

    .venv/bin/python scripts/bench_lag.py [--duration 120] [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
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
    """Write the load; append (path, close time) for every file."""
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


def percentiles(lags: list[float]) -> dict:
    lags = sorted(lags)
    return {"count": len(lags), "p50": statistics.median(lags),
            "p95": lags[int(0.95 * (len(lags) - 1))], "max": lags[-1]}


def daemon_lags(work: Path, args) -> tuple[dict, int]:
    from replicator.client import HttpMirror
    store, mnt = work / "store", work / "mnt"
    mnt.mkdir()
    subprocess.run([BIN / "mountfs", "mkfs", store], check=True, capture_output=True)
    subprocess.run([BIN / "mountfs", "mount", store, mnt], check=True, capture_output=True)
    token = work / "token"
    token.write_text(TOKEN)
    port = free_port()
    receiver = subprocess.Popen([BIN / "mountfs", "serve-mirror", work / "mirror", "--listen",
                                 f"127.0.0.1:{port}", "--token-file", token],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    config = work / "lag.toml"
    config.write_text(f'[daemon]\nstate_dir = "{work}/state"\n[[filesystem]]\nname = "lag"\n'
                      f'mountpoint = "{mnt}"\nmin_interval = "1s"\n[[filesystem.mirror]]\n'
                      f'url = "{url}"\ntoken_file = "{token}"\n')
    daemon = subprocess.Popen([BIN / "mountfsd", "--config", config],
                              stdout=subprocess.DEVNULL, stderr=open(work / "daemon.log", "w"))
    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                mirror = HttpMirror(url, TOKEN)
                for s in mirror.info()["snapshots"]:
                    seen.setdefault(s["name"], time.time())
                mirror.close()
            except Exception:
                pass
            time.sleep(0.1)
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        time.sleep(15)                               # the daemon's Spark session starts
        watcher.start()
        closes: list = []
        trickle(mnt, args.duration, args.files, args.mib, closes)
        deadline = time.time() + 120
        last_close = closes[-1][1]
        while time.time() < deadline and not any(t >= last_close for t in _created(mnt, seen)):
            time.sleep(0.5)
        time.sleep(2)
        stop.set()
        snaps = _snapshots(mnt)
        lags = []
        for name, closed in closes:
            holders = [seen[s] for s, created in snaps if created >= closed and s in seen]
            if holders:
                lags.append(min(holders) - closed)
        result = percentiles(lags)
        result["files"] = len(closes)
        idle = idle_cost(daemon.pid, args.idle)
        result["idle"] = idle
        return result, daemon.pid
    finally:
        stop.set()
        daemon.terminate()
        daemon.wait(timeout=90)
        receiver.terminate()
        receiver.wait(timeout=60)
        subprocess.run([BIN / "mountfs", "umount", mnt], capture_output=True)


def _snapshots(mnt: Path) -> list[tuple[str, float]]:
    out = subprocess.run([BIN / "snapctl", "-m", mnt, "list", "--json"], check=True,
                         capture_output=True, text=True).stdout
    return [(d["name"], d["created_ns"] / 1e9) for d in map(json.loads, out.splitlines())]


def _created(mnt: Path, seen: dict) -> list[float]:
    return [created for name, created in _snapshots(mnt) if name in seen]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and all its descendants (the Spark JVM included)."""
    total, todo = 0.0, [pid]
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
        todo.extend(children.get(p, []))
    return total


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def idle_cost(pid: int, seconds: float) -> dict:
    time.sleep(5)
    a, t = cpu_seconds(pid), time.time()
    time.sleep(seconds)
    used = cpu_seconds(pid) - a
    return {"seconds": seconds, "cpu_percent": 100 * used / (time.time() - t),
            "rss_mib_daemon": rss_mib(pid)}


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
    last = closes[-1][1]
    while not any(start >= last for start, _ in passes):
        time.sleep(0.2)
    stop.set()
    syncer.join()
    lags = [min(end for start, end in passes if start >= closed) - closed
            for _, closed in closes]
    return percentiles(lags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120)
    ap.add_argument("--files", type=int, default=50)
    ap.add_argument("--mib", type=int, default=5)
    ap.add_argument("--idle", type=float, default=60)
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--quick", action="store_true", help="20 s of load, 15 s idle")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.idle = 20, 15
    work = Path(tempfile.mkdtemp(prefix="bench-lag-", dir=args.workdir))
    try:
        mine, _ = daemon_lags(work, args)
        base = rsync_lags(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"trickle: {args.files} files of 1 KiB + {args.mib} MiB per second for "
          f"{args.duration:.0f} s ({mine['files']} files)")
    print(f"{'lag (s)':<8} {'mountfsd':>9} {'rsync loop':>11} {'ratio':>7}  target")
    for key, target in (("p50", 5), ("p95", 15), ("max", None)):
        ok = "" if target is None else (" PASS" if mine[key] < target else " MISS")
        print(f"{key:<8} {mine[key]:>9.2f} {base[key]:>11.2f} {base[key] / mine[key]:>7.2f}  "
              f"{'< ' + str(target) + ' s' if target else ''}{ok}")
    idle = mine["idle"]
    print(f"idle for {idle['seconds']:.0f} s: daemon + Spark JVM CPU {idle['cpu_percent']:.2f}% "
          f"of one core; daemon RSS {idle['rss_mib_daemon']:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"mountfsd": mine, "rsync": base}, indent=1))


if __name__ == "__main__":
    main()
