"""The one parser for sizes, the one for durations and the one for listen addresses, used by
every command line and by the daemon's config, so that what one accepts the other accepts too
("16M", "5m", plain numbers, "127.0.0.1:8765").

Sizes are binary (K = 1024); durations take ms, s, m, h, d, w (no unit: seconds) and are
more than 0 and at most MAX_DURATION (each is a timeout, an interval or a threshold: 0 or
"forever" is a typo, not a setting); addresses are HOST:PORT, an IPv6 host in brackets.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from .errors import StoreError

SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}
MAX_DURATION = 366 * 86400
LISTEN = re.compile(r"^(?:\[([0-9A-Fa-f:.]+)\]|([\w.\-]+)):(\d+)$")


def parse_size(value: str | int) -> int:
    """Bytes from ``16777216``, ``"16M"``, ``"256KiB"``, ``"1G"``; ValueError otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = SIZE.match(value) if isinstance(value, str) else None
    if not m:
        raise ValueError(f"expected a size like 16M, 256K, 1G or a number of bytes "
                         f"(got {value!r})")
    return int(m.group(1)) * SIZE_UNITS[m.group(2).upper()]


def parse_positive_size(value: str | int) -> int:
    """``parse_size`` of a size that must be more than 0 (an amount per batch or task)."""
    size = parse_size(value)
    if size == 0:
        raise ValueError(f"must be more than 0 (got {value!r})")
    return size


def parse_duration(value: str | int | float) -> float:
    """Seconds from ``300``, ``"300"``, ``"5m"``, ``"1.5h"``, ``"250ms"``; ValueError otherwise,
    also outside (0, MAX_DURATION]."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = DURATION.match(value) if isinstance(value, str) else None
        if not m:
            raise ValueError(f"expected a duration like 30s, 5m, 2h, 1d or a number of "
                             f"seconds (got {value!r})")
        seconds = float(m.group(1)) * DURATION_UNITS[m.group(2)]
    if not 0 < seconds <= MAX_DURATION:         # NaN and infinity too
        raise ValueError(f"must be more than 0 and at most {MAX_DURATION // 86400}d "
                         f"(got {value!r})")
    return seconds


def env_duration(name: str, default: str, zero: bool = False,
                 most: float = MAX_DURATION) -> float:
    """Seconds from environment variable ``name`` (``default`` when unset or empty) as
    ``parse_duration`` reads them, at most ``most``, and with ``zero`` also 0 ("at once").
    A bad value is a StoreError naming the variable: the modules tuned by one read it when
    imported, which a mount does before it mounts anything, so the mount refuses in one
    line."""
    raw = os.environ.get(name) or default
    try:
        if zero and float(raw) == 0:
            return 0.0
    except ValueError:
        pass                    # not a plain number: a duration with its unit, or a typo
    limit = f"{most:g} s" if most < MAX_DURATION else f"{MAX_DURATION // 86400}d"
    takes = (f"it takes seconds ({'0' if zero else 'more than 0'} up to {limit}, e.g. "
             f"{default}{' or 250ms' if most >= 0.25 else ''}); fix or unset it")
    try:
        seconds = parse_duration(raw)
    except ValueError as e:
        raise StoreError(f"${name}={raw!r} is not a duration: {takes}") from e
    if seconds > most:
        raise StoreError(f"${name}={raw!r} is more than {limit}: {takes}")
    return seconds


class Address(NamedTuple):
    """Where to listen. str() gives HOST:PORT back in the form the parser takes, so that
    a message names the address as the user wrote it."""
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def cannot_listen(self, error: OSError) -> str:
        """Why this address could not be listened on, and what to do, in the same words
        from every program that listens."""
        return (f"cannot listen on {self}: {error.strerror or error}; choose a free port or "
                f"an address of this host")


def parse_listen(value: str) -> Address:
    """(host, port) from ``"127.0.0.1:8765"``, ``"[::1]:8765"``, ``"backup:8765"``; ValueError
    otherwise. The port is required: a default would be a different one per program, and
    whoever reads the address back (a client, Prometheus) must know it."""
    m = LISTEN.match(value) if isinstance(value, str) else None
    if not m:
        raise ValueError(f"expected HOST:PORT like 127.0.0.1:8765 or [::1]:8765 "
                         f"(got {value!r})")
    port = int(m.group(3))
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535 (got {value!r})")
    return Address(m.group(1) or m.group(2), port)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def counted(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun it counts: "1 chunk", "2 chunks", "3 entries"."""
    return f"{n} {one if n == 1 else many or one + 's'}"
