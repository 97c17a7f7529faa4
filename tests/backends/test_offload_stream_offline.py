"""Prompt-chunk streaming logic that runs on any machine (stream.py): copy runs, the window's
device tables over the staging sets, and the issue order of copies, events and launches, checked
with the happens-before order CUDA streams and events give."""
import numpy as np
import pytest

from strata._native import cuda_driver
from strata.backends.cuda.stream import (COMPUTE, COPY, NUM_STAGES, REACH_COST, WindowTimeline,
                                         copy_runs, decay_counts, rare_experts, run_bytes,
                                         seeded_counts, stream_schedule, stream_tables,
                                         streamed_layers)


def test_copy_runs_are_the_runs_of_missing_experts():
    assert copy_runs(np.array([1, 1, 0, 1, 0, 0, 1, 1], bool)) == [(0, 2), (3, 4), (6, 8)]
    assert copy_runs(np.zeros(5, bool)) == []
    assert copy_runs(np.ones(4, bool)) == [(0, 4)]
    assert copy_runs(np.array([0, 1, 0], bool)) == [(1, 2)]


def test_run_bytes_give_each_runs_first_expert_the_whole_run():
    rng = np.random.default_rng(5)
    copied = rng.random((6, 16)) < 0.5
    copied[0], copied[1] = True, False  # one run of the whole layer; nothing
    image = np.array([100, 90, 80, 70, 60, 50])
    got = run_bytes(copied, 128, image)
    want = np.zeros((6, 16), dtype=np.uint64)
    for layer in range(6):
        for first, stop in copy_runs(copied[layer]):
            want[layer, first] = (stop - first - 1) * 128 + image[layer]
    assert got.dtype == np.uint64 and np.array_equal(got, want)
    assert got[0, 0] == 15 * 128 + 100 and not got[1].any()


def test_streamed_layers_have_a_missing_expert():
    residency = np.array([[0, 1], [-1, 2], [3, 4], [-1, -1]], dtype=np.int32)
    assert streamed_layers(residency) == [1, 3]


def test_stream_tables_point_missing_experts_at_alternating_staging_sets():
    L, E, slot_bytes = 4, 3, 1000
    residency = np.array([[-1, -1, -1], [0, 1, 2], [-1, 3, -1], [4, -1, 5]], dtype=np.int32)
    mirror = np.arange(L * 3 * E, dtype=np.uint64).reshape(L, 3, E) + np.uint64(7 << 40)
    part_offsets = np.array([[0, 256, 512]] * L, dtype=np.uint64)
    bases = [1 << 32, 2 << 32]
    got = stream_tables(mirror, residency, bases, slot_bytes, part_offsets)
    want = mirror.copy()
    # streamed layers 0, 2, 3 -> sets 0, 1, 0; expert e at slot e of its set
    for layer, stage, missing in ((0, 0, (0, 1, 2)), (2, 1, (0, 2)), (3, 0, (1,))):
        for e in missing:
            want[layer, :, e] = [bases[stage] + e * slot_bytes + off for off in (0, 256, 512)]
    assert np.array_equal(got, want)
    assert np.array_equal(got[1], mirror[1])  # a resident layer keeps its cache slots


def test_stream_tables_leave_rare_experts_at_their_host_copies():
    L, E, slot_bytes = 2, 4, 1000
    residency = np.array([[-1, -1, -1, -1], [-1, 0, -1, -1]], dtype=np.int32)
    rare = np.array([[0, 1, 0, 1], [0, 0, 0, 1]], dtype=bool)
    mirror = np.arange(L * 3 * E, dtype=np.uint64).reshape(L, 3, E) + np.uint64(7 << 40)
    part_offsets = np.array([[0, 256, 512]] * L, dtype=np.uint64)
    bases = [1 << 32, 2 << 32]
    got = stream_tables(mirror, residency, bases, slot_bytes, part_offsets, rare)
    want = mirror.copy()  # rare and resident experts: as the mirror has them
    for layer, e in ((0, 0), (0, 2), (1, 0), (1, 2)):  # copied: at slot e of set `layer`
        want[layer, :, e] = [bases[layer] + e * slot_bytes + off for off in (0, 256, 512)]
    assert np.array_equal(got, want)


def test_rare_experts_are_missing_ones_seldom_read_once_the_counts_say_so():
    L, E, R, K = 2, 64, 512, 8
    residency = np.full((L, E), -1, dtype=np.int32)
    residency[1, :4] = np.arange(4)
    # no counts yet: every expert expects R * K / E = 64 rows, none rare
    assert not rare_experts(residency, np.zeros((L, E)), R, K).any()
    # 40 windows of 512 rows in which experts 48.. never appeared and the rest shared the pairs
    routed = np.zeros((L, E))
    routed[:, :48] = 40 * R * K / 48
    rare = rare_experts(residency, routed, R, K)
    assert (rare[0] == (np.arange(E) >= 48)).all()
    assert (rare[1] == (np.arange(E) >= 48)).all()  # resident experts are never rare
    # after one window an unseen expert still expects ~1 row (0.63 chance of a read): rare at
    # a reach cost of 1.5, not at 2...
    one = np.zeros((L, E))
    one[:, :48] = R * K / 48
    assert rare_experts(residency, one, R, K, reach_cost=1.5)[0, 48:].all()
    assert not rare_experts(residency, one, R, K, reach_cost=2.0).any()
    # ...and at 2 for a window of 16 rows (each expert's chance of a read is smaller)
    assert rare_experts(residency, one, 16, K, reach_cost=2.0)[0, 48:].all()
    # the cost of a read from inside the kernels sets the bar: 0 leaves every expert rare
    assert rare_experts(residency, one, R, K, reach_cost=0.0).sum() == (residency < 0).sum()
    assert REACH_COST >= 1.0


