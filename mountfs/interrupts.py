"""A command's ending signals as an exception, so that it cleans up before it goes.

By default SIGHUP (a closed terminal or ssh session) and SIGTERM (``kill``, ``timeout``) end
a process at once, leaving whatever it was half-way through: a partial restore, the
snapshot a replicate took. Inside ``signals_raise`` they raise ``Interrupted`` in the main
thread instead, as Ctrl-C raises KeyboardInterrupt. A signal the caller ignores (``nohup``)
stays ignored."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """One of the signals ``signals_raise`` was given arrived."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def status(self) -> int:
        """The shell's exit status for a command ended by this signal."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}"


@contextmanager
def signals_raise(signals=SIGNALS):
    """Inside: each of ``signals`` the caller does not ignore raises ``Interrupted``. Only
    the main thread can take signals: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)
    old = {}
    try:
        for s in signals:
            if signal.getsignal(s) is not signal.SIG_IGN:
                old[s] = signal.signal(s, handler)
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
