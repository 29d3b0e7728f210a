"""``mountfs``: the store commands (mkfs, mount, umount, fsck, promote) and the replicator's
receiver (serve-mirror), imported only when it runs."""

from mountfs.cli import main

main.lazy.update({"serve-mirror": "replicator.commands:serve_mirror"})

if __name__ == "__main__":
    main(prog_name="mountfs")
