"""Parks and restores on the GPU copy beside the other slots' windows (kv_copies.py): a slot
decodes a long answer while another serves turns of two conversations that park and restore
each other; every answer equals the one with the copies made at once, the copies ran on their
own stream, and the parked arrays hold the cells (a conversation file written from them comes
back right)."""
import logging

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.backends.cuda.kv import CudaKV

pytestmark = pytest.mark.cuda

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _turns(path, folder=None):
    rng = np.random.default_rng(3)
    a, b = (rng.integers(10, 2000, 700).tolist() for _ in range(2))
    with Engine(EngineConfig(path, n_ctx=2048, device="cuda", parallel=2,
                             conversation_cache_dir=folder)) as engine:
        long = engine.submit([5, 6, 7], SamplingParams(max_tokens=1500, **GREEDY))
        out = []
        for prompt in (a, b, None, None):
            if prompt is None:  # the next turn of the conversation parked two turns ago
                first = out[-2]
                prompt = first[0] + first[1] + [11, 12, 13]
            handle = engine.submit(prompt, SamplingParams(max_tokens=6, **GREEDY))
            tokens = []
            while not handle.is_finished:
                assert engine.step()
                tokens += [e.token_id for e in handle.pop_events()]
            assert handle.error is None, handle.error
            out.append((prompt, tokens + [e.token_id for e in handle.pop_events()],
                        handle.stats.num_cached_tokens))
        assert not long.is_finished
        long.cancel()
        engine.scheduler.drop_cancelled()
        stream = getattr(engine.model.runtime, "kv_copy_stream", None)
    return out, stream


def test_copies_beside_the_windows_give_the_answers_of_copies_at_once(
        synth_path, monkeypatch, caplog):
    path = synth_path("tiny", "q8_0")
    caplog.set_level(logging.INFO, logger="strata.engine")
    background, stream = _turns(path)
    assert stream is not None
    assert caplog.text.count("copying beside the other slots' windows") >= 3
    assert all(cached > 0 for _, _, cached in background[2:])  # restored, not read again
    monkeypatch.setattr(CudaKV, "export_prefix_async", lambda self, n: None)
    monkeypatch.setattr(CudaKV, "restore_cells_async", lambda self, k, v, n: None)
    at_once, _ = _turns(path)
    assert [t for _, t, _ in background] == [t for _, t, _ in at_once]


def test_a_file_written_from_a_background_park_comes_back(synth_path, tmp_path):
    path = synth_path("tiny", "q8_0")
    first, _ = _turns(path, tmp_path)  # the stop writes the parked conversations
    again, _ = _turns(path, tmp_path)
    assert [t for _, t, _ in again] == [t for _, t, _ in first]
    assert again[0][2] > 0  # the first turn came back from its file
