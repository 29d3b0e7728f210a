"""The shortest path through the product: mount, write, snapshot, change, browse, restore."""

import os


def test_write_snapshot_browse_restore(mounted):
    f = mounted.mnt / "hello.txt"
    f.write_text("one")
    mounted.snapctl("create", "s1")
    f.write_text("two")
    assert (mounted.mnt / ".snapshot" / "s1" / "hello.txt").read_text() == "one"
    assert ".snapshot" not in os.listdir(mounted.mnt)
    mounted.snapctl("restore", "s1", "hello.txt", "--force")
    assert f.read_text() == "one"


def test_a_whole_chunk_write_then_written_into_again(make_mount):
    """A WRITE covering a whole chunk is buffered as the request's own bytes; the next
    write into that chunk, a read of it, a snapshot and a remount must all see every byte
    (chunks of 64 KiB; caches dropped so that reads come through the mount)."""
    m = make_mount(chunk_size="64K")
    cs = 64 << 10
    first, second = os.urandom(3 * cs), os.urandom(100)
    want = bytearray(first)
    fd = os.open(m.mnt / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, first, 0)                 # three whole chunks in one write
        os.pwrite(fd, second, cs + 10)          # into the second, still buffered
        want[cs + 10:cs + 110] = second
        assert os.pread(fd, 3 * cs, 0) == bytes(want)
        m.snapctl("create", "s")
        os.pwrite(fd, first[:cs], cs)           # a whole chunk over a dirty one
        want[cs:2 * cs] = first[:cs]
    finally:
        os.close(fd)
    m.umount()
    m.mount()
    if os.geteuid() == 0:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2")
    assert (m.mnt / "f").read_bytes() == bytes(want)
    snap = bytearray(first)
    snap[cs + 10:cs + 110] = second
    assert (m.mnt / ".snapshot" / "s" / "f").read_bytes() == bytes(snap)
