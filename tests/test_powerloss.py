"""Power loss (a system crash, not a process crash): the store's two files of data, LMDB's
``data.mdb`` and the chunk file ``chunks.dat`` (mountfs/chunkfile.py), live on a recording
filesystem (tests/recordfs.py) that logs every write and every fsync reaching it while a real
mount runs a workload with fsyncs and snapshots, and with files of several full chunks written,
overwritten and deleted so that slots of the chunk file are freed and reused. Both files are
then rebuilt as a power loss could leave them at many cut points: each file holds everything
written to it up to its own last completed sync before the cut, plus a subset of its writes
after that sync (all of them, a prefix, random subsets, the subset of each file drawn
independently; fixed seed). Each rebuilt store must open, pass fsck (which checks that every
slot named holds its chunk), and hold every fsync'ed file and every snapshot whose
``snapctl create`` had returned by that cut."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli

from mountfs import chunkfile, fsck, snapshots
from mountfs import schema as S
from mountfs.namespace import View
from mountfs.store import Store

sys.path.insert(0, str(Path(__file__).parent))
from recordfs import HEADER  # noqa: E402

pytestmark = pytest.mark.fuse
CUTS = 40
SEED = 12
MIB = 1 << 20
DATA_FILES = ("data.mdb", "chunks.dat")


def read_log(path: Path) -> list[tuple[str, int, int, bytes]]:
    raw = path.read_bytes()
    out, pos = [], 0
    while pos + HEADER.size <= len(raw):
        kind, ino, off, n = HEADER.unpack_from(raw, pos)
        pos += HEADER.size
        out.append((chr(kind), ino, off, raw[pos:pos + n]))
        pos += n
    return out


def log_position(path: Path) -> int:
    """Records in the log so far (the recorder writes each before answering)."""
    return len(read_log(path))


def rebuild(records, ino: int, cut: int, keep) -> bytes:
    """The file ``ino`` as a disk could hold it after a power loss at record ``cut``: every
    write up to the last sync before ``cut``, then the writes after it that ``keep`` picks
    (a predicate on their index among those writes)."""
    synced = max([i for i in range(cut) if records[i][0] == "S" and records[i][1] == ino],
                 default=-1)
    data = bytearray()

    def apply(kind, off, payload):
        nonlocal data
        if kind == "T":
            data = data[:off] + bytearray(max(0, off - len(data)))
        elif kind == "W":
            if len(data) < off:
                data += bytes(off - len(data))
            data[off:off + len(payload)] = payload

    for kind, i, off, payload in records[:synced + 1]:
        if i == ino:
            apply(kind, off, payload)
    pending = [r for r in records[synced + 1:cut] if r[1] == ino and r[0] in "WT"]
    for n, (kind, _, off, payload) in enumerate(pending):
        if keep(n, len(pending)):
            apply(kind, off, payload)
    return bytes(data)


def check_store(path: Path, promised_files, promised_snaps) -> str | None:
    """None if the store is whole and holds everything promised, else what is wrong. Runs in
    a child process: a corrupt data file can crash its reader (SIGBUS from the mmap)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            problem = _check_store(path, promised_files, promised_snaps) or ""
        except BaseException as e:
            problem = f"{type(e).__name__}: {e}"
        os.write(wfd, problem.encode()[:4000])
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        answer = r.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"the reader died of signal {os.WTERMSIG(status)} (corrupt data file)"
    return answer or None


def _check_store(path: Path, promised_files, promised_snaps) -> str | None:
    try:
        st = Store.open(path, readonly=False, lock=True, holder="powerloss test")
    except Exception as e:
        return f"does not open: {e}"
    try:
        report = fsck.check(st)
        if report.problems:
            return f"fsck: {len(report.problems)} problem(s), first: {report.problems[0]}"
        with st.read() as txn:
            live = st.live_epoch(txn)
            view = View(txn, st.db, live, st.chunk_size)
            for name, content in promised_files.items():
                ino = view.resolve(name)
                got = view.read(ino, 0, len(content) + 1, view.get(ino).size)
                if got != content:
                    return f"fsync'ed file {name} differs ({len(got)} vs {len(content)} bytes)"
            for name in promised_snaps:
                snapshots.get(txn, st.db, name)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        st.close()
    return None


@pytest.fixture
def recorded(tmp_path):
    """A recording filesystem at tmp_path/rec logging to tmp_path/log."""
    backing, rec, log = tmp_path / "backing", tmp_path / "rec", tmp_path / "log"
    backing.mkdir()
    rec.mkdir()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "recordfs.py"),
                             backing, rec, log])
    for _ in range(500):
        if os.path.ismount(rec):
            break
        assert proc.poll() is None, "recordfs did not start"
        time.sleep(0.02)
    yield rec, log
    subprocess.run(["fusermount3", "-u", str(rec)], capture_output=True)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        subprocess.run(["fusermount3", "-uz", str(rec)], capture_output=True)


