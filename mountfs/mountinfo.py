"""Which mountfs mounts exist and which store backs a mountpoint, read from
/proc/self/mountinfo: what ``snapctl``, ``mountfs umount`` and the daemon ask before they
talk to a mount. Apart from ``mount`` (the mount process's life) so that a command that only
looks a mount up loads neither subprocess nor signal handling (``snapctl create`` is a
short-lived command: every import shows in its latency)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

FSTYPE = "fuse.mountfs"


@dataclass
class MountInfo:
    mountpoint: str
    store: str
    device: str = ""        # "major:minor", the name of the mount's bdi in /sys/class/bdi


def _unescape(field: str) -> str:
    """A mountinfo field as the path it names: the kernel writes a space, tab, newline or
    backslash in it as an octal escape; other bytes (UTF-8 or not) come as they are."""
    if "\\" not in field:
        return field
    raw = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), os.fsencode(field))
    return os.fsdecode(raw)


def mounts() -> list[MountInfo]:
    out = []
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:   # paths, any bytes
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] == FSTYPE:
                source = _unescape(rfields[1])
                if source.startswith("mountfs:"):
                    out.append(MountInfo(_unescape(fields[4]), source[len("mountfs:"):],
                                         fields[2]))
    return out


def canonical(path: str, known: list[MountInfo] | None = None) -> str:
    """``path`` as /proc/self/mountinfo names it: absolute, its symlinks resolved (the kernel
    mounts on a link's target). Resolution stops at a mountfs mountpoint and never looks
    inside one, so a mount whose process is stuck or dead cannot hang or fail the caller."""
    inside = {m.mountpoint for m in (mounts() if known is None else known)}
    parts = (path if os.path.isabs(path) else os.path.join(os.getcwd(), path)).split("/")
    head = "/"
    for i, part in enumerate(parts):
        if part in ("", "."):
            continue
        if part == "..":                        # of the resolved directory, as the kernel does
            head = os.path.dirname(head)
            continue
        step = os.path.join(head, part)
        if step in inside:                      # a mountpoint is never a symlink: it is covered
            return os.path.normpath(os.path.join(step, *parts[i + 1:]))
        head = os.path.realpath(step)
    return head


def find_mount(path: str) -> MountInfo | None:
    """The mountfs mount holding ``path`` (the deepest one)."""
    known = mounts()
    path = canonical(path, known)
    best = None
    for m in known:
        if path == m.mountpoint or path.startswith(m.mountpoint.rstrip("/") + "/"):
            if best is None or len(m.mountpoint) > len(best.mountpoint):
                best = m
    return best


def mounted_at(store: str, known: list[MountInfo] | None = None) -> str | None:
    """Where the store at ``store`` is mounted, if it is (compared as ``canonical`` names
    paths: nothing inside a mount is looked up)."""
    known = mounts() if known is None else known
    store = canonical(store, known)
    return next((m.mountpoint for m in known if canonical(m.store, known) == store), None)
