"""Prometheus metrics of one app, in a registry of its own (two apps in a process never mix)."""
from __future__ import annotations

import re
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Endpoints counted by name: the app's route that answered (its variable parts as <name>, e.g.
# /slots/<id_slot>), else one of these paths (a 405 finds no route); anything else (unknown
# paths) is counted as "other" so a scanner cannot grow the label set without bound.
KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                   "/v1/messages/count_tokens", "/infill", "/completion", "/completions",
                   "/tokenize", "/detokenize", "/apply-template", "/props", "/slots",
                   "/v1/models", "/health", "/metrics")
# The status a request is counted under when its client went away before its answer was whole
# (a stream it stopped reading, a whole answer it did not wait for): nginx's "client closed
# request", as proxies in front of such servers log it. The HTTP status the server had sent (a
# stream's 200) says only that the answer began.
CLIENT_CLOSED_STATUS = 499
_RULE_CONVERTER = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("strata_requests", "HTTP requests answered, by endpoint and "
                                f"status code ({CLIENT_CLOSED_STATUS}: the client went away "
                                "before its answer was whole)", ["endpoint", "status"],
                                registry=r)
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
        self.draft_tokens = Counter("strata_draft_tokens", "Draft tokens decode windows read "
                                    "(--spec-type)", registry=r)
        self.draft_tokens_accepted = Counter("strata_draft_tokens_accepted", "Draft tokens that "
                                             "were the token sampled there (each one a token "
                                             "without a window of its own)", registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "From queueing a request "
                              "to its first generated token", buckets=_TTFT_BUCKETS_S,
                              registry=r)
        self.token_latency = Histogram("strata_time_per_output_token_seconds", "Between two "
                                       "consecutive generated tokens of a request",
                                       buckets=_TOKEN_BUCKETS_S, registry=r)

    def watch_expert_tier(self, get_tier) -> None:
        """Export the expert cache's figures, read from `get_tier()` (an ExpertTier or None)
        at each scrape."""
        self.registry.register(ExpertCacheCollector(get_tier))

    def watch_conversations(self, get_cache) -> None:
        """Export the parked conversations' figures, read from `get_cache()` (the engine's
        ConversationCache, or None while it loads) at each scrape."""
        self.registry.register(ConversationCacheCollector(get_cache))

    def count_request(self, path: str, status: int, rule: str | None = None) -> None:
        """Count one answered request under its route `rule` (the URL rule that matched, None
        when none did) or its `path` when that is a known endpoint, else under "other"."""
        if rule is not None:
            endpoint = _RULE_CONVERTER.sub(r"<\1>", rule)
        else:
            endpoint = path if path in KNOWN_ENDPOINTS else "other"
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def count_response(self, response, path: str, rule: str | None,
                       is_disconnected: Callable[[], bool] | None) -> None:
        """Count `response` (a Flask response about to be sent) as `count_request` does: a
        stream once it ends, as CLIENT_CLOSED_STATUS when the client stopped reading it before
        its end; a 200 whose client has gone (`is_disconnected()`, waitress's flag: it did not
        wait for its answer, and its generation was cancelled) as CLIENT_CLOSED_STATUS too."""
        status = response.status_code
        if response.is_streamed:
            response.response = _CountedStream(
                response.response, status, lambda status: self.count_request(path, status, rule),
                getattr(response, "stream_failure", None))
            return
        if status == 200 and is_disconnected is not None and is_disconnected():
            status = CLIENT_CLOSED_STATUS
        self.count_request(path, status, rule)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CountedStream:
    """A response's stream that calls `count(status)` once, when the server closes it: `status`
    when it was read to its end (the status of the error it ended with, when `failure()` names
    one: the engine failed, the server stopped), CLIENT_CLOSED_STATUS when the server stopped
    reading it first (a write to a client that had gone failed), 500 when it raised."""

    def __init__(self, stream, status: int, count: Callable[[int], None],
                 failure: Callable[[], object] | None = None):
        self._stream, self._count = stream, count
        self._status = CLIENT_CLOSED_STATUS
        self._whole_status = status
        self._failure = failure

    def __iter__(self):
        try:
            yield from self._stream
        except Exception:
            self._status = 500
            raise
        error = None if self._failure is None else self._failure()
        self._status = self._whole_status if error is None else error.status

    def close(self) -> None:
        count, self._count = self._count, None
        try:
            close = getattr(self._stream, "close", None)
            if close is not None:
                close()
        finally:
            if count is not None:
                count(self._status)


