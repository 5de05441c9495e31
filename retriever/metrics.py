"""The retriever's Prometheus metrics (``GET /metrics`` of the server and the router).

:class:`Metrics` counts requests by route and status, refusals by reason, queries and micro-batches,
and says where a request's time went: the queue wait, the worker's batch time, the batch worker's
wait for company, and the event loop's delivery lag. Text exposition format 0.0.4, no extra dependency.
"""

from __future__ import annotations

import collections
import threading

from emapg.connection_guard import CLOSES

__all__ = ["LATENCY_BUCKETS", "BATCH_BUCKETS", "Histogram", "Metrics"]

# Seconds. Finer between 50 and 250 ms, where a loaded CPU server's batches and requests sit: a p99
# target of 150 ms needs a bucket edge there.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += v

    def render(self, name: str) -> list[str]:
        lines = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.total}"]
        return lines


class Metrics:
    """Prometheus text exposition (format 0.0.4), no extra dependency."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.queries = 0
        self.batches = 0
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.batch_seconds = Histogram(LATENCY_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue_depth = 0
        # Where a request's time goes besides its own batch (the benchmark reports these per level):
        self.queue_wait = Histogram(LATENCY_BUCKETS)  # per request: submitted -> its batch starts
        self.gather_seconds = 0.0  # the worker waiting for company (max_wait), summed
        self.gather_timeouts = 0  # batches that started because that wait reached its bound, not its share
        self.delivery_lag = Histogram(LATENCY_BUCKETS)  # per batch: results ready -> the event loop hands them out

    def count(self, route: str, status: int, reason: str | None, seconds: float) -> None:
        """One answered request (``emapg.server_input.Count``); ``reason`` labels every refusal or failure."""
        with self.lock:
            self.requests[(route, status)] += 1
            if reason is not None:
                self.errors[reason] += 1
            if route == "/retrieve":
                self.latency.observe(seconds)

    def batch(self, n_queries: int, seconds: float) -> None:
        with self.lock:
            self.batches += 1
            self.queries += n_queries
            self.batch_size.observe(n_queries)
            self.batch_seconds.observe(seconds)

    def taken(self, queue_waits: list[float], gather_seconds: float, timed_out: bool = False) -> None:
        """A batch left the queue: how long each of its requests waited, and how long the worker waited for them."""
        with self.lock:
            for w in queue_waits:
                self.queue_wait.observe(w)
            self.gather_seconds += gather_seconds
            self.gather_timeouts += timed_out

    def delivered(self, lag: float) -> None:
        with self.lock:
            self.delivery_lag.observe(lag)

    def render(self) -> str:
        with self.lock:
            out = ["# HELP retriever_requests_total HTTP requests by path and status.", "# TYPE retriever_requests_total counter"]
            out += [f'retriever_requests_total{{path="{p}",status="{s}"}} {n}' for (p, s), n in sorted(self.requests.items())]
            out += ["# HELP retriever_queries_total Queries answered.", "# TYPE retriever_queries_total counter", f"retriever_queries_total {self.queries}"]
            out += ["# HELP retriever_batches_total Micro-batches run by the worker.", "# TYPE retriever_batches_total counter", f"retriever_batches_total {self.batches}"]
            out += ["# HELP retriever_errors_total Refused or failed requests by reason.", "# TYPE retriever_errors_total counter"]
            out += [f'retriever_errors_total{{kind="{k}"}} {n}' for k, n in sorted(self.errors.items())]
            out += ["# HELP retriever_batch_size Queries per micro-batch.", "# TYPE retriever_batch_size histogram"]
            out += self.batch_size.render("retriever_batch_size")
            out += ["# HELP retriever_batch_seconds Worker time per micro-batch (encode + search + lookup).", "# TYPE retriever_batch_seconds histogram"]
            out += self.batch_seconds.render("retriever_batch_seconds")
            out += ["# HELP retriever_request_latency_seconds /retrieve latency.", "# TYPE retriever_request_latency_seconds histogram"]
            out += self.latency.render("retriever_request_latency_seconds")
            out += ["# HELP retriever_queue_depth Queries waiting for the worker.", "# TYPE retriever_queue_depth gauge", f"retriever_queue_depth {self.queue_depth}"]
            out += ["# HELP retriever_queue_wait_seconds Per request: time from arrival until its micro-batch starts.", "# TYPE retriever_queue_wait_seconds histogram"]
            out += self.queue_wait.render("retriever_queue_wait_seconds")
            out += ["# HELP retriever_gather_wait_seconds_total Time the idle worker waited for concurrent requests (--max-wait-ms).",
                    "# TYPE retriever_gather_wait_seconds_total counter", f"retriever_gather_wait_seconds_total {self.gather_seconds:.6f}"]  # fmt: skip
            out += ["# HELP retriever_gather_timeouts_total Batches started because the wait for company (--max-wait-ms, --regroup-wait-ms) reached its bound.",
                    "# TYPE retriever_gather_timeouts_total counter", f"retriever_gather_timeouts_total {self.gather_timeouts}"]  # fmt: skip
            out += ["# HELP retriever_delivery_lag_seconds Per batch: results ready until the event loop hands them to their requests.",
                    "# TYPE retriever_delivery_lag_seconds histogram"]  # fmt: skip
            out += self.delivery_lag.render("retriever_delivery_lag_seconds")
        out += ["# HELP retriever_connection_closes_total Connections the server closed by cause (emapg.connection_guard).",
                "# TYPE retriever_connection_closes_total counter"]  # fmt: skip
        out += [f'retriever_connection_closes_total{{cause="{c}"}} {n}' for c, n in CLOSES.counts().items()]
        return "\n".join(out) + "\n"

