"""The daemon's TOML configuration, checked completely before anything starts.

```toml
[daemon]
state_dir = "/run/mountfs"          # status files read by 'snapctl status' (an absolute path)
metrics_listen = "127.0.0.1:9811"   # Prometheus endpoint; off when absent
spark_master = "local[*]"           # default: embedded

[[filesystem]]
name = "data"                       # letters, digits, '-', '_', '.'; not starting with '.'
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
url = "http://backup:8765"          # or file:///srv/mirror (a directory, not /)
token_file = "/etc/mountfs/token"   # required by an http(s) mirror (or $MOUNTFS_TOKEN)
ca_file = "/etc/mountfs/mirror-ca.pem"   # https: trust only this CA (a self-signed receiver)
retention = { daily = 30, monthly = 12 }
```

Durations take ms, s, m, h, d, w (or a number of seconds), sizes K, M, G (or a number of
bytes): the same parsers as the command lines (``mountfs.units``). A duration is more than
0 and at most 366 days: 0 would spin, and ``inf`` or ``1e308`` is never what was meant.
Paths are absolute: the daemon runs from ``/`` under systemd.

Every error names the key and its line: ``config.toml:12: filesystem[0].min_interval: ...``.
The file must be a regular file (a FIFO would block the daemon forever) of at most 1 MiB,
in UTF-8.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mountfs.snapnames import DAEMON_PREFIX
from mountfs.units import Address, parse_duration, parse_listen, parse_size
from mountfs.urls import url_problem

from .retention import Policy, PolicyError, parse_policy

MAX_CONFIG_BYTES = 1 << 20
DURATIONS = {"min_interval": "10s", "max_interval": "15m", "lag_warning": "5m",
             "lag_critical": "1h", "stall_timeout": "5m"}     # the defaults, as written
NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,99}$")
HEADER = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\-]+)\s*\]\]?\s*(#.*)?$")    # [t], [[t]]


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
    text = _decode(path, _read(path))
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    return _Checker(path, text).config(raw)


def _read(path: Path) -> bytes:
    """The file's bytes. Opened without blocking and checked on the open descriptor (no
    race with a rename): a FIFO or a device would hang the daemon or never end; read at
    most one byte past the cap, so a huge file costs no memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path}: not a regular file; name the config file itself")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB; is it the "
                          f"config?")
    return data


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte {data[e.start]:#04x} at offset "
                          f"{e.start}); save the file as UTF-8") from None


