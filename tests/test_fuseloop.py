"""mountfs's request loop (mountfs/fuseloop.py), through /dev/fuse with tests/gatefs.py:
requests keep being served while handlers wait (as many as pyfuse3's own loop would let
wait), the session ends cleanly however it is ended, and a request that does not wait costs
one step of a serving task, not two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.fuse

GATEFS = Path(__file__).resolve().parent / "gatefs.py"
STAT = "import os, sys\ntry:\n    os.stat(sys.argv[1])\nexcept FileNotFoundError:\n    pass\n"


class Gate:
    """gatefs.py mounted at ``mnt`` in a process of its own."""

    def __init__(self, tmp_path: Path, *args: str):
        self.mnt = tmp_path / "mnt"
        self.mnt.mkdir()
        self.proc = subprocess.Popen([sys.executable, str(GATEFS), str(self.mnt), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mnt):
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "gatefs.py did not mount"
            time.sleep(0.02)

    def stat_in_child(self, name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", STAT, str(self.mnt / name)])

    def ended(self, timeout: float = 20) -> dict:
        """Its exit report, once it has exited by itself (the test fails if it does not)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("gatefs.py did not exit after its session ended")
        assert self.proc.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)


@pytest.fixture
def gate(tmp_path):
    made = []

    def start(*args: str) -> Gate:
        made.append(Gate(tmp_path, *args))
        return made[-1]
    yield start
    for g in made:
        g.kill()


def test_requests_are_served_while_many_handlers_wait(gate):
    g = gate()
    waiting = [g.stat_in_child(f"d{i}/wait") for i in range(24)]
    time.sleep(1)                   # all 24 lookups reach their handlers and wait there
    assert all(p.poll() is None for p in waiting), "a lookup that should wait returned"
    opener = g.stat_in_child("open")
    try:
        # Only a worker that is not waiting can read the request that opens the gate.
        assert opener.wait(timeout=15) == 0
        for p in waiting:
            assert p.wait(timeout=15) == 0
    finally:
        for p in (*waiting, opener):
            if p.poll() is None:
                p.kill()
    subprocess.run(["fusermount3", "-u", str(g.mnt)], check=True)
    assert g.ended()["lookups"] == 49     # dK, then dK/wait; open


@pytest.mark.parametrize("end", ["umount", "sigterm", "terminate-in-a-handler"])
def test_the_session_ends_with_workers_waiting(gate, end):
    g = gate()
    waiting = [g.stat_in_child(f"d{i}/wait") for i in range(4)]
    g.stat_in_child("open").wait(timeout=15)
    for p in waiting:
        assert p.wait(timeout=15) == 0
    # Now several workers exist, all but one parked as spares.
    if end == "umount":
        subprocess.run(["fusermount3", "-u", str(g.mnt)], check=True)
    elif end == "sigterm":
        g.proc.send_signal(signal.SIGTERM)
    else:
        g.stat_in_child("stop").wait(timeout=15)
    assert g.ended()["lookups"] == (10 if end.startswith("terminate") else 9)
    assert not os.path.ismount(g.mnt)


@pytest.mark.parametrize("loop, most", [("mountfs", 1.3), ("pyfuse3", None)])
def test_a_request_that_does_not_wait_costs_one_task_step(gate, loop, most):
    """pyfuse3's own loop wakes a second worker for every request (its figure is printed to
    show what the test tells apart); mountfs's wakes only the one that reads it."""
    g = gate(*(["--pyfuse3-loop"] if loop == "pyfuse3" else []))
    subprocess.run([sys.executable, "-c", "import os, sys\nfor i in range(2000):\n"
                    "    try:\n        os.stat(os.path.join(sys.argv[1], f'n{i}'))\n"
                    "    except FileNotFoundError:\n        pass\n", str(g.mnt)],
                   check=True, timeout=120)
    subprocess.run(["fusermount3", "-u", str(g.mnt)], check=True)
    report = g.ended()
    per_request = report["worker_steps"] / report["lookups"]
    print(f"{loop}'s loop: {per_request:.2f} steps of serving tasks per request")
    assert report["lookups"] >= 2000
    if most is not None:
        assert per_request <= most
    else:
        assert per_request >= 1.8
