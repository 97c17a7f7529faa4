"""The CPU side of the layer split: a GGUF seen through a layer range, a stage's expert store,
the split KV over per-stage parts (park/restore through it), slot groups cut from a window, the
split options in EngineConfig and on the command line, the per-card cache budget in the plan."""
import re

import numpy as np
import pytest
from click.testing import CliRunner

from strata.backends.cuda.split_kv import (SplitKV, group_bounds, group_windows, stage_window,
                                           sub_window)
from strata.backends.cuda.stage import LayerRange, stage_store
from strata.backends.split import Card, LayerCosts, plan_split
from strata.backends.window import Window
from strata.config import EngineConfig
from strata.engine.kv import KVCache
from strata.errors import ConfigError
from strata.experts.store import ExpertStore
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("split-cpu") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", seed=3, n_layers=4)
    with GGUFModel.open(path) as model:
        yield model


def test_layer_range_renames_its_layers_and_keeps_the_ends_where_they_belong(gguf):
    first = LayerRange(gguf, 0, 1)
    middle = LayerRange(gguf, 1, 3)
    last = LayerRange(gguf, 3, 4)
    assert [v.spec.n_layers for v in (first, middle, last)] == [1, 2, 1]
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False,
                                                                            False, True)
    assert "token_embd.weight" in first and "token_embd.weight" not in middle
    assert "output_norm.weight" in last and "output_norm.weight" not in first
    assert not any(n.startswith("output") for n in middle.tensor_names)
    assert {n.split(".")[1] for n in middle.tensor_names} == {"0", "1"}
    # blk.1 of the middle stage is the model's blk.2: the same bytes
    a = middle.tensor("blk.1.attn_q.weight").raw
    b = gguf.tensor("blk.2.attn_q.weight").raw
    assert a.ctypes.data == b.ctypes.data and a.shape == b.shape
    n_blk = sum(n.startswith("blk.") for n in gguf.tensor_names)
    assert sum(n.startswith("blk.") for v in (first, middle, last)
               for n in v.tensor_names) == n_blk
    with pytest.raises(ConfigError, match="not inside the model's 4 layers"):
        LayerRange(gguf, 2, 5)


def test_stage_store_serves_the_ranges_experts(gguf):
    store = ExpertStore.from_gguf(gguf)
    part = stage_store(store, LayerRange(gguf, 2, 4))
    assert part.n_layers == 2 and part.n_experts == store.n_experts
    for layer in range(2):
        for e in (0, store.n_experts - 1):
            for x, y in zip(part.expert(layer, e), store.expert(layer + 2, e)):
                assert x.ctypes.data == y.ctypes.data
    assert np.array_equal(part.expert_pointers(), store.expert_pointers()[2:4])


def _split_kv(spec, firsts, capacity=16):
    parts = [KVCache(spec.with_(n_layers=b - a), capacity, np.float16)
             for a, b in zip(firsts, firsts[1:] + [spec.n_layers])]
    return SplitKV(spec, parts, firsts)


def _fill(kv, spec, num_tokens: int, seed: int):
    """Random fp16 cells for every layer of `kv`, committed; (keys, values) per layer."""
    rng = np.random.default_rng(seed)
    shape = (spec.n_kv_heads, num_tokens, spec.head_dim)
    ks = [rng.standard_normal(shape).astype(np.float16) for _ in range(spec.n_layers)]
    vs = [rng.standard_normal(shape).astype(np.float16) for _ in range(spec.n_layers)]
    for layer in range(spec.n_layers):
        kv.append(layer, ks[layer], vs[layer])
    kv.commit(num_tokens)
    return ks, vs


def test_split_kv_sends_each_layer_to_its_stage_and_moves_tokens_together(gguf):
    spec = gguf.spec
    kv = _split_kv(spec, [0, 1, 3])
    assert [kv.part_of(layer)[1] for layer in range(4)] == [0, 0, 1, 0]
    assert [kv.parts.index(kv.part_of(layer)[0]) for layer in range(4)] == [0, 1, 1, 2]
    ks, vs = _fill(kv, spec, 3, seed=0)
    assert kv.num_tokens == 3 and [p.num_tokens for p in kv.parts] == [3, 3, 3]
    for layer in range(4):  # park: host copies per layer, as the scheduler takes them
        assert np.array_equal(kv.keys(layer), ks[layer])
        assert np.array_equal(kv.values(layer), vs[layer])
    kv.truncate(1)
    assert [p.num_tokens for p in kv.parts] == [1, 1, 1]
    assert kv.room_tokens == 15
    with pytest.raises(ValueError, match="cannot truncate"):
        kv.truncate(2)
    kv.clear()
    assert kv.num_tokens == 0
    with pytest.raises(IndexError, match="outside the 4 with cells"):
        kv.part_of(4)


