"""``mountfsd``: the daemon's command line."""

from __future__ import annotations

import logging
import os
import sys

import click

from mountfs.clitools import CONTEXT, OneLineCommand, fail, version_option

from .config import Config, ConfigError, MirrorConfig, load

CONFIG_DIR = "/etc/mountfs"


@click.command(cls=OneLineCommand, context_settings=CONTEXT)
@click.argument("name", required=False)
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help=f"The config file (default: {CONFIG_DIR}/NAME.toml).")
@click.option("--check", is_flag=True, help="Check the config (and that its token files "
              "and mountpoints exist) and exit.")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
@version_option("mountfsd")
def main(name, config_path, check, verbose):
    """Snapshot mountfs filesystems continuously and keep their mirrors up to date.

    For every [[filesystem]] of the config: when it changed (an O(1) look), take a snapshot
    (at most every min_interval), replicate the newest snapshot to each mirror (one diff from
    that mirror's base, however many snapshots it missed), prune by the retention policies,
    and publish the lag ('snapctl status', Prometheus, systemd STATUS). SIGHUP reloads the
    config; SIGTERM finishes or aborts the cycle in flight and exits."""
    setup_logging(verbose)
    if config_path is None:
        if name is None:
            raise click.UsageError("give NAME (for /etc/mountfs/NAME.toml) or --config PATH")
        config_path = f"{CONFIG_DIR}/{name}.toml"
    try:
        cfg = load(config_path)
        if check:
            check_paths(cfg)
    except ConfigError as e:
        fail(str(e), 2)
    if check:
        click.echo(f"{config_path}: ok ({len(cfg.filesystems)} filesystem(s))")
        return
    import trio

    from .service import serve
    try:
        trio.run(serve, config_path)
    except ConfigError as e:
        fail(str(e), 2)


def setup_logging(verbose: bool) -> None:
    """The daemon's own lines; at INFO one line per cycle, not one per HTTP request."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


def check_paths(cfg: Config) -> None:
    """What the config names on this host must exist, or the daemon would retry forever."""
    for fs in cfg.filesystems:
        if not os.path.isdir(fs.mountpoint):
            raise ConfigError(f"{cfg.path}: filesystem {fs.name!r}: mountpoint "
                              f"{fs.mountpoint} does not exist or is not a directory")
        for m in fs.mirrors:
            if m.url.startswith("http") and not m.token_file and \
                    not os.environ.get("MOUNTFS_TOKEN"):
                raise ConfigError(f"{cfg.path}: mirror {m.url}: token_file missing; an "
                                  f"http(s) mirror needs the replicate token (or "
                                  f"$MOUNTFS_TOKEN in the daemon's environment)")
            for key in ("token_file", "admin_token_file", "ca_file"):
                path = getattr(m, key)
                if path is not None:
                    check_file(cfg, m, key, path)


def check_file(cfg: Config, m: MirrorConfig, key: str, path: str) -> None:
    """A token or CA file the daemon can read: a regular file (a directory passes
    os.access), and a token readable by its owner only (a warning)."""
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{cfg.path}: mirror {m.url}: {key} {path} does not exist or "
                          f"cannot be read")
    if not os.path.isfile(path):
        raise ConfigError(f"{cfg.path}: mirror {m.url}: {key} {path} is not a regular "
                          f"file; name the file itself")
    if key != "ca_file" and os.stat(path).st_mode & 0o077:
        click.echo(f"warning: {cfg.path}: mirror {m.url}: {key} {path} is readable by "
                   f"group or others; run 'chmod 600 {path}'", err=True)


if __name__ == "__main__":
    main(prog_name="mountfsd")
