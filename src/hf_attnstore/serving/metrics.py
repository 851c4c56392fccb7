"""Prometheus metrics of `attnstore serve` (``GET /metrics``), on a registry of the app's own.

Per request (updated by the app): turns by KV source, reused / prefilled / generated tokens, TTFT,
queueing and turn time histograms, errors by HTTP status; the batch cache's bytes and members. Per store (read from `AttnStore.stats()` at
each scrape): hits per tier, bytes used and limits per tier, bytes moved, evictions, I/O errors.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..store import AttnStore

# One INFO line per served turn (`attnstore -v serve`): its own name, so that it can be turned on alone.
turn_log = logging.getLogger("hf_attnstore.turns")

# Seconds: TTFT on a CPU ranges from tens of ms (a resumed turn) to tens of s (a long cold prefill).
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


class StoreCollector:
    """Reads the store's counters at scrape time (one lock acquisition per scrape).

    Example:
        >>> registry.register(StoreCollector(store))  # doctest: +SKIP
    """

    def __init__(self, store: AttnStore | None):
        self.store = store

    def collect(self):
        if self.store is None:
            return
        s = self.store.stats()
        hits = CounterMetricFamily("attnstore_store_hits", "Store lookups that found the session, by tier",
                                   labels=["tier"])
        for tier, value in (("host", s.hits_host), ("disk", s.hits_disk), ("remote", s.hits_remote)):
            hits.add_metric([tier], value)
        yield hits
        yield CounterMetricFamily("attnstore_store_misses", "Store lookups that found nothing", value=s.misses)
        used = GaugeMetricFamily("attnstore_store_bytes_used", "Bytes held per tier", labels=["tier"])
        used.add_metric(["host"], s.host_bytes_used)
        used.add_metric(["disk"], s.disk_bytes_used)
        yield used
        limit = GaugeMetricFamily("attnstore_store_bytes_limit", "Capacity per tier", labels=["tier"])
        limit.add_metric(["host"], s.host_bytes_limit)
        limit.add_metric(["disk"], s.disk_bytes_limit if self.store.config.disk_dir else 0)
        yield limit
        sessions = GaugeMetricFamily("attnstore_store_sessions", "Sessions indexed, by where their KV is",
                                     labels=["tier"])
        sessions.add_metric(["all"], s.sessions)
        sessions.add_metric(["host"], s.host_sessions)
        sessions.add_metric(["disk"], s.disk_sessions)
        yield sessions
        moved = CounterMetricFamily("attnstore_store_bytes", "Bytes read from / written to a tier",
                                    labels=["tier", "direction"])
        for tier, direction, value in (("disk", "read", s.bytes_read), ("disk", "write", s.bytes_written),
                                       ("remote", "read", s.remote_bytes_read),
                                       ("remote", "write", s.remote_bytes_written)):
            moved.add_metric([tier, direction], value)
        yield moved
        evictions = CounterMetricFamily("attnstore_store_evictions", "Sessions moved down or dropped",
                                        labels=["kind"])
        for kind, value in (("demoted", s.demotions), ("host_dropped", s.host_drops), ("disk_dropped", s.disk_drops),
                            ("expired", s.ttl_expired)):
            evictions.add_metric([kind], value)
        yield evictions
        yield GaugeMetricFamily("attnstore_store_retained_sessions", "Sessions kept from expiring by idleness "
                                "(`prompt_cache_retention: 24h`)", value=s.retained_sessions)
        yield CounterMetricFamily("attnstore_store_retained_dropped", "Retained sessions that capacity pressure "
                                  "evicted before their retention ended", value=s.retained_dropped)
        errors = CounterMetricFamily("attnstore_store_errors", "Failed store I/O (each a miss or a retried write)",
                                     labels=["kind"])
        for kind, value in (("write", s.write_errors), ("load", s.load_errors), ("remote", s.remote_errors)):
            errors.add_metric([kind], value)
        yield errors
        if self.store.config.remote is not None:
            yield GaugeMetricFamily("attnstore_store_remote_up", "1 while the shared remote tier is reachable; 0 while "
                                    "it is down (its lookups are misses; reconnected in the background)",
                                    value=1 - s.remote_down)
        # Load or recompute (`recompute_by_cost`): the decisions, and the inputs and estimates of the last one.
        yield CounterMetricFamily("attnstore_store_resume_decisions", "Loads from a lower tier decided by measured "
                                  "cost (recompute_by_cost)", value=s.resume_decisions)
        yield CounterMetricFamily("attnstore_store_resume_recomputes", "Of those, the resumes that recomputed leading "
                                  "chunks instead of loading them", value=s.resume_recomputes)
        yield CounterMetricFamily("attnstore_store_resume_recomputed_tokens", "Tokens recomputed instead of loaded "
                                  "by those choices", value=s.resume_recomputed_tokens)
        last = GaugeMetricFamily("attnstore_store_resume_last", "The last load-or-recompute decision's inputs "
                                 "(load_gbps: the tier's measured rate in GB/s of KV at the model's precision; "
                                 "prefill_tokens_per_s: the model's measured rate) and estimates in seconds "
                                 "(load_s: loading every stored chunk; chosen_s: the choice made)", labels=["value"])
        for name, value in (("load_gbps", s.resume_load_gbps), ("prefill_tokens_per_s", s.resume_prefill_tokens_per_s),
                            ("load_s", s.resume_load_estimate_s), ("chosen_s", s.resume_chosen_estimate_s)):
            last.add_metric([name], value)
        yield last
        yield CounterMetricFamily("attnstore_store_remote_restores", "Local copies kept after the longer remote copy "
                                  "meant to replace them failed to load", value=s.remote_restores)


class BatchCollector:
    """The batch cache now (`ChatPipeline.batch_memory`), read once per scrape so that its values agree.

    Example:
        >>> registry.register(BatchCollector(pipe.batch_memory))  # doctest: +SKIP
    """

    def __init__(self, batch_memory):
        self.batch_memory = batch_memory

    def collect(self):
        now = self.batch_memory()
        kv = GaugeMetricFamily("attnstore_batch_kv_bytes", "The batch cache's KV: live (the decoding members' rows, "
                               "padding included) and allocated (headroom included)", labels=["kind"])
        for kind in ("live", "allocated"):
            kv.add_metric([kind], now[kind])
        yield kv
        yield GaugeMetricFamily("attnstore_batch_members", "Turns decoding in the batch cache now", value=now["rows"])


class ServerMetrics:
    """The app's metrics. `registry` is what ``GET /metrics`` exposes.

    Example:
        >>> metrics = ServerMetrics(None, lambda: 0)
        >>> metrics.errors.labels("429").inc()
    """

    def __init__(self, store: AttnStore | None, queue_depth, batch_memory=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("attnstore_turns", "Completed turns, by where their KV came from", ["kv_source"],
                             registry=r)
        self.tokens = Counter("attnstore_tokens", "Tokens per kind: reused (KV from the store), prefilled, generated",
                              ["kind"], registry=r)
        self.ttft = Histogram("attnstore_ttft_seconds", "Time to first token, from the turn's start", registry=r,
                              buckets=_BUCKETS)
        self.queue = Histogram("attnstore_queue_seconds", "Time a turn waited before it started", registry=r,
                               buckets=_BUCKETS)
        self.turn_time = Histogram("attnstore_turn_seconds", "Time of a whole turn", registry=r, buckets=_BUCKETS)
        self.errors = Counter("attnstore_request_errors", "Requests answered with an error, by HTTP status",
                              ["status"], registry=r)
        self.cancelled = Counter("attnstore_cancelled_turns", "Turns stopped because the client went away",
                                 registry=r)
        self.prompt_cache_keys = Counter("attnstore_prompt_cache_key_requests", "Requests that named their session "
                                         "with OpenAI's `prompt_cache_key`", registry=r)
        self.retention = Counter("attnstore_prompt_cache_retention_requests", "Requests by the `prompt_cache_retention` "
                                 "they asked for (\"default\": none)", ["retention"], registry=r)
        depth = Gauge("attnstore_queue_depth", "Requests admitted and not finished", registry=r)
        depth.set_function(queue_depth)
        if batch_memory is not None:  # what a GPU's memory bounds: `kv_budget` makes each row its budget
            r.register(BatchCollector(batch_memory))
        r.register(StoreCollector(store))

    def prompt_cache(self, key: str | None, retention: str | None) -> None:
        """Counts a chat or Responses request's prompt-cache fields."""
        if key:
            self.prompt_cache_keys.inc()
        self.retention.labels(retention or "default").inc()

    def observe(self, reply) -> None:
        turn_log.info("turn %r: kv %s, reused %d, prefilled %d, generated %d tokens, TTFT %.0f ms, queued %.0f ms",
                      reply.session_id, reply.kv_source, reply.reused_tokens, reply.prefilled_tokens,
                      reply.generated_tokens, 1000 * reply.ttft_s, 1000 * reply.queued_s)
        self.turns.labels(reply.kv_source).inc()
        self.tokens.labels("reused").inc(reply.reused_tokens)
        self.tokens.labels("prefilled").inc(reply.prefilled_tokens)
        self.tokens.labels("generated").inc(reply.generated_tokens)
        self.ttft.observe(reply.ttft_s)
        self.queue.observe(reply.queued_s)
        self.turn_time.observe(reply.total_s)
        if reply.cancelled:
            self.cancelled.inc()
