#!/usr/bin/env python3
"""Benchmark of issue 4: replication against `rsync -a --delete`, and the cost of verify.

A tree of --files files (mixed sizes, --total-mib in all, half of the data under big/) is
written through a mount, snapshotted and replicated to a `mountfs serve-mirror` receiver on
loopback (HTTP); then --changed files are rewritten in part (4 KiB each), big/ is renamed and
the largest file grows by 8 MiB, and the next snapshot is replicated. In the same run
`rsync -a --delete --stats` copies the mounted snapshots to a plain directory, the same two
steps, and a file:// mirror takes the same cycles. Then a directory rename alone, and
`snapctl verify` of a mirror holding --verify-chunks chunk leaves.

    .venv/bin/python scripts/bench_replicate.py [--files N] [--total-mib M] [--json F]
    .venv/bin/python scripts/bench_replicate.py --quick     # 5,000 files, 100 MiB

"Bytes on the wire" are counted by a TCP relay between the clients and the receiver: every
byte of every request and reply (headers included), also those of the Spark tasks, which run
in other processes. The first full copy goes straight to the receiver (the relay would cost
it CPU); its "bytes sent" is the chunk data the receiver stored.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_io import (Results, VENV_BIN, Workdir, machine_info, mount,  # noqa: E402
                      print_table, run, umount)

TOKEN = "bench-token-0123456789abcdef"
CHUNK = 1 << 20                     # the stores' chunk size (mkfs's default)
MB = 1e6


# ---- the receiver and the relay that counts its traffic -------------------------------------

class Receiver:
    """`mountfs serve-mirror STORE` on a free loopback port."""

    def __init__(self, store: Path, token_file: Path, chunk_size: str = "1M",
                 cgroup: "MemoryCgroup | None" = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = store.parent / f"{store.name}.serve-mirror.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [VENV_BIN / "mountfs", "serve-mirror", store, "--listen",
                 f"127.0.0.1:{self.port}", "--token-file", token_file,
                 "--chunk-size", chunk_size], stdout=log, stderr=log,
                preexec_fn=cgroup.enter if cgroup else None)
        wait_for_port(self.port, self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"serve-mirror exited ({proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("serve-mirror did not start")


class CountingRelay:
    """A TCP relay to ``port`` that counts the bytes it carries both ways. A byte is counted
    before it is passed on, so once a client has its reply the count includes it."""

    def __init__(self, port: int):
        self.target = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.count = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def take(self) -> int:
        """Bytes carried since the last call."""
        with self.lock:
            n, self.count = self.count, 0
        return n

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            done = threading.Semaphore(0)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst, done), daemon=True).start()
            threading.Thread(target=self._close_after, args=(client, upstream, done),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, done) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while n := src.recv_into(buf):
                with self.lock:
                    self.count += n
                dst.sendall(view[:n])
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            done.release()

    @staticmethod
    def _close_after(a: socket.socket, b: socket.socket, done) -> None:
        done.acquire()
        done.acquire()
        a.close()
        b.close()


# ---- the tree and its changes ---------------------------------------------------------------

def build_tree(root: Path, files: int, total: int, rng: random.Random) -> tuple[int, int]:
    """FILES files, log-uniform sizes from 1 KiB to 4 MiB scaled to about TOTAL bytes: every
    other file goes to big/ until it holds half of TOTAL, the rest spread over 100
    directories. Returns the bytes written, and those under big/."""
    sizes = [int(2 ** rng.uniform(10, 22)) for _ in range(files)]
    scale = total / sum(sizes)
    (root / "big").mkdir()
    for d in range(100):
        (root / f"d{d:02d}").mkdir()
    in_big = written = 0
    for i, size in enumerate(sizes):
        size = max(1, int(size * scale))
        written += size
        if i % 2 == 0 and in_big < total // 2:
            where, in_big = root / "big", in_big + size
        else:
            where = root / f"d{i % 100:02d}"
        (where / f"f{i:06d}").write_bytes(rng.randbytes(size))
    return written, in_big


def change_tree(root: Path, changed: int, rng: random.Random) -> int:
    """Rewrite 4 KiB in place in CHANGED files outside big/, rename big/, append 8 MiB to the
    largest file. Returns the bytes of the chunks these writes touched (each chunk's length
    in the final file): what an incremental copy has to send, worked out from the writes."""
    touched: dict[Path, set[int]] = {}
    victims = sorted(p for d in root.glob("d*") for p in d.iterdir())[:changed]
    for p in victims:
        size = p.stat().st_size
        off = rng.randrange(0, max(0, size - 4096) + 1)
        with open(p, "r+b") as h:
            h.seek(off)
            h.write(rng.randbytes(4096))
        touched.setdefault(p, set()).update(range(off // CHUNK, (off + 4095) // CHUNK + 1))
    os.rename(root / "big", root / "big-renamed")
    largest = max((p for d in [root / "big-renamed", *root.glob("d*")] for p in d.iterdir()),
                  key=lambda p: p.stat().st_size)
    old = largest.stat().st_size
    with open(largest, "ab") as h:
        h.write(rng.randbytes(8 << 20))
    touched.setdefault(largest, set()).update(range(old // CHUNK, (old + (8 << 20) - 1)
                                                    // CHUNK + 1))
    return sum(min(CHUNK, p.stat().st_size - i * CHUNK)
               for p, chunks in touched.items() for i in chunks)


def diff_stat_bytes(mnt: Path, frm: str, to: str) -> int:
    """`snapctl diff FROM TO --stat`: the bytes of the changed chunks of modified files plus
    the sizes of created files."""
    stat = json.loads(run(VENV_BIN / "snapctl", "-m", mnt, "diff", frm, to, "--stat",
                          "--json").stdout)
    return stat["modify"]["chunk_bytes_written"] + stat["create"]["chunk_bytes_written"]


def du_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---- the two ways of copying ----------------------------------------------------------------

def rsync(src: Path, dst: Path) -> tuple[float, int]:
    """Seconds and "Total bytes sent" of `rsync -a --delete --stats SRC/ DST/`."""
    t = time.monotonic()
    out = run("rsync", "-a", "--delete", "--stats", f"{src}/", f"{dst}/").stdout
    seconds = time.monotonic() - t
    sent = int(re.search(r"Total bytes sent: ([\d,]+)", out).group(1).replace(",", ""))
    return seconds, sent


MASTER = None                       # --cluster: the standalone master's URL


def replicate(mnt: Path, mirror, snapshot: str) -> dict:
    """One cycle in this process as the daemon runs it: Spark for every transfer (no
    small-transfer shortcut), its session already started (see main)."""
    from mountfs.mountinfo import find_mount
    from replicator.cycle import replicate as cycle
    try:
        return cycle(find_mount(str(mnt)).store, mirror, snapshot, master=MASTER).to_json()
    finally:
        mirror.close()


class StandaloneCluster:
    """A Spark standalone master and WORKERS workers (one core each) from pyspark's own
    bin/spark-class on loopback: the executors are other processes that read nothing of
    the source store, they fetch chunks from the replicating process's chunk endpoint."""

    def __init__(self, work: Path, workers: int):
        import pyspark
        home = Path(pyspark.__file__).parent
        port = free_port()
        self.url = f"spark://127.0.0.1:{port}"
        env = dict(os.environ, SPARK_HOME=str(home), SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_NO_DAEMONIZE="1", SPARK_LOG_DIR=str(work))
        spark_class = str(home / "bin" / "spark-class")
        self.procs = [subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(port), "--webui-port", str(free_port())], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        wait_for_port(port, self.procs[0])
        self.procs += [subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
             "--cores", "1", "--memory", "1g", "--webui-port", str(free_port()),
             "--work-dir", str(work / f"worker{i}"), self.url], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(workers)]
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"      # the driver and its chunk endpoint

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            proc.wait(timeout=60)


