"""``mountfs fsck``: check every invariant of a store, and every chunk's digest. It reports;
it never repairs. Each check names the invariant it guards (see schema.py); the rules of
one inode are mountfs.invariants, which a mirror's receiver enforces on every commit too:

* tree shape at every retained epoch: every entry names an inode that exists, no directory is
  reachable twice, every live inode is reachable or a recorded orphan;
* link counts: a file's nlink is the number of names it has, a directory's is 2 + subdirs;
* mepoch: no inode is older than any version of its own records, nor than any child;
* the live parents table matches the live directory entries;
* chunk data: every chunk-map version names stored data of the right length, reference counts
  equal the number of chunk-map versions naming each digest, no data is unreferenced, and
  every stored chunk hashes (blake3) to its name;
* epochs: no version is newer than the live epoch; snapshots are consistent.
"""

from __future__ import annotations

import stat
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import blake3

from . import buckets, chunkfile, invariants
from . import schema as S
from .namespace import View
from .snapshots import interrupted_at, list_all, live_epoch
from .store import Store, iter_visible


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    inodes: int = 0
    chunks: int = 0
    snapshots: int = 0

    def summary(self) -> str:
        state = f"{len(self.problems)} problem(s)" if self.problems else "no problems"
        return (f"fsck: {state}; checked {self.snapshots} snapshot(s) and the live tree, "
                f"{self.inodes} inode version(s), {self.chunks} chunk(s)")


def check(store: Store, progress=None) -> Report:
    report = Report()
    say = progress or (lambda msg: None)
    with store.read() as txn:
        dbs = store.db
        live = live_epoch(txn, dbs)
        snaps = list_all(txn, dbs)
        report.snapshots = len(snaps)
        _check_meta(txn, dbs, live, snaps, report)
        for snap in snaps:
            say(f"checking snapshot {snap.name} (epoch {snap.epoch})")
            _check_tree(View(txn, dbs, snap.epoch, store.chunk_size), report,
                        f"snapshot {snap.name}", live=False)
        before = interrupted_at(txn, dbs)
        if before is None:
            say("checking the live tree")
            _check_tree(View(txn, dbs, live, store.chunk_size), report, "live tree",
                        live=True)
        else:
            say("a change of the live tree was cut short (a mirror's commit): checking the "
                "live tree as it was before it, which the next writer puts back")
            _check_tree(View(txn, dbs, before, store.chunk_size), report, "live tree",
                        live=False)
        say("checking bucket hashes")
        for name, epoch in [(f"snapshot {s.name}", s.epoch) for s in snaps] + \
                [("live tree", live if before is None else before)]:
            _check_buckets(txn, dbs, epoch, store.bucket_count, name, report)
        say("checking chunk data")
        _check_chunks(txn, dbs, store.chunk_size, report)
    return report


def _check_buckets(txn, dbs, epoch: int, count: int, where: str, report: Report) -> None:
    """The incrementally kept bucket hashes must equal those recomputed from the items."""
    kept = buckets.at(txn, dbs, epoch, count)
    for b, (have, want) in enumerate(zip(kept, buckets.compute(txn, dbs, epoch, count))):
        if have != want:
            report.problems.append(f"{where}: bucket {b} hash does not match its items")


def _check_meta(txn, dbs, live: int, snaps, report: Report) -> None:
    next_ino = S.from_u64(txn.get(b"next_ino", db=dbs["meta"]))
    for dbname in S.VERSIONED_DBS:
        for key in txn.cursor(db=dbs[dbname]).iternext(values=False):
            epoch = S.epoch_of_key(bytes(key))
            if epoch > live:
                report.problems.append(f"{dbname}: a version from epoch {epoch} is newer than "
                                       f"the live epoch {live}")
            if S.from_u64(key[:8]) >= next_ino:
                report.problems.append(f"{dbname}: inode {S.from_u64(key[:8])} is not below "
                                       f"the next inode number {next_ino}")
    epochs = Counter(s.epoch for s in snaps)
    for snap in snaps:
        if snap.epoch >= live:
            report.problems.append(f"snapshot {snap.name}: epoch {snap.epoch} is not older "
                                   f"than the live epoch {live}")
        if epochs[snap.epoch] > 1:
            report.problems.append(f"snapshot {snap.name}: epoch {snap.epoch} is shared")
    if txn.stat(dbs["snaps"])["entries"] != len(snaps):
        report.problems.append("snapshot tables disagree (names vs epochs)")


def _check_tree(view: View, report: Report, where: str, live: bool) -> None:
    names = Counter()
    subdirs = {}
    seen_dirs = set()
    reached = set()
    parents = Counter()
    todo = [S.ROOT_INO]
    root = view.inode(S.ROOT_INO)
    if root is None or not stat.S_ISDIR(root.mode):
        report.problems.append(f"{where}: the root directory is missing")
        return
    while todo:
        d = todo.pop()
        if d in seen_dirs:
            report.problems.append(f"{where}: directory {d} is reachable more than once")
            continue
        seen_dirs.add(d)
        reached.add(d)
        drec = view.get(d)
        subdirs[d] = 0
        for name, child in view.listdir(d):
            crec = view.inode(child)
            if crec is None:
                report.problems.append(f"{where}: entry {name!r} in directory {d} names "
                                       f"inode {child}, which does not exist")
                continue
            names[child] += 1
            parents[(child, d, bytes(name))] += 1
            reached.add(child)
            if crec.mepoch > drec.mepoch:
                report.problems.append(f"{where}: directory {d} has mepoch {drec.mepoch}, "
                                       f"older than its child {child} ({crec.mepoch})")
            if stat.S_ISDIR(crec.mode):
                subdirs[d] += 1
                todo.append(child)
    for ino in reached:
        rec = view.get(ino)
        report.inodes += 1
        report.problems += [f"{where}: {p}" for p in invariants.inode_problems(
            view, ino, rec, names[ino], subdirs.get(ino, 0))]
    if live:
        _check_live_extras(view, reached, parents, report)