def test_split_kv_copies_a_prefix_part_by_part_and_exports_it(gguf):
    spec = gguf.spec
    src, dst = _split_kv(spec, [0, 1, 3]), _split_kv(spec, [0, 1, 3])
    ks, vs = _fill(src, spec, 5, seed=1)
    dst.append(0, ks[0][:, :1], vs[0][:, :1])  # a cell the copy replaces
    dst.commit(1)
    dst.copy_prefix(src, 3)
    assert [p.num_tokens for p in dst.parts] == [3, 3, 3]
    for layer in range(4):
        assert np.array_equal(dst.keys(layer), ks[layer][:, :3])
        assert np.array_equal(dst.values(layer), vs[layer][:, :3])
    k, v = src.export_prefix(4)  # [L, KV, n, D] each, as parking takes them
    assert k.shape == (4, spec.n_kv_heads, 4, spec.head_dim)
    assert np.array_equal(k, np.stack(ks)[:, :, :4]) and np.array_equal(v, np.stack(vs)[:, :, :4])
    other = _split_kv(spec, [0, 2])  # split otherwise: layer by layer through host copies
    other.copy_prefix(src, 2)
    assert np.array_equal(other.keys(3), ks[3][:, :2])


@pytest.mark.parametrize("firsts, cells, states", [([0, 1], [0, 2], [1, 1]),
                                                   ([0, 3], [1, 1], [2, 0])])
def test_a_hybrid_split_kv_keeps_its_parts_states_together(firsts, cells, states):
    """qwen3next (layers 0 and 2 recurrent) over stages from `firsts`: cells for the attention
    layers only, each part its layers' recurrent state (a part of attention layers only has
    none); checkpoints are kept, taken back and parked together."""
    from strata.tool.presets import PRESETS

    spec = PRESETS["tiny-qwen3next"][0]
    parts = [KVCache(spec.with_(n_layers=b - a, first_layer=a), 16, np.float16)
             for a, b in zip(firsts, firsts[1:] + [spec.n_layers])]
    kv = SplitKV(spec, parts, firsts)
    assert [p.num_layers for p in parts] == cells and kv.num_layers == 2
    assert [kv.parts.index(kv.part_of(layer)[0]) for layer in range(2)] == \
        [i for i, n in enumerate(cells) for _ in range(n)]
    assert [len(p.spec.recurrent_layers) for p in parts] == states
    parts = [p for p in parts if p.state is not None]
    for p in parts:
        p.state.load((np.full(p.state.conv_shape(p.spec), 1.0, np.float32),
                      np.full(p.state.ssm_shape(p.spec), 1.0, np.float32)))
    kv.commit(5)
    assert kv.keep_checkpoint() and kv.reuse_points() == (5,)
    # what the scheduler reads of a slot's state (parking sizes, the checkpoint before a
    # prompt's last token, the log)
    assert kv.state.positions() == (5,) and len(kv.state.checkpoints) == 1
    assert kv.state.max_checkpoints == 8
    assert kv.state.nbytes_per_state(spec) == sum(p.state.nbytes_per_state(p.spec)
                                                  for p in parts)
    parked = kv.export_state()
    kv.state.flip()  # a window's commit: every part's state moves on together
    assert all(p.state.current == 1 for p in parts)
    kv.commit(3)
    assert kv.reusable(7) == 5 and kv.reusable(4) == 0
    kv.truncate(5)  # back to the checkpoint in every part
    assert [p.num_tokens for p in kv.parts] == [5, 5]
    assert all(np.all(p.state.snapshot()[1] == 1.0) for p in parts)
    with pytest.raises(ValueError, match="checkpoints"):
        kv.truncate(2)
    kv.truncate(0)
    assert all(np.all(p.state.snapshot()[1] == 0.0) for p in parts)
    kv.commit(5)
    kv.import_state(parked, 5)
    assert all(np.all(p.state.snapshot()[1] == 1.0) for p in parts)
    with pytest.raises(ValueError, match="as many stages"):
        kv.import_state(parked[:1], 5)