class _Checker:
    """Walks the parsed TOML, building the config and naming the line of any bad key."""

    def __init__(self, path: Path, text: str):
        self.path = path
        self.lines = text.splitlines()

    def fail(self, where: str, key: str, msg: str):
        raise ConfigError(f"{self.path}:{self._line(where, key)}: {where}{key}: {msg}")

    def _line(self, where: str, key: str) -> int | str:
        """The line of ``key`` in the table ``where`` names (``filesystem[1].mirror[0].``:
        the second [[filesystem]] and the first [[filesystem.mirror]] under it), else its
        first line anywhere (tables written inline)."""
        pattern = re.compile(rf"^\s*{re.escape(key)}\s*=|[{{,]\s*{re.escape(key)}\s*=")
        lo, hi = self._table(where) or (0, 0)
        for n in [*range(lo, hi), *range(len(self.lines))]:
            if pattern.search(self.lines[n]):
                return n + 1
        return "?"

    def _table(self, where: str) -> tuple[int, int] | None:
        """The lines (start, end) of the table ``where`` names, up to the next header."""
        headers = [(n, m.group(1)) for n, line in enumerate(self.lines)
                   if (m := HEADER.match(line))]
        lo, hi, path = 0, len(self.lines), ""
        for name, index in re.findall(r"(\w+)(?:\[(\d+)\])?\.", where):
            path = f"{path}.{name}" if path else name
            mine = [n for n, header in headers if header == path and lo <= n < hi]
            if int(index or 0) >= len(mine):
                return None
            lo = mine[int(index or 0)] + 1
            hi = next((n for n, header in headers
                       if n >= lo and not header.startswith(path + ".")), len(self.lines))
        return lo, next((n for n, _ in headers if n >= lo), len(self.lines))

    def config(self, raw: dict) -> Config:
        self.only(raw, "", {"daemon", "filesystem"})
        d = raw.get("daemon", {})
        self.only(d, "daemon.", {"state_dir", "metrics_listen", "spark_master"})
        cfg = Config(str(self.path), state_dir=self.state_dir(d),
                     metrics_listen=self.listen(d, "daemon.", "metrics_listen"),
                     spark_master=self.spark_master(d))
        filesystems = raw.get("filesystem", [])
        if isinstance(filesystems, dict):
            raise ConfigError(f"{self.path}:{self._header('filesystem')}: write "
                              f"[[filesystem]] (one table per filesystem), not [filesystem]")
        if not isinstance(filesystems, list) or not filesystems:
            raise ConfigError(f"{self.path}: no [[filesystem]] configured")
        cfg.filesystems = [self.filesystem(fs, f"filesystem[{i}].")
                           for i, fs in enumerate(filesystems)]
        self.unique(cfg.filesystems, "filesystem", "name", lambda fs: fs.name)
        self.unique(cfg.filesystems, "filesystem", "mountpoint",
                    lambda fs: os.path.normpath(fs.mountpoint))
        return cfg

    def unique(self, items: list, table: str, key: str, value) -> None:
        """Refuse a second table of ``items`` whose ``key`` repeats an earlier one's: two
        loops would snapshot (or replicate) the same thing, racing each other."""
        seen: dict = {}
        for i, item in enumerate(items):
            first = seen.setdefault(value(item), i)
            if first != i:
                self.fail(f"{table}[{i}].", key, f"the same as {table}[{first}]'s; "
                                                 f"each must be listed once")

    def _header(self, name: str) -> int | str:
        """The line of table header [name] (or [[name]])."""
        return next((n + 1 for n, line in enumerate(self.lines)
                     if (m := HEADER.match(line)) and m.group(1) == name), "?")

    def filesystem(self, raw: dict, where: str) -> FilesystemConfig:
        self.only(raw, where, {"name", "mountpoint", "min_interval", "max_interval",
                               "snapshot_prefix", "retention", "lag_warning", "lag_critical",
                               "stall_timeout", "spark_threshold", "mirror"})
        fs = FilesystemConfig(
            name=self.name(raw, where),
            mountpoint=self.absolute_path(raw, where, "mountpoint", required=True),
            snapshot_prefix=self.string(raw, where, "snapshot_prefix", DAEMON_PREFIX),
            retention=self.policy(raw, where),
            spark_threshold=self.size(raw, where, "spark_threshold", 16 << 20),
            **{key: self.duration(raw, where, key) for key in DURATIONS})
        self.ordered(raw, where, fs, "min_interval", "max_interval")
        self.ordered(raw, where, fs, "lag_warning", "lag_critical")
        if not re.match(r"^[\w.\-]+$", fs.snapshot_prefix):
            self.fail(where, "snapshot_prefix", "letters, digits, '.', '_' and '-' only")
        mirrors = raw.get("mirror", [])
        if not isinstance(mirrors, list):
            self.fail(where, "mirror", "use [[filesystem.mirror]] tables")
        fs.mirrors = [self.mirror(m, f"{where}mirror[{i}].") for i, m in enumerate(mirrors)]
        self.unique(fs.mirrors, f"{where}mirror", "url", lambda m: m.url.rstrip("/"))
        return fs

    def mirror(self, raw: dict, where: str) -> MirrorConfig:
        self.only(raw, where, {"url", "token_file", "ca_file", "retention", "admin_token_file"})
        url = self.string(raw, where, "url", required=True)
        if problem := url_problem(url):
            self.fail(where, "url", problem)
        return MirrorConfig(url, self.absolute_path(raw, where, "token_file"),
                            self.absolute_path(raw, where, "ca_file"),
                            self.policy(raw, where),
                            self.absolute_path(raw, where, "admin_token_file"))

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

    def absolute_path(self, raw, where, key, required=False) -> str | None:
        """An absolute path: a relative one would be taken from wherever the daemon was
        started (``/`` under systemd, the shell's directory by hand), so one config would
        name two places."""
        path = self.string(raw, where, key, None, required)
        if path is not None and not os.path.isabs(path):
            self.fail(where, key, f"must be an absolute path (got {path!r}; write "
                                  f"{os.path.abspath(path)!r} if that is the one)")
        return path

    def size(self, raw, where, key, default: int) -> int:
        try:
            return parse_size(raw.get(key, default))
        except ValueError as e:
            self.fail(where, key, str(e))

    def duration(self, raw, where, key) -> float:
        try:
            return parse_duration(raw.get(key, DURATIONS[key]))
        except ValueError as e:
            self.fail(where, key, str(e))

    def ordered(self, raw, where, fs: FilesystemConfig, short: str, long: str) -> None:
        """``long`` must not be shorter than ``short``: blamed on ``long`` if the user wrote
        it, else on ``short``, naming ``long``'s default (the user never wrote it)."""
        if getattr(fs, long) >= getattr(fs, short):
            return
        if long in raw:
            self.fail(where, long, f"must not be shorter than {short}")
        self.fail(where, short, f"must not be longer than {long} ({DURATIONS[long]} by "
                                f"default; set {long} too)")

    def name(self, raw, where) -> str:
        """The name makes the status file STATE_DIR/NAME.json: never a path of its own."""
        name = self.string(raw, where, "name", required=True)
        if not NAME.match(name):
            self.fail(where, "name", "use letters, digits, '.', '_' and '-' (not starting "
                                     "with '.'), at most 100: it names the status file")
        return name

    def state_dir(self, raw) -> str:
        """Absolute (the daemon's working directory is no place for it), and a directory
        or to be made under one: a file there would fail every status write."""
        path = self.string(raw, "daemon.", "state_dir", "/run/mountfs")
        if not os.path.isabs(path):
            self.fail("daemon.", "state_dir", f"must be an absolute path (got {path!r})")
        existing = next(p for p in (Path(path), *Path(path).parents) if os.path.exists(p))
        if not os.path.isdir(existing):
            self.fail("daemon.", "state_dir", f"{existing} is not a directory")
        return path

    def spark_master(self, raw) -> str | None:
        """Checked as ``--spark-master`` is (imported here: ``snapctl status`` reads this
        config without the replicator)."""
        from replicator.masters import master_problem
        master = self.string(raw, "daemon.", "spark_master", None)
        if master is not None and (problem := master_problem(master)):
            self.fail("daemon.", "spark_master", problem)
        return master

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
