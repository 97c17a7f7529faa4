"""Synthetic routing skew: Zipf popularity, skewed routers in synth models, synthetic traces,
and the replay/profile/synth-trace/inspect --routing commands."""
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from strata.errors import ConfigError
from strata.experts.profile import read_profile
from strata.experts.trace import read_trace, skew_summary
from strata.tool.cli import main as tool_main
from strata.tool.replay_cmd import profile, replay, synth_trace_cmd
from strata.tool.routing import skew_router_rows, synth_trace, zipf_popularity
from strata.tool.synth import synth_model


def test_zipf_popularity_exact():
    rng = np.random.default_rng(3)
    popularity = zipf_popularity(5, 1.0, rng)
    ranks = np.random.default_rng(3).permutation(5)
    expected = 1.0 / (ranks + 1.0)
    assert np.allclose(popularity, expected / expected.sum(), rtol=0, atol=1e-15)
    assert np.allclose(zipf_popularity(4, 0.0, rng), 0.25)
    with pytest.raises(ConfigError, match="routing skew must be a finite number >= 0"):
        zipf_popularity(4, -1.0, rng)


def test_skew_router_rows_matches_float64_reference():
    router = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    got = skew_router_rows(router, 0.7, np.random.default_rng(9))
    ranks = np.random.default_rng(9).permutation(16).astype(np.float64)
    scales = (ranks + 1.0) ** -0.7
    scales /= np.sqrt(np.mean(scales ** 2))
    reference = router.astype(np.float64) * scales[:, None]
    assert got.dtype == np.float32
    assert np.allclose(got, reference, rtol=1e-6, atol=0)


def _tensors(path):
    return {t.name: bytes(t.data.tobytes()) for t in GGUFReader(path).tensors}


def _top_share(router, top_k=2, fraction=0.25):
    """Share of top-k picks taken by the top `fraction` of experts on isotropic hidden states."""
    hidden = np.random.default_rng(1).standard_normal((4000, router.shape[1]))  # [T, H]
    logits = hidden @ router.T.astype(np.float64)  # [T, E]
    picks = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    counts = np.sort(np.bincount(picks.ravel(), minlength=router.shape[0]))[::-1]
    return counts[:round(fraction * router.shape[0])].sum() / counts.sum()


def test_synth_routing_skew_changes_only_the_routers(tmp_path):
    plain, zero, skewed = (tmp_path / f"{n}.gguf" for n in ("plain", "zero", "skewed"))
    synth_model(plain, "tiny", "q4_0", seed=4)
    synth_model(zero, "tiny", "q4_0", seed=4, routing_skew=0.0)
    spec = synth_model(skewed, "tiny", "q4_0", seed=4, routing_skew=1.0)
    assert plain.read_bytes() == zero.read_bytes()
    before, after = _tensors(plain), _tensors(skewed)
    assert before.keys() == after.keys()
    changed = sorted(name for name in before if before[name] != after[name])
    assert changed == sorted(f"blk.{i}.ffn_gate_inp.weight" for i in range(spec.n_layers))
    router_before = np.frombuffer(before["blk.0.ffn_gate_inp.weight"], np.float32)
    router_after = np.frombuffer(after["blk.0.ffn_gate_inp.weight"], np.float32)
    shape = (spec.n_experts, spec.hidden)
    assert _top_share(router_after.reshape(shape), spec.n_experts_used) > \
        _top_share(router_before.reshape(shape), spec.n_experts_used) + 0.1
    fields = GGUFReader(skewed).fields
    assert float(fields["strata.synth.routing_skew"].parts[-1][0]) == 1.0
    with pytest.raises(ConfigError, match="routing skew must be a finite number >= 0"):
        synth_model(tmp_path / "bad.gguf", "tiny", "q4_0", routing_skew=-0.5)


def test_synth_trace_shape_determinism_and_knobs():
    trace = synth_trace(3, 16, 4, 50, rows_per_window=2, skew=1.0, locality=0.5, seed=2)
    again = synth_trace(3, 16, 4, 50, rows_per_window=2, skew=1.0, locality=0.5, seed=2)
    assert np.array_equal(trace.records, again.records)
    assert trace.num_windows == 50
    rows = trace.rows_per_expert()
    assert rows.sum() == 3 * 50 * 2 * 4  # every (window, layer, stream) picks top-k entries
    # Each (window, layer) has between top_k and rows * top_k distinct experts.
    per_window_layer = np.bincount(trace.records["window"].astype(int) * 3
                                   + trace.records["layer"])
    assert per_window_layer.min() >= 4 and per_window_layer.max() <= 8

    def summary(**knobs):
        args = {"skew": 0.0, "locality": 0.0, **knobs}
        return skew_summary(synth_trace(2, 32, 4, 400, 2, seed=0, **args))

    assert summary(skew=1.2).share_of_top[0.1] > summary().share_of_top[0.1] + 0.15
    assert summary(locality=0.8).reuse_next_window > summary().reuse_next_window + 0.4
    with pytest.raises(ConfigError, match="locality"):
        synth_trace(1, 4, 2, 10, locality=1.0)
    with pytest.raises(ConfigError, match="top-k 5"):
        synth_trace(1, 4, 5, 10)


