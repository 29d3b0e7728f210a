"""The serving loop's idle polling (mountfs/idlepoll.py): it looks for I/O before sleeping
while waits are short, stops when they are not, keeps every deadline, and a mount that has
nothing to do burns no CPU.

The loop's polling shows in the trio thread's CPU time: a loop that polls for a 0.1 s wait
uses about 0.1 s of CPU, one that sleeps almost none. The bounds below are wide (a tenth of
the difference apart) so that a loaded machine cannot flip them."""

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from mountfs import idlepoll

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

EpollIOManager = pytest.importorskip("trio._core._io_epoll").EpollIOManager


@pytest.fixture
def polling_for():
    """polling_for(window): this process's trio loops poll ``window`` s before sleeping,
    from a fresh start (the first wait polls), until the test ends."""
    original = EpollIOManager.get_events

    def install(window: float) -> None:
        EpollIOManager.get_events = original
        assert idlepoll.install(window)
        wrapped = EpollIOManager.get_events
        assert wrapped is not original
        assert idlepoll.install(window)     # idempotent: not wrapped twice
        assert EpollIOManager.get_events is wrapped

    yield install
    EpollIOManager.get_events = original


@pytest.fixture
def pair():
    """(a, b): a connected socket pair; ``a`` is what the loop waits on."""
    a, b = socket.socketpair()
    a.setblocking(False)
    with a, b:
        yield a, b


async def cpu_of_wait(a, b, delay: float = 0.2) -> float:
    """CPU seconds the trio thread uses waiting for ``a`` while a thread sends on ``b``
    after ``delay`` seconds: about ``delay`` if the loop polled, about 0 if it slept."""
    threading.Timer(delay, b.send, (b"request",)).start()
    start = time.thread_time()
    await trio.lowlevel.wait_readable(a)
    used = time.thread_time() - start
    assert a.recv(100) == b"request"
    return used


def test_a_wait_that_polls_finds_what_comes_and_the_thread_kept_looking(polling_for, pair):
    polling_for(1.0)
    cpu = trio.run(cpu_of_wait, *pair)
    assert cpu > 0.05, f"the loop slept ({cpu:.3f} s of CPU in a 0.2 s wait): it did not poll"


def test_an_idle_loop_stops_polling_after_one_window(polling_for):
    """40 waits of 20 ms, nothing coming: the first polls its 5 ms, then every one sleeps
    at once; a loop that polled each would use 0.2 s more CPU than one that never polls.
    Measured against that loop, in the same minute: 40 wake-ups of a trio loop cost
    0.05-0.11 s of CPU on this VM by themselves (a fixed bound under them failed in CI)."""
    assert not getattr(EpollIOManager.get_events, "polls_first", False)
    never = idle_cpu()
    polling_for(0.005)
    polled = idle_cpu()
    assert polled - never < 0.1, (f"{polled:.3f} s of CPU in 0.8 s of idle waits against "
                                  f"{never:.3f} without polling: it kept polling")


def idle_cpu() -> float:
    """The trio thread's CPU seconds over 40 waits of 20 ms with nothing coming: the least
    of three loops (the CPU of a wake-up varies with what else the VM runs)."""
    async def idle():
        for _ in range(40):
            await trio.sleep(0.02)

    used = []
    for _ in range(3):
        start = time.thread_time()
        trio.run(idle)
        used.append(time.thread_time() - start)
    return min(used)


def test_short_waits_bring_polling_back(polling_for, pair):
    """After an idle wait turned polling off, a wait that ends within two windows turns it
    on again: the next wait polls (its CPU shows it)."""
    polling_for(0.3)

    async def idle_then_burst(a, b):
        await trio.sleep(0.5)               # polls 0.3 s, finds nothing: off
        await cpu_of_wait(a, b, delay=0)    # ends at once: on again
        return await cpu_of_wait(a, b)

    cpu = trio.run(idle_then_burst, *pair)
    assert cpu > 0.05, f"the wait after a short one slept ({cpu:.3f} s of CPU): not re-armed"


def test_deadlines_shorter_than_the_window_are_kept(polling_for, pair):
    polling_for(2.0)

    async def wait_with_deadline(a):
        start = trio.current_time()
        with trio.move_on_after(0.05):
            await trio.lowlevel.wait_readable(a)
        return trio.current_time() - start

    waited = trio.run(wait_with_deadline, pair[0])
    assert 0.05 <= waited < 1.0, f"a 50 ms deadline took {waited:.3f} s with a 2 s window"


def test_a_deadline_within_the_window_leaves_polling_on(polling_for, pair):
    """A timer that ends a poll early is not an idle loop: the next wait still polls."""
    polling_for(0.3)

    async def timer_then_wait(a, b):
        await trio.sleep(0.01)              # polls, cut short by its own deadline
        return await cpu_of_wait(a, b)

    cpu = trio.run(timer_then_wait, *pair)
    assert cpu > 0.05, f"the wait after a timer slept ({cpu:.3f} s of CPU): polling went off"


