#!/usr/bin/env python3
"""Benchmarks of issues 2 and 12: everyday work through a mountfs mount against a plain
directory on the same disk and against the floor (scripts/nullfs.py, a do-nothing pyfuse3+trio
filesystem), in the same run, printed as ratios: untar of the Python stdlib, a git checkout
between two distant commits, 10,000 small files, 1 GiB sequential I/O, random 4 KiB IOPS (fio);
snapshot creation latency at two store sizes; and a chunk-size sweep. With --durable-floor,
each of those figures is also measured on scripts/durable_floor.py, the floor plus the least
durability costs in this stack, so that the distance to the mount splits into that cost and
what mountfs does beyond it.

    .venv/bin/python scripts/bench_io.py            # the issue's figures (1 GiB, 10,000 files...)
    .venv/bin/python scripts/bench_io.py --quick    # a smoke run (seconds)

Needs root (it drops the page cache between writing and reading) and FUSE. It uses the
installed command lines (.venv/bin/mountfs, .venv/bin/snapctl) on a temporary store and
mountpoint under --workdir, next to the plain baseline directory, and unmounts and removes
everything at the end, also on an error or Ctrl-C. On a VM that reports free pages to its
host, each timed run suspends that reporting and restores it after (``pages_kept``). What a
run killed with SIGKILL left, the next run clears first: kernel parameters it changed
(``restore_kernel_knobs``), its work directory and the stores still mounted there
(``remove_left_workdirs``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
sys.path.insert(0, str(REPO))

MiB = 1 << 20
TARGETS = {"throughput_ratio": 0.40, "small_ops": 3000, "snapshot_ms": 20.0}


# ---- shared helpers (bench_diff.py uses them too) ------------------------------------------

def parse_size(text: str) -> int:
    """'64K', '1M', '4G' or a number of bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    """Run a command, failing loudly with its output."""
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({res.returncode}): "
                           f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def drop_caches() -> None:
    """Write back and drop the page cache, dentries and inodes (root only)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class Workdir:
    """A temporary directory on a real disk holding the stores, the mountpoints and the
    baseline directory. On exit (also on Ctrl-C or SIGTERM) every mount made through it is
    unmounted and the directory removed. A run killed with SIGKILL cannot do that: its
    directory names its run (RUN_PID), and the next run with the same ``prefix`` and
    ``base`` removes it, mounts and all, first (``remove_left_workdirs``)."""

    def __init__(self, base: str, prefix: str):
        fstype = run("stat", "-f", "-c", "%T", base).stdout.strip()
        if fstype in ("tmpfs", "ramfs"):
            raise SystemExit(f"{base} is {fstype}: choose a --workdir on a real disk")
        remove_left_workdirs(Path(base), prefix)
        self.path = Path(tempfile.mkdtemp(prefix=prefix + "-", dir=base))
        (self.path / RUN_PID).write_text(f"{os.getpid()}\n")
        self.mounts: list[Path] = []

    def __enter__(self) -> "Workdir":
        signal.signal(signal.SIGTERM, _raise_interrupt)
        signal.signal(signal.SIGHUP, _raise_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        for mnt in reversed(self.mounts):
            _unmount(mnt)
        shutil.rmtree(self.path, ignore_errors=True)


RUN_PID = "run.pid"     # in a work directory: the pid of the run that made it


def remove_left_workdirs(base: Path, prefix: str) -> None:
    """Unmount and remove the work directories (``prefix``-*) that runs killed with SIGKILL
    left under ``base``, and say so. Their mounts' processes still run, each holding a
    store and its memory; unmounted, they exit. A directory without RUN_PID, or whose run
    still runs, is not ours to touch."""
    for path in sorted(base.glob(f"{prefix}-*")):
        try:
            pid = int((path / RUN_PID).read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        left = _mounts_under(path)
        for mnt in left:
            _unmount(mnt)
        shutil.rmtree(path, ignore_errors=True)
        print(f"bench_io: removed {path} and its {len(left)} mount(s), left by a killed run "
              f"(pid {pid})")


def _mounts_under(path: Path) -> list[Path]:
    """The mountpoints at or under ``path``, deepest first (/proc/self/mountinfo's fifth
    field, whose spaces, tabs, newlines and backslashes are octal escapes)."""
    top = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                           line.split()[4])
            if point == top or point.startswith(top + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unmount(mnt: Path) -> None:
    """``mountfs umount`` (which also detaches a dead mount), else a lazy fusermount3 (the
    floor, or a mount that will not go)."""
    if subprocess.run([VENV_BIN / "mountfs", "umount", mnt],
                      capture_output=True).returncode != 0:
        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def mount(work: Workdir, store: Path, mnt: Path) -> None:
    run(VENV_BIN / "mountfs", "mount", store, mnt)
    work.mounts.append(mnt)


def umount(work: Workdir, mnt: Path) -> None:
    run(VENV_BIN / "mountfs", "umount", mnt)
    work.mounts.remove(mnt)


def mkfs(store: Path, chunk_size: str = "1M") -> None:
    run(VENV_BIN / "mountfs", "mkfs", "--chunk-size", chunk_size, store)


def machine_info(path: Path) -> str:
    """What the figures were measured on (for docs/benchmarks.md)."""
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    df = run("df", "-T", path).stdout.splitlines()[-1].split()
    return (f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
            f"{os.cpu_count()} CPUs ({cpu}), {mem_gib:.0f} GiB RAM; disk {df[0]} ({df[1]}); "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


class Results:
    """Figures collected for --json."""

    def __init__(self, name: str, args: dict):
        self.data = {"benchmark": name, "args": args, "results": {}}

    def add(self, key: str, value) -> None:
        self.data["results"][key] = value

    def write(self, path: str) -> None:
        self.data["machine"] = machine_info(Path(path).resolve().parent)
        Path(path).write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"


# ---- sequential I/O --------------------------------------------------------------------------

def write_file(path: Path, size: int, block: int) -> float:
    """Seconds to write ``size`` bytes in ``block``-sized writes, fsync and close. Each 4 KiB
    of the data is unique, so the store's content addressing cannot deduplicate any chunk."""
    buf = bytearray(os.urandom(block))
    stamps = range(0, block, 4096)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for n in range(size // block):
            for off in stamps:
                struct.pack_into("<Q", buf, off, (n * block + off) // 4096)
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def read_file(path: Path, block: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, block):
            total += len(chunk)
    finally:
        os.close(fd)
    return time.perf_counter() - t0, total


def seq_pair(work: Workdir, target: Path, size: int, block: int, remount=None) -> dict:
    """Write then read one file at ``target``: MB/s each. The page cache is dropped in
    between (and the mount remounted, when ``remount`` is given, so nothing is cached in the
    mount process either)."""
    w = write_file(target, size, block)
    if remount:
        remount()
    drop_caches()
    r, got = read_file(target, block)
    if got != size:
        raise RuntimeError(f"read {got} bytes of {target}, wrote {size}")
    os.unlink(target)
    return {"write_mbs": size / w / 1e6, "read_mbs": size / r / 1e6}


PAGE_REPORTING = Path("/sys/module/page_reporting/parameters/page_reporting_order")


def _read(path: Path) -> str | None:
    """A kernel parameter's value; None where the kernel has no such parameter."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


# Kernel parameters a run changed, with their values before: a run killed with SIGKILL
# cannot restore them, so the next run does (``restore_kernel_knobs``) before it measures.
KNOBS_CHANGED = Path("/run/mountfs-bench-io-knobs.json")


def _knobs_changed() -> dict:
    try:
        knobs = json.loads(KNOBS_CHANGED.read_text())
    except (OSError, ValueError):
        return {}
    return knobs if isinstance(knobs, dict) else {}


def _note_knobs(knobs: dict) -> None:
    if knobs:
        KNOBS_CHANGED.write_text(json.dumps(knobs))
    else:
        KNOBS_CHANGED.unlink(missing_ok=True)


@contextlib.contextmanager
def kernel_knob(path: Path, value: str):
    """``path`` (a kernel parameter) set to ``value`` inside this block, then restored;
    nothing where the kernel has no such parameter. Its value before is noted in
    KNOBS_CHANGED while the block runs."""
    before = _read(path)
    if before is None:
        yield
        return
    knobs = _knobs_changed()
    knobs.setdefault(str(path), {"value": before, "pid": os.getpid()})
    _note_knobs(knobs)
    path.write_text(f"{value}\n")
    try:
        yield
    finally:
        path.write_text(f"{before}\n")
        knobs = _knobs_changed()
        knobs.pop(str(path), None)
        _note_knobs(knobs)


def restore_kernel_knobs() -> None:
    """Put back what a run killed before it could restore left changed (KNOBS_CHANGED),
    and say so: that run's figures are lost, and this one measures the machine as
    configured. While another run still has one changed, this one does not start: it
    would measure that run's machine, and restore its values."""
    knobs = _knobs_changed()
    for name, left in list(knobs.items()):
        value, pid = _left_by(left)
        if name not in (str(PAGE_REPORTING), str(HALT_POLL_NS)) or pid is None:
            print(f"bench_io: ignored {KNOBS_CHANGED}'s entry {name!r}: not a parameter "
                  f"this benchmark sets with its value and run")
        elif _alive(pid):
            raise SystemExit(f"bench_io: another run (pid {pid}) has {name} changed; wait "
                             f"for it to end, or kill it and start again")
        else:
            Path(name).write_text(f"{value}\n")
            print(f"bench_io: restored {name} to {value} (a killed run had left it changed)")
        del knobs[name]
    _note_knobs(knobs)


def _left_by(entry) -> tuple[str | None, int | None]:
    """(the value before, the run's pid) of a KNOBS_CHANGED entry; (None, None) if it is
    not one ``kernel_knob`` wrote (a number and a pid)."""
    try:
        value, pid = str(entry["value"]), int(entry["pid"])
    except (TypeError, KeyError, ValueError):
        return None, None
    return (value, pid) if value.isdigit() and pid > 0 else (None, None)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a run killed with SIGKILL stays a zombie until its
    parent reaps it, which may be never."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@contextlib.contextmanager
def pages_kept(nbytes: int = 3 << 30):
    """Pages freed inside this block stay the VM's; ``nbytes`` of them are made so first.
    Every timed run of a three-way figure is made inside one.

    On a VM with free page reporting (virtio-balloon feature bit 5: this benchmark's
    machine), free pages go back to the host within seconds, and filling the page cache
    with them is slow: a cold 1 GiB read from a plain directory made 539-705 MB/s in pages
    reported back, 1,840-1,926 in pages kept (docs/benchmarks.md, twentieth round). Which
    ones a run gets depends on what was freed how long before (drop_caches frees gigabytes),
    so each figure moved with the run. Here reporting is suspended (an order above the
    largest; restored on exit) and ``nbytes`` of memory filled and freed, so that every
    run of every side fills pages the VM has. Without reporting, only the filling happens."""
    with kernel_knob(PAGE_REPORTING, "11"):    # MAX_PAGE_ORDER + 1: nothing is reported
        with open("/proc/meminfo") as meminfo:
            avail = next(int(line.split()[1]) << 10 for line in meminfo
                         if line.startswith("MemAvailable:"))
        buf = bytearray(min(nbytes, avail // 2))    # zero-filled: every page touched
        del buf
        yield


def kept(measure, *args) -> dict:
    """``measure(*args)`` in pages the VM keeps (``pages_kept``)."""
    with pages_kept():
        return measure(*args)


HALT_POLL_NS = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


@contextlib.contextmanager
def halt_polling(ns: int | None):
    """With ``ns``, an idle CPU of this VM guest polls that long before it halts (a halt is
    a VM exit, and waking the CPU again another): restored on exit. On this benchmark's
    machine the kernel's command line sets 0, and every FUSE request that wakes the
    filesystem's thread on the other CPU pays for both; docs/benchmarks.md, twentieth
    round."""
    if ns is None:
        yield
        return
    if _read(HALT_POLL_NS) is None:
        raise SystemExit(f"--guest-halt-poll-ns: {HALT_POLL_NS} is missing (not a VM guest "
                         f"with the haltpoll idle driver); run without it")
    with kernel_knob(HALT_POLL_NS, str(ns)):
        yield


SAME_CPU: list[set[int]] = []     # with --same-cpu: the CPUs it may use (``co_locate``)


def co_locate(pid: int | None) -> None:
    """With --same-cpu: this process and every thread of filesystem process ``pid`` (None:
    a plain directory) on the first CPU it may use, that process's children (the writers)
    on the others. A FUSE request then hands the CPU over between the caller and the
    filesystem's thread instead of waking the other CPU; on this benchmark's VM a wake-up
    of a halted CPU is a VM exit, and where the scheduler puts the two decides how many a
    run pays (docs/benchmarks.md, twentieth and thirty-seventh rounds). No filesystem can
    choose this for its callers: it measures the floor and the mount without it."""
    if not SAME_CPU:
        return
    first = {min(SAME_CPU[0])}
    others = SAME_CPU[0] - first
    os.sched_setaffinity(0, first)
    if pid is None:
        return
    children = set()
    for task in _tasks(pid):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):   # ended meanwhile
            os.sched_setaffinity(int(task.name), first)
            children.update(int(c) for c in (task / "children").read_text().split())
    for child in children:
        for task in _tasks(child):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task.name), others)


def _tasks(pid: int) -> list[Path]:
    """The threads of process ``pid`` (none once it has exited)."""
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []


def placed(measure, pid: int | None, *args) -> dict:
    """``kept(measure, *args)``, co-located with filesystem process ``pid`` under
    --same-cpu (``co_locate``); this process's own CPUs back after."""
    cpus = os.sched_getaffinity(0)
    try:
        co_locate(pid)
        return kept(measure, *args)
    finally:
        os.sched_setaffinity(0, cpus)


class MountedStore:
    """A fresh store mounted in the work directory."""

    def __init__(self, work: Workdir, name: str, chunk_size: str = "1M", store: Path = None):
        self.work = work
        self.store = store or work.path / f"{name}.store"
        self.mnt = work.path / f"{name}.mnt"
        if store is None:
            mkfs(self.store, chunk_size)
        self.mnt.mkdir()
        mount(work, self.store, self.mnt)

    def remount(self) -> None:
        umount(self.work, self.mnt)
        mount(self.work, self.store, self.mnt)

    def pid(self) -> int:
        return int((self.store / "lock").read_text().split()[1])

    def close(self) -> None:
        umount(self.work, self.mnt)
        self.mnt.rmdir()
        shutil.rmtree(self.store)


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def seq_compare(work: Workdir, size: int, block: int, repeat: int,
                chunk_size: str = "1M") -> tuple[dict, dict]:
    """Median MB/s over ``repeat`` runs, alternating the plain directory and a fresh store
    (so that load from elsewhere on the machine hits both alike)."""
    plain = work.path / "plain"
    plain.mkdir(exist_ok=True)
    base, mnt = [], []
    for _ in range(repeat):
        base.append(kept(seq_pair, work, plain / "big", size, block))
        m = MountedStore(work, f"seq{chunk_size}", chunk_size=chunk_size)
        try:
            mnt.append(kept(seq_pair, work, m.mnt / "big", size, block, m.remount))
        finally:
            m.close()
    return medians(mnt), medians(base)


# ---- small files -----------------------------------------------------------------------------

def small_files(root: Path, count: int, size: int, remount=None) -> dict:
    """ops/s of creating (with ``size`` bytes of content), stat-ing (warm, then with the
    kernel's caches dropped) and deleting ``count`` files in one directory; of reading each
    whole, twice, the second timed (open, read, close: what a build pays for the headers
    it reopens; the data is cached only if the filesystem lets the kernel keep it across
    opens); and of stat-ing ``count`` names that do not exist, a second time (what a
    program probing for missing files pays on each run: likewise)."""
    d = root / "small"
    d.mkdir()
    names = [d / f"f{i:06d}" for i in range(count)]
    data = os.urandom(size)
    t0 = time.perf_counter()
    for p in names:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.close(fd)
    create = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in names:
        os.stat(p)
    stat_warm = time.perf_counter() - t0
    for _ in range(2):
        t0 = time.perf_counter()
        for p in names:
            with open(p, "rb") as f:
                if len(f.read()) != size:
                    raise RuntimeError(f"{p} reads short")
        reread = time.perf_counter() - t0
    if remount:
        remount()
    drop_caches()
    t0 = time.perf_counter()
    for p in names:
        if os.stat(p).st_size != size:
            raise RuntimeError(f"{p} has the wrong size")
    stat_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in names:
        os.unlink(p)
    delete = time.perf_counter() - t0
    for _ in range(2):
        t0 = time.perf_counter()
        for p in names:
            if os.path.lexists(p):
                raise RuntimeError(f"{p} is still there")
        stat_missing = time.perf_counter() - t0
    d.rmdir()
    return {k: count / v for k, v in (("create", create), ("stat_warm", stat_warm),
                                      ("reread", reread), ("stat_cold", stat_cold),
                                      ("delete", delete),
                                      ("stat_missing", stat_missing))}


# ---- snapshot creation -----------------------------------------------------------------------

def _percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]


