"""``snapctl``: mountfs's snapshot commands, the replicator's and the daemon's, in one
command line. A command imports only its own module (``snapctl create`` loads neither
Spark, nor httpx, nor trio, nor pyfuse3)."""

from mountfs.snapctl import main

main.lazy.update({
    "restore": "replicator.commands:restore",          # mountfs's restore, plus --from
    "replicate": "replicator.commands:replicate",
    "verify": "replicator.commands:verify",
    "forget-mirror": "replicator.commands:forget_mirror",
    "status": "daemon.commands:status",
    "check": "daemon.commands:check",
    "prune": "daemon.commands:prune",
})

if __name__ == "__main__":
    main(prog_name="snapctl")
