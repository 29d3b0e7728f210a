"""Prometheus metrics of the daemon (prometheus-client), off unless ``metrics_listen`` is set.

Per filesystem and mirror, named the Prometheus way (``_seconds``, ``_bytes``, ``_total``):
a mirror that stops succeeding shows as a growing lag and an old last-success time, not as
"no errors"."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from mountfs.units import Address

LABELS = ("filesystem", "mirror")


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.last_success = Gauge("mountfs_replication_last_success_timestamp_seconds",
                                  "Unix time of the last successful cycle", LABELS, registry=r)
        self.lag = Gauge("mountfs_replication_lag_seconds",
                         "Age of the mirror's view when the source changed since (0: current)",
                         LABELS, registry=r)
        self.pending_bytes = Gauge("mountfs_replication_pending_bytes",
                                   "Chunk bytes written since the mirror's base", LABELS,
                                   registry=r)
        self.pending_snapshots = Gauge("mountfs_replication_pending_snapshots",
                                       "Snapshots newer than the mirror's base", LABELS,
                                       registry=r)
        self.bytes_sent = Counter("mountfs_replication_sent_bytes_total",
                                  "Chunk bytes sent to the mirror", LABELS, registry=r)
        self.errors = Counter("mountfs_replication_errors_total", "Failed cycles", LABELS,
                              registry=r)
        self.stalled = Counter("mountfs_replication_stalled_transfers_total",
                               "Transfers cancelled by the stall watchdog", LABELS, registry=r)
        self.executor_rate = Gauge("mountfs_replication_executor_bytes_per_second",
                                   "Chunk bytes per second each Spark executor moved in the "
                                   "last cycle", (*LABELS, "executor"), registry=r)
        self.cycle_seconds = Histogram("mountfs_replication_cycle_seconds",
                                       "Duration of successful cycles", LABELS, registry=r)
        self.mismatched = Gauge("mountfs_verify_mismatched_buckets",
                                "Buckets that differed at the last verify", LABELS, registry=r)
        self.snapshots = Counter("mountfs_snapshots_taken_total", "Snapshots the daemon took",
                                 ("filesystem",), registry=r)

    def keep_only(self, filesystem: str, urls: list[str]) -> None:
        """Drop the series of mirrors of ``filesystem`` that are no longer configured (a
        reload removed them): a mirror nobody replicates to must not look stuck."""
        wanted = {(filesystem, url) for url in urls}
        for metric in (self.last_success, self.lag, self.pending_bytes, self.pending_snapshots,
                       self.bytes_sent, self.errors, self.stalled, self.cycle_seconds,
                       self.mismatched):
            present = {(s.labels["filesystem"], s.labels["mirror"])
                       for family in metric.collect() for s in family.samples
                       if "mirror" in s.labels}
            for labels in present:
                if labels[0] == filesystem and labels not in wanted:
                    metric.remove(*labels)

    def serve(self, listen: Address) -> None:
        """Serve /metrics from a background thread (never on the trio loop). An address that
        cannot be resolved or bound raises OSError here, before the thread starts."""
        start_http_server(listen.port, addr=listen.host, registry=self.registry)
