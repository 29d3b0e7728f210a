"""How snapshots are named by mountfsd and replicate (a prefix and the UTC time), and the
error every snapshot command raises. Apart from mountfs.snapshots, which needs the store:
``snapctl create`` refuses a name of the daemon's form before it asks the mount, and its
start-up is most of what the command costs (docs/benchmarks.md, `snapctl create`).
"""

from __future__ import annotations

import datetime as dt
import re

from .errors import StoreError


class SnapshotError(StoreError):
    """A user-facing snapshot error (bad name, unknown snapshot, existing target)."""


DAEMON_PREFIX = "auto-"          # mountfsd's snapshot_prefix unless its config says otherwise
_STAMP = "%Y%m%dT%H%M%S.%fZ"
_STAMP_FORM = re.compile(r"[0-9]{8}T[0-9]{6}\.[0-9]{6}Z")


def stamped_name(prefix: str) -> str:
    """``prefix`` and the UTC time to the microsecond: how mountfsd (and replicate, with
    ``repl-``) name the snapshots they take."""
    return prefix + dt.datetime.now(dt.timezone.utc).strftime(_STAMP)


def is_stamped(name: str, prefix: str) -> bool:
    """Whether ``name`` is exactly of the form ``stamped_name(prefix)`` gives. The daemon
    prunes only such names: a prefix alone would also match a user's 'auto-manual'."""
    return name.startswith(prefix) and _STAMP_FORM.fullmatch(name[len(prefix):]) is not None


def refuse_daemon_name(name: str) -> None:
    """A user's snapshot must not look like the daemon's (default prefix): it would be
    pruned as the daemon's own."""
    if is_stamped(name, DAEMON_PREFIX):
        raise SnapshotError(f"{name!r} has the form of mountfsd's own snapshot names "
                            f"({DAEMON_PREFIX}YYYYmmddTHHMMSS.ffffffZ): the daemon would treat "
                            f"it as its own and prune it; choose another name")
