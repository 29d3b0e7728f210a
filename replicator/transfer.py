"""Moving chunks to a mirror with Spark: batches balanced by bytes and count, one task each.

Where a task gets its chunks depends on where it runs. With the embedded master the tasks
run on this host and open the source store read-only (chunks are content-addressed, so a
digest names the same bytes at every epoch; the cycle's snapshot keeps them from being
reclaimed). With a cluster master an executor may be on any host, so it fetches its batch
from this process's chunk endpoint (replicator.chunkserver: alive for the job, read-only,
one random credential per job carried in the task) and checks every digest. Either way the
task hands the batch to the mirror's sink, which verifies every digest before staging it. A
batch that fails is retried by Spark; a retry first asks the mirror what it still lacks, and
chunks staged before a failure stay staged, so a re-run sends only what is still missing.

Spark runs embedded (``local[*]``) unless a master URL is given; the session is created once
per process and reused by later cycles (the daemon keeps it). Its jobs take turns: the
daemon runs cycles to several mirrors at once, and under Spark's FIFO scheduler a second
job gets no task slot while the first has tasks waiting, which the second's watchdog would
take for a stall.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from py4j.protocol import Py4JError

from mountfs.strictmodes import open_private

log = logging.getLogger(__name__)

DEFAULT_BATCH_BYTES = 32 << 20
MAX_CHUNKS = 4096                   # per batch: many tiny chunks weigh as much as few big
CHUNK_COST = 64 << 10               # what one chunk costs beyond its bytes, when balancing
EMBEDDED_MASTER = "local[*,4]"      # every core, a failed task retried up to 4 times
DEFAULT_STALL_SECONDS = 300.0
READAHEAD_MIN_CHUNK = 64 << 10      # mean chunk size from which readahead pays

LOG4J_CONFIG = os.path.join(os.path.dirname(__file__), "log4j2.properties")
QUIET_LOGGING = f"-Dlog4j.configurationFile=file:{LOG4J_CONFIG}"

_session_lock = threading.Lock()
_session = None
_job_lock = threading.Lock()        # one Spark job at a time in this process
_cancels = 0                        # how many times cancel_all ran


def spark_session(master: str | None = None):
    """The process's Spark session (created on first use, quiet, without a web UI)."""
    global _session
    with _session_lock:
        if _session is None:
            _session = _started(master or EMBEDDED_MASTER)
        return _session


def _started(master: str):
    """A new session, started in a thread of its own while this one waits: PySpark gives a
    session started in the main thread a SIGINT handler that calls the JVM wherever Ctrl-C
    lands, also in the middle of another py4j call on the same connection, which py4j then
    reports as a Py4JError instead of the interruption. Started elsewhere, it gets none, and
    Ctrl-C while the JVM starts interrupts only the waiting."""
    starter, result = _in_thread("spark-start", lambda: _start(master))
    starter.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _start(master: str):
    """The session itself; its JVM writes to the Spark log, not to the terminal."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    builder = (SparkSession.builder.appName("mountfs-replicate")
               .master(master)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.task.maxFailures", "4")
               .config("spark.python.worker.reuse", "true")
               .config("spark.driver.extraJavaOptions", QUIET_LOGGING)
               .config("spark.executor.extraJavaOptions", QUIET_LOGGING))
    try:
        with _stderr_to(spark_log_path()):
            session = builder.getOrCreate()
    except Py4JError as e:
        raise TransferFailed(f"cannot start Spark with master {master}: "
                             f"{_spark_message(e)}") from None
    session.sparkContext.setLogLevel("ERROR")
    return session


def _in_thread(name: str, fn) -> tuple[threading.Thread, dict]:
    """``fn()`` started in a daemon thread; its "value", or the "error" it raised, is left in
    the dict for the thread that waits for it."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:          # handed to the waiting thread
            result["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, result


def cancel_all() -> None:
    """Cancel every running Spark job of this process (the daemon stopping), and the jobs
    waiting for their turn."""
    global _cancels
    with _session_lock:
        _cancels += 1
        if _session is not None:
            _session.sparkContext.cancelAllJobs()


def spark_log_path() -> str:
    """Where the Spark JVM and its Python workers write their own output: a file, so that
    the command line shows only mountfs's messages ($MOUNTFS_SPARK_LOG to choose)."""
    return os.environ.get("MOUNTFS_SPARK_LOG") or os.path.join(
        tempfile.gettempdir(), f"mountfs-spark-{os.getuid()}.log")


def open_spark_log(path: str) -> int:
    """The Spark log, opened for appending: in a shared $TMPDIR another user could have put
    a link or a file of theirs at its name first, so neither is followed or written (0600)."""
    return open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)