def happens_before(ops):
    """For each op, the set of ops that must complete before it (program order per stream;
    a wait on an event orders after everything before that event's latest record)."""
    before, last_on = [], {}  # last_on[stream]: index of the stream's last op
    recorded = {}  # event -> ops before its latest record (inclusive)
    for i, op in enumerate(ops):
        deps = set()
        prev = last_on.get(op.stream)
        if prev is not None:
            deps |= before[prev] | {prev}
        if op.kind == "wait":
            assert op.event in recorded, f"wait on {op.event} before any record of it"
            deps |= recorded[op.event]
        if op.kind == "record":
            recorded[op.event] = deps | {i}
        before.append(deps)
        last_on[op.stream] = i
    return before


def launch_ops(ops, first, stop):
    """Indices of the ops that run plan launches in [first, stop)."""
    return [i for i, op in enumerate(ops)
            if op.kind == "launches" and op.first < stop and first < op.stop]


@pytest.mark.parametrize("streamed", [[0, 1, 2, 3, 4, 5], [3, 4, 5], [0, 2, 5], [4]])
def test_schedule_orders_copies_and_reads_of_each_staging_set(streamed):
    L, per_layer = 6, 10
    spans = [(ly * per_layer + 4, ly * per_layer + 7) for ly in range(L)]  # gate/up .. down
    num_launches = L * per_layer + 3
    runs = {ly: [(0, 2), (5, 8)] for ly in streamed}
    ops = stream_schedule(num_launches, spans, runs)
    # every plan launch appears once, in order, on the compute stream
    ranges = [(op.first, op.stop) for op in ops if op.kind == "launches"]
    assert all(op.stream == COMPUTE for op in ops if op.kind == "launches")
    assert [i for a, b in ranges for i in range(a, b)] == list(range(num_launches))
    assert all(op.stream == COPY for op in ops if op.kind == "copy")
    hb = happens_before(ops)
    copies = {ly: [i for i, op in enumerate(ops) if op.kind == "copy" and op.layer == ly]
              for ly in range(L)}
    for ly in range(L):
        assert [(ops[i].first, ops[i].stop) for i in copies[ly]] == runs.get(ly, [])
    for j, layer in enumerate(streamed):
        readers = launch_ops(ops, *spans[layer])
        # a layer's expert launches run after all its copies landed
        assert all(set(copies[layer]) <= hb[r] for r in readers)
        # the copies start after every launch issued before the window (event start) ...
        assert ops[0].kind == "record" and all(0 in hb[c] for c in copies[layer])
        # ... and after the previous user of the same staging set read it
        if j >= NUM_STAGES:
            previous = launch_ops(ops, *spans[streamed[j - NUM_STAGES]])
            assert all(set(previous) <= hb[c] for c in copies[layer])
        # the copies do not wait for the layer before (they overlap its compute)
        if j >= 1:
            other = launch_ops(ops, *spans[streamed[j - 1]])
            assert not any(set(other) <= hb[c] for c in copies[layer])
    # the first two streamed layers' copies are issued before any launch
    first_launch = min(i for i, op in enumerate(ops) if op.kind == "launches")
    for layer in streamed[:NUM_STAGES]:
        assert max(copies[layer]) < first_launch


def test_the_timeline_only_adds_timing_records_around_each_layer():
    L, per_layer = 5, 10
    spans = [(ly * per_layer + 4, ly * per_layer + 7) for ly in range(L)]
    runs = {ly: [(0, 2), (5, 8)] for ly in (0, 2, 3, 4)}
    plain = stream_schedule(L * per_layer, spans, runs)
    timed = stream_schedule(L * per_layer, spans, runs, timeline=True)
    marks = [op for op in timed if op.event[:1] == ("t",)]
    assert all(op.kind == "record" for op in marks)
    assert [op for op in timed if op.event[:1] != ("t",)] == plain
    at = {op.event[1:]: i for i, op in enumerate(timed) if op.event[:1] == ("t",)}
    assert len(at) == len(marks)  # each key once
    assert timed[at[("start",)]].stream == COMPUTE and at[("end",)] == len(timed) - 1
    for ly in runs:
        copies = [i for i, op in enumerate(timed) if op.kind == "copy" and op.layer == ly]
        assert at[("copy", ly)] < min(copies) and max(copies) < at[("copied", ly)]
        assert timed[at[("copy", ly)]].stream == timed[at[("copied", ly)]].stream == COPY
        wait = next(i for i, op in enumerate(timed)
                    if op.kind == "wait" and op.event == ("copied", ly))
        launch = launch_ops(timed, *spans[ly])
        assert at[("ready", ly)] < wait < at[("go", ly)] < min(launch)
        assert max(launch) < at[("done", ly)]
        assert all(timed[at[(k, ly)]].stream == COMPUTE for k in ("ready", "go", "done"))
    assert not any(key[1:] == (1,) for key in at)  # layer 1 is resident: no marks
    # the tier's spans outside the expert launches: marked around them, empty ones not at all
    tier = {"grouping": {ly: (ly * per_layer + 2, ly * per_layer + 4) for ly in range(L)},
            "guess": {ly: (ly * per_layer + 2, ly * per_layer + 3) for ly in range(L)},
            "pool": {ly: (ly * per_layer + 7, ly * per_layer + 9) for ly in range(L) if ly != 3}}
    marked = stream_schedule(L * per_layer, spans, runs, timeline=True, tier_spans=tier)

    def covered(ops):  # the launches run, in order
        return [i for op in ops if op.kind == "launches" for i in range(op.first, op.stop)]

    def others(ops):  # copies, events: everything but launches and timing records
        return [op for op in ops if op.kind != "launches" and op.event[:1] != ("t",)]

    assert covered(marked) == covered(plain) == list(range(L * per_layer))
    assert others(marked) == others(plain)
    at = {op.event[1:]: i for i, op in enumerate(marked) if op.event[:1] == ("t",)}
    for ly in runs:
        for name, per_layer_spans in tier.items():
            first, stop = per_layer_spans.get(ly, (0, 0))
            if first == stop:
                assert (name, ly) not in at and (name + "_end", ly) not in at
                continue
            inside = launch_ops(marked, first, stop)
            assert at[(name, ly)] < min(inside) and max(inside) < at[(name + "_end", ly)]
            assert not launch_ops(marked, stop, stop + 1) or (
                at[(name + "_end", ly)] < min(launch_ops(marked, stop, stop + 1)))
        # the grouping ends where the experts begin: before the wait for the layer's copies
        assert at[("grouping_end", ly)] < at[("ready", ly)]
        if ("pool", ly) in at:  # the pool's combine follows the layer's experts
            assert max(launch_ops(marked, *spans[ly])) < at[("pool", ly)]
    assert stream_schedule(L * per_layer, spans, runs, tier_spans=tier) == plain  # timeline off


