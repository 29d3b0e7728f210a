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