def snapshot_latency(m: MountedStore, creates: int) -> dict:
    """ms per snapshot: through the `snapctl create` command (process start-up included), and
    as the request snapctl sends (syncfs + the control-socket round trip). One small file is
    written before each, so every snapshot has something in it."""
    from mountfs import control
    from mountfs.snapctl import syncfs
    cli, req = [], []
    for i in range(creates * 2):
        (m.mnt / f"between{i}").write_bytes(b"x" * 100)
        t0 = time.perf_counter()
        if i % 2 == 0:
            run(VENV_BIN / "snapctl", "-m", m.mnt, "create", f"cli{i}")
            cli.append(time.perf_counter() - t0)
        else:
            syncfs(str(m.mnt), str(m.store))
            control.request(m.store, {"op": "create", "name": f"req{i}"})
            req.append(time.perf_counter() - t0)
    return {f"{name}_{stat}_ms": fn(vals) * 1e3 for name, vals in (("cli", cli), ("req", req))
            for stat, fn in (("median", statistics.median),
                             ("p95", lambda v: _percentile(v, 0.95)))}


def cp_baseline(work: Workdir, nfiles: int, ndirs: int) -> float:
    """ms of `cp -a` of a plain tree like the smaller store (the copy a snapshot avoids)."""
    src = work.path / "plain-tree"
    for d in range(ndirs):
        (src / f"dir{d:04d}").mkdir(parents=True)
    for i in range(nfiles):
        (src / f"dir{i % ndirs:04d}" / f"file{i:07d}").write_bytes(b"content %d\n" % i)
    drop_caches()
    t0 = time.perf_counter()
    run("cp", "-a", src, work.path / "plain-tree-copy")
    took = time.perf_counter() - t0
    shutil.rmtree(src)
    shutil.rmtree(work.path / "plain-tree-copy")
    return took * 1e3