def test_window_timeline_sums_each_layers_spans():
    # made-up times (ms from start) for two streamed layers copied back to back, then one
    # that waited 1 ms for its staging set
    times = {("start",): 0.0, ("copy", 0): 0.0, ("copied", 0): 2.0, ("copy", 1): 2.0,
             ("copied", 1): 4.0, ("copy", 2): 5.0, ("copied", 2): 7.0,
             ("ready", 0): 0.5, ("go", 0): 2.0, ("done", 0): 3.0,
             ("ready", 1): 3.5, ("go", 1): 4.0, ("done", 1): 5.0,
             ("ready", 2): 5.5, ("go", 2): 7.0, ("done", 2): 8.0, ("end",): 8.5}
    t = WindowTimeline.measure(512, [0, 1, 2], lambda a, b: times[b] - times[a], 3 * 2**30)
    assert (t.total, t.fill, t.copying, t.held) == (8.5, 2.0, 6.0, 1.0)
    assert (t.waiting, t.experts, t.tail) == (1.5 + 0.5 + 1.5, 3.0, 1.5)
    assert (t.grouping, t.pool) == (0.0, 0.0)  # no tier spans marked
    line = t.describe()
    assert "512 rows: 8.5 ms" in line and "3.00 GiB" in line and "held" in line
    # the tier's spans: summed over the layers that have them
    times.update({("grouping", 0): 0.2, ("grouping_end", 0): 0.5, ("grouping", 2): 5.0,
                  ("grouping_end", 2): 5.5, ("pool", 1): 5.0, ("pool_end", 1): 5.25,
                  ("guess", 2): 5.0, ("guess_end", 2): 5.25, ("publish", 0): 0.25,
                  ("publish_end", 0): 0.5})
    t = WindowTimeline.measure(512, [0, 1, 2], lambda a, b: times[b] - times[a], 3 * 2**30)
    assert (t.grouping, t.pool) == (0.3 + 0.5, 0.25)
    assert (t.guess, t.pulls, t.publish) == (0.25, 0.0, 0.25)
    assert "0.8 ms in the tier's launches after the grouping" in t.describe()
    assert t.faults == -1 and "page faults" not in t.describe()  # none counted
    t = WindowTimeline.measure(512, [0, 1, 2], lambda a, b: times[b] - times[a], 3 * 2**30,
                               faults=3034)
    assert t.describe().endswith("; 3034 minor page faults in the process since the last "
                                 "timed window")


def test_minor_faults_count_the_pages_the_process_touches_first():
    from strata.backends.cuda.stream import minor_faults

    before = minor_faults()
    pages = np.empty(64 << 20, dtype=np.uint8)  # 64 MiB, untouched until filled
    pages[::4096] = 1
    # 16,384 small pages, or (numpy asks for huge pages for big arrays) at least 32 huge ones
    assert minor_faults() - before >= 32


def test_no_streamed_layer_is_the_plain_list():
    ops = stream_schedule(50, [(10 * ly + 4, 10 * ly + 7) for ly in range(5)], {})
    assert [(op.kind, op.first, op.stop) for op in ops if op.kind == "launches"] == [
        ("launches", 0, 50)]


def test_launch_list_entries_need_a_driver_and_known_kinds():
    launches = cuda_driver.LaunchList()
    with pytest.raises(TypeError, match="Launch or StreamOp"):
        launches.append(object())
    with pytest.raises(IndexError):
        launches.extend(cuda_driver.LaunchList(), 0, 1)
    if not cuda_driver.is_available():
        with pytest.raises(cuda_driver.CudaUnavailable):
            cuda_driver.Event()
        with pytest.raises(cuda_driver.CudaUnavailable):
            cuda_driver.copy_htod(1 << 20, 1 << 20, 256)


