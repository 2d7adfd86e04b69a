"""The server's Prometheus metrics, in a registry of its own per app (two apps in one process never share counts)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Paths counted under their own name (``/v1/models/{name}`` as ``/v1/models``); any other path (a 404, say) is
#: counted as "other", so that clients cannot grow the label set.
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """Requests by endpoint and status, tokens in and out, queue depth and running batch size (read from the
    scheduler when scraped), time to first token and inter-token latency."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, scheduler_stats: Callable[[], dict]):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("splice_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("splice_prompt_tokens", "Prompt tokens of the requests scheduled",
                                     registry=registry)
        self.generated_tokens = Counter("splice_generation_tokens", "Tokens generated", registry=registry)
        self.finished = Counter("splice_request_finished", "Generation requests (one per choice) by finish reason: "
                                "stop, length, error, cancelled", ["reason"], registry=registry)
        queue = Gauge("splice_queue_depth", "Requests waiting for a batch slot", registry=registry)
        queue.set_function(lambda: scheduler_stats().get("queued", 0))
        running = Gauge("splice_running_batch_size", "Requests in the running batch", registry=registry)
        running.set_function(lambda: scheduler_stats().get("running", 0))
        self.ttft = Histogram("splice_time_to_first_token_seconds", "From the request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("splice_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.duration = Histogram("splice_request_duration_seconds", "From the request's arrival to its last token",
                                  buckets=LATENCY_BUCKETS, registry=registry)

    def count_request(self, path: str, status: int) -> None:
        if path.startswith("/v1/models/"):
            path = "/v1/models"
        self.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting every HTTP response by endpoint and status, streaming ones included (a plain ASGI
    wrapper: Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect from a streaming response)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        finally:
            self.metrics.count_request(scope["path"], status)
