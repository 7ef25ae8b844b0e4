"""Prometheus metrics of the agent daemon (``serve --metrics-port``).

Metric families (one registry per daemon; labels in brackets):

- ``cuinterpose_phase_duration_seconds`` histogram [kind, phase]: wall time of each agent
  phase (census, SAVE_ALLOCATIONS, native lock, criu dump, ...) in seconds;
- ``cuinterpose_phase_bytes_total`` counter [kind, phase]: bytes a phase carried (carrier
  copies, CRIU images, the ``sync`` phase's fsynced and hashed bytes, restore's ``verify``);
- ``cuinterpose_phase_seconds_total`` counter [kind, phase]: seconds spent in each phase (the
  histogram's sum, as a counter: ``rate(bytes_total) / rate(seconds_total)`` is a phase's
  throughput in bytes/s);
- ``cuinterpose_snapshots_total`` counter [kind, result]: finished requests, ``kind`` in
  checkpoint/restore, ``result`` in succeeded/failed;
- ``cuinterpose_requests_in_flight`` gauge [kind];
- ``cuinterpose_group_leases_expired_total`` counter [kind, result]: group requests whose
  lease expired on this member (its leader stopped renewing it) and that the member undid
  itself; ``result``: ``undone`` (checkpoint rolled back and released, restore aborted),
  ``completed`` (a checkpoint past ``finish``: its ``resume`` was run), ``dropped`` (nothing to
  undo), ``undo_failed`` (the undo failed; the workload may stay parked).
"""

from __future__ import annotations


class Metrics:
    """Holds the metric objects in a private registry; :meth:`serve` exposes them over HTTP."""

    BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600)

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.phase_seconds = Histogram(
            "cuinterpose_phase_duration_seconds",
            "Wall time of an agent phase",
            ["kind", "phase"],
            buckets=self.BUCKETS,
            registry=self.registry,
        )
        self.phase_bytes = Counter(
            "cuinterpose_phase_bytes",
            "Bytes carried by agent phases",
            ["kind", "phase"],
            registry=self.registry,
        )
        self.phase_seconds_total = Counter(
            "cuinterpose_phase_seconds",
            "Seconds spent in agent phases",
            ["kind", "phase"],
            registry=self.registry,
        )
        self.snapshots = Counter(
            "cuinterpose_snapshots",
            "Finished checkpoint/restore requests",
            ["kind", "result"],
            registry=self.registry,
        )
        self.leases_expired = Counter(
            "cuinterpose_group_leases_expired",
            "Group requests whose lease expired on this member",
            ["kind", "result"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "cuinterpose_requests_in_flight",
            "Requests being served",
            ["kind"],
            registry=self.registry,
        )
        self.server = None

    def phase_done(self, kind: str, phase: str, elapsed_ns: int, nbytes: int) -> None:
        """One finished phase row of a ``kind`` request: ``elapsed_ns`` (ns) into the duration
        histogram and the seconds counter, ``nbytes`` into the bytes counter."""
        seconds = max(0, int(elapsed_ns)) / 1e9
        self.phase_seconds.labels(kind, phase).observe(seconds)
        self.phase_seconds_total.labels(kind, phase).inc(seconds)
        if nbytes:
            self.phase_bytes.labels(kind, phase).inc(int(nbytes))

    def finished(self, kind: str, ok: bool) -> None:
        self.snapshots.labels(kind, "succeeded" if ok else "failed").inc()

    def lease_expired(self, kind: str, result: str) -> None:
        """Count one expired group lease (``result``: undone, completed, dropped,
        undo_failed)."""
        self.leases_expired.labels(kind, result).inc()

    def text(self) -> str:
        """The exposition format, as served on /metrics."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``addr:port`` (0: any free port); returns the bound port."""
        from prometheus_client import start_http_server

        self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self.server.server_port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