def test_seeded_counts_are_the_steady_state_of_the_decay():
    """A profile's rows, seeded, give the counts (and so the rare experts) that many windows
    routed in the same shares would reach; a layer the profile never saw calls nothing rare."""
    rng = np.random.default_rng(5)
    L, E, K, rows_per_window = 3, 16, 2, 512
    share = rng.dirichlet(np.full(E, 0.3), size=L)  # [L, E] skewed routing
    profile_rows = share * 1000.0
    profile_rows[2] = 0.0  # a layer the profile saw nothing of
    seeded = seeded_counts(profile_rows, K)
    per_window = share * rows_per_window * K  # [L, E] pairs a window routes
    routed = np.zeros((L, E))
    for _ in range(400):  # 50 half-lives
        decay_counts(routed, per_window, K)
    # the same total per layer within the discrete steps' 4% (halving per 512 rows vs smooth)
    assert np.allclose(seeded[:2].sum(axis=1), routed[:2].sum(axis=1), rtol=0.05)
    assert np.allclose(seeded[:2], routed[:2] * seeded[:2].sum() / routed[:2].sum())
    missing = np.full((L, E), -1)
    rare = rare_experts(missing, seeded, rows_per_window, K)
    assert rare[:2].any() and not rare[2].any()
    # the steady state's ~4% more pairs move no expert across the threshold here
    assert np.array_equal(rare[:2], rare_experts(missing, routed, rows_per_window, K)[:2])
    assert np.array_equal(seeded[2], np.zeros(E))


def test_with_a_pool_prompt_windows_up_to_its_rows_leave_experts_at_a_lower_reach_cost():
    """A streamed window the CPU pool serves (a pool attached, at most PROMPT_POOL_MAX_ROWS
    rows) calls an expert rare at POOL_REACH_COST, so it copies only those nearly sure to be
    read; other windows keep REACH_COST."""
    from types import SimpleNamespace

    from strata.backends.cuda.stream import (POOL_REACH_COST, PROMPT_POOL_MAX_ROWS,
                                             RARE_MAX_ROWS, PromptStreamer)

    streamer = PromptStreamer.__new__(PromptStreamer)  # the decisions only: no device
    streamer.min_rows, streamer.arena = 256, SimpleNamespace(pool=None)
    assert not streamer.pools_rare(512) and streamer._reach_cost(512) == REACH_COST
    streamer.arena.pool = object()
    assert streamer.pools_rare(256) and streamer.pools_rare(PROMPT_POOL_MAX_ROWS)
    assert streamer._reach_cost(512) == POOL_REACH_COST < REACH_COST
    assert not streamer.pools_rare(255)  # not streamed
    assert not streamer.pools_rare(PROMPT_POOL_MAX_ROWS + 1)
    assert streamer._reach_cost(PROMPT_POOL_MAX_ROWS + 1) == REACH_COST
    assert 1.0 < POOL_REACH_COST and PROMPT_POOL_MAX_ROWS <= RARE_MAX_ROWS
    # the lower cost leaves an expert the counts expect ~3 rows of (a 0.95 chance of a read)
    L, E, R, K = 1, 64, 512, 8
    residency = np.full((L, E), -1, dtype=np.int32)
    routed = np.full((L, E), 3.0 * 40 / (R * K))  # steady counts: 3 rows a window each ...
    routed[0, :8] = 40 * (R * K - 3 * (E - 8)) / (8 * R * K)  # ... but the 8 hot ones
    routed *= R * K  # 40 windows' pairs
    left = rare_experts(residency, routed, R, K, reach_cost=POOL_REACH_COST)
    assert left[0, 8:].all() and not left[0, :8].any()
    assert not rare_experts(residency, routed, R, K, reach_cost=REACH_COST).any()


def test_hit_share_is_the_decayed_share_of_windows_that_routed_to_each_expert():
    from strata.backends.cuda.stream import HIT_DECAY, HitShare

    hits = HitShare(1, 4, decay=0.5)
    assert hits.share() is None  # no window yet
    window = np.array([[3, 0, 1, 0]])  # [L, E] routed pairs
    hits.add(window)
    assert hits.share() is None  # one window is not enough to call an expert rare
    hits.add(np.array([[5, 2, 0, 0]]))
    # weights: the last window 1, the one before 0.5
    assert np.allclose(hits.share(), [[1.0, 1 / 1.5, 0.5 / 1.5, 0.0]])
    for _ in range(40):
        hits.add(window)
    assert np.allclose(hits.share(), [[1.0, 0.0, 1.0, 0.0]], atol=1e-9)
    assert 0.0 < HIT_DECAY < 1.0


def test_a_burst_of_rows_does_not_make_an_expert_sure_to_be_read():
    """Prompt windows route in bursts (a window's rows are one prompt's): an expert with
    hundreds of rows in one window of three and none in the others has a mean that makes the
    counts call it sure, while two windows in three did not read it. With the share of windows
    it is left rare; one routed in every window is still copied."""
    from strata.backends.cuda.stream import POOL_REACH_COST, HitShare

    L, E, R, K = 1, 16, 512, 8
    residency = np.full((L, E), -1, dtype=np.int32)
    routed, hits = np.zeros((L, E)), HitShare(L, E)
    rng = np.random.default_rng(0)
    for w in range(30):
        pairs = np.zeros((L, E))
        pairs[0, :4] = rng.integers(200, 400, size=4)  # routed in every window
        pairs[0, 4 + w % 3] = R  # a burst in one window of three
        pairs[0, 8:] = (R * K - pairs.sum()) / 8
        decay_counts(routed, pairs, K)
        hits.add(pairs)
    by_counts = rare_experts(residency, routed, R, K, POOL_REACH_COST)
    assert not by_counts[0, :7].any()  # the counts expect ~170 rows of each bursty one
    with_hits = rare_experts(residency, routed, R, K, POOL_REACH_COST, hits.share())
    assert with_hits[0, 4:7].all() and not with_hits[0, :4].any() and not with_hits[0, 8:].any()
    assert by_counts[0, 7] and with_hits[0, 7]  # never routed: rare either way


