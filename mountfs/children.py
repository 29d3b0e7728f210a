"""How mountfs starts a Python process of its own (the background mount, the writer): as
``python -P -m MODULE`` with the directory the parent imported ``mountfs`` from first on
``PYTHONPATH``, from ``/``.

Why: ``python -m`` puts the current directory first on ``sys.path``, so a mount started
from a directory holding another ``mountfs`` (a second checkout, an older copy) ran that
one's mount or writer beside this one's, or failed to start at all. ``-P`` leaves the
current directory out; the parent's own package directory goes in explicitly, so the child
runs exactly the code the parent runs, installed or not. From ``/``: a long-lived process
must not hold the caller's directory busy (it would keep its filesystem from unmounting)."""

from __future__ import annotations

import os
import sys

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CWD = "/"       # where such a child runs


def module_command(module: str, *args: str) -> list[str]:
    """The command line running ``module`` (of this source tree) with ``args``."""
    return [sys.executable, "-P", "-m", module, *args]


def module_env() -> dict[str, str]:
    """The environment for ``module_command``: this one, with this source tree first on
    ``PYTHONPATH``."""
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + rest if rest else "")
    return env