def http(url: str):
    from replicator.client import HttpMirror
    return HttpMirror(url, TOKEN)


def local(path: Path):
    from replicator.endpoints import LocalMirror
    return LocalMirror(path, CHUNK)


# ---- verify of a mirror of many chunk leaves ------------------------------------------------

def chunk_heavy_store(store: Path, leaves: int) -> None:
    """A store whose snapshot 'full' holds LEAVES chunk leaves: files of 10,000 64 KiB chunks,
    all with the same 64 KiB of data (the chunk maps are large, the data is one blob)."""
    from mountfs import schema as S
    from mountfs import snapshots
    from mountfs.namespace import Live
    from mountfs.store import Store
    import blake3
    run(VENV_BIN / "mountfs", "mkfs", "--chunk-size", "64K", store)
    data = os.urandom(64 << 10)
    digest = blake3.blake3(data).digest()
    s = Store.open(store)
    try:
        done, i = 0, 0
        while done < leaves:
            n = min(10_000, leaves - done)
            with s.write() as txn:
                live = Live(txn, s.db, snapshots.live_epoch(txn, s.db), s.chunk_size)
                ino, _ = live.create(S.ROOT_INO, f"file{i}".encode(), stat.S_IFREG | 0o644, 0, 0)
                for idx in range(n):
                    live.put_chunk(ino, idx, digest, data)
                live.save(ino, live.get(ino).evolve(size=n * (64 << 10)))
            done, i = done + n, i + 1
        with s.write() as txn:
            snapshots.create(txn, s.db, "full")
    finally:
        s.close()