def _deciding_streamer(residency: np.ndarray, top_k: int):
    """A PromptStreamer with only what its decisions read (no device): zero counts, no share
    of windows yet, a CPU pool attached, `residency` [L, E] the published table."""
    from types import SimpleNamespace

    from strata.backends.cuda.stream import HitShare, PromptStreamer

    L, E = residency.shape
    streamer = PromptStreamer.__new__(PromptStreamer)
    streamer.min_rows, streamer.num_layers, streamer._top_k = 256, L, top_k
    streamer._routed, streamer._hits = np.zeros((L, E)), HitShare(L, E)
    streamer.sure_percent = 0
    table = SimpleNamespace(peek=lambda: SimpleNamespace(table=residency))
    streamer.arena = SimpleNamespace(pool=object(), table=table)
    return streamer


def test_the_streamer_counts_streamed_windows_and_uses_their_share_where_the_pool_serves():
    """account() adds a window to the share of windows only when it streams and may leave
    experts (STREAM_MIN_ROWS..RARE_MAX_ROWS rows); rare_for() uses the share from the second
    such window on, in windows the CPU pool serves; without a pool the counts alone decide."""
    from strata.backends.cuda.stream import POOL_REACH_COST

    L, E, R, K = 1, 16, 512, 8
    residency = np.full((L, E), -1, dtype=np.int32)
    streamer = _deciding_streamer(residency, K)

    def window(burst, rows=R):  # experts 0-3 every window, 4 + burst in this one, 8.. spread
        pairs = np.zeros((L, E))
        pairs[0, :4] = rows
        pairs[0, 4 + burst] = rows
        pairs[0, 8:] = (rows * K - pairs.sum()) / 8
        return pairs

    streamer.account(window(0))
    for _ in range(20):  # decode windows: counts only
        streamer.account(window(1, rows=1))
    assert streamer._hits.weight == 1.0 and streamer._hits.share() is None
    by_counts = rare_experts(residency, streamer._routed, R, K, POOL_REACH_COST)
    assert np.array_equal(streamer.rare_for(R), by_counts)  # one window: the counts alone
    for w in range(1, 9):
        streamer.account(window(w % 3))
    rare = streamer.rare_for(R)[0]
    assert rare[4:7].all() and not rare[:4].any() and not rare[8:].any()
    # the streak's log counts the window's rare experts and those the share left
    streamer.num_left = streamer._streak_left = streamer._streak_by_share = 0
    streamer._count_left(streamer.rare_for(R), residency, R)
    by_counts = rare_experts(residency, streamer._routed, R, K, POOL_REACH_COST)
    assert streamer._streak_left == rare.sum() == streamer.num_left
    assert streamer._streak_by_share == (rare & ~by_counts[0]).sum() > 0
    streamer.arena.pool = None  # no pool: rare experts would cost per-tile reads
    by_counts = rare_experts(residency, streamer._routed, R, K)
    assert np.array_equal(streamer.rare_for(R), by_counts) and not by_counts[0, :7].any()


def test_a_layer_with_no_routing_seen_leaves_every_missing_expert_rare_where_the_pool_serves():
    """With all-zero counts every expert's chance is the same, high enough to copy them all:
    with a CPU pool such a layer (a fresh server's first prompt window, no profile) leaves
    every missing expert rare, resident ones not; a layer with counts keeps the counts' rule;
    without a pool nothing is rare; past RARE_MAX_ROWS nothing either."""
    from strata.backends.cuda.stream import POOL_REACH_COST, RARE_MAX_ROWS

    L, E, R, K = 2, 16, 512, 8
    residency = np.full((L, E), -1, dtype=np.int32)
    residency[0, :3] = [5, 6, 7]  # resident: never rare
    streamer = _deciding_streamer(residency, K)
    assert not rare_experts(residency, streamer._routed, R, K, POOL_REACH_COST).any()
    assert np.array_equal(streamer.rare_for(R), residency < 0)
    assert not streamer.rare_for(RARE_MAX_ROWS + 1).any()
    streamer._routed[1, :8] = 1_000.0  # layer 1 has seen routing: the counts decide there
    rare = streamer.rare_for(R)
    assert np.array_equal(rare[0], residency[0] < 0)
    by_counts = rare_experts(residency, streamer._routed, R, K, POOL_REACH_COST)
    assert np.array_equal(rare[1], by_counts[1]) and rare[1, 8:].all() and not rare[1, :8].any()
    streamer._routed[1] = 0.0
    streamer.arena.pool = None  # no pool: a rare expert would cost per-tile reads
    assert not streamer.rare_for(R).any()


