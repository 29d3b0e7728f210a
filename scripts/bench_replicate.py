#!/usr/bin/env python3
"""Replication vs rsync, and the cost of verify (issue 4).

A tree of FILES files (mixed sizes) is written through a mount, snapshotted and replicated
to a `mountfs serve-mirror` receiver on loopback; then CHANGED files are rewritten in part, a
directory holding about half the data is renamed, a large file is appended to, and the next
snapshot is replicated. In the same run `rsync -a --delete --stats` copies the mount to a
plain directory for the same two steps. Printed: cycle time and bytes sent for both, the
changed chunk bytes, the ratios, and `snapctl verify` of a mirror of CHUNKS chunk leaves
(time and bytes on the wire).

    .venv/bin/python scripts/bench_replicate.py [--files N] [--total-mib M] [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOP = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TOKEN = "bench-token-0123456789abcdef"


def run(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True,
                          **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    def __init__(self, store: Path, token_file: Path, chunk_size: str = "1M"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([BIN / "mountfs", "serve-mirror", store, "--listen",
                                      f"127.0.0.1:{self.port}", "--token-file", token_file,
                                      "--chunk-size", chunk_size],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("serve-mirror did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def build_tree(root: Path, files: int, total: int, rng: random.Random) -> None:
    """FILES files in 100 directories; sizes from a few KiB to a few MiB (log-uniform),
    scaled to about TOTAL bytes; 'big/' holds about half of the data."""
    sizes = [int(2 ** rng.uniform(10, 22)) for _ in range(files)]
    scale = total / sum(sizes)
    (root / "big").mkdir()
    for d in range(100):
        (root / f"d{d:02d}").mkdir()
    placed = 0
    for i, size in enumerate(sizes):
        size = max(1, int(size * scale))
        where = root / "big" if placed < total // 2 and i % 2 == 0 else root / f"d{i % 100:02d}"
        (where / f"f{i:06d}").write_bytes(rng.randbytes(size))
        placed += size


def change_tree(root: Path, changed: int, rng: random.Random) -> None:
    victims = sorted(p for p in root.rglob("f*") if p.parent.name != "big")[:changed]
    for p in victims:                                   # rewrite 4 KiB in place
        with open(p, "r+b") as h:
            h.seek(rng.randrange(0, max(1, p.stat().st_size - 4096) + 1))
            h.write(rng.randbytes(4096))
    os.rename(root / "big", root / "big-renamed")        # about half of all the data
    largest = max(root.rglob("f*"), key=lambda p: p.stat().st_size)
    with open(largest, "ab") as h:
        h.write(rng.randbytes(8 << 20))


def rsync(src: Path, dst: Path) -> tuple[float, int]:
    t = time.monotonic()
    out = run("rsync", "-a", "--delete", "--stats", f"{src}/", f"{dst}/").stdout
    seconds = time.monotonic() - t
    sent = int(re.search(r"Total bytes sent: ([\d,]+)", out).group(1).replace(",", ""))
    return seconds, sent


def replicate(mnt: Path, url: str, token_file: Path, snapshot: str) -> dict:
    """One cycle in this process, as the daemon runs it: Spark always (no small-transfer
    shortcut), its session started once beforehand (see main)."""
    sys.path.insert(0, str(TOP))
    from mountfs.mount import find_mount
    from replicator.client import HttpMirror
    from replicator.cycle import replicate as cycle
    mirror = HttpMirror(url, token_file.read_text().strip())
    try:
        return cycle(find_mount(str(mnt)).store, mirror, snapshot).to_json()
    finally:
        mirror.close()


def changed_chunk_bytes(store: Path, frm: str, to: str) -> int:
    sys.path.insert(0, str(TOP))
    from mountfs import snapshots
    from mountfs.store import Store
    from replicator import changeset
    s = Store.open(store, readonly=True, lock=False)
    try:
        with s.read() as txn:
            epochs = {x.name: x.epoch for x in snapshots.list_all(txn, s.db)}
            cs = changeset.build(txn, s.db, s.chunk_size, epochs[frm], epochs[to])
        return sum(v[1] for leaves in cs.chunks.values() for v in leaves.values() if v)
    finally:
        s.close()


def verify_wire(mnt: Path, url: str, token: str) -> tuple[float, int]:
    """snapctl verify's time, and the bytes its requests and replies carry (counted by
    running the same verify in-process through an httpx client that tallies bodies)."""
    t = time.monotonic()
    run(BIN / "snapctl", "-m", mnt, "verify", "--mirror", url, "--token-file", token)
    cli_seconds = time.monotonic() - t
    sys.path.insert(0, str(TOP))
    from mountfs.mount import find_mount
    from replicator import client
    from replicator.verify import verify
    counted = [0]
    real = client._call

    def counting(c, method, path, body=None):
        res = real(c, method, path, body)
        counted[0] += len(body or b"") + len(res.content)
        return res
    client._call = counting
    mirror = client.HttpMirror(url, TOKEN)
    try:
        t = time.monotonic()
        result = verify(find_mount(str(mnt)).store, mirror)
        seconds = time.monotonic() - t
    finally:
        mirror.close()
        client._call = real
    assert result.clean, result.to_json()
    return min(cli_seconds, seconds), counted[0]


def chunk_heavy_store(work: Path, leaves: int) -> Path:
    """A mounted store whose snapshot holds LEAVES chunk leaves (files of 64 KiB chunks, the
    same 4 KiB of data in every chunk: the mirror's chunk maps, not its data, are large)."""
    sys.path.insert(0, str(TOP))
    from mountfs import schema as S
    from mountfs import snapshots
    from mountfs.namespace import Live
    from mountfs.store import Store
    import blake3
    store = work / "chunky"
    Store.mkfs(store, 64 << 10)
    data = os.urandom(4096)
    digest = blake3.blake3(data).digest()
    s = Store.open(store)
    per_file, done, i = 10_000, 0, 0
    while done < leaves:
        with s.write() as txn:
            live = Live(txn, s.db, snapshots.live_epoch(txn, s.db), s.chunk_size)
            ino, _ = live.create(S.ROOT_INO, f"file{i}".encode(), stat.S_IFREG | 0o644, 0, 0)
            n = min(per_file, leaves - done)
            for idx in range(n):
                live.put_chunk(ino, idx, digest, data)
            live.save(ino, live.get(ino).evolve(size=(n - 1) * (64 << 10) + 4096))
        done += n
        i += 1
    with s.write() as txn:
        snapshots.create(txn, s.db, "full")
    s.close()
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--total-mib", type=int, default=2048)
    ap.add_argument("--changed", type=int, default=1000)
    ap.add_argument("--verify-chunks", type=int, default=1_000_000)
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--quick", action="store_true", help="5,000 files, 100 MiB, 100k chunks")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.files, args.total_mib, args.changed, args.verify_chunks = 5000, 100, 100, 100_000
    rng = random.Random(42)
    work = Path(tempfile.mkdtemp(prefix="bench-repl-", dir=args.workdir))
    token = work / "token"
    token.write_text(TOKEN)
    store, mnt, plain = work / "store", work / "mnt", work / "plain"
    mnt.mkdir()
    plain.mkdir()
    run(BIN / "mountfs", "mkfs", store)
    run(BIN / "mountfs", "mount", store, mnt)
    receiver = None
    results: dict = {"files": args.files, "total_mib": args.total_mib}
    try:
        t = time.monotonic()
        build_tree(mnt, args.files, args.total_mib << 20, rng)
        results["build_seconds"] = time.monotonic() - t
        run(BIN / "snapctl", "-m", mnt, "create", "s1")
        receiver = Receiver(work / "mirror", token)
        sys.path.insert(0, str(TOP))
        from replicator import transfer
        t = time.monotonic()
        transfer.spark_session()                      # once per process, like the daemon
        results["spark_start_seconds"] = time.monotonic() - t
        print(f"Spark session start-up (once per daemon): {results['spark_start_seconds']:.1f} s")
        first = replicate(mnt, receiver.url, token, "s1")
        r1 = rsync(mnt / ".snapshot/s1", plain)
        change_tree(mnt, args.changed, rng)
        run(BIN / "snapctl", "-m", mnt, "create", "s2")
        changed = changed_chunk_bytes(store, "s1", "s2")
        second = replicate(mnt, receiver.url, token, "s2")
        r2 = rsync(mnt / ".snapshot/s2", plain)
        results.update(first=first, second=second, rsync_first=r1, rsync_second=r2,
                       changed_chunk_bytes=changed)
        total = args.total_mib << 20
        rows = [
            ("first copy s", first["seconds"], r1[0], r1[0] / first["seconds"],
             "replicate >= 0.5x rsync throughput", r1[0] / first["seconds"] >= 0.5),
            ("first copy bytes sent", first["bytes_sent"], r1[1], r1[1] / max(1, first["bytes_sent"]),
             "", True),
            ("incremental s", second["seconds"], r2[0], r2[0] / second["seconds"],
             ">= 10x faster than rsync", r2[0] / second["seconds"] >= 10),
            ("incremental bytes sent", second["bytes_sent"], r2[1],
             r2[1] / max(1, second["bytes_sent"]), "<= 1.1x changed chunk bytes",
             second["bytes_sent"] <= 1.1 * changed),
        ]
        receiver.stop()
        receiver = None
        print(f"{args.files} files, {total >> 20} MiB; changed chunk bytes {changed}")
        print(f"{'figure':<24} {'replicate':>12} {'rsync':>12} {'ratio':>8}  target")
        for name, mine, theirs, ratio, target, ok in rows:
            print(f"{name:<24} {mine:>12.6g} {theirs:>12.6g} {ratio:>8.2f}  {target}"
                  f"{'' if not target else (' PASS' if ok else ' MISS')}")
        # the directory rename alone
        run(BIN / "snapctl", "-m", mnt, "create", "s3")
        os.rename(mnt / "big-renamed", mnt / "big-again")
        run(BIN / "snapctl", "-m", mnt, "create", "s4")
        receiver = Receiver(work / "mirror", token)
        replicate(mnt, receiver.url, token, "s3")
        rename = replicate(mnt, receiver.url, token, "s4")
        results["rename_only"] = rename
        print(f"rename of a directory holding ~{total >> 21} MiB: {rename['bytes_sent']} bytes "
              f"sent, {rename['seconds']:.2f} s  (target < 1 MiB: "
              f"{'PASS' if rename['bytes_sent'] < 1 << 20 else 'MISS'})")
        receiver.stop()
        receiver = None
        # verify of a mirror holding many chunk leaves
        chunky = chunk_heavy_store(work, args.verify_chunks)
        cmnt = work / "cmnt"
        cmnt.mkdir()
        run(BIN / "mountfs", "mount", chunky, cmnt)
        try:
            receiver = Receiver(work / "cmirror", token, "64K")
            replicate(cmnt, receiver.url, token, "full")
            seconds, wire = verify_wire(cmnt, receiver.url, token)
        finally:
            run(BIN / "mountfs", "umount", cmnt)
        results["verify"] = {"chunks": args.verify_chunks, "seconds": seconds, "wire_bytes": wire}
        print(f"verify of a mirror with {args.verify_chunks} chunk leaves, nothing wrong: "
              f"{seconds * 1000:.0f} ms, {wire} bytes on the wire (targets < 1 s, < 64 KiB: "
              f"{'PASS' if seconds < 1 and wire < 64 << 10 else 'MISS'})")
    finally:
        if receiver:
            receiver.stop()
        subprocess.run([BIN / "mountfs", "umount", mnt], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