def _check_live_extras(view: View, reached: set, parents: Counter, report: Report) -> None:
    txn, dbs = view.txn, view.db
    stored = Counter()
    for key in txn.cursor(db=dbs["parents"]).iternext(values=False):
        key = bytes(key)
        stored[(S.from_u64(key[:8]), S.from_u64(key[8:16]), key[16:])] += 1
    if stored != parents:
        diff = set(stored.items()) ^ set(parents.items())
        report.problems.append(f"live tree: the parents table disagrees with the directory "
                               f"entries at {len(diff)} place(s), e.g. {sorted(diff)[:3]}")
    orphans = {S.from_u64(k) for k in txn.cursor(db=dbs["orphans"]).iternext(values=False)}
    for base, value in iter_visible(txn, dbs["inodes"], b"", view.epoch):
        ino = S.from_u64(base)
        if ino not in reached and ino not in orphans:
            report.problems.append(f"live tree: inode {ino} exists but has no name and is not "
                                   f"a recorded orphan")


def _check_chunks(txn, dbs, chunk_size: int, report: Report) -> None:
    refs = Counter()
    lengths = defaultdict(set)
    for key, value in txn.cursor(db=dbs["chunks"]):
        if len(value):
            digest, length = S.unpack_chunk(value)
            refs[digest] += 1
            lengths[digest].add(length)
    stored = {bytes(k): S.from_u64(v) for k, v in txn.cursor(db=dbs["refs"])}
    for digest in set(refs) | set(stored):
        if refs[digest] != stored.get(digest, 0):
            report.problems.append(f"chunk {digest.hex()[:16]}: reference count "
                                   f"{stored.get(digest, 0)}, but {refs[digest]} chunk-map "
                                   f"version(s) name it")
    blobs = 0
    for key, data in txn.cursor(db=dbs["blobs"]):
        key = bytes(key)
        if len(key) != S.DIGEST_SIZE and txn.get(key, db=dbs["staged"]) is not None:
            continue              # a changeset part staged on a mirror, not a chunk
        blobs += 1
        if key not in stored and txn.get(key, db=dbs["staged"]) is None:
            report.problems.append(f"chunk {key.hex()[:16]}: stored but unreferenced")
        if blake3.blake3(data).digest() != key:
            report.problems.append(f"chunk {key.hex()[:16]}: data does not match its digest "
                                   f"(corrupt)")
        if lengths[key] and lengths[key] != {len(data)}:
            report.problems.append(f"chunk {key.hex()[:16]}: stored length {len(data)} but "
                                   f"chunk maps say {sorted(lengths[key])}")
    blobs += _check_slots(txn, dbs, chunk_size, stored, lengths, report)
    for digest in stored:
        if not chunkfile.has(txn, dbs, digest):
            report.problems.append(f"chunk {digest.hex()[:16]}: referenced but missing")
    report.chunks = blobs


def _check_slots(txn, dbs, chunk_size: int, stored: dict, lengths, report: Report) -> int:
    """The chunk file's invariants (chunkfile.py): each slot below ``next_slot`` named once,
    by a chunk or as free; a chunk in a slot is referenced, in no blob, and its bytes there
    match its digest. Returns the number of chunks in slots."""
    raw = txn.get(chunkfile.NEXT_SLOT, db=dbs["meta"])
    end = S.from_u64(raw) if raw is not None else 0
    named = Counter()
    for key in txn.cursor(db=dbs["freeslots"]).iternext(values=False):
        key = bytes(key)
        if len(key) != 16 or S.from_u64(key[:8]) > txn.id():
            report.problems.append(f"chunk file: free-slot record {key.hex()} is malformed "
                                   f"(or names a transaction still to come: never reused)")
            continue
        named[S.from_u64(key[8:16])] += 1
    chunks = 0
    for key, value in txn.cursor(db=dbs["slots"]):
        digest, value = bytes(key), bytes(value)
        if len(digest) != S.DIGEST_SIZE or len(value) != 8:
            report.problems.append(f"chunk file: slot record {digest.hex()[:16]} -> "
                                   f"{value.hex()} is malformed")
            continue
        slot = S.from_u64(value)
        chunks += 1
        named[slot] += 1
        where = f"chunk {digest.hex()[:16]} (slot {slot})"
        if digest not in stored:
            report.problems.append(f"{where}: stored but unreferenced")
        if txn.get(digest, db=dbs["blobs"]) is not None:
            report.problems.append(f"{where}: stored twice, also in LMDB")
        data = dbs.chunkfile.read(slot) if slot < end else b""
        if blake3.blake3(data).digest() != digest:
            report.problems.append(f"{where}: data in the chunk file does not match its "
                                   f"digest (corrupt or missing)")
        if lengths[digest] and lengths[digest] != {chunk_size}:
            report.problems.append(f"{where}: a full chunk, but chunk maps say "
                                   f"{sorted(lengths[digest])}")
    unnamed = end - sum(1 for slot in named if slot < end)
    if unnamed:
        report.problems.append(f"chunk file: {unnamed} slot(s) below {end} are neither in "
                               f"use nor free (leaked)")
    for slot, n in sorted(named.items()):
        if slot >= end:
            report.problems.append(f"chunk file: slot {slot} is named but beyond its last "
                                   f"({end})")
        elif n > 1:
            report.problems.append(f"chunk file: slot {slot} is named {n} times")
    return chunks