def test_sure_experts_left_to_the_pool_are_the_fewest_expected_rows_of_the_copied_ones():
    """sure_for_pool (STRATA_POOL_SURE): per layer the given percent of the experts a window
    copies (missing, not rare), the fewest expected rows first, none above the rows cap; their
    expected rows are the budget added for them."""
    from strata.backends.cuda.stream import sure_for_pool

    L, E, R, K = 2, 8, 512, 8
    residency = np.full((L, E), -1, dtype=np.int32)
    residency[1, 0] = 0  # resident: never left
    routed = np.tile(np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.float64) * 1000, (L, 1))
    rare = np.zeros((L, E), dtype=bool)
    rare[:, 0] = True
    sure, rows = sure_for_pool(residency, routed, rare, R, K, 50, rows_cap=4096)
    # layer 0 copies experts 1..7 (7): 50% -> 3, the fewest rows (1, 2, 3); layer 1 the same
    assert np.flatnonzero(sure[0]).tolist() == [1, 2, 3]
    assert np.flatnonzero(sure[1]).tolist() == [1, 2, 3]
    expected = (routed + 1) / (routed.sum(axis=1, keepdims=True) + E) * R * K
    assert np.allclose(rows, expected[:, 1:4].sum(axis=1))
    # the rows cap keeps experts expected to get more rows out; 0% leaves none
    cap = float(expected[0, 2]) + 1e-6
    sure, _ = sure_for_pool(residency, routed, rare, R, K, 50, rows_cap=cap)
    assert np.flatnonzero(sure[0]).tolist() == [1, 2]
    assert not sure_for_pool(residency, routed, rare, R, K, 0, 4096)[0].any()
    assert sure_for_pool(residency, routed, rare, R, K, 100, 4096)[0].sum() == 14


def test_sure_costs_are_the_row_units_of_what_sure_for_pool_leaves_at_each_percent():
    """sure_costs (STRATA_POOL_SURE=auto's model): at each percent, expert_rows per expert that
    sure_for_pool leaves to the pool plus their expected rows, summed over the layers; a rows
    cap that keeps experts out keeps them out of the cost too."""
    from strata.backends.cuda.stream import sure_costs, sure_for_pool

    rng = np.random.default_rng(7)
    L, E, R, K = 4, 16, 512, 8
    residency = np.where(rng.random((L, E)) < 0.2, 0, -1).astype(np.int32)
    routed = rng.gamma(0.7, 300.0, size=(L, E))
    rare = (residency < 0) & (rng.random((L, E)) < 0.25)
    percents = [0, 10, 35, 50, 70, 100]
    for cap in (4096, 40):
        got = sure_costs(residency, routed, rare, R, K, percents, cap, 13.0)
        want = []
        for p in percents:
            sure, rows = sure_for_pool(residency, routed, rare, R, K, p, cap)
            want.append(sure.sum() * 13.0 + rows.sum())
        assert np.allclose(got, want), (cap, got, want)
        assert got[0] == 0 and np.all(np.diff(got) >= 0) and got[-1] > 0
    assert sure_costs(residency, routed, rare, R, K, [100], 40, 13.0)[0] < \
        sure_costs(residency, routed, rare, R, K, [100], 4096, 13.0)[0]


def _sure_follower(auto, model: bool, costs=None):
    """A PromptStreamer with only what _follow_pool reads (no device) and `auto` as its
    SurePercent, and its pool; it follows no window before one is served, nor a decode one."""
    from types import SimpleNamespace

    from strata.backends.cuda.cpu_pool import PoolWindowStats
    from strata.backends.cuda.stream import PromptStreamer

    streamer = PromptStreamer.__new__(PromptStreamer)
    streamer.min_rows, streamer.sure_percent = 256, 0
    streamer.sure_auto, streamer.sure_model = auto, model
    streamer.leaves_rare = lambda num_rows: True
    if costs is not None:
        streamer.sure_costs = costs
    pool = SimpleNamespace(last_stats=None)
    streamer.arena = SimpleNamespace(pool=pool)
    streamer._follow_pool(512)  # no window served yet
    assert streamer.sure_percent == 0
    pool.last_stats = PoolWindowStats(7, 1, 8, 8, 0.5, 20.0)  # a decode window: not counted
    streamer._follow_pool(512)
    assert streamer.sure_percent == 0
    return streamer, pool


def test_pool_sure_auto_follows_the_pools_share_of_each_streamed_window():
    """STRATA_POOL_SURE=auto (stream.SurePercent): after each streamed window the pool served,
    the percent rises a step while the pool computed under the band's low end of the window,
    falls above its high end, stays within 0..most, and a window seen twice counts once; the
    streamer takes it before a streamed window only, from the pool's last prompt window."""
    from strata.backends.cuda.cpu_pool import PoolWindowStats
    from strata.backends.cuda.stream import (SURE_AUTO_BAND, SURE_AUTO_MAX, SURE_AUTO_STEP,
                                             SurePercent)

    auto = SurePercent(step=10, most=30, band=(0.3, 0.45))
    assert auto.record(1, 20.0, 80.0) == 10  # the pool computed 20% of the window: up
    assert auto.record(1, 20.0, 80.0) == 10  # the same window again: unchanged
    assert [auto.record(seq, 10.0, 90.0) for seq in (2, 3, 4)] == [20, 30, 30]  # at most 30
    assert auto.record(5, 40.0, 60.0) == 30  # 40%: within the band
    assert auto.record(6, 60.0, 40.0) == 20  # 60%: down
    assert [auto.record(seq, 90.0, 10.0) for seq in (7, 8, 9)] == [10, 0, 0]  # at least 0
    assert auto.record(10, 0.0, 0.0) == 0  # nothing timed: unchanged
    assert 0 < SURE_AUTO_BAND[0] < SURE_AUTO_BAND[1] < 1 and 0 < SURE_AUTO_STEP <= SURE_AUTO_MAX

    streamer, pool = _sure_follower(SurePercent(), False)
    pool.last_stats = PoolWindowStats(8, 512, 900, 300, 20.0, 90.0)  # a streamed one, 18%
    streamer._follow_pool(512)
    streamer._follow_pool(512)  # the same window: one step
    assert streamer.sure_percent == SURE_AUTO_STEP
    streamer.arena.pool = None  # no pool: nothing to follow
    streamer._follow_pool(512)
    assert streamer.sure_percent == SURE_AUTO_STEP


