"""The optional per-window TierPolicy hook in the engine: ExpertTier calls `observe` after every
window with exactly that window's routed rows (as the trace records them), before the round's
`plan_swaps`; never while the tier is frozen. Tiny synth model on the CPU backend."""
import numpy as np
import pytest

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.config import EngineConfig
from strata.engine.expert_tier import ExpertTier
from strata.experts.tier_window import WindowScoreTier
from strata.experts.trace import read_trace
from strata.model.gguf_file import GGUFModel

pytestmark = pytest.mark.usefixtures("one_kernel_thread")

PROMPTS = [(11, 12, 13), (40, 2), (7, 7, 7, 7), (99,)]


class ObservingPolicy:
    """Logs each call in order; swaps nothing."""

    name = "observing"

    def __init__(self):
        self.events = []

    def observe(self, counts):
        self.events.append(("observe", counts.copy()))

    def plan_swaps(self, counts, residency, min_gain):
        self.events.append(("round", counts.copy()))
        return []


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("observe") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=8)
    return path


def run_windows(model_path, policy, **options):
    """Each prompt of PROMPTS as one window through an ExpertTier with `policy`."""
    with GGUFModel.open(model_path) as gguf:
        model = CpuModel(gguf)
        tier = ExpertTier.build(EngineConfig(model_path, **options), gguf, model)
        tier.start(policy)
        kv = model.new_kv(256)
        for tokens in PROMPTS:
            tier.forward_window(Window.build([(kv, np.array(tokens))]))
        tier.close()
        return tier


def window_rows(trace):
    """[W, L, E] int64 rows per window, from the trace's records."""
    out = np.zeros((trace.num_windows, trace.n_layers, trace.n_experts), dtype=np.int64)
    records = trace.records
    out[records["window"], records["layer"], records["expert"]] = records["rows"]
    return out


def test_observe_gets_every_windows_rows_before_the_round(model_path, tmp_path):
    policy = ObservingPolicy()
    trace_path = tmp_path / "routing.trace"
    run_windows(model_path, policy, expert_cache=4, adapt_every=2, adapt_async=False,
                dump_routing_path=trace_path)
    rows = window_rows(read_trace(trace_path))
    assert len(rows) == len(PROMPTS) and rows.sum() > 0
    assert [kind for kind, _ in policy.events] == [
        "observe", "observe", "round", "observe", "observe", "round"]
    observed = [counts for kind, counts in policy.events if kind == "observe"]
    assert all(np.array_equal(seen, expected) for seen, expected in zip(observed, rows))
    rounds = [counts for kind, counts in policy.events if kind == "round"]
    assert np.array_equal(rounds[0], rows[0] + rows[1])
    assert np.array_equal(rounds[1], rows[2] + rows[3])


def test_a_frozen_tier_observes_nothing(model_path):
    policy = ObservingPolicy()
    run_windows(model_path, policy, expert_cache=4, adapt_every=0)
    assert policy.events == []


def test_window_score_scores_every_window_in_the_engine(model_path, tmp_path):
    trace_path = tmp_path / "routing.trace"
    policy = WindowScoreTier(4, decay=0.5)
    tier = run_windows(model_path, policy, expert_cache=4, adapt_every=3, adapt_async=False,
                       dump_routing_path=trace_path)
    rows = window_rows(read_trace(trace_path))
    # Windows 0-2 observed, a round, then window 3: one window since the round.
    frequency = (rows[0] > 0).astype(np.float64)
    for window in rows[1:]:
        frequency = 0.5 * frequency + 0.5 * (window > 0)
    assert np.array_equal(policy.frequency, frequency)
    assert np.array_equal(policy.recent_rows, rows[3])
    assert policy.num_windows_observed == 1
    assert tier.snapshot_totals().num_rounds == 1