def bench_snapshots(work: Workdir, sizes: list[int], creates: int, res: Results) -> None:
    from bench_diff import build_tree
    out = {}
    for n in sizes:
        store = work.path / f"snap{n}.store"
        build_tree(store, n, max(1, min(1000, n // 100)), progress=False)
        m = MountedStore(work, f"snap{n}", store=store)
        try:
            out[n] = snapshot_latency(m, creates)
        finally:
            m.close()
    t0 = time.perf_counter()
    run(VENV_BIN / "snapctl", "--help")
    startup = (time.perf_counter() - t0) * 1e3
    cp_ms = cp_baseline(work, sizes[0], max(1, min(1000, sizes[0] // 100)))
    small, big = out[sizes[0]], out[sizes[-1]]
    rows = []
    for key, label, limit in (("req_median_ms", "request median", 20),
                              ("req_p95_ms", "request p95", 20),
                              ("cli_median_ms", "snapctl create median", 100),
                              ("cli_p95_ms", "snapctl create p95", 100)):
        rows.append([label, f"{small[key]:.1f}", f"{big[key]:.1f}",
                     f"{big[key] / small[key]:.2f}",
                     verdict(max(small[key], big[key]) <= limit) + f" (<= {limit} ms)"])
    res.add("snapshot_create", {"by_files": out, "cp_a_ms": cp_ms, "snapctl_help_ms": startup})
    print_table(f"snapshot create latency over {creates} creates each (ms; 'request' is what "
                f"snapctl does after its start-up: syncfs + the control request)",
                ["figure", f"{sizes[0]:,} files", f"{sizes[-1]:,} files",
                 f"{sizes[-1] // sizes[0]}x/1x",
                 "target (request: issue 2; command: issue 12)"], rows)
    print(f"baselines: there is no snapshot of a plain directory; `cp -a` of the "
          f"{sizes[0]:,}-file tree (cold cache) takes {cp_ms:.0f} ms; `snapctl --help` "
          f"(start-up alone) takes {startup:.0f} ms")


# ---- chunk-size sweep ------------------------------------------------------------------------

def bench_sweep(work: Workdir, chunk_sizes: list[str], size: int, block: int, repeat: int,
                res: Results) -> None:
    """Each chunk size against its own plain-directory runs, interleaved."""
    rows, out = [], {}
    for cs in chunk_sizes:
        fig, base = seq_compare(work, size, block, repeat, chunk_size=cs)
        out[cs] = {"mount": fig, "plain": base}
        rows.append([cs, f"{fig['write_mbs']:.0f}", f"{base['write_mbs']:.0f}",
                     f"{fig['write_mbs'] / base['write_mbs']:.0%}", f"{fig['read_mbs']:.0f}",
                     f"{base['read_mbs']:.0f}", f"{fig['read_mbs'] / base['read_mbs']:.0%}"])
    res.add("chunk_size_sweep", out)
    print_table(f"chunk-size sweep: {size // MiB} MiB sequential write (with fsync) and cold "
                f"read, {block // 1024} KiB blocks, median of {repeat}",
                ["chunk size", "write MB/s", "plain", "ratio", "read MB/s", "plain", "ratio"],
                rows)


# ---- the three targets: plain directory, the do-nothing pyfuse3 floor, the mount ----------

class Floor:
    """scripts/nullfs.py mounted in the work directory: a pyfuse3+trio filesystem that keeps
    names in dicts and data in memory, with the same kernel-side options as mountfs. With
    ``durable``, scripts/durable_floor.py: the same, and every change also committed to an
    LMDB store by a writer process, in group commits (the least durability costs)."""

    def __init__(self, work: Workdir, name: str = "floor", durable: bool = False):
        self.work = work
        self.mnt = work.path / f"{name}.mnt"
        self.mnt.mkdir()
        self.store = work.path / f"{name}.store" if durable else None
        script = "durable_floor.py" if durable else "nullfs.py"
        extra = [str(self.store)] if durable else DISCARDING
        self.proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / script),
                                      str(self.mnt), *extra, *FLOOR_OPTIONS])
        for _ in range(500):
            if os.path.ismount(self.mnt):
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"scripts/{script} did not start")
            time.sleep(0.02)
        work.mounts.append(self.mnt)

    def close(self) -> None:
        run("fusermount3", "-u", self.mnt)
        self.work.mounts.remove(self.mnt)
        self.proc.wait(timeout=60)
        self.mnt.rmdir()
        if self.store is not None:
            shutil.rmtree(self.store)


FLOOR_OPTIONS: list[str] = []     # nullfs.py options matching mountfs's kernel-side options
DISCARDING: list[str] = []        # ["--discard"]: the (not durable) floor keeps no data


SIDES = ["plain", "floor", "mount"]     # what three_way measures, in its order ("durable"
                                        # before "mount" with --durable-floor)


def three_way(work: Workdir, label: str, measure, repeat: int = 1) -> dict:
    """``measure(root, remount)`` -> {figure: value} on a plain directory, the floor and a
    fresh mount, in that order, ``repeat`` times over: each figure is the median of its runs
    (under "runs", every run's figures). Alternating spreads the machine's drift (others'
    load, the disk's writeback) over the three alike: one run of each can be 40% off."""
    runs = {t: [] for t in SIDES}
    for _ in range(repeat):
        plain = work.path / f"plain-{label}"
        plain.mkdir()
        try:
            runs["plain"].append(placed(measure, None, plain, None))
        finally:
            shutil.rmtree(plain)
        for side in ("floor", "durable"):
            if side not in SIDES:
                continue
            floor = Floor(work, side, durable=side == "durable")
            try:
                runs[side].append(placed(measure, floor.proc.pid, floor.mnt, None))
            finally:
                floor.close()
        m = MountedStore(work, label)

        def remount():
            m.remount()
            co_locate(m.pid())
        try:
            runs["mount"].append(placed(measure, m.pid(), m.mnt, remount))
        finally:
            m.close()
    return {**{t: medians(r) for t, r in runs.items()}, "runs": runs}


def print_three_way(title: str, figures: dict, keys: list[tuple[str, str, bool]],
                    target=None) -> None:
    """keys: (figure, label, higher is better). Ratios say how many times slower the mount
    is (>1: slower) than the plain directory and than the floor: of the medians, and of
    each run's mount against the same run's floor."""
    durable = "durable" in figures
    rows = []
    for key, label, higher in keys:
        slower = (lambda a, b: a / b) if higher else (lambda a, b: b / a)
        p, f, m = (figures[t][key] for t in ("plain", "floor", "mount"))
        runs = figures["runs"]
        each = ", ".join(f"{_figure(rm[key])} ({slower(rf[key], rm[key]):.2f}x)"
                         for rf, rm in zip(runs["floor"], runs["mount"]))
        extra = []
        if durable:
            d = figures["durable"][key]
            extra = [f"{d:,.2f}", f"{slower(f, d):.2f}x", f"{slower(d, m):.2f}x"]
        rows.append([label, f"{m:,.2f}", f"{f:,.2f}", f"{p:,.2f}", f"{slower(p, m):.2f}x",
                     f"{slower(f, m):.2f}x", *extra, each,
                     target(key, figures) if target else ""])
    extra = ["durable floor", "durable vs floor", "mount vs durable"] if durable else []
    print_table(f"{title}; median of {len(figures['runs']['mount'])} alternating runs",
                ["figure", "mount", "floor", "plain dir", "vs plain", "vs floor", *extra,
                 "each run: mount (vs floor)", "target"], rows)


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def stdlib_tarball(work: Workdir) -> Path:
    """The Python standard library (lib/python3.11 without __pycache__) as one tar file."""
    import sysconfig
    tarball = work.path / "stdlib.tar"
    if not tarball.exists():
        run("tar", "-cf", tarball, "--exclude=__pycache__", "-C",
            sysconfig.get_paths()["stdlib"], ".")
    return tarball


def untar(tarball: Path):
    def measure(root: Path, remount) -> dict:
        drop_caches()
        t0 = time.perf_counter()
        run("tar", "-xf", tarball, "-C", root)
        os.sync()
        took = time.perf_counter() - t0
        entries = int(run("sh", "-c", f"find '{root}' | wc -l").stdout) - 1
        return {"seconds": took, "entries": entries}
    return measure


def bench_untar(work: Workdir, repeat: int, res: Results) -> None:
    figures = three_way(work, "untar", untar(stdlib_tarball(work)), repeat)
    res.add("untar", figures)
    print_three_way(f"untar of the stdlib ({figures['plain']['entries']:,} entries) + sync, "
                    f"seconds", figures, [("seconds", "untar+sync s", False)],
                    lambda k, f: verdict(f["mount"][k] <= 1.5 * f["floor"][k])
                    + " (<= 1.5x floor)")


def synthetic_repo(work: Workdir, files: int) -> tuple[Path, str, str]:
    """A git repository of ``files`` files in 100 directories and two distant commits:
    A, then 30 commits later B, where a third of the files changed, a tenth were deleted,
    a tenth added and some renamed. Packed, so copying it is cheap."""
    repo = work.path / "repo"
    if (repo / ".git").exists():
        return repo, "A", "B"
    repo.mkdir()
    git = lambda *a: run("git", "-C", repo, *a)     # noqa: E731
    git("init", "-q")
    git("config", "user.email", "bench@example.invalid")
    git("config", "user.name", "bench")
    git("config", "gc.auto", "0")                   # no background gc racing ours
    import random
    rnd = random.Random(1)
    paths = [f"d{i % 100:02d}/f{i:05d}.txt" for i in range(files)]
    for p in paths:
        (repo / p).parent.mkdir(exist_ok=True)
        (repo / p).write_bytes(rnd.randbytes(rnd.choice([200, 1500, 6000])).hex().encode())
    git("add", "-A")
    git("commit", "-qm", "A")
    git("tag", "A")
    for c in range(30):
        for p in rnd.sample(paths, files // 90):
            (repo / p).write_text(f"changed in {c}\n" + (repo / p).read_text()[:3000])
        for p in rnd.sample(paths, files // 300):
            if (repo / p).exists():
                paths.remove(p)
                (repo / p).unlink()
        for n in range(files // 300):
            p = f"n{c:02d}/g{n:05d}.txt"
            (repo / p).parent.mkdir(exist_ok=True)
            (repo / p).write_text(f"new {c} {n}\n" * 20)
            paths.append(p)
        git("add", "-A")
        git("commit", "-qm", f"c{c}")
    git("tag", "B")
    git("gc", "-q")
    git("checkout", "-q", "A")
    return repo, "A", "B"


def index_written_later(clone: Path) -> None:
    """Write the index of ``clone`` again in a later second than the files its checkout
    wrote, as a repository checked out more than a second ago has it. git compares
    modification times in whole seconds, so the next command reads again every file
    modified in the second the index was written ("racily clean"). Left so, the timed
    checkout re-read a random number of files (those the setup's checkout wrote in its
    last second: 0 to 1,600 here), and that, not the filesystem, made most of the spread
    between runs (docs/benchmarks.md, thirty-eighth round)."""
    index = clone / ".git" / "index"
    later = math.floor(index.stat().st_mtime) + 1 + 0.05    # past the kernel's coarse clock
    time.sleep(max(0.0, later - time.time()))
    run("git", "-C", clone, "update-index", "-q", "--refresh", "--force-write-index")


def checkout_clone(repo: Path, a: str, root: Path, remount) -> Path:
    """A copy of ``repo`` under ``root`` checked out at ``a``, with every cache cold (the
    mount remounted when ``remount`` is given, the page cache dropped)."""
    clone = root / "repo"
    run("cp", "-a", repo, clone)
    run("git", "-C", clone, "checkout", "-qf", a)
    index_written_later(clone)
    if remount:
        remount()
    drop_caches()
    return clone


def checkout(repo: Path, a: str, b: str):
    def measure(root: Path, remount) -> dict:
        clone = checkout_clone(repo, a, root, remount)
        t0 = time.perf_counter()
        run("git", "-C", clone, "checkout", "-q", b)
        os.sync()
        took = time.perf_counter() - t0
        return {"seconds": took}
    return measure


def bench_git(work: Workdir, files: int, repeat: int, res: Results) -> None:
    repo, a, b = synthetic_repo(work, files)
    figures = three_way(work, "git", checkout(repo, a, b), repeat)
    res.add("git_checkout", figures)
    print_three_way(f"git checkout between two commits 30 apart of a {files:,}-file "
                    f"repository + sync, seconds", figures,
                    [("seconds", "checkout+sync s", False)],
                    lambda k, f: verdict(f["mount"][k] <= 1.5 * f["floor"][k])
                    + " (<= 1.5x floor)")


def ensure_fio() -> str | None:
    if shutil.which("fio") is None:
        subprocess.run(["apt-get", "install", "-y", "-q", "fio"], capture_output=True)
    return shutil.which("fio")


def random_io(size: int, seconds: int):
    def measure(root: Path, remount) -> dict:
        target = root / "rand"
        write_file(target, size, MiB)
        out = {}
        for mode in ("randread", "randwrite"):
            drop_caches()
            res = run("fio", "--name=r", f"--filename={target}", f"--size={size}",
                      f"--rw={mode}", "--bs=4k", "--ioengine=psync", f"--runtime={seconds}",
                      "--time_based", "--end_fsync=1", "--output-format=json")
            job = json.loads(res.stdout)["jobs"][0]
            out[mode] = job["read" if mode == "randread" else "write"]["iops"]
        target.unlink()
        return out
    return measure


def bench_random(work: Workdir, size: int, seconds: int, repeat: int, res: Results) -> None:
    if ensure_fio() is None:
        print("\nrandom 4 KiB I/O: fio is not installed and apt-get could not install it")
        return
    figures = three_way(work, "rand", random_io(size, seconds), repeat)
    res.add("random_4k", figures)
    print_three_way(f"random 4 KiB I/O on a {size // MiB} MiB file, fio psync, 1 job, "
                    f"{seconds} s each (caches dropped before each), IOPS", figures,
                    [("randread", "randread IOPS", True), ("randwrite", "randwrite IOPS", True)],
                    lambda k, f: verdict(f["mount"][k] >= 5000) + " (>= 5,000)")


def bench_small3(work: Workdir, count: int, size: int, repeat: int, res: Results) -> None:
    figures = three_way(work, "small", lambda root, remount: small_files(root, count, size,
                                                                         remount), repeat)
    res.add("small_files", figures)
    print_three_way(f"{count:,} small files of {size} bytes in one directory, ops/s "
                    f"(reread: open, read and close each, twice, the second timed; "
                    f"stat_cold: after remount and drop_caches; stat_missing: the deleted "
                    f"names, asked twice, the second timed)", figures,
                    [(k, f"{k} ops/s", True) for k in ("create", "stat_warm", "reread",
                                                       "stat_cold", "delete", "stat_missing")],
                    lambda k, f: "no target" if k in ("reread", "stat_missing") else
                    verdict(f["mount"][k] >= TARGETS["small_ops"]) + " (>= 3,000/s)")


def store_ingest(root: Path, size: int, block: int) -> dict:
    """MB/s of the store alone taking ``size`` bytes as ``block``-sized chunks, stored as the
    writer stores a new chunk (``chunkfile.put``: a full chunk into a slot of the chunk file,
    its number into LMDB; any other into LMDB): a store made by ``mkfs`` and opened as the
    mount's writer opens it (each commit synced, the chunk file first, LMDB's meta page
    not), a commit every ``committer.TXN_BYTES`` as the writer's committer makes at most,
    its data file prepared ahead by the writer's preallocator. Every byte the mount keeps
    crosses this path, one writer at a time, and here nothing stands in front of it (no
    FUSE, no hashing, no chunk map, no other process): the bound of the mount's sequential
    write. The data is write_file's (unique per 4 KiB)."""
    from mountfs import chunkfile
    from mountfs.committer import TXN_BYTES
    from mountfs.prealloc import Preallocator
    from mountfs.store import Store
    path = root / "ingest.store"
    Store.mkfs(path)
    store = Store.open(path)
    prealloc = Preallocator(store)
    prealloc.start()
    try:
        buf = bytearray(os.urandom(block))
        t0 = time.perf_counter()
        txn, pending = store.env.begin(write=True), 0
        for n in range(size // block):
            for off in range(0, block, 4096):
                struct.pack_into("<Q", buf, off, (n * block + off) // 4096)
            chunkfile.put(txn, store.db, n.to_bytes(32, "big"), buf)
            pending += block
            if pending >= TXN_BYTES:
                store.commit(txn)
                prealloc.wake()
                txn, pending = store.env.begin(write=True), 0
        store.commit(txn)
        seconds = time.perf_counter() - t0
    finally:
        prealloc.stop()
        store.close()
        shutil.rmtree(path)
    return {"write_mbs": size / seconds / 1e6}


def bench_ingest(work: Workdir, size: int, block: int, repeat: int, figures: dict,
                 res: Results) -> None:
    """The store's write path alone (``store_ingest``), ``repeat`` runs after the three-way
    figure, against its plain directory and mount medians."""
    runs = []
    for _ in range(repeat):
        root = work.path / "ingest"
        root.mkdir()
        try:
            runs.append(kept(store_ingest, root, size, block)["write_mbs"])
        finally:
            shutil.rmtree(root)
    bound = statistics.median(runs)
    plain, mnt = figures["plain"]["write_mbs"], figures["mount"]["write_mbs"]
    res.add("store_ingest", {"write_mbs": bound, "runs": runs})
    print(f"the store's write path alone (as the mount's writer stores {block // 1024} KiB chunks, "
          f"no FUSE): {bound:,.0f} MB/s, median of {len(runs)} "
          f"({', '.join(f'{r:,.0f}' for r in runs)}): {bound / plain:.0%} of the plain "
          f"directory; the mount writes at {mnt / bound:.0%} of it\n")


def bench_seq3(work: Workdir, size: int, block: int, repeat: int, res: Results) -> None:
    figures = three_way(work, "seq", lambda root, remount: seq_pair(work, root / "big", size,
                                                                    block, remount), repeat)
    res.add("sequential", figures)
    print_three_way(f"sequential I/O, {size // MiB} MiB file in {block // 1024} KiB blocks, "
                    f"MB/s (write includes fsync+close; caches dropped before the read)",
                    figures,
                    [("write_mbs", "seq write MB/s", True), ("read_mbs", "seq read MB/s", True)],
                    lambda k, f: verdict(f["mount"][k] >= 0.4 * f["plain"][k]
                                         and f["mount"][k] >= 0.8 * f["floor"][k])
                    + " (>= 40% plain, 80% floor)")
    bench_ingest(work, size, block, repeat, figures, res)


# ---- main ------------------------------------------------------------------------------------

def parse_nanoseconds(text: str) -> int:
    if not text.isdigit() or int(text) > 10**9:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole nanoseconds, 0 to 1000000000")
    return int(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1G", help="sequential file size (default: 1G)")
    p.add_argument("--block", default="1M", help="write/read block size (default: 1M)")
    p.add_argument("--files", type=int, default=10000, help="small files (default: 10000)")
    p.add_argument("--file-size", type=int, default=1024,
                   help="bytes per small file (default: 1024)")
    p.add_argument("--snap-sizes", default="1000,100000",
                   help="store sizes (files) for snapshot latency (default: %(default)s)")
    p.add_argument("--creates", type=int, default=20,
                   help="snapshot creates per size and method (default: 20)")
    p.add_argument("--chunk-sizes", default="64K,256K,1M,4M",
                   help="chunk sizes of the sweep (default: %(default)s)")
    p.add_argument("--sweep-size", default="256M", help="file size of the sweep (default: 256M)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each three-way figure (plain, floor, mount alternating), "
                        "median (default: 3)")
    p.add_argument("--repo-files", type=int, default=6000,
                   help="files in the synthetic git repository (default: 6000)")
    p.add_argument("--rand-seconds", type=int, default=15,
                   help="seconds per fio random I/O run (default: 15)")
    p.add_argument("--only", choices=["untar", "git", "small", "seq", "rand", "snap", "sweep"],
                   action="append",
                   help="run only these benchmarks (repeatable)")
    p.add_argument("--workdir", default="/var/tmp",
                   help="where the store, mountpoint and baseline go: the same disk for "
                        "both, not tmpfs (default: %(default)s)")
    p.add_argument("--floor-writeback", action="store_true",
                   help="mount the floor with the writeback cache (what it would give mountfs)")
    p.add_argument("--floor-discard", action="store_true",
                   help="with --only seq (and rand): the floor discards what is written "
                        "(reads give zeros): what carrying the data through FUSE alone "
                        "costs, without the floor's own copy")
    p.add_argument("--durable-floor", action="store_true",
                   help="also measure scripts/durable_floor.py in each three-way figure: the "
                        "floor plus the least durability costs (every change committed to "
                        "LMDB by a writer process in group commits)")
    p.add_argument("--guest-halt-poll-ns", type=parse_nanoseconds, metavar="NS",
                   help="on a VM guest with the haltpoll idle driver, poll this long before "
                        "halting an idle CPU for the whole run (restored after): cheap "
                        "wake-ups, where each FUSE request wakes the filesystem's thread")
    p.add_argument("--same-cpu", action="store_true",
                   help="in every three-way figure's timed runs, put this process and the "
                        "filesystem's process on one CPU and the filesystem's writer on the "
                        "other CPUs: requests then cost no wake-up of the other CPU, which "
                        "the scheduler's placement otherwise decides (a diagnostic: no "
                        "filesystem chooses where its callers run)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.floor_discard and not set(args.only or ["all"]) <= {"seq", "rand"}:
        p.error("--floor-discard goes with --only seq (and rand): a floor that keeps no data "
                "cannot hold an untarred tree, a git repository or files read back")
    if args.quick:
        args.size, args.files, args.snap_sizes, args.creates = "32M", 500, "100,2000", 5
        args.chunk_sizes, args.sweep_size, args.repeat = "64K,1M", "16M", 1
        args.repo_files, args.rand_seconds = 600, 3
    return args


def check_tuning_variables() -> None:
    """Refuse a bad ``$MOUNTFS_*`` tuning variable before anything is set up, in the mount's
    own words: the mount and the floors read them as they start, and would each stop."""
    from mountfs.errors import StoreError
    try:
        import mountfs.idlepoll, mountfs.ops  # noqa: F401,E401  (what the floors import)
    except StoreError as e:
        raise SystemExit(f"bench_io: {e}") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_io needs root (to drop the page cache)")
    check_tuning_variables()
    restore_kernel_knobs()
    only = set(args.only or ["untar", "git", "small", "seq", "rand", "snap", "sweep"])
    block = parse_size(args.block)
    if args.floor_writeback:
        FLOOR_OPTIONS.append("--writeback")
    if args.floor_discard:
        DISCARDING.append("--discard")
    if args.durable_floor:
        SIDES.insert(2, "durable")
    if args.same_cpu:
        cpus = os.sched_getaffinity(0)
        if len(cpus) < 2:
            raise SystemExit(f"bench_io: --same-cpu needs two CPUs to use, this process may "
                             f"use {len(cpus)}; run it without --same-cpu (or outside "
                             f"taskset / the cpuset that confines it)")
        SAME_CPU.append(cpus)
    res = Results("bench_io", vars(args))
    with Workdir(args.workdir, "bench-io") as work, halt_polling(args.guest_halt_poll_ns):
        placement = f"; timed runs on CPU {min(SAME_CPU[0])} with the filesystem " \
            f"(--same-cpu)" if SAME_CPU else ""
        print(f"{machine_info(work.path)}; free page reporting "
              f"{'suspended in timed runs' if PAGE_REPORTING.exists() else 'absent'}; "
              f"guest halt polling {_read(HALT_POLL_NS) or 'absent'} ns"
              f"{placement}")
        if "untar" in only:
            bench_untar(work, args.repeat, res)
        if "git" in only:
            bench_git(work, args.repo_files, args.repeat, res)
        if "small" in only:
            bench_small3(work, args.files, args.file_size, args.repeat, res)
        if "seq" in only:
            bench_seq3(work, parse_size(args.size), block, args.repeat, res)
        if "rand" in only:
            bench_random(work, parse_size(args.size), args.rand_seconds, args.repeat, res)
        if "snap" in only:
            bench_snapshots(work, [int(s) for s in args.snap_sizes.split(",")], args.creates,
                            res)
        if "sweep" in only:
            bench_sweep(work, args.chunk_sizes.split(","), parse_size(args.sweep_size), block,
                        args.repeat, res)
    if args.json:
        res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