def test_pool_budget_auto_moves_the_rare_experts_budget_before_the_sure_percent():
    """STRATA_POOL_BUDGET=auto (SurePercent's shares): under the band the budget climbs a step
    a window, the sure percent only at the top step; over it the percent falls first, then the
    budget, to the lowest step; within it both stay. It starts at share.POOL_SHARE_OF_COPY (or
    the nearest step below), and the streamer's budget is its step."""
    from strata.backends.cuda.cpu_pool import PoolWindowStats
    from strata.backends.cuda.share import POOL_SHARE_OF_COPY
    from strata.backends.cuda.stream import BUDGET_AUTO_SHARES, SurePercent

    auto = SurePercent(step=10, most=20, band=(0.3, 0.45),
                       shares=(POOL_SHARE_OF_COPY / 2, POOL_SHARE_OF_COPY, 2 * POOL_SHARE_OF_COPY))
    assert auto.share_of_copy == POOL_SHARE_OF_COPY
    walk = [(auto.record(seq, pool, 100.0 - pool), auto.share_of_copy) for seq, pool in
            enumerate((20, 20, 20, 20, 40, 60, 60, 60, 60, 60, 40, 20), start=1)]
    assert walk == [(0, 2 * POOL_SHARE_OF_COPY), (10, 2 * POOL_SHARE_OF_COPY),
                    (20, 2 * POOL_SHARE_OF_COPY), (20, 2 * POOL_SHARE_OF_COPY),  # at most 20
                    (20, 2 * POOL_SHARE_OF_COPY),  # 40%: within the band
                    (10, 2 * POOL_SHARE_OF_COPY), (0, 2 * POOL_SHARE_OF_COPY),  # the percent first
                    (0, POOL_SHARE_OF_COPY), (0, POOL_SHARE_OF_COPY / 2),  # then the budget
                    (0, POOL_SHARE_OF_COPY / 2),  # at the lowest step
                    (0, POOL_SHARE_OF_COPY / 2),  # 40%: within the band
                    (0, POOL_SHARE_OF_COPY)], walk  # under: the budget first again
    assert SurePercent(shares=(1e6,)).share_of_copy == 1e6  # one step: fixed, even above
    assert SurePercent(shares=(0.5, 2 * POOL_SHARE_OF_COPY)).share_of_copy == 0.5
    assert list(BUDGET_AUTO_SHARES) == sorted(BUDGET_AUTO_SHARES)
    assert POOL_SHARE_OF_COPY in BUDGET_AUTO_SHARES

    streamer, pool = _sure_follower(SurePercent(shares=BUDGET_AUTO_SHARES), False)
    assert streamer.pool_share_of_copy == POOL_SHARE_OF_COPY
    pool.last_stats = PoolWindowStats(8, 512, 900, 300, 20.0, 90.0)  # a streamed one, 18%
    streamer._follow_pool(512)
    streamer._follow_pool(512)  # the same window: one step
    step = BUDGET_AUTO_SHARES.index(POOL_SHARE_OF_COPY) + 1
    assert streamer.pool_share_of_copy == BUDGET_AUTO_SHARES[step]
    assert streamer.sure_percent == 0


def test_pool_follower_and_budget_setting_read_the_settings_and_name_what_was_wrong():
    """pool_follower: STRATA_POOL_SURE=auto with STRATA_POOL_BUDGET=auto moves both (the budget
    along BUDGET_AUTO_SHARES from share.POOL_SHARE_OF_COPY), with a number fixes the budget
    there; model moves only the percent; a fixed percent nothing (the budget then fixed at the
    setting or the default). pool_budget_setting names the variable and a bad value."""
    from strata.backends.cuda.share import POOL_SHARE_OF_COPY
    from strata.backends.cuda.stream import (BUDGET_AUTO_SHARES, pool_budget_setting,
                                             pool_follower)
    from strata.errors import ConfigError

    follower, fixed = pool_follower("auto", "auto")
    assert follower.shares == BUDGET_AUTO_SHARES and follower.share_of_copy == POOL_SHARE_OF_COPY
    assert fixed == POOL_SHARE_OF_COPY
    follower, fixed = pool_follower("auto", 9.0)
    assert follower.shares == (9.0,) and follower.share_of_copy == fixed == 9.0
    follower, fixed = pool_follower("model", "auto")
    assert follower.shares == (POOL_SHARE_OF_COPY,) and follower.grid[-1] > 50
    assert pool_follower(30, 2.5) == (None, 2.5)
    assert pool_follower(0, "auto") == (None, POOL_SHARE_OF_COPY)

    assert pool_budget_setting({}) == "auto"  # the default
    assert pool_budget_setting({"STRATA_POOL_BUDGET": " Auto "}) == "auto"
    assert pool_budget_setting({"STRATA_POOL_BUDGET": " 6.75 "}) == 6.75
    for bad in ("0", "-1", "x", "nan", "inf", "4,5"):
        with pytest.raises(ConfigError, match="STRATA_POOL_BUDGET") as info:
            pool_budget_setting({"STRATA_POOL_BUDGET": bad})
        assert repr(bad.lower()) in str(info.value)


