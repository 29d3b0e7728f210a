#!/usr/bin/env python3
"""Where the distance to the floor goes: CPU seconds per thread of the filesystem process
and of the workload, on the floor (scripts/nullfs.py) and on a mount, in the same run (and,
with --durable-floor, on scripts/durable_floor.py between them).

bench_io.py says how much slower the mount is than the floor; this says what the extra time
is made of. For each workload it reads, before and after, the CPU time (user + system) of
every thread of the filesystem's process (/proc/PID/task) and of its children (the mount's
writer process, mountfs.writer), and of the workload's processes (RUSAGE_CHILDREN), and
prints them beside the wall time. The workloads send their requests
one at a time (git, a create loop), so the wall time is a chain: the workload's CPU, the
serving thread's CPU, whatever else holds the GIL in between, and the waits (wake-ups,
the disk). ``chain vs floor`` compares the workload's CPU plus the serving thread's with the
floor's: what the chain would cost if the rest (the writer process, the thread reading its
replies) ran beside it for free, on a core of its own, so a bound that no change outside
the serving thread can get under. ``cores busy`` is all the CPU counted
over the wall time: on a 2-core machine, how much room is left to run anything beside.

    .venv/bin/python scripts/bench_cpu.py            # git checkout, creates, 1 GiB written
    .venv/bin/python scripts/bench_cpu.py --only untar --durable-floor --guest-halt-poll-ns 200000
    .venv/bin/python scripts/bench_cpu.py --repeat 3 # three runs, floor and mount alternating

Root and FUSE, like bench_io.py (whose helpers it uses).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_io as B    # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds so far of each thread of ``pid`` and of its children, by
    thread id (the serving thread is the main one: its id is ``pid``)."""
    out: dict[int, tuple[float, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except FileNotFoundError:
            children = []
        for child in children:
            with contextlib.suppress(FileNotFoundError):   # it exited meanwhile
                out.update(thread_cpu(int(child)))
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:           # the thread ended between listing and reading
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measured(pid: int, work) -> dict:
    """Run ``work()``; wall, the workload's CPU, the serving thread's and the others'."""
    before, kids = thread_cpu(pid), children_cpu()
    t0 = time.perf_counter()
    work()
    wall = time.perf_counter() - t0
    after, kids = thread_cpu(pid), children_cpu() - kids
    delta = {tid: tuple(a - b for a, b in zip(after[tid], before.get(tid, (0.0, 0.0))))
             for tid in after}
    user, system = delta.pop(pid, (0.0, 0.0))
    others = [sum(cpu) for cpu in delta.values()]
    return {"wall": wall, "workload": kids, "serving": user + system, "serving_sys": system,
            "other": sum(others), "busiest other": max(others, default=0.0)}


def git_checkout(repo: Path, a: str, b: str):
    def prepare(root: Path, remount) -> Path:
        return B.checkout_clone(repo, a, root, remount)

    def work(clone: Path) -> None:
        B.run("git", "-C", clone, "checkout", "-q", b)
        os.sync()
    return prepare, work


def untar(tarball: Path):
    """bench_io's untar of the standard library, then sync (the page cache dropped first)."""
    def prepare(root: Path, remount) -> Path:
        return root

    def work(root: Path) -> None:
        B.drop_caches()
        B.run("tar", "-xf", tarball, "-C", root)
        os.sync()
    return prepare, work


def creates(count: int, size: int):
    """``count`` files of ``size`` bytes created in one directory by a child process (so
    that its CPU is the workload's, like git's)."""
    script = ("import os,sys\n"
              "d=sys.argv[1]; data=os.urandom(int(sys.argv[3]))\n"
              "for i in range(int(sys.argv[2])):\n"
              "    fd=os.open(f'{d}/f{i:06d}', os.O_WRONLY|os.O_CREAT|os.O_EXCL, 0o644)\n"
              "    os.write(fd, data); os.close(fd)\n")

    def prepare(root: Path, remount) -> Path:
        (root / "small").mkdir()
        return root / "small"

    def work(d: Path) -> None:
        B.run(sys.executable, "-c", script, d, count, size)
    return prepare, work


def seq_write(size: int):
    """One file of ``size`` bytes written in 1 MiB blocks, then fsync'ed, by a child process
    (bench_io.write_file: every 4 KiB unique)."""
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_io as B\n"
              "B.write_file(B.Path(sys.argv[2]), int(sys.argv[3]), 1 << 20)\n")

    def prepare(root: Path, remount) -> Path:
        return root / "big"

    def work(target: Path) -> None:
        B.run(sys.executable, "-c", script, Path(__file__).resolve().parent, target, size)
    return prepare, work


FLOORS = ["floor"]      # and "durable floor" with --durable-floor


def one_run(work_dir: B.Workdir, label: str, workload, shm_store: bool = False) -> dict:
    """The workload on the floor (and the durable floor), then on a fresh mount (and, with
    ``shm_store``, on a mount whose store is in /dev/shm: the same code without the disk)."""
    prepare, work = workload
    out = {}
    for name in FLOORS:
        floor = B.Floor(work_dir, name.replace(" ", "-"), durable=name != "floor")
        try:
            target = prepare(floor.mnt, None)
            out[name] = measured(floor.proc.pid, lambda: work(target))
        finally:
            floor.close()
    stores = {"mount": None}
    if shm_store:
        stores["mount, store in /dev/shm"] = Path("/dev/shm") / f"{work_dir.path.name}-{label}"
    for name, store in stores.items():
        try:
            if store is not None:
                B.mkfs(store)
            m = B.MountedStore(work_dir, label + str(len(out)), store=store)
            try:
                target = prepare(m.mnt, m.remount)
                out[name] = measured(m.pid(), lambda: work(target))
            finally:
                m.close()
        finally:
            if store is not None:           # outside the work directory: ours to remove
                shutil.rmtree(store, ignore_errors=True)
    return out


def report(title: str, runs: list[dict], size: int = 0) -> None:
    """One row per run and filesystem; with ``size`` (bytes written), MB/s too."""
    rows = []
    for n, r in enumerate(runs, 1):
        f = r["floor"]
        for name, x in r.items():
            chain = x["serving"] + x["workload"]
            rows.append([f"{n} {name}", f"{x['wall']:.2f}",
                         *([f"{size / x['wall'] / 1e6:,.0f}"] if size else []),
                         f"{x['workload']:.2f}", f"{x['serving']:.2f}",
                         f"{x['serving_sys']:.2f}", f"{x['other']:.2f}",
                         f"{(chain + x['other']) / x['wall']:.2f}",
                         f"{x['wall'] / f['wall']:.2f}x",
                         f"{chain / (f['serving'] + f['workload']):.2f}x"])
    B.print_table(title, ["run", "wall s", *(["MB/s"] if size else []), "workload cpu",
                          "serving cpu", "of it system", "the rest", "cores busy",
                          "wall vs floor", "chain vs floor"], rows)
    for name in [n for n in runs[0] if n != "floor"]:
        print(f"the {name}'s busiest other thread (its writer process's), cpu s:",
              ", ".join(f"{r[name]['busiest other']:.2f}" for r in runs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/var/tmp", help="on a real disk (default /var/tmp)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each workload (default 1)")
    p.add_argument("--files", type=int, default=6000, help="files in the git repository")
    p.add_argument("--creates", type=int, default=10000, help="files the create loop makes")
    p.add_argument("--size", type=B.parse_size, default=1 << 30,
                   help="the sequentially written file (default 1G)")
    p.add_argument("--only", action="append", choices=["git", "creates", "seq", "untar"],
                   help="run only these workloads (repeatable; default git, creates and "
                        "seq)")
    p.add_argument("--durable-floor", action="store_true",
                   help="also run each workload on scripts/durable_floor.py (the floor plus "
                        "every change committed to LMDB by a writer process)")
    p.add_argument("--guest-halt-poll-ns", type=B.parse_nanoseconds, metavar="NS",
                   help="as bench_io.py's: idle CPUs poll this long before halting")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_cpu.py needs root (it drops the page cache)")
    if args.durable_floor:
        FLOORS.append("durable floor")
    B.restore_kernel_knobs()
    with B.Workdir(args.workdir, "bench-cpu") as work, B.halt_polling(args.guest_halt_poll_ns):
        print(B.machine_info(work.path), flush=True)
        only = set(args.only or ["git", "creates", "seq"])
        if "untar" in only:
            report("untar of the standard library + sync",
                   [one_run(work, f"untar{n}", untar(B.stdlib_tarball(work)))
                    for n in range(args.repeat)])
        if "git" in only:
            repo, a, b = B.synthetic_repo(work, args.files)
            report(f"git checkout A->B of a {args.files:,}-file repository + sync",
                   [one_run(work, f"git{n}", git_checkout(repo, a, b))
                    for n in range(args.repeat)])
        if "creates" in only:
            report(f"{args.creates:,} creates of 1 KiB files in one directory",
                   [one_run(work, f"cr{n}", creates(args.creates, 1024))
                    for n in range(args.repeat)])
        if "seq" in only:
            report(f"sequential write of {args.size // B.MiB:,} MiB + fsync",
                   [one_run(work, f"seq{n}", seq_write(args.size), shm_store=True)
                    for n in range(args.repeat)], args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
