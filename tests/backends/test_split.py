"""The layer split over several GPUs: option parsing, exact stage plans on hand-made costs, the
auto choice, the batch-group decision, and the costs read from a synth model."""
import numpy as np
import pytest

from strata.backends.split import (Bandwidths, Card, LayerCosts, choose_batch_groups,
                                   layer_costs, parse_layer_split, parse_split_devices,
                                   plan_for_model, plan_split)
from strata.errors import ConfigError
from strata.model.gguf_file import GGUFModel
from strata.tool.inspect import inspect_model
from strata.tool.synth import synth_model

GiB = 2**30
RESERVE = 512 << 20


def _costs(L=8, dense=GiB // 4, expert=GiB // 64, E=16, K=2):
    return LayerCosts((dense,) * L, (expert,) * L, (0,) * L, E, K, GiB // 8, GiB // 8)


@pytest.mark.parametrize("value,error", [
    ("a,1", "'a' is not a GPU index"), ("0,5", "GPU 5 does not exist"),
    ("1,1", "GPU 1 is named twice")])
def test_split_device_errors(value, error):
    with pytest.raises(ConfigError, match=error):
        parse_split_devices(value, 2)


def test_split_device_default_is_every_gpu():
    assert parse_split_devices(None, 3) == [0, 1, 2]
    assert parse_split_devices("1,0", 2) == [1, 0]


@pytest.mark.parametrize("value,error", [
    ("24", "names 1 stages but 2 GPUs"), ("20,20", "adds up to 40 layers; the model has 48"),
    ("48,0", "at least one layer"), ("half", "give auto or layer counts")])
def test_layer_split_errors(value, error):
    with pytest.raises(ConfigError, match=error):
        parse_layer_split(value, 48, 2)


def test_layer_split_values():
    assert parse_layer_split("auto", 48, 2) is None
    assert parse_layer_split(None, 48, 2) is None
    assert parse_layer_split("20, 28", 48, 2) == [20, 28]


def test_given_split_exact_stages():
    costs = _costs()
    cards = [Card(0, 4 * GiB), Card(1, 3 * GiB)]
    plan = plan_split(costs, cards, [3, 5], kv_tokens=0)
    a, b = plan.stages
    assert (a.card, a.first_layer, a.stop_layer, b.first_layer, b.stop_layer) == (0, 0, 3, 3, 8)
    assert a.dense_bytes == 3 * GiB // 4 + GiB // 8
    assert b.dense_bytes == 5 * GiB // 4 + GiB // 8
    # slots: what is left after dense and the reserve, in experts of 1/64 GiB, capped at all
    assert a.cache_slots == min((4 * GiB - RESERVE - a.dense_bytes) // (GiB // 64), 3 * 16)
    assert b.cache_slots == (3 * GiB - RESERVE - b.dense_bytes) // (GiB // 64) == 72
    assert a.hit_rate == 1.0 and b.hit_rate == pytest.approx(b.cache_slots / (5 * 16))
    assert plan.how == "given" and plan.counts == [3, 5]
    assert "layers 0-2" in plan.describe() and "layers 3-7" in plan.describe()


def test_auto_balances_equal_cards_and_favours_the_larger_card():
    costs = _costs(L=8)
    even = plan_split(costs, [Card(0, 3 * GiB), Card(1, 3 * GiB)], kv_tokens=0)
    assert even.counts == [4, 4] and even.how == "auto"
    lopsided = plan_split(costs, [Card(0, 6 * GiB), Card(1, 2 * GiB)], kv_tokens=0)
    assert lopsided.counts[0] > lopsided.counts[1]
    # the predicted time of the chosen plan is the smallest slowest stage of all splits
    slowest = max(s.predicted_ms for s in lopsided.stages)
    for k in range(1, 8):
        try:
            other = plan_split(costs, [Card(0, 6 * GiB), Card(1, 2 * GiB)], [k, 8 - k],
                               kv_tokens=0)
        except ConfigError:
            continue
        assert max(s.predicted_ms for s in other.stages) >= slowest - 1e-12


def test_profile_raises_the_predicted_hit_rate():
    costs = _costs(L=4, E=16)
    cards = [Card(0, int(1.6 * GiB)), Card(1, int(1.6 * GiB))]
    flat = plan_split(costs, cards, [2, 2], kv_tokens=0)
    skewed = np.ones((4, 16))
    skewed[:, :4] = 100.0  # four experts per layer take most rows
    ranked = plan_split(costs, cards, [2, 2], kv_tokens=0, profile=skewed)
    for f, r in zip(flat.stages, ranked.stages):
        assert f.cache_slots == r.cache_slots and r.hit_rate > f.hit_rate
        assert r.predicted_ms < f.predicted_ms


def test_resident_experts_take_memory_and_a_token_reads_only_its_routed_ones():
    # no offload: a stage holds every expert of its layers (E of them per layer) and no cache;
    # a decode token reads the dense part and K experts per layer, each layer with its fixed time
    costs, bw = _costs(L=8, E=16, K=2), Bandwidths()
    plan = plan_split(costs, [Card(0, 8 * GiB), Card(1, 8 * GiB)], [4, 4], kv_tokens=0,
                      experts_resident=True)
    a, b = plan.stages
    assert a.resident_expert_bytes == b.resident_expert_bytes == 4 * 16 * (GiB // 64)
    assert (a.cache_slots, a.hit_rate) == (0, 1.0)
    read_b = 4 * (GiB // 4) + GiB // 8 + 4 * 2 * (GiB // 64)  # dense + head + K experts
    assert b.predicted_ms == pytest.approx(1e3 * (4 * bw.layer_s + read_b / bw.vram_bytes_s))
    assert "every expert in VRAM (1.00 GiB)" in plan.describe()
    # the experts count: dense 2 + embedding and head 0.25 + experts 2 GiB > 2 x 1.5 usable
    with pytest.raises(ConfigError, match=r"does not fit the dense weights, every expert and KV "
                       r"\(4\.25 GiB in all"):
        plan_split(costs, [Card(0, 2 * GiB), Card(1, 2 * GiB)], [4, 4], kv_tokens=0,
                   experts_resident=True)


def test_experts_go_to_ram_when_they_do_not_fit_the_cards():
    costs = _costs(L=8, E=16, K=2)  # dense 2.25 GiB with embedding and head, experts 2 GiB
    roomy = [Card(0, 8 * GiB), Card(1, 8 * GiB)]
    plan, offload, why = plan_for_model(costs, roomy, None, kv_tokens=0, offload=False)
    assert (offload, why) == (False, None) and plan.stages[0].resident_expert_bytes > 0
    tight = [Card(0, 2 * GiB), Card(1, 2 * GiB)]  # 3 GiB usable: the dense part only
    plan, offload, why = plan_for_model(costs, tight, [4, 4], kv_tokens=0, offload=False)
    assert offload and "does not fit the dense weights, every expert and KV" in why
    assert plan.stages[0].resident_expert_bytes == 0 and plan.stages[1].cache_slots > 0
    # an expert option given: offloaded whatever fits; a dense model has nothing to offload
    assert plan_for_model(costs, roomy, None, kv_tokens=0, offload=True)[1:] == (True, None)
    dense = LayerCosts((GiB,) * 4, (0,) * 4, (0,) * 4, 0, 0, 0, 0)
    with pytest.raises(ConfigError, match=r"fits the dense weights and KV \(4\.00 GiB"):
        plan_for_model(dense, tight, None, kv_tokens=0, offload=False)
    plan = plan_for_model(dense, roomy, None, kv_tokens=0, offload=False)[0]
    assert plan.counts == [2, 2] and "no routed experts" in plan.describe()


def test_each_layer_has_a_fixed_time():
    costs, cards = _costs(), [Card(0, 8 * GiB), Card(1, 8 * GiB)]
    plain = plan_split(costs, cards, [4, 4], kv_tokens=0, bandwidths=Bandwidths(layer_s=0.0))
    fixed = plan_split(costs, cards, [4, 4], kv_tokens=0, bandwidths=Bandwidths(layer_s=1e-4))
    for p, f in zip(plain.stages, fixed.stages):
        assert f.predicted_ms - p.predicted_ms == pytest.approx(0.4)


def test_no_fit_names_the_memory():
    with pytest.raises(ConfigError, match=r"does not fit .*GPU 0: 0\.50 GiB"):
        plan_split(_costs(), [Card(0, GiB), Card(1, 8 * GiB)], [4, 4], kv_tokens=0)
    with pytest.raises(ConfigError, match="no layer split fits"):
        plan_split(_costs(), [Card(0, GiB), Card(1, GiB)], kv_tokens=0)


def test_budget_caps_a_card():
    costs = _costs()
    plan = plan_split(costs, [Card(0, 80 * GiB, budget_bytes=3 * GiB), Card(1, 3 * GiB)],
                      kv_tokens=0)
    assert plan.counts == [4, 4]


def test_slower_miss_bandwidth_predicts_more_time():
    costs, cards = _costs(), [Card(0, 2 * GiB), Card(1, 2 * GiB)]
    fast = plan_split(costs, cards, [4, 4], kv_tokens=0, bandwidths=Bandwidths(miss_bytes_s=1e11))
    slow = plan_split(costs, cards, [4, 4], kv_tokens=0, bandwidths=Bandwidths(miss_bytes_s=1e10))
    assert slow.predicted_ms > fast.predicted_ms


@pytest.mark.parametrize("value,stages,slots,blocking,want", [
    ("auto", 2, 4, False, 2), ("auto", 2, 4, True, 1), ("auto", 1, 4, False, 1),
    ("auto", 2, 1, False, 1), ("3", 2, 4, True, 3), ("1", 2, 4, False, 1),
    ("auto", 2, 2, False, 2)])
def test_batch_groups(value, stages, slots, blocking, want):
    groups, line = choose_batch_groups(value, stages, slots, blocking_tier=blocking)
    assert groups == want
    if value == "auto" and blocking and stages > 1 and slots > 1:
        assert "would switch off the blocking tier" in line
    if value == "3":
        assert "turns off the blocking tier" in line
    if value == "auto" and want > 1:
        assert "pipelined over" in line


@pytest.mark.parametrize("value,want", [("auto", 1), ("2", 2)])
def test_a_cpu_pool_asked_for_keeps_one_group_unless_groups_are_given(value, want):
    groups, line = choose_batch_groups(value, 2, 4, cpu_pool=True)
    assert groups == want
    assert ("would switch off the CPU pool" if want == 1 else "turns off the CPU pool") in line


def test_batch_groups_errors():
    with pytest.raises(ConfigError, match="more than the 2 slots"):
        choose_batch_groups("3", 2, 2)
    with pytest.raises(ConfigError, match="give auto or a number"):
        choose_batch_groups("0", 2, 2)


def test_layer_costs_of_a_synth_model(tmp_path):
    path = tmp_path / "m.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0")
    report = inspect_model(path)
    with GGUFModel.open(path) as model:
        costs = layer_costs(model)
        spec = model.spec
    assert costs.n_layers == spec.n_layers
    total = sum(costs.dense_bytes) + costs.embed_bytes + costs.head_bytes
    if spec.tied_output:
        total -= costs.embed_bytes
    assert total == report.dense_bytes
    assert sum(costs.expert_bytes) * spec.n_experts == report.expert_bytes
    assert costs.kv_bytes_per_token[0] == 2 * spec.n_kv_heads * spec.head_dim * 2
