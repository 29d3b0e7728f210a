"""``mountfsd``: the daemon's command line."""

from __future__ import annotations

import logging
import sys

import click
import trio

from .config import ConfigError, load
from .service import serve

CONFIG_DIR = "/etc/mountfs"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("name", required=False)
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help=f"The config file (default: {CONFIG_DIR}/NAME.toml).")
@click.option("--check", is_flag=True, help="Check the config and exit.")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
def main(name, config_path, check, verbose):
    """Snapshot mountfs filesystems continuously and keep their mirrors up to date.

    For every [[filesystem]] of the config: when it changed (an O(1) look), take a snapshot
    (at most every min_interval), replicate the newest snapshot to each mirror (one diff from
    that mirror's base, however many snapshots it missed), prune by the retention policies,
    and publish the lag ('snapctl status', Prometheus, systemd STATUS). SIGHUP reloads the
    config; SIGTERM finishes or aborts the cycle in flight and exits."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    if config_path is None:
        if name is None:
            raise click.UsageError("give NAME (for /etc/mountfs/NAME.toml) or --config PATH")
        config_path = f"{CONFIG_DIR}/{name}.toml"
    try:
        cfg = load(config_path)
    except ConfigError as e:
        click.echo(f"mountfsd: {e}", err=True)
        sys.exit(2)
    if check:
        click.echo(f"{config_path}: ok ({len(cfg.filesystems)} filesystem(s))")
        return
    try:
        trio.run(serve, config_path)
    except ConfigError as e:
        click.echo(f"mountfsd: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