def timed_cli(*args) -> float:
    t = time.monotonic()
    run(*args)
    return time.monotonic() - t


def bench_verify(work: Workdir, token: Path, leaves: int) -> dict:
    """`snapctl verify` against a receiver holding a copy of a LEAVES-leaf snapshot: its
    time (command included, against `snapctl list` as the command's own start-up), the
    same verify in-process, and the bytes on the wire."""
    from mountfs.mountinfo import find_mount
    from replicator.verify import verify
    store, mnt = work.path / "chunky", work.path / "cmnt"
    t = time.monotonic()
    chunk_heavy_store(store, leaves)
    build = time.monotonic() - t
    mnt.mkdir()
    mount(work, store, mnt)
    receiver = Receiver(work.path / "cmirror", token, "64K")
    relay = CountingRelay(receiver.port)
    try:
        copy = replicate(mnt, http(receiver.url), "full")     # one commit of LEAVES leaves
        relay.take()
        cli = [VENV_BIN / "snapctl", "-m", mnt]
        runs = [timed_cli(*cli, "verify", "--mirror", relay.url, "--token-file", token)
                for _ in range(3)]
        wire = relay.take() // 3
        startup = min(timed_cli(*cli, "list") for _ in range(3))
        mirror = http(receiver.url)
        try:
            t = time.monotonic()
            result = verify(find_mount(str(mnt)).store, mirror)
            inproc = time.monotonic() - t
        finally:
            mirror.close()
        if not result.clean:
            raise SystemExit(f"verify found differences: {result.to_json()}")
    finally:
        relay.close()
        receiver.stop()
        umount(work, mnt)
    return {"chunk_leaves": leaves, "build_seconds": build, "copy_seconds": copy["seconds"],
            "cli_seconds": sorted(runs)[1],
            "cli_startup_seconds": startup, "in_process_seconds": inproc, "wire_bytes": wire}


# ---- the run --------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--total-mib", type=int, default=2048)
    ap.add_argument("--changed", type=int, default=1000)
    ap.add_argument("--verify-chunks", type=int, default=1_000_000)
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--quick", action="store_true",
                    help="5,000 files, 100 MiB, 100 changed, 100,000 chunk leaves")
    ap.add_argument("--cluster", type=int, default=0, metavar="N",
                    help="replicate through a standalone Spark cluster of N one-core "
                         "workers on loopback (default: the embedded local[*])")
    ap.add_argument("--memory", metavar="FILES,CHANGES",
                    help="only measure peak memory (VmHWM and RssAnon) of the source and of "
                         "the receiver: a first copy of FILES files and an incremental of "
                         "CHANGES changes, stores built offline (e.g. 1000000,100000)")
    ap.add_argument("--memory-limit", metavar="MIB", type=int,
                    help="with --memory: run the source and the receiver each in a memory "
                         "cgroup limited to MIB (the kernel then reclaims the store's mapped "
                         "page cache; a cycle that needs more is OOM-killed)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.memory:
        files, changes = (int(n) for n in args.memory.split(","))
        results = Results("bench_replicate_memory", vars(args))
        with Workdir(args.workdir, "bench-repl-mem") as work:
            results.add("machine_start", machine_info(work.path))
            print(results.data["results"]["machine_start"])
            bench_memory(work, files, changes, results,
                         args.memory_limit << 20 if args.memory_limit else None)
            results.add("machine_end", machine_info(work.path))
            print(results.data["results"]["machine_end"])
        if args.json:
            results.write(args.json)
        return
    if args.quick:
        args.files, args.total_mib, args.changed, args.verify_chunks = 5000, 100, 100, 100_000
    results = Results("bench_replicate", vars(args))
    with Workdir(args.workdir, "bench-repl") as work:
        results.add("machine_start", machine_info(work.path))
        print(results.data["results"]["machine_start"])
        run_all(work, args, results)
        results.add("machine_end", machine_info(work.path))
        print(results.data["results"]["machine_end"])
    if args.json:
        results.write(args.json)


# ---- peak memory of a replication cycle (issue 11 point 3) ----------------------------------

class MemoryCgroup:
    """A memory cgroup of its own (v1 or v2, below this process's) with a hard limit: a
    process put in it (``enter``, before exec) is charged for its own memory *and* for the
    page cache it faults in (the store file it maps), and the kernel reclaims that cache
    rather than let the group pass the limit. A cycle that completes inside the limit
    needed no more; one that needed more is OOM-killed."""

    def __init__(self, name: str, limit: int):
        own = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = next((line.split(":", 2)[2] for line in own if ":memory:" in line), None)
        if v1 is not None:
            self.path = Path("/sys/fs/cgroup/memory") / v1.lstrip("/") / name
            self.limit_file, self.peak_file = "memory.limit_in_bytes", "memory.max_usage_in_bytes"
        else:
            v2 = next(line.split(":", 2)[2] for line in own if line.startswith("0::"))
            self.path = Path("/sys/fs/cgroup") / v2.lstrip("/") / name
            self.limit_file, self.peak_file = "memory.max", "memory.peak"
        self.path.mkdir()
        (self.path / self.limit_file).write_text(str(limit))

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_mib(self) -> float:
        return int((self.path / self.peak_file).read_text()) / (1 << 20)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


class Peak:
    """Samples a process's RssAnon (its own memory, not LMDB's page-cache mapping) every
    0.1 s; VmHWM (the kernel's exact peak RSS, mapped store pages included) is read by
    the caller while the process lives, or from wait4 once it exits."""

    def __init__(self, pid: int):
        self.pid, self.anon_kib, self.done = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.1):
            self.anon_kib = max(self.anon_kib, status_kib(self.pid, "RssAnon") or 0)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.anon_kib


