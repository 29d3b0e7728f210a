#!/usr/bin/env python3
"""Benchmark of issue 3: how long `snapctl diff` takes as the store grows and as the change
grows, compared with the naive way (walking the whole tree at TO).

Stores are built offline through the store API (``mountfs.namespace.Live`` on write
transactions of a few thousand files each, as ``snapctl --store`` opens an unmounted store):
building a million files through FUSE would take far longer than the diff we measure.

    .venv/bin/python scripts/bench_diff.py              # the issue's figures (100k and 1M files)
    .venv/bin/python scripts/bench_diff.py --quick      # a smoke run (seconds)

Run it from the repository with the project's virtualenv (it imports ``mountfs``). Stores live
under --workdir (same disk as the repository, not tmpfs) and are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import stat
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import blake3  # noqa: E402

from bench_io import (Results, Workdir, drop_caches, machine_info, mount,  # noqa: E402
                      parse_size, print_table, umount, VENV_BIN)
from mountfs import schema as S  # noqa: E402
from mountfs import snapshots as snaps  # noqa: E402
from mountfs.diff import diff  # noqa: E402
from mountfs.namespace import Live, View  # noqa: E402
from mountfs.store import Store  # noqa: E402

FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755
BATCH = 5000            # files per write transaction (keeps LMDB's dirty page list small)


# ---- building stores offline -----------------------------------------------------------------

@dataclass
class Tree:
    """What was built: leaf directory inodes and, per leaf, its file names (for changes)."""
    store: Path
    leaves: list[int] = field(default_factory=list)
    files: dict[int, list[bytes]] = field(default_factory=dict)

    @property
    def nfiles(self) -> int:
        return sum(len(v) for v in self.files.values())


def _live(store: Store, txn) -> Live:
    return Live(txn, store.db, store.live_epoch(txn), store.chunk_size)


def _content(tag: bytes) -> tuple[bytes, bytes]:
    """Small unique file content and its blake3 (what the mount would store)."""
    data = b"content of " + tag + b"\n"
    return blake3.blake3(data).digest(), data


def _write_file(live: Live, ino: int, data: tuple[bytes, bytes]) -> None:
    digest, raw = data
    live.put_chunk(ino, 0, digest, raw)
    live.setattr(ino, size=len(raw), mtime_ns=live.now)


def build_tree(path: Path, nfiles: int, ndirs: int, chunk_size: str = "1M",
               progress: bool = True) -> Tree:
    """mkfs, then ``nfiles`` small files spread over ``ndirs`` leaf directories grouped under
    top directories of up to 100 leaves each (a realistic depth of 3 below the root)."""
    subprocess.run([str(VENV_BIN / "mountfs"), "mkfs", "--chunk-size", chunk_size, str(path)],
                   check=True, capture_output=True)
    tree = Tree(path)
    store = Store.open(path, holder="bench_diff build")
    try:
        with store.write() as txn:
            live = _live(store, txn)
            tops = [live.create(S.ROOT_INO, b"top%03d" % t, DIR_MODE, 0, 0)[0]
                    for t in range((ndirs + 99) // 100)]
            for d in range(ndirs):
                leaf = live.create(tops[d // 100], b"dir%04d" % d, DIR_MODE, 0, 0)[0]
                tree.leaves.append(leaf)
                tree.files[leaf] = []
        per_dir = [nfiles // ndirs + (1 if d < nfiles % ndirs else 0) for d in range(ndirs)]
        todo = [(leaf, b"file%07d" % i) for leaf, n in zip(tree.leaves, per_dir)
                for i in range(n)]
        t0 = time.monotonic()
        for start in range(0, len(todo), BATCH):
            with store.write() as txn:
                live = _live(store, txn)
                for leaf, name in todo[start:start + BATCH]:
                    ino = live.create(leaf, name, FILE_MODE, 0, 0)[0]
                    _write_file(live, ino, _content(b"%d/%s" % (leaf, name)))
                    tree.files[leaf].append(name)
            if progress and (start // BATCH) % 20 == 19:
                done = start + BATCH
                rate = done / (time.monotonic() - t0)
                print(f"  built {done:,}/{len(todo):,} files ({rate:,.0f}/s)", file=sys.stderr)
    finally:
        store.close()
    return tree


def snapshot(path: Path, name: str) -> None:
    store = Store.open(path, holder="bench_diff snapshot")
    try:
        with store.write() as txn:
            snaps.create(txn, store.db, name)
    finally:
        store.close()


def change_files(tree: Tree, count: int, seed: int = 1) -> dict[str, int]:
    """A mix of ``count`` changes spread over the tree: a quarter each of modifies, renames
    (to another directory), creates and deletes."""
    rng = random.Random(seed)
    store = Store.open(tree.store, holder="bench_diff changes")
    kinds = {"modify": 0, "rename": 0, "create": 0, "delete": 0}
    try:
        with store.write() as txn:
            live = _live(store, txn)
            for n in range(count):
                kind = ("modify", "rename", "create", "delete")[n % 4]
                leaf = rng.choice(tree.leaves)
                names = tree.files[leaf]
                if kind == "create" or not names:
                    name = b"new%d-%07d" % (seed, n)
                    ino = live.create(leaf, name, FILE_MODE, 0, 0)[0]
                    _write_file(live, ino, _content(b"new %d" % n))
                    names.append(name)
                    kinds["create"] += 1
                    continue
                name = names.pop(rng.randrange(len(names)))
                if kind == "modify":
                    _write_file(live, live.lookup(leaf, name), _content(b"changed %d" % n))
                    names.append(name)
                elif kind == "rename":
                    dest, new_name = rng.choice(tree.leaves), b"moved%d-%07d" % (seed, n)
                    for ino, _ in live.rename(leaf, name, dest, new_name):
                        live.destroy(ino)        # a replaced target (never, with new names)
                    tree.files[dest].append(new_name)
                else:
                    ino, rec = live.unlink(leaf, name)
                    if rec.nlink == 0:
                        live.destroy(ino)
                kinds[kind] += 1
    finally:
        store.close()
    return kinds


def modify_all(tree: Tree) -> int:
    """Give every file a new mtime (each one a MODIFY entry of the next diff)."""
    store = Store.open(tree.store, holder="bench_diff modify-all")
    todo = [(leaf, name) for leaf, names in tree.files.items() for name in names]
    try:
        for start in range(0, len(todo), BATCH):
            with store.write() as txn:
                live = _live(store, txn)
                for leaf, name in todo[start:start + BATCH]:
                    live.setattr(live.lookup(leaf, name), mtime_ns=live.now + 1)
    finally:
        store.close()
    return len(todo)


def build_sparse(path: Path, size: int, chunk_size: str, changed_index: int) -> None:
    """One file of ``size`` bytes whose every chunk-map entry names one stored chunk (the
    chunk map of a fully written file, its data deduplicated), snapshot s1, one chunk
    rewritten, snapshot s2."""
    subprocess.run([str(VENV_BIN / "mountfs"), "mkfs", "--chunk-size", chunk_size, str(path)],
                   check=True, capture_output=True)
    store = Store.open(path, holder="bench_diff sparse")
    try:
        cs = store.chunk_size
        zero = bytes(cs)
        digest = blake3.blake3(zero).digest()
        with store.write() as txn:
            live = _live(store, txn)
            ino = live.create(S.ROOT_INO, b"big", FILE_MODE, 0, 0)[0]
            live.setattr(ino, size=size)
        nchunks = size // cs
        for start in range(0, nchunks, 20000):
            with store.write() as txn:
                live = _live(store, txn)
                for idx in range(start, min(start + 20000, nchunks)):
                    live.put_chunk(ino, idx, digest, zero)
        with store.write() as txn:
            snaps.create(txn, store.db, "s1")
        with store.write() as txn:
            live = _live(store, txn)
            data = b"x" * cs
            live.put_chunk(ino, changed_index, blake3.blake3(data).digest(), data)
            live.setattr(ino, mtime_ns=live.now)
            snaps.create(txn, store.db, "s2")
    finally:
        store.close()


# ---- measuring -----------------------------------------------------------------------------

def epochs(store: Store, txn, *names: str) -> list[int]:
    return [snaps.get(txn, store.db, n).epoch for n in names]


def time_diff(path: Path, a: str, b: str, repeat: int, with_chunks: bool = False
              ) -> tuple[float, int]:
    """Median seconds of iterating diff(a, b) (warm page cache), and the entry count."""
    store = Store.open(path, readonly=True, lock=False, readahead=False)
    try:
        times, count = [], 0
        for _ in range(repeat):
            with store.read() as txn:
                lo, hi = epochs(store, txn, a, b)
                t0 = time.perf_counter()
                count = sum(1 for _ in diff(txn, store.db, store.chunk_size, lo, hi,
                                            with_chunks))
                times.append(time.perf_counter() - t0)
        return statistics.median(times), count
    finally:
        store.close()


def walk_store(path: Path, name: str) -> tuple[float, int]:
    """The naive way: list every directory at snapshot ``name`` and read every inode."""
    store = Store.open(path, readonly=True, lock=False, readahead=False)
    try:
        with store.read() as txn:
            view = View(txn, store.db, epochs(store, txn, name)[0], store.chunk_size)
            t0 = time.perf_counter()
            count, todo = 0, [S.ROOT_INO]
            while todo:
                for _, child in view.listdir(todo.pop()):
                    count += 1
                    if stat.S_ISDIR(view.get(child).mode):
                        todo.append(child)
            return time.perf_counter() - t0, count
    finally:
        store.close()


def scan_chunk_map(path: Path, a: str, b: str) -> tuple[float, int]:
    """The naive way for one file: compare its whole chunk map at a and at b."""
    store = Store.open(path, readonly=True, lock=False, readahead=False)
    try:
        with store.read() as txn:
            lo, hi = epochs(store, txn, a, b)
            old = View(txn, store.db, lo, store.chunk_size)
            new = View(txn, store.db, hi, store.chunk_size)
            ino = new.resolve("big")
            t0 = time.perf_counter()
            changed = [i for i in new.chunk_indices(ino) if old.chunk(ino, i) != new.chunk(ino, i)]
            return time.perf_counter() - t0, len(changed)
    finally:
        store.close()


def time_cli(*args: str, repeat: int = 3) -> float:
    """Median wall seconds of a `snapctl` command (process start-up included)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([str(VENV_BIN / "snapctl"), *args], check=True,
                       stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def find_count(root: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    res = subprocess.run(["find", str(root)], capture_output=True)
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"find {root} failed: {res.stderr.decode()[-500:]}")
    return took, res.stdout.count(b"\n") - 1


def memory_probe(store: str, a: str, b: str, keep: bool) -> None:
    """(Child process.) Iterate diff(a, b), counting entries (or keeping them all, the
    baseline), sampling anonymous memory (the Python heap: LMDB's map is file-backed) as it
    goes. Prints: entries, peak RssAnon KiB, ru_maxrss KiB, seconds."""
    st = Store.open(store, readonly=True, lock=False, readahead=False)
    kept, peak, count = [], _rss_anon(), 0
    with st.read() as txn:
        lo, hi = epochs(st, txn, a, b)
        t0 = time.perf_counter()
        for e in diff(txn, st.db, st.chunk_size, lo, hi):
            count += 1
            if keep:
                kept.append(e)
            if count % 20000 == 0:
                peak = max(peak, _rss_anon())
        seconds = time.perf_counter() - t0
    peak = max(peak, _rss_anon())
    print(count, peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, f"{seconds:.3f}")


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def run_memory(path: Path, a: str, b: str) -> dict:
    out = {}
    for mode in ("stream", "keep"):
        res = subprocess.run([sys.executable, __file__, "--memory-probe", str(path), a, b,
                              mode], check=True, capture_output=True, text=True)
        count, anon, maxrss, secs = res.stdout.split()
        out[mode] = {"entries": int(count), "rss_anon_mib": int(anon) / 1024,
                     "maxrss_mib": int(maxrss) / 1024, "seconds": float(secs)}
    return out


# ---- the benchmarks ------------------------------------------------------------------------

def bench_scaling(work: Workdir, sizes: list[int], ndirs: int, changes: list[int],
                  repeat: int, res: Results, find_limit: int) -> None:
    """Diff time vs store size (fixed change) and vs change size (fixed store)."""
    rows, change_rows = [], []
    for nfiles in sizes:
        path = work.path / f"tree{nfiles}"
        t0 = time.monotonic()
        tree = build_tree(path, nfiles, min(ndirs, max(1, nfiles // 10)))
        build = time.monotonic() - t0
        print(f"built {nfiles:,} files in {build:.1f} s", file=sys.stderr)
        snapshot(path, "s1")
        prev = "s1"
        for i, n in enumerate(changes):
            kinds = change_files(tree, n, seed=i)
            snapshot(path, f"c{n}")
            secs, count = time_diff(path, prev, f"c{n}", repeat)
            change_rows.append({"files": nfiles, "changes": n, "entries": count,
                                "diff_ms": secs * 1e3, "kinds": kinds})
            prev = f"c{n}"
        first = f"c{changes[0]}"
        diff_s, count = time_diff(path, "s1", first, repeat)
        drop_caches()
        cold_s, _ = time_diff(path, "s1", first, 1)
        walk_s, walked = walk_store(path, first)
        cli_s = time_cli("--store", str(path), "diff", "s1", first, "--json")
        row = {"files": nfiles, "build_s": build, "entries": count, "diff_ms": diff_s * 1e3,
               "diff_cold_ms": cold_s * 1e3, "walk_ms": walk_s * 1e3, "walked": walked,
               "walk_over_diff": walk_s / diff_s, "cli_ms": cli_s * 1e3}
        if nfiles <= find_limit:
            row.update(_find_over_mount(work, path, first))
        rows.append(row)
        shutil.rmtree(path) if nfiles != sizes[-1] else None
    res.add("diff_vs_store_size", rows)
    res.add("diff_vs_change_size", change_rows)
    table = [[f"{r['files']:,}", r["entries"], f"{r['diff_ms']:.2f}", f"{r['diff_cold_ms']:.1f}",
              f"{r['walk_ms']:.0f}", f"{r['walk_over_diff']:,.0f}x",
              f"{r['find_ms']:.0f}" if "find_ms" in r else "-", f"{r['cli_ms']:.0f}"]
             for r in rows]
    print_table(f"diff of {changes[0]} changes vs store size (warm median of {repeat}; "
                f"baseline: full walk at TO through the store API, and find over the mount)",
                ["files", "entries", "diff ms", "cold ms", "walk ms", "walk/diff", "find ms",
                 "snapctl ms"], table)
    if len(rows) > 1:
        print(f"diff time {rows[-1]['files']:,} / {rows[0]['files']:,} files: "
              f"{rows[-1]['diff_ms'] / rows[0]['diff_ms']:.2f}x "
              f"(the walk: {rows[-1]['walk_ms'] / rows[0]['walk_ms']:.1f}x)")
    print_table("diff time vs change size (successive snapshots of the same store)",
                ["files", "changes", "entries", "diff ms", "us/entry"],
                [[f"{r['files']:,}", r["changes"], r["entries"], f"{r['diff_ms']:.2f}",
                  f"{r['diff_ms'] * 1e3 / max(1, r['entries']):.0f}"] for r in change_rows])


def _find_over_mount(work: Workdir, path: Path, snap: str) -> dict:
    mnt = work.path / "mnt"
    mnt.mkdir(exist_ok=True)
    mount(work, path, mnt)
    try:
        secs, count = find_count(mnt / ".snapshot" / snap)
    finally:
        umount(work, mnt)
    return {"find_ms": secs * 1e3, "found": count}


def bench_sparse(work: Workdir, size: int, chunk_sizes: list[str], repeat: int,
                 res: Results) -> None:
    rows = []
    for cs in chunk_sizes:
        path = work.path / f"sparse{cs}"
        nchunks = size // parse_size(cs)
        build_sparse(path, size, cs, changed_index=nchunks // 3)
        diff_s, count = time_diff(path, "s1", "s2", repeat, with_chunks=True)
        scan_s, changed = scan_chunk_map(path, "s1", "s2")
        cli_s = time_cli("--store", str(path), "diff", "s1", "s2", "--json", "--chunks")
        rows.append({"chunk_size": cs, "chunks": nchunks, "entries": count,
                     "diff_ms": diff_s * 1e3, "scan_ms": scan_s * 1e3, "changed": changed,
                     "scan_over_diff": scan_s / diff_s, "cli_ms": cli_s * 1e3})
        shutil.rmtree(path)
    res.add("sparse_file_chunks", rows)
    print_table(f"--chunks diff of a {size / (1 << 30):g} GiB file with one chunk rewritten "
                f"(baseline: compare its whole chunk map at s1 and s2)",
                ["chunk size", "map entries", "diff ms", "scan ms", "scan/diff", "snapctl ms"],
                [[r["chunk_size"], f"{r['chunks']:,}", f"{r['diff_ms']:.2f}",
                  f"{r['scan_ms']:.1f}", f"{r['scan_over_diff']:,.0f}x", f"{r['cli_ms']:.0f}"]
                 for r in rows])


def bench_memory(work: Workdir, nfiles: int, ndirs: int, res: Results) -> None:
    path = work.path / f"tree{nfiles}"
    if not (path / "data.mdb").exists():
        shutil.rmtree(path, ignore_errors=True)
        build_tree(path, nfiles, ndirs)
        snapshot(path, "s1")
    tree = _reload_tree(path)
    snapshot(path, "m1")
    t0 = time.monotonic()
    modified = modify_all(tree)
    print(f"modified {modified:,} files in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    snapshot(path, "m2")
    mem = run_memory(path, "m1", "m2")
    res.add("diff_memory", {"files": nfiles, **mem})
    print_table(f"memory of a diff with {mem['stream']['entries']:,} entries (peak anonymous "
                f"RSS of a process iterating it; baseline: the same entries kept in a list)",
                ["mode", "entries", "peak anon MiB", "max RSS MiB", "seconds"],
                [[m, f"{v['entries']:,}", f"{v['rss_anon_mib']:.0f}",
                  f"{v['maxrss_mib']:.0f}", f"{v['seconds']:.1f}"] for m, v in mem.items()])


def _reload_tree(path: Path) -> Tree:
    """The leaves and file names of a built store (reused between benchmarks)."""
    tree = Tree(path)
    store = Store.open(path, readonly=True, lock=False, readahead=False)
    try:
        with store.read() as txn:
            view = View(txn, store.db, store.live_epoch(txn), store.chunk_size)
            for _, top in view.listdir(S.ROOT_INO):
                for _, leaf in view.listdir(top):
                    tree.leaves.append(leaf)
                    tree.files[leaf] = [name for name, _ in view.listdir(leaf)]
    finally:
        store.close()
    return tree


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100000,1000000",
                   help="store sizes in files, comma-separated (default: %(default)s)")
    p.add_argument("--dirs", type=int, default=1000, help="leaf directories (default: 1000)")
    p.add_argument("--changes", default="100,1000,10000",
                   help="change sizes; the first is the one compared across store sizes "
                        "(default: %(default)s)")
    p.add_argument("--sparse-size", default="4G", help="sparse file size (default: 4G)")
    p.add_argument("--sparse-chunk-sizes", default="1M,64K",
                   help="chunk sizes of the sparse file's store (default: %(default)s)")
    p.add_argument("--memory-files", type=int, default=1000000,
                   help="files modified for the memory benchmark (default: 1000000; reuses "
                        "the largest store of --sizes when equal)")
    p.add_argument("--find-limit", type=int, default=100000,
                   help="run find over the mounted snapshot up to this store size")
    p.add_argument("--repeat", type=int, default=5, help="diff runs per figure (median)")
    p.add_argument("--only", choices=["scaling", "sparse", "memory"], action="append",
                   help="run only these benchmarks (repeatable)")
    p.add_argument("--workdir", default="/var/tmp",
                   help="where to create the stores (not tmpfs; default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--memory-probe", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.dirs, args.changes = "2000,10000", 50, "20,200"
        args.sparse_size, args.memory_files, args.repeat = "64M", 10000, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_probe:
        store, a, b, mode = args.memory_probe
        memory_probe(store, a, b, mode == "keep")
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    changes = [int(s) for s in args.changes.split(",")]
    only = set(args.only or ["scaling", "sparse", "memory"])
    res = Results("bench_diff", vars(args))
    with Workdir(args.workdir, "bench-diff") as work:
        print(machine_info(work.path))
        if "scaling" in only:
            bench_scaling(work, sizes, args.dirs, changes, args.repeat, res, args.find_limit)
        if "sparse" in only:
            bench_sparse(work, parse_size(args.sparse_size),
                         args.sparse_chunk_sizes.split(","), args.repeat, res)
        if "memory" in only:
            bench_memory(work, args.memory_files, args.dirs, res)
    if args.json:
        res.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