def guess_metrics(device_tier):
    """The guessed copies' counters (backends/cuda/guess.py), once a window has guessed."""
    windows, listed, routed, _, nbytes = getattr(device_tier, "guess_totals",
                                                 lambda: (0,) * 5)()
    if not windows:
        return
    yield _counter("strata_expert_guessed_copies", "Rare experts prompt chunks copied into "
                   "staging a layer before their routing, from the layer's routing guessed on "
                   "the layer before's residual (STRATA_GUESS_ROWS)", listed)
    yield _counter("strata_expert_guessed_copies_routed", "Of those, the experts the routing "
                   "then chose", routed)
    yield _counter("strata_expert_guessed_copies_bytes", "Bytes of those copies", nbytes)


class ExpertCacheCollector:
    """The expert cache's counters, read from the engine's ExpertTier at scrape time (nothing
    per window). Absent while the engine loads or runs without `--expert-cache`. The optimum
    (Belady with the same slots) is computed here, over the recent windows only, at most once
    per new window (docs/expert-cache.md)."""

    def __init__(self, get_tier):
        self._get_tier = get_tier

    def describe(self):
        return []  # the families exist only once a cache does

    def collect(self):
        tier = self._get_tier()
        if tier is None or tier.arena is None:
            return
        t = tier.snapshot_totals()
        yield _counter("strata_expert_cache_hits", "Routed entries (row x top-k pick) served "
                       "by the expert cache", t.num_hits)
        yield _counter("strata_expert_cache_misses", "Routed entries served from the expert "
                       "store (not resident)", t.num_misses)
        if tier.arena.misses_on_gpu:
            staged, routed, ahead = getattr(tier.arena, "read_ahead_totals",
                                            lambda: (0, 0, 0))()
            served = CounterMetricFamily("strata_expert_cache_misses_served", "Cache misses "
                                         "(routed entries) by who served them: the GPU over "
                                         "PCIe, the CPU pool, or the GPU from the copy a "
                                         "decode window read ahead", labels=["by"])
            served.add_metric(["pcie"], max(0, t.num_misses - t.num_pool_entries - ahead))
            served.add_metric(["cpu_pool"], t.num_pool_entries)
            served.add_metric(["read_ahead"], ahead)
            yield served
            yield _counter("strata_expert_read_ahead_experts", "Experts decode windows copied "
                           "into VRAM before their routing (every expert in RAM: the link is "
                           "idle while a layer's dense part runs)", staged)
            yield _counter("strata_expert_read_ahead_routed", "Of those, the experts the "
                           "routing then chose", routed)
            yield _counter("strata_expert_cpu_pool_seconds", "CPU pool compute time",
                           t.pool_s)
            yield _counter("strata_expert_cpu_pool_wait_seconds", "CPU pool time waiting for "
                           "the GPU to publish a layer (its dense work and PCIe reads)",
                           t.pool_wait_s)
            tuner = getattr(tier.arena, "share_tuner", None)
            if tuner is not None:  # --pcie-frac auto: the share each window class runs at
                shares = GaugeMetricFamily("strata_expert_pcie_share", "PCIe share of a decode "
                                           "window's misses (--pcie-frac auto), by the most "
                                           "rows of the window class", labels=["rows"])
                for rows, share in tuner.shares().items():
                    shares.add_metric([str(rows)], share)
                yield shares
            streamer = getattr(tier.arena, "streamer", None)
            if streamer is not None:  # prompt chunks' experts copied into staging slots
                yield _counter("strata_expert_streamed_bytes", "Bytes of experts prompt chunks "
                               "copied into VRAM staging slots", streamer.streamed_bytes)
                yield _counter("strata_expert_stream_rare_experts", "Rarely routed missing "
                               "experts prompt chunks left at their host copies (read over PCIe "
                               "only when routed) instead of copying them",
                               streamer.num_left)
                yield _counter("strata_expert_stream_pulled_experts", "Rare experts a prompt "
                               "chunk routed many rows to that the GPU copied into staging once "
                               "the routing was known, instead of reading them per row tile",
                               streamer.pulled)
                if getattr(tier.arena, "pool", None) is not None:  # the pool's prompt share
                    yield _gauge("strata_expert_stream_pool_sure_percent", "Percent of the "
                                 "experts a prompt chunk would copy that it leaves to the CPU "
                                 "pool instead (STRATA_POOL_SURE; auto moves it)",
                                 streamer.sure_percent)
                    yield _gauge("strata_expert_stream_pool_budget", "The CPU pool's budget "
                                 "per layer for a prompt chunk's rare experts, in copy times "
                                 "of the layer's copied experts (STRATA_POOL_BUDGET; auto "
                                 "moves it)", streamer.pool_share_of_copy)
                yield from guess_metrics(getattr(tier.arena.model, "tier", None))
        yield _gauge("strata_expert_cache_hit_rate", "Share of routed entries served by the "
                     "cache since start-up", t.hit_rate)
        yield _gauge("strata_expert_cache_slots", "Expert cache slots (one routed expert each)",
                     tier.arena.n_slots)
        yield _counter("strata_expert_cache_rounds", "Tier rounds that asked the policy",
                       t.num_rounds)
        yield _counter("strata_expert_cache_rounds_skipped", "Async tier rounds skipped "
                       "because the previous round was still copying", t.num_rounds_skipped)
        yield _counter("strata_expert_cache_admissions", "Missed experts their window's kernels "
                       "kept in cache slots as they read them (free admission)", t.num_admissions)
        swaps = CounterMetricFamily("strata_expert_cache_swaps", "Experts copied into the "
                                    "cache by the tier, into a free slot or evicting one",
                                    labels=["kind"])
        swaps.add_metric(["fill"], t.num_fills)
        swaps.add_metric(["eviction"], t.num_evictions)
        yield swaps
        yield _counter("strata_expert_cache_moved_bytes", "Bytes copied into cache slots by "
                       "the tier", t.num_bytes_moved)
        yield _counter("strata_expert_tier_wait_seconds", "Time windows waited for the tier "
                       "outside their forward pass", t.wait_s)
        lender = getattr(tier, "kv_lender", None)
        if lender is not None:  # --kv-grow (experts/kv_grow.py)
            yield _gauge("strata_kv_lent_slots", "Expert-cache slots lent to KV now",
                         lender.num_lent_slots)
            yield _counter("strata_kv_grows", "KV grows into lent expert-cache slots",
                           lender.num_grows)
            yield _counter("strata_kv_grows_refused", "KV grows the policy refused",
                           lender.num_refused)
            yield _counter("strata_kv_trims", "KVs trimmed back to their base cells (lent "
                           "slots returned)", lender.num_trims)
        optimum = tier.recent.optimum()
        yield _gauge("strata_expert_cache_recent_windows", "Windows the recent hit rates cover "
                     "(the last ones, at most 1024)", optimum.num_windows)
        yield _gauge("strata_expert_cache_recent_access_hit_rate", "Share of accesses (distinct "
                     "window, layer, expert) that hit the cache over the recent windows",
                     optimum.cache_hit_rate)
        yield _gauge("strata_expert_cache_optimum_hit_rate", "The access hit rate Belady's "
                     "optimum (demand loads, same slots) would have had on the recent windows",
                     optimum.optimum_hit_rate)


