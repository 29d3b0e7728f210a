"""The daemon's TOML configuration, checked completely before anything starts.

```toml
[daemon]
state_dir = "/run/mountfs"          # status files read by 'snapctl status'
metrics_listen = "127.0.0.1:9811"   # Prometheus endpoint; off when absent
spark_master = "local[*]"           # default: embedded

[[filesystem]]
name = "data"
mountpoint = "/mnt/data"
min_interval = "10s"                # never snapshot more often
max_interval = "15m"                # snapshot at least this often while data is buffered
snapshot_prefix = "auto-"           # the daemon's own snapshots: auto-YYYYmmddTHHMMSS.ffffffZ
retention = { hourly = 24, daily = 7, weekly = 4, monthly = 6 }
lag_warning = "5m"                  # snapctl check thresholds
lag_critical = "1h"
stall_timeout = "5m"                # cancel a transfer that makes no progress this long
spark_threshold = "16M"             # sent without starting Spark (0: always Spark)

[[filesystem.mirror]]
url = "http://backup:8765"
token_file = "/etc/mountfs/token"
ca_file = "/etc/mountfs/mirror-ca.pem"   # https: trust only this CA (a self-signed receiver)
retention = { daily = 30, monthly = 12 }
```

Durations take ms, s, m, h, d, w (or a number of seconds), sizes K, M, G (or a number of
bytes): the same parsers as the command lines (``mountfs.units``).

Every error names the key and its line: ``config.toml:12: filesystem[0].min_interval: ...``.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mountfs.snapshots import DAEMON_PREFIX
from mountfs.units import Address, parse_duration, parse_listen, parse_size

from .retention import Policy, PolicyError, parse_policy


class ConfigError(Exception):
    """A configuration the daemon refuses, with the file, line and key."""


@dataclass
class MirrorConfig:
    url: str
    token_file: str | None = None
    ca_file: str | None = None
    retention: Policy | None = None
    admin_token_file: str | None = None    # pruning an http(s) mirror needs its admin token

    @property
    def label(self) -> str:
        return self.url


@dataclass
class FilesystemConfig:
    name: str
    mountpoint: str
    min_interval: float = 10.0
    max_interval: float = 900.0
    snapshot_prefix: str = DAEMON_PREFIX
    retention: Policy | None = None
    lag_warning: float = 300.0
    lag_critical: float = 3600.0
    stall_timeout: float = 300.0
    spark_threshold: int = 16 << 20
    mirrors: list[MirrorConfig] = field(default_factory=list)


@dataclass
class Config:
    path: str
    state_dir: str = "/run/mountfs"
    metrics_listen: Address | None = None
    spark_master: str | None = None
    filesystems: list[FilesystemConfig] = field(default_factory=list)


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    return _Checker(path, text).config(raw)


class _Checker:
    """Walks the parsed TOML, building the config and naming the line of any bad key."""

    def __init__(self, path: Path, text: str):
        self.path = path
        self.lines = text.splitlines()

    def fail(self, where: str, key: str, msg: str):
        raise ConfigError(f"{self.path}:{self._line(key)}: {where}{key}: {msg}")

    def _line(self, key: str) -> int | str:
        pattern = re.compile(rf"^\s*{re.escape(key)}\s*=|[{{,]\s*{re.escape(key)}\s*=")
        for n, line in enumerate(self.lines, 1):
            if pattern.search(line):
                return n
        return "?"

    def config(self, raw: dict) -> Config:
        self.only(raw, "", {"daemon", "filesystem"})
        d = raw.get("daemon", {})
        self.only(d, "daemon.", {"state_dir", "metrics_listen", "spark_master"})
        cfg = Config(str(self.path),
                     state_dir=self.string(d, "daemon.", "state_dir", "/run/mountfs"),
                     metrics_listen=self.listen(d, "daemon.", "metrics_listen"),
                     spark_master=self.string(d, "daemon.", "spark_master", None))
        filesystems = raw.get("filesystem", [])
        if not isinstance(filesystems, list) or not filesystems:
            raise ConfigError(f"{self.path}: no [[filesystem]] configured")
        cfg.filesystems = [self.filesystem(fs, f"filesystem[{i}].")
                           for i, fs in enumerate(filesystems)]
        names = [fs.name for fs in cfg.filesystems]
        if len(set(names)) != len(names):
            self.fail("filesystem.", "name", "names must be unique")
        return cfg

    def filesystem(self, raw: dict, where: str) -> FilesystemConfig:
        self.only(raw, where, {"name", "mountpoint", "min_interval", "max_interval",
                               "snapshot_prefix", "retention", "lag_warning", "lag_critical",
                               "stall_timeout", "spark_threshold", "mirror"})
        fs = FilesystemConfig(
            name=self.string(raw, where, "name", required=True),
            mountpoint=self.string(raw, where, "mountpoint", required=True),
            min_interval=self.duration(raw, where, "min_interval", 10.0),
            max_interval=self.duration(raw, where, "max_interval", 900.0),
            snapshot_prefix=self.string(raw, where, "snapshot_prefix", DAEMON_PREFIX),
            retention=self.policy(raw, where),
            lag_warning=self.duration(raw, where, "lag_warning", 300.0),
            lag_critical=self.duration(raw, where, "lag_critical", 3600.0),
            stall_timeout=self.duration(raw, where, "stall_timeout", 300.0),
            spark_threshold=self.size(raw, where, "spark_threshold", 16 << 20))
        if fs.max_interval < fs.min_interval:
            self.fail(where, "max_interval", "must not be shorter than min_interval")
        if fs.lag_critical < fs.lag_warning:
            self.fail(where, "lag_critical", "must not be shorter than lag_warning")
        if not re.match(r"^[\w.\-]+$", fs.snapshot_prefix):
            self.fail(where, "snapshot_prefix", "letters, digits, '.', '_' and '-' only")
        mirrors = raw.get("mirror", [])
        if not isinstance(mirrors, list):
            self.fail(where, "mirror", "use [[filesystem.mirror]] tables")
        fs.mirrors = [self.mirror(m, f"{where}mirror[{i}].") for i, m in enumerate(mirrors)]
        return fs

    def mirror(self, raw: dict, where: str) -> MirrorConfig:
        self.only(raw, where, {"url", "token_file", "ca_file", "retention", "admin_token_file"})
        url = self.string(raw, where, "url", required=True)
        if not re.match(r"^(file:///|https?://)", url):
            self.fail(where, "url", "expected file:///path or http(s)://host:port")
        return MirrorConfig(url, self.string(raw, where, "token_file", None),
                            self.string(raw, where, "ca_file", None), self.policy(raw, where),
                            self.string(raw, where, "admin_token_file", None))

    # ---- typed values ----------------------------------------------------------------------

    def only(self, raw, where: str, allowed: set[str]) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{self.path}: {where.rstrip('.')}: expected a table")
        for key in raw:
            if key not in allowed:
                self.fail(where, key, f"unknown key (known: {', '.join(sorted(allowed))})")

    def string(self, raw, where, key, default=None, required=False):
        if key not in raw:
            if required:
                raise ConfigError(f"{self.path}: {where}{key}: missing")
            return default
        if not isinstance(raw[key], str) or not raw[key]:
            self.fail(where, key, "expected a non-empty string")
        return raw[key]

    def size(self, raw, where, key, default: int) -> int:
        try:
            return parse_size(raw.get(key, default))
        except ValueError as e:
            self.fail(where, key, str(e))

    def duration(self, raw, where, key, default: float) -> float:
        try:
            return parse_duration(raw.get(key, default))
        except ValueError as e:
            self.fail(where, key, str(e))

    def listen(self, raw, where, key) -> Address | None:
        if key not in raw:
            return None
        try:
            return parse_listen(raw[key])
        except ValueError as e:
            self.fail(where, key, str(e))

    def policy(self, raw, where) -> Policy | None:
        if "retention" not in raw:
            return None
        try:
            return parse_policy(raw["retention"])
        except PolicyError as e:
            self.fail(where, "retention", str(e))