def workload(m, log: Path):
    """Writes, overwrites, deletes and renames (so LMDB frees and reuses pages), files of
    one to three full chunks (1 MiB, the default chunk size) written whole, overwritten and
    deleted (so slots of the chunk file are freed, and reused), with fsyncs and snapshots
    (a deleted one frees the slots only it still held). Returns [(log position when
    promised, kind, name, content)]."""
    rnd = random.Random(SEED)
    promises = []
    for round_ in range(6):
        for i in range(20):
            p = m.mnt / f"f{i % 12}"
            p.write_bytes(rnd.randbytes(rnd.choice([100, 5000, 70000, 300000])))
        for i in range(4):
            p = m.mnt / f"big{rnd.randrange(5)}"
            p.write_bytes(rnd.randbytes(rnd.randint(1, 3) * MIB + rnd.choice([0, 0, 50000])))
        for i in range(0, 12, 3):
            os.rename(m.mnt / f"f{i}", m.mnt / f"g{round_}-{i}")
        for name in os.listdir(m.mnt):
            if name.startswith("g") and rnd.random() < 0.5:
                os.unlink(m.mnt / name)
            elif name.startswith("big") and rnd.random() < 0.25:
                os.unlink(m.mnt / name)
        name = f"durable{round_}"
        content = rnd.randbytes((round_ % 3) * MIB + 200000 + round_)
        with open(m.mnt / name, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        promises.append((log_position(log), "file", name, content))
        if round_ % 2:
            snap = f"s{round_}"
            m.snapctl("create", snap)
            promises.append((log_position(log), "snapshot", snap, None))
        if round_ == 3:
            m.snapctl("delete", "s1")        # frees pages the next rounds reuse
            promises = [p for p in promises if p[2] != "s1"]
    return promises


@pytest.fixture
def recorded_store(recorded, tmp_path):
    """A store whose data file and chunk file are the recording filesystem's (each
    bind-mounted over a file of the store: a store's paths are never links,
    mountfs.strictmodes), its other files beside them; and the log position from which it
    exists. Unmounted after the mount's own teardown (its fsck) and before the recording
    filesystem's."""
    rec, log = recorded
    cli("mountfs", "mkfs", rec)
    (rec / "chunks.dat").touch(mode=0o600)  # mkfs makes none (a first writer does): bind it
    made = log_position(log)
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    for name in DATA_FILES:
        (store / name).touch(mode=0o600)
        subprocess.run(["mount", "--bind", rec / name, store / name], check=True)
    yield store, made
    for name in DATA_FILES:
        subprocess.run(["umount", store / name], check=True)


def assert_slots_reused(store: Path, records, ino: int) -> None:
    """The workload wrote more full chunks into the chunk file than it has slots: freed
    slots were written again. Counted from the log: each chunk's pwrite of its slot reaches
    the recording filesystem once (in pieces; it runs without a writeback cache)."""
    st = Store.open(store, readonly=True, lock=False)
    try:
        with st.read() as txn:
            raw = txn.get(chunkfile.NEXT_SLOT, db=st.db["meta"])
            next_slot = S.from_u64(raw) if raw is not None else 0
            free = txn.stat(st.db["freeslots"])["entries"]
        size = st.chunk_size
    finally:
        st.close()
    written = [0] * next_slot
    for kind, i, off, payload in records:
        if kind == "W" and i == ino:
            assert (off + len(payload) - 1) // size < next_slot, "a write beyond next_slot"
            written[off // size] += len(payload)
    chunks = sum(written) // size
    rewritten = sum(1 for n in written if n > size)
    print(f"chunk file: {chunks} full chunks written into {next_slot} slots "
          f"({rewritten} slots written more than once, {free} free at the end)")
    assert rewritten >= 3 and chunks > next_slot, \
        f"the workload reused too few slots ({rewritten}; {chunks} chunks, {next_slot} slots)"


def test_power_loss_at_any_cut_keeps_the_store_whole(recorded, recorded_store, make_mount,
                                                     tmp_path):
    _rec, log = recorded
    store, made = recorded_store
    m = make_mount(store)
    promises = workload(m, log)
    m.umount()
    records = read_log(log)
    inos = {name: next(i for kind, i, _, n in records if kind == "N" and n == name.encode())
            for name in DATA_FILES}
    assert_slots_reused(store, records, inos["chunks.dat"])

    rnd = random.Random(SEED)
    cuts = sorted(rnd.sample(range(made, len(records) + 1), min(CUTS, len(records) - made)))
    variants = {
        "all": lambda n, total: True,
        "prefix": None,
        "random": None,
    }
    failures = []
    trial = tmp_path / "trial"
    checked = 0
    for cut in cuts:
        for variant in variants:
            shutil.rmtree(trial, ignore_errors=True)
            trial.mkdir()
            for name in DATA_FILES:         # each file's unsynced writes kept independently
                if variant == "all":
                    keep = variants["all"]
                elif variant == "prefix":
                    stop = rnd.random()
                    keep = (lambda s: lambda n, total: n < int(total * s))(stop)
                else:
                    chosen = random.Random(rnd.random())
                    keep = lambda n, total, c=chosen: c.random() < 0.5
                (trial / name).write_bytes(rebuild(records, inos[name], cut, keep))
            files = {name: content for pos, kind, name, content in promises
                     if kind == "file" and pos <= cut}
            snaps = [name for pos, kind, name, _ in promises if kind == "snapshot" and pos <= cut]
            problem = check_store(trial, files, snaps)
            checked += 1
            if problem:
                failures.append(f"cut {cut}/{len(records)} ({variant}): {problem}")
    print(f"{checked} power-loss states checked, {len(failures)} failed")
    assert not failures, f"{len(failures)} of {checked} power-loss states are broken:\n" + \
        "\n".join(failures[:20])