def test_zero_turns_it_off():
    original = EpollIOManager.get_events
    assert idlepoll.install(0) is False
    assert EpollIOManager.get_events is original


@pytest.mark.parametrize("text", ["5", "-1", "nan", "0.02"])
def test_the_floors_refuse_a_window_that_would_spin_a_cpu(text):
    """``nullfs.py --idle-poll`` takes what MOUNTFS_IDLE_POLL takes: 0 up to 10 ms."""
    assert idlepoll.parse_window("0") == 0 and idlepoll.parse_window("0.0001") == 0.0001
    with pytest.raises(ValueError):
        idlepoll.parse_window(text)


BAD_SETTINGS = {
    "MOUNTFS_IDLE_POLL=20ms": "$MOUNTFS_IDLE_POLL='20ms' is more than 0.01 s: it takes "
                              "seconds (0 up to 0.01 s, e.g. 0.00005); fix or unset it",
    "MOUNTFS_COMMIT_DELAY=x": "$MOUNTFS_COMMIT_DELAY='x' is not a duration: it takes seconds "
                              "(0 up to 366d, e.g. 0.005 or 250ms); fix or unset it",
    "MOUNTFS_DIRTY_EXPIRE=0": "$MOUNTFS_DIRTY_EXPIRE='0' is not a duration: it takes seconds "
                              "(more than 0 up to 366d, e.g. 30 or 250ms); fix or unset it"}


@pytest.mark.parametrize("setting", BAD_SETTINGS)
@pytest.mark.parametrize("script", [["nullfs.py", "MNT"], ["durable_floor.py", "MNT", "STORE"],
                                    ["bench_io.py", "--quick"]])
def test_the_benchmarks_refuse_a_bad_tuning_variable_in_one_line(script, setting, tmp_path):
    """A tuning variable the mount would refuse (the idle-poll window among them) stops the
    floors (which read them as the mount does) and bench_io (before it sets anything up)
    with the mount's line, not a traceback."""
    args = [str(tmp_path / a.lower()) if a.isupper() else a for a in script[1:]]
    name, value = setting.split("=")
    env = {**os.environ, name: value}
    done = subprocess.run([sys.executable, str(SCRIPTS / script[0]), *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"{script[0].removesuffix('.py')}: {BAD_SETTINGS[setting]}"]
    assert not any(tmp_path.iterdir())         # nothing mounted, no store made


def test_a_trio_without_the_epoll_wait_is_left_alone(monkeypatch):
    """Another trio (no epoll manager's ``get_events`` to wrap): nothing changes and the
    mount serves as it would without polling."""
    monkeypatch.delattr(EpollIOManager, "get_events")
    assert idlepoll.install(0.00005) is False
    assert not hasattr(EpollIOManager, "get_events")


def test_an_idle_mount_goes_back_to_sleep_after_a_burst(make_mount, monkeypatch):
    """A burst of creates (the loop polls between them), then nothing: the mount's serving
    thread must go back to sleeping in epoll until something happens. With the longest window
    (10 ms), one that polled before each of its idle timers' waits used 31 ms of CPU in 3 s
    (tried: polling never turned off); the adaptive one 1 ms.

    Counted in the thread's epoll_wait calls (strace), not its CPU time: on some VMs the
    kernel charges a thread CPU time for its sleeps (a Python thread sleeping 5 s once was
    charged 11.8 ms, the idle mount 80-135 ms in 5 s whether it polled or not, 2026-11-29),
    which no bound on CPU time can tell from polling. A poll is an epoll_wait that does not
    wait (timeout 0): a loop that polled on each of its waits would make thousands in a
    10 ms window, the adaptive one none once the burst is over."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("strace is needed (scripts/setup.sh installs it)")
    monkeypatch.setenv("MOUNTFS_IDLE_POLL", str(idlepoll.MAX_POLL))
    mounted = make_mount()
    for i in range(300):
        (mounted.mnt / f"f{i}").write_bytes(b"x" * 100)
    time.sleep(1.0)                 # the writer commits, the file cache settles
    traced = subprocess.run(
        ["timeout", "-s", "INT", "5", strace, "-qq", "-e", "trace=epoll_wait,epoll_pwait",
         "-p", str(mounted.pid)], capture_output=True, text=True)
    calls = [line for line in traced.stderr.splitlines() if line.startswith("epoll_")]
    assert calls, f"strace saw no epoll_wait of the serving thread: {traced.stderr[-300:]}"
    polls = [line for line in calls if re.search(r", 0\) += ", line)]
    assert len(polls) < 50, (f"the idle mount polled {len(polls)} times in 5 s "
                             f"({len(calls)} waits)")
    assert len(calls) < 200, f"the idle mount woke {len(calls)} times in 5 s"
    assert len(os.listdir(mounted.mnt)) == 300