class ConversationCacheCollector:
    """Parked conversations (`--cache-ram`): what the host RAM holds and how often a
    conversation moved out of its slot and back, and with `--conversation-cache-dir` the same
    of the files, read at scrape time."""

    def __init__(self, get_cache):
        self._get_cache = get_cache

    def describe(self):
        return []  # the families exist only once an engine does

    def collect(self):
        cache = self._get_cache()
        if cache is None:
            return
        yield _gauge("strata_conversation_cache_entries", "Conversations parked in host RAM",
                     cache.num_entries)
        yield _gauge("strata_conversation_cache_bytes", "Bytes of KV they hold",
                     cache.used_bytes)
        yield _gauge("strata_conversation_cache_budget_bytes", "What they may hold "
                     "(--cache-ram, at most half the RAM available at start)",
                     cache.budget_bytes)
        yield _counter("strata_conversations_parked", "Conversations parked (whole, or their "
                       "longest prefix that fits)", cache.num_parked)
        yield _counter("strata_conversations_restored", "Parked conversations copied back into "
                       "a slot", cache.num_taken)
        yield _counter("strata_conversations_evicted", "Parked conversations dropped to make "
                       "room, least recently used first", cache.num_evicted)
        disk = cache.disk
        if disk is None:
            return
        yield _gauge("strata_conversation_files", "Conversations in files "
                     "(--conversation-cache-dir)", disk.num_entries)
        yield _gauge("strata_conversation_files_bytes", "Bytes of those files",
                     disk.used_bytes)
        yield _gauge("strata_conversation_files_budget_bytes", "What they may take "
                     "(--conversation-cache-disk-mib, at most half the disk space free at "
                     "start)", disk.budget_bytes)
        yield _counter("strata_conversation_files_written", "Conversation files written",
                       disk.num_written)
        yield _counter("strata_conversation_files_read", "Conversation files read back into "
                       "a slot", disk.num_read)
        yield _counter("strata_conversation_files_evicted", "Conversation files deleted to "
                       "make room, least recently used first", disk.num_evicted)
        yield _counter("strata_conversation_files_failed", "Conversation files that could not "
                       "be written", disk.num_failed)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