def status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def measured_cycle(store: Path, url: str, token: Path, snapshot: str,
                   receiver: Receiver, work: Workdir,
                   cgroup: MemoryCgroup | None = None) -> dict:
    """One `snapctl replicate` (Spark kept out: all chunks sent from the source process) and
    the peak memory of both sides during it (the source's VmHWM from wait4's rusage)."""
    t = time.monotonic()
    out_path, err_path = work.path / "cycle.out", work.path / "cycle.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([VENV_BIN / "snapctl", "--store", store, "replicate",
                                 "--to", url, "--snapshot", snapshot, "--token-file", token,
                                 "--spark-threshold", "1T", "--json"], stdout=out, stderr=err,
                                preexec_fn=cgroup.enter if cgroup else None)
        src, dst = Peak(proc.pid), Peak(receiver.proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - t
    receiver_hwm = status_kib(receiver.proc.pid, "VmHWM")
    receiver_file = status_kib(receiver.proc.pid, "RssFile")
    if proc.returncode:
        raise SystemExit(f"replicate failed: {err_path.read_text().strip()} (the receiver's "
                         f"log: {receiver.log})")
    summary = json.loads(out_path.read_text())
    return {"seconds": seconds, "entries": summary["entries"], "inodes": summary["inodes"],
            "chunks_sent": summary["chunks_sent"],
            "source_vmhwm_mib": usage.ru_maxrss / 1024,
            "source_rss_anon_mib": src.stop() / 1024,
            "receiver_vmhwm_mib": receiver_hwm / 1024,
            "receiver_rss_file_mib_at_end": receiver_file / 1024,
            "receiver_rss_anon_mib": dst.stop() / 1024}


def bench_memory(work: Workdir, files: int, changes: int, results: Results,
                 limit: int | None = None) -> None:
    """A first copy of ``files`` files (built offline through the store API, 1,000 files a
    directory) and an incremental of ``changes`` changes (a quarter each of modifies,
    renames, creates, deletes), each to a fresh receiver process so that its VmHWM is that
    cycle's."""
    import bench_diff
    token = work.path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    store, mirror = work.path / "store", work.path / "mirror"
    t = time.monotonic()
    tree = bench_diff.build_tree(store, files, max(1, files // 1000))
    bench_diff.snapshot(store, "s0")
    print(f"built {files:,} files offline in {time.monotonic() - t:.0f} s")
    rows = []
    for label, snap in (("first copy", "s0"), ("incremental", "s1")):
        if snap == "s1":
            kinds = bench_diff.change_files(tree, changes)
            bench_diff.snapshot(store, "s1")
            label = f"incremental ({changes:,} changes: {kinds})"
        groups = [MemoryCgroup(f"bench-{side}-{os.getpid()}-{snap}", limit)
                  for side in ("source", "receiver")] if limit else [None, None]
        if limit:       # each side then faults in (and is charged for) every page it maps
            subprocess.run(["sync"], check=True)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        receiver = Receiver(mirror, token, cgroup=groups[1])
        try:
            figures = measured_cycle(store, receiver.url, token, snap, receiver, work,
                                     groups[0])
        finally:
            receiver.stop()
            if limit:
                figures_limit = {f"{side}_cgroup_peak_mib": g.peak_mib()
                                 for side, g in zip(("source", "receiver"), groups)}
                for g in groups:
                    g.remove()
        if limit:
            figures.update(figures_limit, cgroup_limit_mib=limit / (1 << 20))
            print(f"  inside a memory cgroup of {limit >> 20} MiB each: completed; cgroup "
                  f"peak (own memory + page cache charged) source "
                  f"{figures['source_cgroup_peak_mib']:.0f} MiB, receiver "
                  f"{figures['receiver_cgroup_peak_mib']:.0f} MiB")
        results.add(snap, figures)
        rows.append([label, f"{figures['seconds']:.0f}", figures["entries"], figures["inodes"],
                     f"{figures['source_vmhwm_mib']:.0f}",
                     f"{figures['source_rss_anon_mib']:.0f}",
                     f"{figures['receiver_vmhwm_mib']:.0f}",
                     f"{figures['receiver_rss_anon_mib']:.0f}"])
        print(rows[-1])
    print_table(f"peak memory of replication, {files:,} files (MiB)",
                ["cycle", "s", "names", "inodes", "source VmHWM", "source RssAnon",
                 "receiver VmHWM", "receiver RssAnon"], rows)


def run_all(work: Workdir, args, results: Results) -> None:
    rng = random.Random(42)
    token = work.path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)                        # serve-mirror refuses a token others can read
    store, mnt, plain = work.path / "store", work.path / "mnt", work.path / "plain"
    mnt.mkdir()
    plain.mkdir()
    run(VENV_BIN / "mountfs", "mkfs", "--chunk-size", "1M", store)
    mount(work, store, mnt)
    snapctl = [VENV_BIN / "snapctl", "-m", mnt]

    t = time.monotonic()
    total, big = build_tree(mnt, args.files, args.total_mib << 20, rng)
    build = time.monotonic() - t
    results.add("build", {"seconds": build, "bytes": total, "big_bytes": big})
    print(f"tree written through the mount: {args.files} files, {total / MB:.0f} MB in "
          f"{build:.1f} s ({args.files / build:.0f} files/s, {total / MB / build:.1f} MB/s)")
    run(*snapctl, "create", "s1")

    from replicator import transfer
    global MASTER
    cluster = StandaloneCluster(work.path, args.cluster) if args.cluster else None
    MASTER = cluster.url if cluster else None
    t = time.monotonic()
    transfer.spark_session(MASTER)            # once per process, as in the daemon
    if cluster:                               # wait until every executor has registered
        sc = transfer.spark_session().sparkContext
        while sc._jsc.sc().getExecutorMemoryStatus().size() < args.cluster + 1:
            time.sleep(0.2)
    results.add("spark_start_seconds", time.monotonic() - t)
    print(f"Spark session start-up (once per daemon): {time.monotonic() - t:.1f} s")

    receiver = Receiver(work.path / "mirror", token)
    relay = CountingRelay(receiver.port)
    try:
        first = replicate(mnt, http(receiver.url), "s1")
        print(f"first copy: {first['seconds']:.1f} s, per executor {first['executors']}")
        r1 = rsync(mnt / ".snapshot/s1", plain)
        # a cluster's executors cannot write a file:// mirror (refused): skipped there
        f1 = None if MASTER else replicate(mnt, local(work.path / "fmirror"), "s1")
        expected = change_tree(mnt, args.changed, rng)
        run(*snapctl, "create", "s2")
        changed = diff_stat_bytes(mnt, "s1", "s2")
        relay.take()
        second = replicate(mnt, http(relay.url), "s2")
        second["wire_bytes"] = relay.take()
        r2 = rsync(mnt / ".snapshot/s2", plain)
        f2 = None if MASTER else replicate(mnt, local(work.path / "fmirror"), "s2")

        run(*snapctl, "create", "s3")
        moved = du_bytes(mnt / "big-renamed")
        os.rename(mnt / "big-renamed", mnt / "big-again")
        run(*snapctl, "create", "s4")
        replicate(mnt, http(relay.url), "s3")
        relay.take()
        rename = replicate(mnt, http(relay.url), "s4")
        rename["wire_bytes"] = relay.take()
        rename["moved_bytes"] = moved
    finally:
        relay.close()
        receiver.stop()
    results.add("first", first)
    results.add("second", second)
    results.add("rsync_first", {"seconds": r1[0], "bytes_sent": r1[1]})
    results.add("rsync_second", {"seconds": r2[0], "bytes_sent": r2[1]})
    results.add("file_first", f1)
    results.add("file_second", f2)
    results.add("changed_chunk_bytes", {"diff_stat": changed, "from_writes": expected})
    results.add("rename_only", rename)
    umount(work, mnt)

    try:
        ver = bench_verify(work, token, args.verify_chunks)
    finally:
        if cluster:
            cluster.stop()
    results.add("verify", ver)
    report(args, total, big, first, second, r1, r2, f1, f2, changed, expected, rename, ver)


def row(name, mine, base, ratio, target="", ok=None) -> list:
    verdict = "" if ok is None else ("PASS" if ok else "MISS")
    return [name, mine, base, f"{ratio:.2f}" if ratio is not None else "", target, verdict]


def report(args, total, big, first, second, r1, r2, f1, f2, changed, expected, rename,
           ver) -> None:
    print(f"\n{args.files} files, {total / MB:.0f} MB ({big / MB:.0f} MB under big/); "
          f"changed chunk bytes: {changed} (snapctl diff --stat), {expected} (worked out "
          f"from the writes)")
    rows = [
        row("first copy, s (http)", f"{first['seconds']:.1f}", f"{r1[0]:.1f} rsync",
            r1[0] / first["seconds"], "throughput >= 0.5x rsync's",
            r1[0] / first["seconds"] >= 0.5),
        row("first copy, bytes sent", first["bytes_sent"], f"{r1[1]} rsync",
            first["bytes_sent"] / r1[1]),
        row("incremental, s (http)", f"{second['seconds']:.2f}", f"{r2[0]:.1f} rsync",
            r2[0] / second["seconds"], ">= 10x faster than rsync",
            r2[0] / second["seconds"] >= 10),
        row("incremental, chunk bytes sent", second["bytes_sent"], f"{changed} changed",
            second["bytes_sent"] / changed),
        row("incremental, bytes on the wire", second["wire_bytes"], f"{changed} changed",
            second["wire_bytes"] / changed, "<= 1.1x changed chunk bytes",
            second["wire_bytes"] <= 1.1 * changed),
        row("incremental, rsync bytes sent", second["wire_bytes"], f"{r2[1]} rsync",
            second["wire_bytes"] / r2[1]),
        row("rename only, bytes on the wire", rename["wire_bytes"],
            f"{rename['moved_bytes']} moved", rename["wire_bytes"] / rename["moved_bytes"],
            "< 1 MiB", rename["wire_bytes"] < 1 << 20),
        row("rename only, s (http)", f"{rename['seconds']:.2f}", "", None),
        row(f"verify {ver['chunk_leaves']} leaves, s", f"{ver['cli_seconds']:.2f}",
            f"{ver['cli_startup_seconds']:.2f} snapctl list",
            ver["cli_seconds"] / ver["cli_startup_seconds"], "< 1 s",
            ver["cli_seconds"] < 1),
        row("verify, in-process s", f"{ver['in_process_seconds']:.3f}", "", None),
        row(f"copy of {ver['chunk_leaves']} leaves, s", f"{ver['copy_seconds']:.2f}", "",
            None),
        row("verify, bytes on the wire", ver["wire_bytes"], "", None, "< 64 KiB",
            ver["wire_bytes"] < 64 << 10),
    ]
    if f1 and f2:                  # embedded Spark only
        rows[2:2] = [row("first copy, s (file://)", f"{f1['seconds']:.1f}",
                         f"{r1[0]:.1f} rsync", r1[0] / f1["seconds"])]
        rows[4:4] = [row("incremental, s (file://)", f"{f2['seconds']:.2f}",
                         f"{r2[0]:.1f} rsync", r2[0] / f2["seconds"])]
    print_table(f"replication ({MASTER or 'embedded local[*]'})", ["figure", "replicate", "baseline", "ratio",
                                          "target", ""], rows)


if __name__ == "__main__":
    main()