def test_phases_move_the_popular_experts():
    trace = synth_trace(1, 32, 2, 400, 2, skew=1.5, locality=0.0, phase_windows=200, seed=1)
    windows = trace.records["window"]
    first = np.bincount(trace.records["expert"][windows < 200], minlength=32)
    second = np.bincount(trace.records["expert"][windows >= 200], minlength=32)
    # The 4 hottest experts of the two phases have nothing in common (drawn ranks differ).
    assert not set(np.argsort(first)[-4:].tolist()) & set(np.argsort(second)[-4:].tolist())
    no_phases = synth_trace(1, 32, 2, 400, 2, skew=1.5, locality=0.0, seed=1)
    windows = no_phases.records["window"]
    first = np.bincount(no_phases.records["expert"][windows < 200], minlength=32)
    second = np.bincount(no_phases.records["expert"][windows >= 200], minlength=32)
    assert np.argmax(first) == np.argmax(second)


def test_commands_synth_trace_profile_replay_inspect(tmp_path):
    runner = CliRunner()
    path = str(tmp_path / "t.trace")
    result = runner.invoke(synth_trace_cmd, [path, "--layers", "2", "--experts", "8", "--top-k",
                                             "2", "--windows", "40", "--rows", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {path}\nrouting trace: 2 layers x 8 experts, "
                                    "40 windows")
    out = str(tmp_path / "p.txt")
    result = runner.invoke(profile, [path, path, "-o", out, "--show", "2"])
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == 3
    assert read_profile(out).accesses.sum() == 2 * len(read_trace(path).records)
    result = runner.invoke(replay, [path, "--slots", "25%", "--slots", "3", "--profile", out])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[:2] for line in lines[2:]] == [
        [slots, name] for slots in ("4", "3")
        for name in ("decayed-count", "lru", "lfu", "static-profile", "round-oracle", "belady")]
    result = runner.invoke(replay, [path, "--slots", "4", "--policy", "nope"])
    assert result.exit_code == 2
    assert "no installed tier policy is called 'nope'; installed: decayed-count" in result.output
    assert "windows" not in result.output          # refused before the header
    for bad, says in (("-3", "-3 slots: the trace has 16 experts, so 0..16"), ("17", "0..16"),
                      ("101%", "a share of all experts lies in 0..100%"), ("nan%", "0..100%")):
        result = runner.invoke(replay, [path, "--slots", "25%", "--slots", bad])
        assert result.exit_code == 2 and says in result.output, (bad, result.output)
        assert "windows" not in result.output and "Traceback" not in result.output
    result = runner.invoke(tool_main, ["inspect", "--routing", path])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("routing trace: 2 layers x 8 experts, 40 windows")
    result = runner.invoke(replay, [str(tmp_path / "missing.trace"), "--slots", "1"])
    assert result.exit_code == 2 and "cannot read" in result.output


def test_locality_keeps_each_previous_expert_with_its_probability():
    """One stream, uniform popularity: an expert of token t is routed again for token t + 1
    when kept (probability `locality`) or drawn again among the fresh picks, so the measured
    reuse is locality + (1 - locality) * (K - kept) / (E - kept), kept ~ (K - 1) * locality."""
    def trace(locality):
        return synth_trace(1, 64, 8, 3000, 1, skew=0.0, locality=locality, seed=3)

    for locality in (0.0, 0.3, 0.6):
        num_kept = 7 * locality
        expected = locality + (1 - locality) * (8 - num_kept) / (64 - num_kept)
        assert abs(skew_summary(trace(locality)).reuse_next_window - expected) < 0.02
    # Consecutive tokens share part of their experts, rarely all of them (0.6 ** 8 = 1.7%).
    experts = trace(0.6).records["expert"].reshape(3000, 8)  # one stream: 8 records a window
    num_same_sets = int((experts[1:] == experts[:-1]).all(axis=1).sum())
    assert 0 < num_same_sets < 0.05 * 3000


