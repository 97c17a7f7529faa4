"""/metrics with an expert cache: hit/miss counters against the routed entries of the requests
made, the hit rate, swaps, bytes moved, tier wait, and the Belady optimum against a replay of
the routing trace the same server recorded."""
import pytest
import requests
from conftest import start_live_server
from prometheus_client.parser import text_string_to_metric_families

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.experts.replay import replay_belady
from strata.experts.trace import read_trace
from strata.server.app import ServerConfig


def scrape(live) -> dict:
    response = requests.get(live.url + "/metrics", timeout=10)
    assert response.status_code == 200
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples}


TOP_K, N_LAYERS = 2, 2  # the tiny preset
CACHE_SLOTS = 3


@pytest.fixture(scope="module")
def cached(model_path, tmp_path_factory):
    trace = tmp_path_factory.mktemp("metrics") / "served.trace"
    engine = Engine(EngineConfig(model_path, n_ctx=512, threads=2, expert_cache=CACHE_SLOTS,
                                 adapt_every=1, adapt_async=False, dump_routing_path=trace))
    server = start_live_server(engine, ServerConfig(model_id="tiny-server"))
    yield server, trace
    server.stop()


def test_expert_cache_metrics(cached):
    live, trace_path = cached
    before = scrape(live)
    assert before[("strata_expert_cache_hits_total", ())] == 0
    assert before[("strata_expert_cache_slots", ())] == CACHE_SLOTS
    usages = []
    for prompt in ("the first prompt", "and a second one"):
        response = requests.post(live.url + "/v1/completions",
                                 json={"prompt": prompt, "max_tokens": 5, "temperature": 0},
                                 timeout=60)
        assert response.status_code == 200
        usages.append(response.json()["usage"])
    after = scrape(live)
    hits = after[("strata_expert_cache_hits_total", ())]
    misses = after[("strata_expert_cache_misses_total", ())]
    num_rows = sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
                   + u["completion_tokens"] - 1 for u in usages)
    assert hits + misses == num_rows * TOP_K * N_LAYERS
    assert hits > 0 and misses > 0
    assert after[("strata_expert_cache_hit_rate", ())] == pytest.approx(hits / (hits + misses))
    fills = after[("strata_expert_cache_swaps_total", (("kind", "fill"),))]
    evictions = after[("strata_expert_cache_swaps_total", (("kind", "eviction"),))]
    assert fills == 0  # the start-up fill took every slot
    assert evictions > 0
    tier = live.state.worker.engine.expert_tier
    assert after[("strata_expert_cache_moved_bytes_total", ())] == \
        evictions * tier.store.layer_expert_nbytes(0)
    num_windows = after[("strata_expert_cache_recent_windows", ())]
    assert after[("strata_expert_cache_rounds_total", ())] == num_windows  # adapt every window
    assert after[("strata_expert_cache_rounds_skipped_total", ())] == 0
    assert 0 < after[("strata_expert_tier_wait_seconds_total", ())] < 5
    optimum = after[("strata_expert_cache_optimum_hit_rate", ())]
    recent = after[("strata_expert_cache_recent_access_hit_rate", ())]
    totals = tier.snapshot_totals()
    assert recent == pytest.approx(totals.num_access_hits / totals.num_accesses)
    live.state.worker.engine.expert_tier.trace.flush()
    trace = read_trace(trace_path)
    assert trace.num_windows == num_windows
    assert optimum == pytest.approx(replay_belady(trace, CACHE_SLOTS).hit_rate)


def test_no_expert_cache_metrics_without_a_cache(live):
    assert not any(name.startswith("strata_expert_") for name, _ in scrape(live))