@contextlib.contextmanager
def _one_job_at_a_time():
    """This job's turn, once the job in flight has ended. A job still waiting when
    ``cancel_all`` runs does not start: the daemon, stopping, would wait for all of it."""
    cancels = _cancels
    with _job_lock:
        if _cancels != cancels:
            raise TransferFailed("cancelled before it started; run again to resume")
        yield


@contextlib.contextmanager
def _stderr_to(path: str):
    """Point file descriptor 2 at ``path`` while the JVM starts (it inherits it)."""
    fd = open_spark_log(path)
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def batches(chunks: list[tuple[bytes, int]], batch_bytes: int = DEFAULT_BATCH_BYTES,
            min_batches: int = 1,
            max_chunks: int = MAX_CHUNKS) -> list[list[tuple[str, int]]]:
    """Cut (digest, length) pairs into batches of about ``batch_bytes`` and at most about
    ``max_chunks`` chunks each, balanced by bytes and by count (largest first into the
    batch whose bytes plus CHUNK_COST per chunk are lowest), as (hex digest, length)
    lists."""
    total = sum(n for _, n in chunks)
    count = max(min_batches, -(-total // batch_bytes), -(-len(chunks) // max_chunks)) \
        if chunks else 0
    count = min(count, len(chunks))
    bins: list[list[tuple[str, int]]] = [[] for _ in range(count)]
    loads = [0] * count
    for digest, n in sorted(chunks, key=lambda c: -c[1]):
        i = loads.index(min(loads))
        bins[i].append((digest.hex(), n))
        loads[i] += n + CHUNK_COST
    return bins


@dataclass
class Sent:
    chunks: int = 0
    bytes: int = 0
    executors: dict = field(default_factory=dict)   # executor -> tasks, chunks, bytes, s

    def add(self, task: dict) -> None:
        """Count one finished task's report (see _BatchSender)."""
        self.chunks += task["chunks"]
        self.bytes += task["bytes"]
        ex = self.executors.setdefault(task["executor"], {
            "tasks": 0, "chunks": 0, "bytes": 0, "seconds": 0.0})
        ex["tasks"] += 1
        ex["chunks"] += task["chunks"]
        ex["bytes"] += task["bytes"]
        ex["seconds"] += task["seconds"]
        ex["bytes_per_second"] = int(ex["bytes"] / ex["seconds"]) if ex["seconds"] else 0


def embedded(master: str | None) -> bool:
    """Whether the executors run on this host (``local[...]``): they can read the store."""
    return master is None or master.startswith("local")


def check_reachable(master: str | None, sink) -> None:
    """Refuse up front a mirror that remote executors could not write: a file:// mirror
    is a path on this host."""
    if not embedded(master) and not getattr(sink, "remote", False):
        raise TransferFailed(f"a file:// mirror cannot be written by the executors of "
                             f"{master} (they may run on other hosts): serve it with "
                             f"'mountfs serve-mirror' and replicate to its http(s):// URL")


def send(source, sink, chunk_batches: list, master: str | None = None,
         stall_seconds: float = DEFAULT_STALL_SECONDS,
         progress: Callable[[int, int, int], None] | None = None) -> Sent:
    """Run the Spark job: every batch read from ``source`` (the open source Store; through
    its chunk endpoint when the executors may be remote) and staged through ``sink`` (a
    picklable object with ``put(list of (digest, data)) -> (chunks, bytes)`` and
    ``missing(digests)``). ``progress(bytes done, bytes in all, chunks in all)`` is called
    as batches finish. A job in which no batch finishes for ``stall_seconds`` is cancelled
    (TransferStalled); what arrived stays. A job waits for this process's job in flight,
    and its watchdog starts with its turn."""
    if not chunk_batches:
        return Sent()
    with _one_job_at_a_time():
        return _send(source, sink, chunk_batches, master, stall_seconds, progress)


def _send(source, sink, chunk_batches, master, stall_seconds, progress) -> Sent:
    sc = spark_session(master).sparkContext
    with _SignalsHeld() as held:
        if embedded(sc.master):
            return _run(sc, _BatchSender(str(source.path), None, sink, stall_seconds),
                        chunk_batches, stall_seconds, progress, held)
        lengths = {bytes.fromhex(h): n for batch in chunk_batches for h, n in batch}
        with _chunk_endpoint(sc, source, lengths) as endpoint:
            task = _BatchSender(None, endpoint.client(), sink, stall_seconds)
            return _run(sc, task, chunk_batches, stall_seconds, progress, held,
                        endpoint.explain)


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _SignalsHeld:
    """While the main thread talks to the JVM, Ctrl-C (SIGTERM, SIGHUP) is only noted, and
    acted on at a point between py4j calls (``deliver``) or on leaving, also over an error
    that came after it. Raised in the middle of a py4j call, KeyboardInterrupt made py4j
    tear the thread's connection down, and when it landed just as the call ended (the
    connection back in py4j's pool) the second teardown raised Py4JError in its place: the
    run said "lost the Spark driver" instead of "interrupted". Raised in a py4j finalizer,
    it was printed and dropped: the run went on. Other threads take no signals: for them
    nothing changes."""

    def __init__(self):
        self.handlers: dict = {}
        self.arrived: list[int] = []

    def __enter__(self) -> "_SignalsHeld":
        if threading.current_thread() is threading.main_thread():
            try:
                for s in HELD_SIGNALS:
                    if callable(signal.getsignal(s)):
                        self.handlers[s] = signal.signal(s, self._note)
            except BaseException:   # one not yet held arrived meanwhile: acted on as before
                self._put_back()
                raise
        return self

    def _put_back(self) -> None:
        """Every handler back as it was. A signal that arrives meanwhile is acted on by the
        handler it has then (``signal.signal`` runs those of pending signals first), so one
        already put back may raise before the next is: the rest still go back, then the
        first of those interruptions is raised. Left half done, a later SIGTERM would only
        be noted by a ``_note`` nobody reads: lost."""
        raised = None
        for s, handler in self.handlers.items():
            while True:
                try:
                    signal.signal(s, handler)
                    break
                except BaseException as e:      # raised once the rest are back
                    raised = raised or e
        if raised is not None:
            raise raised

    def _note(self, signum, frame) -> None:
        self.arrived.append(signum)

    def deliver(self) -> None:
        """Act on the signals that arrived as their own handlers would have: raise
        KeyboardInterrupt (Interrupted under ``signals_raise``)."""
        while self.arrived:
            signum = self.arrived.pop(0)
            self.handlers[signum](signum, None)

    def __exit__(self, *exc) -> None:
        self._put_back()
        self.deliver()


def _chunk_endpoint(sc, source, lengths):
    """The job's chunk endpoint, listening where the executors reach the driver
    (``spark.driver.host``; ``spark.driver.bindAddress`` if set), with TLS when
    $MOUNTFS_CHUNK_CERT and $MOUNTFS_CHUNK_KEY name a certificate and its key."""
    from .chunkserver import ChunkServer
    conf = sc.getConf()
    host = conf.get("spark.driver.host")
    cert, key = os.environ.get("MOUNTFS_CHUNK_CERT"), os.environ.get("MOUNTFS_CHUNK_KEY")
    try:
        return ChunkServer(source, lengths, host, conf.get("spark.driver.bindAddress", host),
                           (cert, key) if cert and key else None)
    except (OSError, ValueError) as e:
        raise TransferFailed(f"cannot serve chunks to the executors on {host}: {e}; set "
                             f"spark.driver.host to an address of this host they can "
                             f"reach") from None


def _run(sc, task, chunk_batches, stall_seconds, progress, held, explain=None) -> Sent:
    group = f"mountfs-{os.getpid()}-{time.monotonic_ns()}"

    def run():
        sc.setJobGroup(group, "mountfs replicate", interruptOnCancel=True)
        rdd = sc.parallelize(chunk_batches, len(chunk_batches))
        return rdd.map(task).collect()

    worker, result = _in_thread("spark-transfer", run)
    sizes = [sum(n for _, n in batch) for batch in chunk_batches]
    chunks = sum(len(batch) for batch in chunk_batches)
    report = (lambda done: progress(sum(sizes[:done]), sum(sizes), chunks)) if progress \
        else None
    try:
        _watch(sc, group, worker, len(chunk_batches), stall_seconds, report, held, explain)
    except Py4JError as e:
        raise TransferFailed(f"lost the Spark driver ({e.__class__.__name__}); chunks that "
                             f"arrived are kept, run again to resume") from None
    if "error" in result:
        raise TransferFailed(_spark_message(result["error"])) from result["error"]
    sent = Sent()
    for task_report in result["value"]:
        sent.add(task_report)
    return sent


def readahead_suits(lengths) -> bool:
    """Whether chunks of these lengths read faster from a store opened with readahead: when
    they are large on average (contiguous overflow pages read in sequence, the next chunk
    pulled in while this one is sent). Small ones are random pages that readahead would
    each inflate to ~128 KiB (a 1M-file source thrashed a 512 MiB memory limit that way);
    a store opened without it still copies a large chunk with one pread (Store.copy)."""
    return bool(lengths) and sum(lengths) >= READAHEAD_MIN_CHUNK * len(lengths)


def send_inline(store, stage, chunk_batches: list, progress=None) -> Sent:
    """The same batches sent from this process, without Spark (small transfers):
    ``stage(list of (digest, data))`` returns (chunks, bytes) stored."""
    sent, total = Sent(), sum(n for batch in chunk_batches for _, n in batch)
    chunks = sum(len(batch) for batch in chunk_batches)
    done = 0
    for batch in chunk_batches:
        with store.read() as txn:
            data = [(bytes.fromhex(h), _blob(txn, store, h)) for h, _ in batch]
        stored, nbytes = stage(data)
        sent.chunks += stored
        sent.bytes += nbytes
        done += sum(n for _, n in batch)
        if progress:
            progress(done, total, chunks)
    return sent


def _blob(txn, store, hexdigest: str) -> bytes:
    from mountfs.store import StoreError
    from mountfs import chunkfile
    data = chunkfile.get(txn, store.db, bytes.fromhex(hexdigest))
    if data is None:
        raise StoreError(f"source chunk {hexdigest[:16]} is missing (was the snapshot "
                         f"deleted?)")
    return store.copy(data)


class TransferFailed(Exception):
    """The Spark job failed; chunks staged before the failure stay on the mirror."""


class TransferStalled(TransferFailed):
    """No batch finished for the stall timeout; the job was cancelled."""


START_SECONDS = 120.0               # at least this long for the first task to start


def _watch(sc, group, worker, total, stall_seconds, progress, held,
           explain=None) -> None:
    """Report finished batches; cancel the job when none finishes for ``stall_seconds``
    while tasks are running (the clock starts with the first running task, so starting
    executors and Python workers is not a stall), or when no task starts at all within
    ``max(stall_seconds, START_SECONDS)`` (no executor left: a worker died, the cluster is
    full). ``explain()`` says, for remote executors, which side they could not reach. A
    signal ``held`` is acted on between two rounds of questions to the JVM."""
    done, last_change, submitted = 0, None, time.monotonic()
    tracker = sc.statusTracker()
    explain = _with_lost_executors(sc, explain)
    while worker.is_alive():
        worker.join(0.2)
        held.deliver()
        explain.poll()
        now_done, running = _task_counts(tracker, group)
        if now_done != done:
            done, last_change = now_done, time.monotonic()
            if progress:
                progress(min(done, total))
        elif last_change is None:
            if running:
                last_change = time.monotonic()
            elif time.monotonic() - submitted > max(stall_seconds, START_SECONDS):
                _cancel(sc, group, worker, f"no task of the transfer started in "
                        f"{max(stall_seconds, START_SECONDS):.0f} s: does the cluster have "
                        f"executors for it?", explain)
        elif time.monotonic() - last_change > stall_seconds:
            _cancel(sc, group, worker, f"no chunk batch finished in {stall_seconds:.0f} s",
                    explain)
    if progress:
        progress(total)


class _with_lost_executors:
    """``explain()`` that first says when the job has no executor left (a worker died):
    the executors' hosts are polled while the job runs, so the lost ones can be named."""

    def __init__(self, sc, explain=None):
        self.tracker = sc._jsc.sc().statusTracker()
        self.driver = sc.getConf().get("spark.driver.host")
        self.explain = explain
        self.seen: set[str] = set()
        self.now: list[str] = []
        self.next_poll = 0.0

    def poll(self) -> None:
        if time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + 1.0
        hosts = [info.host() for info in self.tracker.getExecutorInfos()]
        if self.driver in hosts:                 # the driver's own entry is in the list
            hosts.remove(self.driver)
        self.now = hosts
        self.seen.update(hosts)

    def __call__(self) -> str | None:
        self.next_poll = 0.0
        self.poll()
        if self.seen and not self.now:
            return (f"the job has no executor left (lost: {', '.join(sorted(self.seen))}; "
                    f"did a worker die?)")
        return self.explain() if self.explain else None


def _cancel(sc, group, worker, what: str, explain) -> None:
    why = explain() if explain else None
    why = f": {why}" if why else ""
    sc.cancelJobGroup(group)
    worker.join()
    raise TransferStalled(f"{what}; cancelled (what arrived is kept; run again to "
                          f"resume){why}")


def _task_counts(tracker, group) -> tuple[int, int]:
    """(finished, running) tasks of the job group."""
    done = running = 0
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in (job.stageIds if job else []):
            info = tracker.getStageInfo(stage_id)
            if info:
                done += info.numCompletedTasks
                running += info.numActiveTasks
    return done, running


def _spark_message(error: BaseException) -> str:
    """The useful line of a Spark failure: the last error our own code raised in the task
    (``mountfs.store.StoreFull: no space ...``), else the first line."""
    text = str(error)
    ours = re.findall(r"^(?:mountfs|replicator)\.[\w.]+: (.+)$", text, re.MULTILINE)
    if ours:
        return ours[-1]
    other = re.findall(r"^(?:: )?[\w.]*(?:Error|Exception): (.+)$", text, re.MULTILINE)
    if other:
        return other[-1]
    return text.splitlines()[0] if text else type(error).__name__


class ClusterMismatch(Exception):
    """An executor runs another pyspark than the driver: refused before it sends anything
    (pickled tasks and results are only promised to work between equal versions)."""


class _BatchSender:
    """The Spark task: read one batch (from the source store on this host, or from the
    source's chunk endpoint) and put it to the sink. A retried attempt first asks the
    mirror which chunks it still lacks, so what arrived is not sent again. Returns what it
    stored and which executor did it, for the per-executor figures."""

    def __init__(self, store_path: str | None, endpoint, sink, stall_seconds: float):
        import pyspark
        self.store_path = store_path
        self.endpoint = endpoint
        self.sink = sink
        self.stall_seconds = stall_seconds
        self.pyspark_version = pyspark.__version__

    def __call__(self, batch: list[tuple[str, int]]) -> dict:
        import pyspark
        from pyspark import TaskContext
        if pyspark.__version__ != self.pyspark_version:
            raise ClusterMismatch(
                f"executor {self._executor()} runs pyspark {pyspark.__version__} but this "
                f"host runs {self.pyspark_version}: install pyspark=={self.pyspark_version} "
                f"for the cluster's Python (PYSPARK_PYTHON), or the same version here")
        started = time.monotonic()
        digests = [bytes.fromhex(h) for h, _ in batch]
        context = TaskContext.get()
        self.sink.timeout = self.stall_seconds / 2     # fail (and say why) before the watchdog
        try:
            if context is not None and context.attemptNumber() > 0:
                digests = self.sink.missing(digests)
            chunks = self._read(digests, [n for _, n in batch]) if digests else []
            stored, nbytes = self.sink.put(chunks) if chunks else (0, 0)
        except Exception as e:
            if self.endpoint is not None:
                self.endpoint.report(str(e))
            raise
        return {"executor": self._executor(), "chunks": stored, "bytes": nbytes,
                "seconds": time.monotonic() - started}

    def _read(self, digests: list[bytes], lengths: list[int]) -> list[tuple[bytes, bytes]]:
        if self.endpoint is not None:
            return self.endpoint.fetch(digests, timeout=self.stall_seconds / 2)
        from mountfs.store import Store
        store = Store.open(self.store_path, readonly=True, lock=False,
                           readahead=readahead_suits(lengths))
        try:
            with store.read() as txn:
                return [(d, _blob(txn, store, d.hex())) for d in digests]
        finally:
            store.close()

    def _executor(self) -> str:
        """The executor's name in the figures: its address toward the source (remote), or
        the host name (embedded)."""
        if self.endpoint is not None and self.endpoint.local_address:
            return self.endpoint.local_address
        import socket
        return socket.gethostname()
