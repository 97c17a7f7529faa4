"""Prometheus metrics of one app, in a registry of its own (two apps in a process never mix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

# Endpoints counted by name; anything else (unknown paths) is counted as "other" so a scanner
# cannot grow the label set without bound.
KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                   "/metrics")
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("strata_requests", "HTTP requests answered, by endpoint and "
                                "status code", ["endpoint", "status"], registry=r)
        self.running = Gauge("strata_requests_running", "Requests in a slot (reading their "
                             "prompt or generating)",
                             registry=r)
        self.queued = Gauge("strata_requests_queued", "Requests waiting for a free slot",
                            registry=r)
        self.reading = Gauge("strata_requests_reading", "Running requests still reading their "
                             "prompt", registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens of finished "
                                     "requests (cached ones included)", registry=r)
        self.cached_tokens = Counter("strata_prompt_tokens_cached", "Prompt tokens reused from "
                                     "the KV cache instead of being read again", registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "Tokens generated",
                                        registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "From queueing a request "
                              "to its first generated token", buckets=_TTFT_BUCKETS_S,
                              registry=r)
        self.token_latency = Histogram("strata_time_per_output_token_seconds", "Between two "
                                       "consecutive generated tokens of a request",
                                       buckets=_TOKEN_BUCKETS_S, registry=r)

    def count_request(self, path: str, status: int) -> None:
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
