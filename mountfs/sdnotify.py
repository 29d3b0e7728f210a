"""systemd's notify protocol (sd_notify): READY, STATUS, WATCHDOG and STOPPING datagrams to
$NOTIFY_SOCKET. Without systemd (no socket) every call does nothing."""

from __future__ import annotations

import os
import socket


def notify(**fields: str) -> bool:
    """Send e.g. ``notify(READY="1", STATUS="mounted")``. Returns whether it was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):                     # abstract namespace
        address = "\0" + address[1:]
    message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(message, address)
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of systemd's WatchdogSec for this process, or None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
