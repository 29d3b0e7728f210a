"""Mounting and unmounting: the mount process's life, from the store lock to a clean
unmount (finding which store backs a mountpoint is ``mountinfo``'s).

``mountfs mount`` starts the mount process in the background and returns once the mount is
live (the child reports READY, or its error, on a pipe); ``--foreground`` runs it here.
``mountfs umount`` waits until the mount process has flushed and exited, not just for the
kernel to detach (umount alone returns before our data is safe).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import children
from .mountinfo import MountInfo, canonical, mounted_at, mounts
from .sdnotify import notify
from .errors import StoreError

log = logging.getLogger(__name__)

# s: how long a thread holding the GIL keeps a waiting one waiting (CPython's default is
# 5 ms). The trio thread answers every request; the committer running a queue of posted
# steps must not hold it off that long. 0.5 ms measured best (docs/benchmarks.md).
GIL_SWITCH = 0.0005
# KiB the kernel reads ahead of a sequential reader. Its default on a FUSE mount is 128 KiB:
# a cold read then waits for every chunk's disk reads and digest check in turn (874-960
# MB/s for 1 GiB here); with 1 MiB the next chunk's requests overlap them (1,330-1,539 MB/s),
# and with 4 MiB the next four chunks' (858 -> 974 MB/s on the second machine, random reads
# unchanged; docs/benchmarks.md, twentieth round). Set through sysfs, so only as root.
READAHEAD_KIB = 4096


async def _raise_readahead(ops: Operations, mountpoint: str) -> None:
    """Once the kernel's INIT is answered (the answer sets the readahead, lowering it to
    what the kernel offered at mount time, 128 KiB), raise it to READAHEAD_KIB. The mount's
    device is found in /proc/self/mountinfo: a stat of the mountpoint would wait for our own
    loop."""
    await ops.initialized.wait()
    devices = [m.device for m in mounts() if m.mountpoint == mountpoint]
    if not devices:
        log.info("%s is not in /proc/self/mountinfo: the kernel's readahead stays", mountpoint)
        return
    set_readahead(devices[-1], mountpoint)


def set_readahead(device: str, mountpoint: str) -> None:
    """Give the FUSE mount ``device`` (MAJOR:MINOR; its bdi is its own) READAHEAD_KIB of
    readahead. The benchmarks' floor (scripts/nullfs.py) calls it too, so that both read
    ahead alike."""
    try:
        Path(f"/sys/class/bdi/{device}/read_ahead_kb").write_text(f"{READAHEAD_KIB}\n")
    except OSError as e:
        log.info("could not set the readahead of %s (%s): the kernel's default stays",
                 mountpoint, e.strerror)


def _check_mountpoint(mountpoint: str) -> None:
    mounted = next((m for m in mounts() if m.mountpoint == mountpoint), None)
    if mounted is not None and _alive(_server(mounted)):    # not stat'ed: it may be stuck
        raise StoreError(f"{mountpoint} is already a mountpoint")
    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        raise StoreError(f"mountpoint {mountpoint} does not exist")
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise StoreError(f"{mountpoint} is a mount whose process died; run "
                             f"'mountfs umount {mountpoint}' first")
        raise StoreError(f"mountpoint {mountpoint}: {e.strerror}")
    import stat as st_mod
    if not st_mod.S_ISDIR(st.st_mode):
        raise StoreError(f"mountpoint {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise StoreError(f"{mountpoint} is already a mountpoint")


def _check_apart(store_path: str, mountpoint: str) -> None:
    """Refuse a mountpoint that is the store's directory or one above it: the mount would
    cover the store, and its writer, opening the store through the mount it serves, would
    wait for it forever."""
    store = os.path.realpath(store_path)
    if store == mountpoint or store.startswith(mountpoint.rstrip("/") + "/"):
        what = "is the store's own directory" if store == mountpoint else \
            f"contains the store {store}"
        raise StoreError(f"{mountpoint} {what}: a mount there would hide the store from its "
                         f"own mount; mount it on another directory")


def _fsname(store_path: str) -> str:
    """The ``fsname`` mount option, which the kernel shows as the mount's source (``mounts``
    reads the store's path back from it). libfuse splits options at commas and reads
    backslash escapes, so commas, backslashes and every byte that is not printable ASCII go
    as octal escapes: a store named 's,allow_other' must not switch that option on."""
    plain = set(range(0x21, 0x7f)) - set(b",\\")
    return "fsname=" + "".join(chr(b) if b in plain else f"\\{b:03o}"
                               for b in os.fsencode(f"mountfs:{store_path}"))


# ---- the mount process ------------------------------------------------------------------------

def run_foreground(store_path: str, mountpoint: str, allow_other: bool = False,
                   read_only: bool = False, ready=None) -> None:
    """Mount and serve until unmounted or signalled. ``ready(msg)`` is called with None once
    the mount is live, or with an error message if it could not be."""
    import pyfuse3              # the serving side's imports: finding a mount needs none
    import trio

    from .control import runtime_dir
    from .engine import Engine
    from .idlepoll import install as poll_before_sleeping
    from .memory import keep_freed_buffers
    from .ops import Operations
    from .store import Store
    mountpoint = canonical(mountpoint)
    _check_mountpoint(mountpoint)
    _check_apart(store_path, mountpoint)
    runtime_dir(create=True)    # refused now, not by the control server once mounted
    keep_freed_buffers()
    sys.setswitchinterval(GIL_SWITCH)
    poll_before_sleeping()
    store = Store.open(store_path, readonly=read_only, lock=not read_only,
                       holder=f"mounted at {mountpoint}")
    try:
        if not read_only and store.mirror_of is not None:
            raise StoreError(f"{store.path} is a mirror (of store {store.mirror_of.hex()}); "
                             f"mount it --read-only, or 'mountfs promote' it to make it a "
                             f"writable source")
        engine = Engine(store)
        ops = Operations(engine, read_only=read_only)
        ops.mountpoint = mountpoint
        options = set(pyfuse3.default_options)
        options |= {_fsname(store.path), "subtype=mountfs"}
        if allow_other:
            options.add("allow_other")
        if read_only:
            options.add("ro")
        try:
            pyfuse3.init(ops, mountpoint, options)
        except RuntimeError as e:
            raise StoreError(f"cannot mount {mountpoint}: {e}") from e
        clean = False
        try:
            trio.run(_serve, engine, ops, mountpoint, ready)
            clean = True
        finally:
            engine.close()
            pyfuse3.close(unmount=clean)
    finally:
        store.close()


async def _remove_orphans(engine: Engine) -> None:
    """Delete the inodes an earlier mount left unlinked but open. If that cannot be
    committed (a full disk: the deletion itself needs a few pages), the mount goes on: the
    files stay invisible, and the next mount tries again."""
    from .namespace import FsError
    try:
        n = await engine.remove_orphans()
    except FsError as e:
        if e.errno != errno.ENOSPC:
            raise
        log.warning("could not delete the unlinked inodes an earlier mount left open (%s); "
                    "the next mount will try again", e.args[1])
        return
    if n:
        log.info("deleted %d unlinked inodes left open by an earlier mount", n)


async def _serve(engine: Engine, ops: Operations, mountpoint: str, ready) -> None:
    import trio

    from . import fuseloop
    from .controlserver import ControlServer
    from .namespace import FsError
    engine.start()
    if not engine.store.readonly:
        await _remove_orphans(engine)
    async with trio.open_nursery() as nursery:
        engine.files.nursery = nursery
        if not engine.store.readonly:
            nursery.start_soon(engine.syncer)
            nursery.start_soon(engine.collector)
            nursery.start_soon(engine.files.expirer)
            engine.wake_gc()
        await nursery.start(ControlServer(engine, ops, mountpoint).serve)
        nursery.start_soon(_on_signals)
        nursery.start_soon(_raise_readahead, ops, mountpoint)
        if ready:
            ready(None)
        notify(READY="1", STATUS=f"mounted {engine.store.path} at {mountpoint}")
        log.info("mounted %s at %s", engine.store.path, mountpoint)
        await fuseloop.main()
        log.info("unmounting %s: flushing", mountpoint)
        notify(STOPPING="1", STATUS="unmounting: flushing")
        engine.files.nursery = None
        try:
            await engine.files.flush_all()
        except FsError as e:
            log.error("could not flush buffered data at unmount: %s", e)
        try:
            await engine.sync()     # a no-op on a read-only store
        except FsError as e:        # the writer failed (logged then) or the disk did
            log.error("could not sync the store at unmount: %s", e)
        nursery.cancel_scope.cancel()


async def _on_signals() -> None:
    """SIGTERM, SIGINT and SIGHUP unmount: a service stop, Ctrl-C, a foreground mount's
    terminal closing. SIGHUP stays ignored if it came ignored (``nohup``)."""
    import pyfuse3
    import trio
    hangup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else []
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, *hangup) as signals:
        async for _ in signals:
            log.info("signal received: unmounting")
            pyfuse3.terminate()


# ---- starting in the background and stopping -------------------------------------------------

def mount_background(store: str, mountpoint: str, allow_other: bool, read_only: bool,
                     verbose: bool, timeout: float = 60.0) -> int:
    """Start the mount process and wait until it reports that the mount is live."""
    from .strictmodes import check_store
    store = os.path.abspath(store)
    check_store(store)                  # before its log is opened
    log_path, logfd = _open_log(store)
    rfd, wfd = os.pipe()
    cmd = children.module_command("mountfs.cli", *(["-v"] if verbose else []), "mount",
                                  "--foreground", "--ready-fd", str(wfd), store,
                                  os.path.abspath(mountpoint))
    if allow_other:
        cmd.append("--allow-other")
    if read_only:
        cmd.append("--read-only")
    proc = subprocess.Popen(cmd, pass_fds=(wfd,), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL if logfd is None else logfd,
                            start_new_session=True, env=children.module_env(),
                            cwd=children.CWD)
    os.close(wfd)
    if logfd is not None:
        os.close(logfd)
    deadline = time.monotonic() + timeout
    msg = b""
    with os.fdopen(rfd, "rb") as r:
        while time.monotonic() < deadline:
            chunk = r.readline()
            msg += chunk
            if not chunk or chunk.endswith(b"\n"):
                break
    text = msg.decode(errors="replace").strip()
    if text == "READY":
        return proc.pid
    if text:
        raise StoreError(text.removeprefix("ERROR "))
    raise StoreError(_silent_end(proc, mountpoint, log_path))


def _silent_end(proc: subprocess.Popen, mountpoint: str, log_path: Path) -> str:
    """What to tell of a mount process that said neither READY nor why not: it died (and
    may have left its dead mount behind), or it hangs."""
    try:
        rc = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return (f"the mount process (pid {proc.pid}) has not mounted and does not answer; "
                f"see {log_path}, and stop it with 'kill {proc.pid}'")
    if any(m.mountpoint == canonical(mountpoint) for m in mounts()):
        return (f"the mount process died (status {rc}) after mounting; see {log_path}, and "
                f"detach its dead mount with 'mountfs umount {mountpoint}'")
    return f"the mount process exited (status {rc}) without mounting; see {log_path}"


def _open_log(store: str) -> tuple[Path, int | None]:
    """The background mount's log, ``STORE/mountfs.log``, opened for appending (never
    through a link: check_store passed) if STORE is a store we may write: a refused
    directory must be left as it was (an empty one would no longer be empty, and 'mountfs
    mkfs' would refuse it)."""
    from .strictmodes import open_private
    if not (Path(store) / "data.mdb").is_file() or not os.access(store, os.W_OK):
        return Path(os.devnull), None
    log_path = Path(store) / "mountfs.log"
    try:
        return log_path, open_private(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError:
        return Path(os.devnull), None


def _holds_lock(info: MountInfo) -> bool:
    """Whether the store lock is held by the mount at ``info.mountpoint``."""
    from .store import lock_holder
    return (lock_holder(info.store) or "").endswith(f" mounted at {info.mountpoint}")


def _server(info: MountInfo) -> tuple[int, int | None] | None:
    """(pid, start time) of the process serving the mount at ``info.mountpoint``: its own
    record, or (a mount of an older version) the store lock's holder if that names this
    mountpoint. Never another process of the store (a writer beside a read-only mount, a
    mirror's receiver)."""
    from .control import mount_record, process_start
    from .store import lock_holder
    rec = mount_record(info.mountpoint)
    if rec is not None and rec["store"] == info.store:
        return rec["pid"], rec.get("start")
    holder = lock_holder(info.store) or ""
    if holder.startswith("pid ") and _holds_lock(info):
        pid = int(holder.split()[1])
        return pid, process_start(pid)
    return None


def _alive(server: tuple[int, int | None] | None) -> bool:
    """Whether the process ``_server`` named still runs (as far as this pid namespace sees)."""
    from .control import process_start
    if server is None:
        return False
    start = process_start(server[0])
    return start is not None and (server[1] is None or start == server[1])


def _disconnected(mountpoint: str) -> bool:
    """Whether the mount at ``mountpoint`` lost its process (ENOTCONN). Asked only when that
    process is not seen running: a stat of a mount whose process is stopped or stuck would
    wait for it forever."""
    try:
        os.stat(mountpoint)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def _if_a_store(path: str, known: list[MountInfo]) -> str:
    """For ``umount STORE``: where that store is mounted, if it is one ("" if not)."""
    at = mounted_at(path, known)
    if at is not None:
        return f" but a store, mounted at {at}: run 'mountfs umount {at}'"
    return " (it is no mountpoint; 'mount | grep mountfs' lists the mounts)"


def umount(mountpoint: str, timeout: float = 120.0) -> None:
    """Unmount, then wait until the process that served this mountpoint has flushed, closed
    the store and exited: once this returns the store is free (fsck, another mount)."""
    known = mounts()
    given, mountpoint = mountpoint, canonical(mountpoint, known)
    info = next((m for m in known if m.mountpoint == mountpoint), None)
    if info is None:
        raise StoreError(f"{given} is not a mountfs mount{_if_a_store(given, known)}")
    server = _server(info)
    dead = not _alive(server) and _disconnected(mountpoint)
    cmd = ["fusermount3", "-u"] + (["-z"] if dead else []) + [mountpoint]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        err = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"
        if "busy" in err:
            err += (f"; a process has a file open or its working directory in it: "
                    f"'fuser -vm {mountpoint}' lists them; close them and retry")
        raise StoreError(f"cannot unmount {mountpoint}: {err}")
    if server is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # The lock too: a pid seen from another pid namespace looks gone while it runs.
        if not _alive(server) and not _holds_lock(info):       # a zombie counts as gone
            return
        time.sleep(0.05)
    raise StoreError(f"unmounted, but the mount process {server[0]} has not exited after "
                     f"{timeout:.0f} s: it may still be flushing (see {info.store}/mountfs.log); "
                     f"the store is free once it exits")