def test_pool_sure_model_goes_to_the_percent_whose_modelled_pool_time_fits_the_band():
    """STRATA_POOL_SURE=model (stream.SurePercent.modelled): after each streamed window the
    pool served,
    the percent stays while the pool computed within the band of the window; outside it, it
    goes to the highest percent whose modelled pool time (the last window's time per row unit,
    times its units less the sure experts it had plus those at the new percent) is the band's
    middle of the window, at most `rise` above the last and within 0..most; a window seen twice
    counts once. The streamer takes it before a streamed window only, from the pool's last
    prompt window."""
    from strata.backends.cuda.cpu_pool import PoolWindowStats
    from strata.backends.cuda.stream import (SURE_AUTO_STEP, SURE_MODEL_BAND, SURE_MODEL_MAX,
                                             SURE_MODEL_RISE, SurePercent)

    asked = []

    def costs(grid):  # 10 row units a percent
        asked.append(list(grid))
        return np.asarray(grid, dtype=np.float64) * 10.0

    auto = SurePercent(step=10, most=70, band=(0.35, 0.45), rise=40)
    # 20% of a 100 ms window, 200 units at 0%: 0.1 ms a unit, 40 ms fits 200 more units: 20%
    assert auto.record(1, 20.0, 80.0, 200.0, costs) == 20
    assert asked == [[0, 10, 20, 30, 40, 50, 60, 70]]
    assert auto.record(1, 5.0, 95.0, 50.0, costs) == 20  # the same window again: unchanged
    assert auto.record(2, 40.0, 60.0, 600.0, costs) == 20  # 40%: within the band
    assert len(asked) == 1  # (and the model is not asked)
    # 10 of 100 ms, 100 units at 20% (modelled 200: none besides the sure): 40 ms fits 40%
    assert auto.record(3, 10.0, 90.0, 100.0, costs) == 40
    # 1 of 100 ms: everything fits, but 40 above the last at most, and 70 at most
    assert auto.record(4, 1.0, 99.0, 400.0, costs) == 70
    # 60%, 600 units at 70% (700 modelled: none besides): 40 ms fits 40%; then 200 units
    # besides the sure ones at 40%: 20%
    assert auto.record(5, 60.0, 40.0, 600.0, costs) == 40
    assert auto.record(6, 60.0, 40.0, 600.0, costs) == 20
    # the pool over the band with the sure experts gone: 0
    assert auto.record(7, 90.0, 10.0, 900.0, costs) == 0
    # under the band, though the sure experts came short of the model (100 units at 40%
    # where 400 were modelled, so 40 ms fits only 20%): never down
    assert auto.record(20, 0.0, 100.0, 0.0, costs) == 40
    assert auto.record(21, 20.0, 80.0, 100.0, costs) == 40
    auto.percent = 0
    assert auto.record(8, 0.0, 0.0, 0.0, costs) == 0  # nothing timed: unchanged
    assert auto.record(9, 0.0, 100.0, 0.0, costs) == 40  # the pool computed nothing: a rise
    assert 0 < SURE_MODEL_BAND[0] < SURE_MODEL_BAND[1] < 1 and SURE_AUTO_STEP <= SURE_MODEL_MAX
    assert SURE_MODEL_MAX % SURE_AUTO_STEP == 0 and SURE_AUTO_STEP <= SURE_MODEL_RISE

    modelled = []
    streamer, pool = _sure_follower(
        SurePercent.modelled(), True, lambda num_rows, grid, expert_rows: (
            modelled.append((num_rows, expert_rows)) or np.zeros(len(grid))))
    assert not modelled
    pool.last_stats = PoolWindowStats(8, 480, 900, 300, 20.0, 90.0)  # a streamed one, 18%
    streamer._follow_pool(512)
    streamer._follow_pool(512)  # the same window: once
    assert streamer.sure_percent == min(SURE_MODEL_RISE, SURE_MODEL_MAX)
    assert len(modelled) == 1 and modelled[0][0] == 480  # modelled on the window's rows
    streamer.arena.pool = None  # no pool: nothing to follow
    streamer._follow_pool(512)
    assert streamer.sure_percent == min(SURE_MODEL_RISE, SURE_MODEL_MAX)


def test_pool_sure_setting_reads_a_percent_or_auto_and_names_what_was_wrong():
    from strata.backends.cuda.stream import pool_sure_setting
    from strata.errors import ConfigError

    assert pool_sure_setting({}) == "auto"  # the default
    assert pool_sure_setting({"STRATA_POOL_SURE": " "}) == "auto"
    assert pool_sure_setting({"STRATA_POOL_SURE": "0"}) == 0
    assert pool_sure_setting({"STRATA_POOL_SURE": "30"}) == 30
    assert pool_sure_setting({"STRATA_POOL_SURE": " Auto "}) == "auto"
    assert pool_sure_setting({"STRATA_POOL_SURE": "model"}) == "model"
    for bad in ("abc", "101", "-1", "0.5"):
        with pytest.raises(ConfigError, match="STRATA_POOL_SURE.*or auto"):
            pool_sure_setting({"STRATA_POOL_SURE": bad})
