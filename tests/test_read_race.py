"""A read racing a rewrite of the same chunks sees the old or the new data, never an error:
the digests a read checks and the data it serves come from one transaction, so "corrupt or
missing" is only ever said of a chunk that is corrupt (issue: 1 EIO in ~10,000-22,000 O_DIRECT
reads while another process rewrote the file and fsynced in a loop)."""

from __future__ import annotations

import os
import subprocess
import sys

READS = int(os.environ.get("MOUNTFS_RACE_READS", "6000"))
SIZE = 1 << 20

WRITER = r"""
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY)
i = 0
while True:
    i += 1
    os.pwrite(fd, i.to_bytes(8, "little") * (size // 8), 0)     # new digests every round
    os.fsync(fd)
"""

READER = r"""
import mmap, os, sys
path, size, reads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = mmap.mmap(-1, size)                       # page-aligned, as O_DIRECT wants
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
eio = short = 0
for _ in range(reads):
    try:
        n = os.preadv(fd, [buf], 0)
    except OSError as e:
        if e.errno != 5:
            raise
        eio += 1
        continue
    short += n != size
print(eio, short)
"""


def test_o_direct_reads_racing_rewrites_never_fail(make_mount):
    m = make_mount(chunk_size="64K")
    f = m.mnt / "f"
    f.write_bytes(bytes(SIZE))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(f), str(SIZE)])
    try:
        out = subprocess.run([sys.executable, "-c", READER, str(f), str(SIZE), str(READS)],
                             capture_output=True, text=True, check=True, timeout=600).stdout
    finally:
        writer.kill()
        writer.wait()
    eio, short = map(int, out.split())
    log = (m.store / "mountfs.log").read_text()
    corrupt = [line for line in log.splitlines() if "corrupt or missing" in line]
    assert (eio, short, corrupt) == (0, 0, []), f"{eio} EIO, {short} short reads in {READS}"
