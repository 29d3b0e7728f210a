"""The serving loop's idle polling (mountfs/idlepoll.py): it looks for I/O before sleeping
while waits are short, stops when they are not, keeps every deadline, and a mount that has
nothing to do burns no CPU.

The loop's polling shows in the trio thread's CPU time: a loop that polls for a 0.1 s wait
uses about 0.1 s of CPU, one that sleeps almost none. The bounds below are wide (a tenth of
the difference apart) so that a loaded machine cannot flip them."""

import os
import socket
import threading
import time

import pytest
import trio
from trio._core._io_epoll import EpollIOManager

from conftest import cli
from mountfs import idlepoll


@pytest.fixture
def polling_for():
    """polling_for(window): this process's trio loops poll ``window`` s before sleeping,
    from a fresh start (the first wait polls), until the test ends."""
    original = EpollIOManager.get_events

    def install(window: float) -> None:
        EpollIOManager.get_events = original
        assert idlepoll.install(window)
        assert idlepoll.install(window)     # idempotent: not wrapped twice
        assert EpollIOManager.get_events.__closure__ is not None

    yield install
    EpollIOManager.get_events = original


def cpu_of(async_fn, *args) -> tuple[float, object]:
    """(CPU seconds the trio thread used, result) of ``trio.run(async_fn, *args)``."""
    start = time.thread_time()
    result = trio.run(async_fn, *args)
    return time.thread_time() - start, result


def test_a_wait_that_polls_finds_what_comes_and_the_thread_kept_looking(polling_for):
    polling_for(1.0)
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)

        async def wait_for_data():
            threading.Timer(0.2, b.send, (b"request",)).start()
            await trio.lowlevel.wait_readable(a)
            return a.recv(100)

        cpu, got = cpu_of(wait_for_data)
    assert got == b"request"
    assert cpu > 0.05, f"the loop slept ({cpu:.3f} s of CPU in a 0.2 s wait): it did not poll"


def test_an_idle_loop_stops_polling_after_one_window(polling_for):
    """40 waits of 20 ms, nothing coming: the first polls its 5 ms, then every one sleeps
    at once (a loop that polled each would use 0.2 s)."""
    polling_for(0.005)

    async def idle():
        for _ in range(40):
            await trio.sleep(0.02)

    cpu, _ = cpu_of(idle)
    assert cpu < 0.08, f"{cpu:.3f} s of CPU in 0.8 s of idle waits: it kept polling"


def test_short_waits_bring_polling_back(polling_for):
    """After an idle wait turned polling off, a wait that ends within two windows turns it
    on again: the next wait polls (its CPU shows it)."""
    polling_for(0.3)
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)

        async def idle_then_burst():
            await trio.sleep(0.5)               # polls 0.3 s, finds nothing: off
            b.send(b"soon")                     # the next wait ends at once: on again
            await trio.lowlevel.wait_readable(a)
            a.recv(100)
            threading.Timer(0.2, b.send, (b"later",)).start()
            start = time.thread_time()
            await trio.lowlevel.wait_readable(a)
            return time.thread_time() - start

        _, cpu = cpu_of(idle_then_burst)
    assert cpu > 0.05, f"the wait after a short one slept ({cpu:.3f} s of CPU): not re-armed"


def test_deadlines_shorter_than_the_window_are_kept(polling_for):
    polling_for(2.0)
    a, b = socket.socketpair()
    with a, b:
        async def wait_with_deadline():
            start = trio.current_time()
            with trio.move_on_after(0.05):
                await trio.lowlevel.wait_readable(a)
            return trio.current_time() - start

        waited = trio.run(wait_with_deadline)
    assert 0.05 <= waited < 1.0, f"a 50 ms deadline took {waited:.3f} s with a 2 s window"


def test_zero_turns_it_off():
    original = EpollIOManager.get_events
    assert idlepoll.install(0) is False
    assert EpollIOManager.get_events is original


def test_a_bad_setting_is_refused_in_one_line_before_mounting(store, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = cli("mountfs", "mount", store, mnt, check=False,
            env={**os.environ, "MOUNTFS_IDLE_POLL": "fast"})
    assert r.returncode != 0 and not os.path.ismount(mnt)
    assert r.stderr.strip().count("\n") == 0 and "MOUNTFS_IDLE_POLL" in r.stderr, r.stderr


def test_an_idle_mount_burns_no_cpu_after_a_burst(mounted):
    """A burst of creates (the loop polls between them), then nothing: the mount process
    must go back to sleep, not keep polling."""
    for i in range(300):
        (mounted.mnt / f"f{i}").write_bytes(b"x" * 100)
    time.sleep(1.0)                 # the writer commits, the file cache settles
    stat = f"/proc/{mounted.pid}/stat"

    def cpu() -> float:
        fields = open(stat).read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = cpu()
    time.sleep(3.0)
    used = cpu() - before
    assert used < 0.3, f"an idle mount used {used:.2f} s of CPU in 3 s"
    assert len(os.listdir(mounted.mnt)) == 300
