"""Prometheus metrics: `joaderd --metrics-listen HOST:PORT` serves `/metrics`.

The metrics are read from the status snapshot at scrape time (a custom collector), not kept as
a second set of counters beside the registry's: what Prometheus shows is what `joader status`
shows, and the registry's hot paths pay nothing for it. `prometheus_client` writes the text
format and runs the HTTP server (a daemon thread of its own).

Per-job series carry the labels `job` (the job's name, as the issue of record asked) and
`job_id` (names may repeat; ids do not). Prometheus sets its own `job` label on every scraped
series, so a scrape config keeps ours as `exported_job` unless it sets `honor_labels: true`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from joader.address import resolve_address, socket_path
from joader.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


class StatusCollector(Collector):
    """Turns one status snapshot (`joader.server.registry.status`) into metric families per scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        cache, decodes, workers = status["cache"], status["decodes"], status.get("workers", {})
        found = [cache["lookups"], cache["lookahead"]]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield counter("joader_items_decoded", "Items decoded successfully.", status["items_decoded"])
        yield counter("joader_items_delivered", "Items handed to jobs (each copy to each job).",
                      status["items_delivered"])
        yield counter("joader_items_reused",
                      "Deliveries of a copy its job had been given before (cross-epoch reuse).",
                      status["sharing"]["items_reused"])
        yield counter("joader_cache_hits",
                      "Queue entries that found their item cached or already being decoded "
                      "(lookahead included).",
                      sum(f["hits"] + f["joined_decode"] for f in found))
        yield counter("joader_cache_misses",
                      "Queue entries that found nothing: a decode was requested (lookahead included).",
                      sum(f["misses"] for f in found))
        yield counter("joader_cache_evictions", "Items evicted to make room.", cache["evictions"])
        yield counter("joader_decode_failures", "Decodes that failed.", decodes["failures"])
        yield counter("joader_decode_seconds", "Decode workers' busy seconds.", decodes["decode_s"])
        yield gauge("joader_cache_bytes_used", "Arena bytes in use (items and decodes in flight).",
                    cache["used_bytes"])
        yield gauge("joader_cache_bytes_capacity", "Arena size in bytes.", cache["capacity_bytes"])
        yield gauge("joader_cache_items", "Items cached.", cache["items"])
        yield gauge("joader_cache_pinned_items", "Cached items with a pin.", cache["pinned_items"])
        yield gauge("joader_decodes_in_flight", "Decodes waiting for a worker or running.",
                    decodes["in_flight"])
        yield gauge("joader_jobs", "Attached jobs.", len(status["jobs"]))
        yield gauge("joader_decode_workers_alive", "Decode workers alive.", workers.get("alive", 0))
        yield gauge("joader_decode_workers_configured", "Decode workers configured.",
                    workers.get("configured", 0))
        yield gauge("joader_decode_workers_busy", "Decode workers decoding now.", workers.get("busy", 0))

        labels = ["job", "job_id", "source"]
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "wait": CounterMetricFamily(
                "joader_job_wait_seconds",
                "Seconds the job's training loop waited inside next() for data (measured by a "
                "reader in the training process; 0 with DataLoader workers).", labels=labels),
            "step": CounterMetricFamily(
                "joader_job_step_seconds",
                "Seconds the job's training loop spent between next() calls.", labels=labels),
            "server_wait": CounterMetricFamily(
                "joader_job_server_wait_seconds",
                "Seconds the job's requests waited in joaderd for a ready item.", labels=labels),
            "items": CounterMetricFamily("joader_job_items", "Items delivered to the job.", labels=labels),
            "epoch": GaugeMetricFamily("joader_job_epoch", "The epoch the job reads now.", labels=labels),
            "rate": GaugeMetricFamily("joader_job_samples_per_second",
                                      "The job's delivery rate over the last seconds.", labels=labels),
        }
        for job in status["jobs"]:
            values = [job["name"], job["job_id"], job["source"]]
            families["wait"].add_metric(values, job["stall_total"]["wait_s"])
            families["step"].add_metric(values, job["stall_total"]["step_s"])
            families["server_wait"].add_metric(values, job["server_wait_s"])
            families["items"].add_metric(values, job["items_delivered"])
            families["epoch"].add_metric(values, job["epoch"])
            families["rate"].add_metric(values, job["samples_per_s"] or 0.0)
        yield from families.values()


def serve_metrics(listen: str, status: Callable[[], dict[str, Any]]) -> tuple[Any, int]:
    """Starts the `/metrics` HTTP server on `listen` (HOST:PORT, port 0 picks one); returns
    (server, port). The caller calls `server.shutdown()` when joaderd stops."""
    host, port = split_metrics_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise InvalidArgumentError(
            f"--metrics-listen {listen}: cannot listen there ({error.strerror or error}); pick a free "
            "port (or port 0 for any), or leave out --metrics-listen") from None
    bound_port = server.server_address[1]
    logger.info("Prometheus metrics at http://%s:%d/metrics", host if ":" not in host else f"[{host}]", bound_port)
    return server, bound_port


def split_metrics_listen(listen: str) -> tuple[str, int]:
    """(host, port) of a `--metrics-listen` value; a unix: socket is refused (Prometheus
    scrapes over TCP)."""
    resolved = resolve_address(listen)
    if socket_path(resolved) is not None:
        raise InvalidArgumentError(
            f"--metrics-listen {listen}: Prometheus scrapes over TCP; give HOST:PORT, e.g. 127.0.0.1:9400")
    host, _, port = resolved.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)