def test_group_bounds_cut_runs_into_contiguous_groups_of_about_equal_rows():
    assert group_bounds(np.array([1, 1, 1, 1]), 2) == [0, 2, 4]
    assert group_bounds(np.array([1, 1, 1]), 2) == [0, 2, 3]
    assert group_bounds(np.array([16, 1, 1]), 2) == [0, 1, 3]
    assert group_bounds(np.array([1, 1, 16]), 2) == [0, 2, 3]
    assert group_bounds(np.array([1, 16]), 3) == [0, 1, 2]  # never more groups than runs
    assert group_bounds(np.array([5, 5, 5, 5]), 4) == [0, 1, 2, 3, 4]
    assert group_bounds(np.array([4, 4]), 1) == [0, 2]


def test_group_windows_keep_rows_positions_and_logit_rows(gguf):
    spec = gguf.spec
    kvs = [_split_kv(spec, [0, 2]) for _ in range(3)]
    kvs[1].parts[0].commit(4)
    kvs[1].parts[1].commit(4)
    window = Window.build([(kvs[0], [5, 6, 7]), (kvs[1], [8]), (kvs[2], [9, 10])],
                          logits=["all", "last", "none"])
    groups = group_windows(window, 2)
    assert [g.num_slots for g in groups] == [1, 2]
    assert np.array_equal(np.concatenate([g.tokens for g in groups]), window.tokens)
    assert np.array_equal(np.concatenate([g.positions for g in groups]), window.positions)
    assert [list(g.logit_rows) for g in groups] == [[0, 1, 2], [0]]
    assert sum(g.num_logit_rows for g in groups) == window.num_logit_rows
    assert list(groups[1].positions) == [4, 0, 1]
    assert list(groups[1].slots) == [0, 1, 1]
    whole = sub_window(window, 0, 3)
    assert np.array_equal(whole.logit_rows, window.logit_rows)
    staged = stage_window(groups[1], 1)
    assert staged.kvs == (kvs[1].parts[1], kvs[2].parts[1])
    staged.check_current()
    assert group_windows(window, 1) == [window]


def test_split_options_in_the_engine_config(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    config = EngineConfig(path, split_devices="0,1", layer_split="auto", batch_groups="2")
    assert config.is_split and config.batch_groups == 2
    assert not EngineConfig(path).is_split and EngineConfig(path).batch_groups == "auto"
    with pytest.raises(ConfigError, match="--batch-groups 'x'"):
        EngineConfig(path, batch_groups="x")
    with pytest.raises(ConfigError, match="use --device cuda"):
        EngineConfig(path, layer_split="2,2", device="cpu")


@pytest.mark.parametrize("options, message", [
    ({"layer_split": "3,x"}, "--layer-split '3,x': give auto or a number of layers"),
    ({"layer_split": "0,4"}, "--layer-split '0,4'"),
    ({"split_devices": "0,a"}, "--split-device '0,a': give distinct GPU indices"),
    ({"split_devices": "1,1"}, "--split-device '1,1'"),
])
def test_malformed_split_lists_are_refused_before_a_backend_is_built(tmp_path, options, message):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(message)):
        EngineConfig(path, **options)
    EngineConfig(path, layer_split=" Auto ", split_devices="0, 1")  # the well-formed ones pass


@pytest.mark.parametrize("command", ["run", "bench"])
def test_split_options_on_the_command_line(command):
    from strata.cli import main

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0
    for option in ("--split-device", "--layer-split", "--batch-groups"):
        assert option in result.output


def test_the_cache_budget_per_card_bounds_the_planned_slots():
    GiB = 2**30
    costs = LayerCosts((GiB // 4,) * 4, (GiB // 64,) * 4, (0,) * 4, 16, 2, GiB // 8, GiB // 8)
    free = plan_split(costs, [Card(0, 4 * GiB), Card(1, 4 * GiB)], [2, 2], kv_tokens=0)
    capped = plan_split(costs, [Card(0, 4 * GiB, cache_budget_bytes=GiB // 8),
                                Card(1, 4 * GiB, cache_budget_bytes=GiB // 8)], [2, 2],
                        kv_tokens=0)
    assert [s.cache_slots for s in free.stages] == [32, 32]  # all of their 2 x 16 experts
    assert [s.cache_slots for s in capped.stages] == [8, 8]
    assert capped.predicted_ms > free.predicted_ms


def test_a_split_on_the_cpu_is_refused_on_the_command_line(gguf):
    from strata.cli import main

    result = CliRunner().invoke(main, ["run", "--model", str(gguf.path), "--device", "cpu",
                                       "--layer-split", "2,2", "hi"])
    assert result.exit_code == 2
    assert "use --device cuda" in result.output
