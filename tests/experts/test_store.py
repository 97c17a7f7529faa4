"""ExpertStore: the GGUF and pack sources give identical views, sizes, types and segments."""
import numpy as np
import pytest

from strata.experts.pack import write_pack
from strata.experts.store import ExpertStore
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model


@pytest.fixture(scope="module", params=["q4_0", "f32"])
def stores(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    synth_model(d / "m.gguf", shape="tiny", weight_type=request.param)
    model = GGUFModel.open(d / "m.gguf")
    write_pack(model, d / "m.pack")
    return model, ExpertStore.from_gguf(model), ExpertStore.from_pack(d / "m.pack", model)


def test_sources_agree_expert_by_expert(stores):
    model, from_gguf, from_pack = stores
    assert (from_gguf.source, from_pack.source) == ("gguf", "pack")
    spec = model.spec
    for layer in range(spec.n_layers):
        assert from_gguf.types(layer) == from_pack.types(layer)
        for e in range(spec.n_experts):
            a, b = from_gguf.expert(layer, e), from_pack.expert(layer, e)
            for va, vb in zip(a, b):
                assert va.shape == vb.shape
                assert np.array_equal(va, vb)
            seg_a = np.concatenate(from_gguf.expert_segments(layer, e))
            seg_b = from_pack.expert_segments(layer, e)
            assert len(seg_b) == 1
            assert np.array_equal(seg_a, seg_b[0])
            assert seg_a.size == from_gguf.layer_expert_nbytes(layer)


def test_expert_nbytes_is_gate_up_down(stores):
    model, from_gguf, from_pack = stores
    spec = model.spec
    gate = model.tensor("blk.0.ffn_gate_exps.weight").raw
    down = model.tensor("blk.0.ffn_down_exps.weight").raw
    expected = 2 * gate[0].nbytes + down[0].nbytes
    assert from_gguf.expert_nbytes == from_pack.expert_nbytes == expected
    # F = 32, H = 64: gate and up are [32, row(64)], down is [64, row(32)]
    assert gate.shape[:2] == (spec.n_experts, spec.expert_ffn)


def test_out_of_range_expert_is_refused(stores):
    _, from_gguf, from_pack = stores
    for store in (from_gguf, from_pack):
        with pytest.raises(IndexError, match=r"expert \(2, 0\) is out of range.*2 layers x 8"):
            store.expert(2, 0)
        with pytest.raises(IndexError, match=r"expert \(0, 8\)"):
            store.expert_segments(0, 8)
