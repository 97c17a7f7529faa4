"""A token whose embedding holds a NaN (a corrupt model) gives NaN logits in its own slot, on
quantised and float weights, and leaves the other slots of its window as they were alone."""
import gguf
import numpy as np
import pytest

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model

BAD_TOKEN = 5


def _corrupt_model(path, weight_type, shape):
    """A synth model whose embedding row BAD_TOKEN starts with a NaN (its first block's fp16
    scale for a quantised type, its first value for a float one)."""
    synth_model(path, shape=shape, weight_type=weight_type, seed=1)
    reader = gguf.GGUFReader(path)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    row_bytes = int(embd.n_bytes) // int(embd.shape[1])
    offset = int(embd.data_offset) + BAD_TOKEN * row_bytes
    nan = (np.float32(np.nan) if embd.tensor_type == gguf.GGMLQuantizationType.F32
           else np.float16(np.nan))
    del reader
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(nan.tobytes())
    return CpuModel(GGUFModel.open(path))


@pytest.mark.parametrize("weight_type", ["q8_0", "q4_0", "f32"])
@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen3next"])
def test_a_nan_row_stays_in_its_slot(tmp_path, weight_type, shape):
    model = _corrupt_model(tmp_path / "m.gguf", weight_type, shape)
    good = np.array([17, 3, 9, 250], dtype=np.int32)
    bad = np.array([17, BAD_TOKEN, 9], dtype=np.int32)
    alone = model.forward(good, model.new_kv(32), all_logits=True)
    window = Window.build([(model.new_kv(32), bad), (model.new_kv(32), good)], logits="all")
    logits = model.forward_window(window)
    assert np.isfinite(window.logits_of(logits, 0)[0]).all()      # before the bad token
    assert np.isnan(window.logits_of(logits, 0)[1:]).all()
    assert np.array_equal(window.logits_of(logits, 1), alone)
