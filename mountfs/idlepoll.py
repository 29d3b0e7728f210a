"""Adaptive idle polling of the serving trio loop: look for the next request a little while
before going to sleep, while requests come in bursts.

Why: a program working in the mount (tar, git, a build) sends a FUSE request, waits for the
answer, and sends the next one a few microseconds later; a small file's create is six such
round trips. If the serving thread has gone to sleep in the meantime, each request first has
to wake it, and on a virtual machine whose idle CPUs halt at once (KVM guests without halt
polling: `haltpoll.guest_halt_poll_ns=0`, the default of many clouds) waking a halted CPU
costs two VM exits, tens of microseconds, more than the mount's own work on a request.
Polling the loop's file descriptors for up to ``POLL`` (50 µs) before sleeping finds the
next request on a CPU that is still running (on such a VM, docs/benchmarks.md, thirtieth
round: small-file creates 2,650 -> 3,030-3,140 per s, an untar 32 -> 27 s). Seastar's
reactor and the kernel's own halt polling do the same.

Adaptive, so that polling costs nothing when it cannot help: the loop polls only while its
waits are short (the last one ended within ``REARM`` windows); after a whole window that
found nothing it sleeps at once on every wait until one ends that soon again. An idle mount, or
one answering a request now and then, sleeps as before. A loop with work to do never
sleeps, so it never polls either.

How: trio has no public hook for its wait for I/O, so this wraps the epoll I/O manager's
``get_events(timeout)``, which the run loop calls on every pass: with 0 while tasks are
runnable (passed through), else with the time to its next deadline (the wait that may
poll first). Looking is ``get_events(0)``: the same epoll set, so a reply
from the writer process, a control-socket connection or another thread waking the loop
ends the polling as a FUSE request does. If this trio has no such manager, nothing is
changed and the loop sleeps as usual.
"""

from __future__ import annotations

import time

from .units import env_duration

MAX_POLL = 0.01     # seconds: longer would spin a CPU for nothing after every burst
POLL = env_duration("MOUNTFS_IDLE_POLL", "0.00005", zero=True, most=MAX_POLL)  # 0: off
REARM = 2           # a wait that ends within this many windows means a burst


def parse_window(text: str) -> float:
    """A window given on a command line (the floors' ``--idle-poll``): seconds, from 0 (off)
    up to MAX_POLL, as ``MOUNTFS_IDLE_POLL`` takes them; ValueError otherwise."""
    seconds = float(text)
    if not 0 <= seconds <= MAX_POLL:            # NaN too
        raise ValueError(f"{text!r}: seconds from 0 (off) up to {MAX_POLL:g}")
    return seconds


def install(window: float = POLL) -> bool:
    """Make every trio loop of this process poll up to ``window`` seconds before it sleeps,
    adaptively (see above). Idempotent. False if nothing was changed: ``window`` is 0, or
    trio's epoll I/O manager is not there."""
    if window <= 0:
        return False
    try:
        from trio._core._io_epoll import EpollIOManager
    except ImportError:
        return False
    wait = getattr(EpollIOManager, "get_events", None)
    if wait is None:
        return False
    if not getattr(wait, "polls_first", False):
        EpollIOManager.get_events = polling(wait, window)
    return True


def polling(wait, window: float):
    """``wait(manager, timeout)`` (returns the events, empty if the timeout passed without
    any), made to look for events for up to ``window`` seconds before it sleeps, while the
    waits are short."""
    clock = time.perf_counter
    rearm = REARM * window
    burst = True

    def get_events(manager, timeout: float):
        nonlocal burst
        if timeout <= 0:                # tasks are runnable: the loop only looks
            return wait(manager, timeout)
        start = clock()
        if burst:
            until = start + min(timeout, window)
            while True:
                events = wait(manager, 0)
                if events:
                    return events
                if clock() >= until:
                    break
            if timeout >= window:       # a whole window and nothing came (not a deadline
                burst = False           # within it): sleep until a wait is short again
        events = wait(manager, max(0.0, timeout - (clock() - start)))
        if events and clock() - start < rearm:
            burst = True
        return events

    get_events.polls_first = True
    return get_events