def test_stream_topics_spread_the_streams_over_more_experts():
    def summary(rows, stream_topics, seed=4):
        return skew_summary(synth_trace(2, 64, 8, 600, rows, skew=1.5, locality=0.5,
                                        phase_windows=200, seed=seed,
                                        stream_topics=stream_topics))

    shared, own = summary(4, False), summary(4, True)
    assert own.mean_experts_per_window > shared.mean_experts_per_window + 3
    # One stream: its own topic is the shared one, drawn from the same random numbers.
    one = synth_trace(2, 64, 8, 600, 1, 1.5, 0.5, 200, seed=4)
    assert np.array_equal(one.records, synth_trace(2, 64, 8, 600, 1, 1.5, 0.5, 200, seed=4,
                                                   stream_topics=True).records)
    other_seed = synth_trace(2, 64, 8, 600, 1, 1.5, 0.5, 200, seed=5)
    assert not np.array_equal(one.records[:1000], other_seed.records[:1000])


def test_stream_topics_change_at_staggered_times():
    """Two streams, phases of 200 windows: with their own topics stream 1 changes at window
    100 and stream 0 at 200, so the hot experts of windows 0-99 and 100-199 differ in part;
    shared topics change only at 200. Phase 0 never changes either."""
    def hot_overlap(stream_topics, phase_windows, first, second):
        trace = synth_trace(1, 64, 4, 400, 2, skew=2.0, locality=0.0,
                            phase_windows=phase_windows, seed=7, stream_topics=stream_topics)
        windows, experts = trace.records["window"], trace.records["expert"]

        def hot(lo, hi):
            counts = np.bincount(experts[(windows >= lo) & (windows < hi)], minlength=64)
            return set(np.argsort(counts)[-6:].tolist())

        return len(hot(*first) & hot(*second))

    assert hot_overlap(False, 200, (0, 100), (100, 200)) >= 5
    assert hot_overlap(True, 200, (0, 100), (100, 200)) <= 4
    assert hot_overlap(False, 200, (100, 200), (200, 300)) <= 2
    assert hot_overlap(True, 0, (0, 200), (200, 400)) >= 5


def test_synth_trace_command_gives_each_stream_its_topic(tmp_path):
    """`strata-tool synth-trace --stream-topics` writes synth_trace(..., stream_topics=True)'s
    trace and says so in the file; without the flag the streams share their topics."""
    runner = CliRunner()
    args = ["--layers", "2", "--experts", "64", "--top-k", "8", "--windows", "300", "--rows",
            "4", "--skew", "1.5", "--phase-windows", "100", "--seed", "4"]
    own, shared = str(tmp_path / "own.trace"), str(tmp_path / "shared.trace")
    result = runner.invoke(synth_trace_cmd, [own, "--stream-topics", *args])
    assert result.exit_code == 0, result.output
    result = runner.invoke(synth_trace_cmd, [shared, *args])
    assert result.exit_code == 0, result.output
    expected = synth_trace(2, 64, 8, 300, 4, 1.5, 0.5, 100, seed=4, stream_topics=True)
    written = read_trace(own)
    assert np.array_equal(written.records, expected.records)
    assert written.extra["synthetic"]["stream_topics"] is True
    assert read_trace(shared).extra["synthetic"]["stream_topics"] is False
    assert (skew_summary(written).mean_experts_per_window
            > skew_summary(read_trace(shared)).mean_experts_per_window + 3)


@pytest.mark.parametrize("skew", [float("nan"), float("inf"), -0.5])
def test_a_skew_that_is_not_a_finite_number_is_refused(tmp_path, skew):
    # NaN was taken silently: synth wrote an unskewed model, synth-trace a trace of NaN
    # popularities (every expert "routed again" 100%); inf routed to one expert only
    with pytest.raises(ConfigError, match=f"skew must be a finite number >= 0 .* not {skew}"):
        synth_trace(2, 8, 2, 10, skew=skew)
    with pytest.raises(ConfigError, match=f"routing skew must be a finite number >= 0 .* not "
                                          f"{skew}"):
        synth_model(tmp_path / "m.gguf", "tiny", "f32", routing_skew=skew)
    assert not (tmp_path / "m.gguf").exists()
    result = CliRunner().invoke(synth_trace_cmd, [str(tmp_path / "t.trace"), "--skew", str(skew)])
    assert result.exit_code == 2 and "skew must be a finite number" in result.output


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_numpy_or_the_file_cannot_take_is_refused(tmp_path, seed):
    # -1: a ValueError traceback from numpy; 2**64: a struct.error writing the metadata
    with pytest.raises(ConfigError, match=f"the seed must be an integer in 0..{2**64 - 1}, "
                                          f"not {seed}"):
        synth_trace(2, 8, 2, 10, seed=seed)
    with pytest.raises(ConfigError, match="the seed must be an integer"):
        synth_model(tmp_path / "m.gguf", "tiny", "f32", seed=seed)
    result = CliRunner().invoke(tool_main, ["synth", "--seed", str(seed),
                                            str(tmp_path / "m.gguf")])
    assert result.exit_code == 2 and "the seed must be an integer" in result.output
