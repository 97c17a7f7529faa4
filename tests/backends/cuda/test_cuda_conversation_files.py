"""--conversation-cache-dir on the GPU backend: a conversation written at a stop comes back
into a new engine's device KV (fp16, int8 cells, a hybrid model's recurrent state) and the
answer equals a fresh run's; files of another KV format or backend are left alone."""
import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.generate import collect
from strata.engine.kv_file import SUFFIX

pytestmark = pytest.mark.cuda

PARAMS = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)


def engine(path, folder, device="cuda", kv_type="auto"):
    return Engine(EngineConfig(path, n_ctx=1024, device=device, kv_type=kv_type,
                               conversation_cache_dir=folder))


@pytest.mark.parametrize("shape, kv_type", [("tiny", "f16"), ("tiny", "int8"),
                                            ("tiny-qwen3next", "auto")])
def test_a_conversation_comes_back_after_a_restart(synth_path, tmp_path, shape, kv_type):
    path = synth_path(shape, "q8_0")
    rng = np.random.default_rng(5)
    a = rng.integers(10, 2000, 300).tolist()
    with engine(path, tmp_path, kv_type=kv_type) as e:
        first = collect(e.generate(a, PARAMS))
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    again = a + first.token_ids + rng.integers(10, 2000, 12).tolist()
    with engine(path, tmp_path, kv_type=kv_type) as e:
        res = collect(e.generate(again, PARAMS))
        assert res.stats.num_cached_tokens >= len(a)
        assert e.scheduler.conversations.disk.num_read == 1
        e.reset()
        assert collect(e.generate(again, PARAMS)).token_ids == res.token_ids


@pytest.mark.parametrize("shape, num_tokens", [("tiny", 9000), ("tiny-qwen3next", 4500)])
def test_a_long_conversation_comes_back_through_the_copy_thread(tmp_path, monkeypatch, shape,
                                                                num_tokens):
    """Cells of over 1 MiB come back from the file in mappings of their own, which the copy
    thread pins and copies while the engine goes on (a hybrid model's recurrent state is
    copied from the same file right after: session 55's pin of heap pages broke that copy)."""
    from strata.backends.cuda import kv_copies
    from strata.tool.synth import synth_model

    path = tmp_path / f"{shape}-16k.gguf"
    synth_model(path, shape=shape, weight_type="q8_0", seed=3, context_length=16384)
    folder = tmp_path / "conversations"
    rng = np.random.default_rng(8)
    a = rng.integers(10, 2000, num_tokens).tolist()

    def long_engine():
        return Engine(EngineConfig(path, n_ctx=16384, device="cuda",
                                   conversation_cache_dir=folder))

    with long_engine() as e:
        first = collect(e.generate(a, PARAMS))
    jobs = []
    real_submit = kv_copies.KVCopier.submit

    def spy(self, copies, keep, in_pieces, around=None):
        jobs.append((in_pieces, around is not None))
        return real_submit(self, copies, keep, in_pieces, around=around)

    monkeypatch.setattr(kv_copies.KVCopier, "submit", spy)
    again = a + first.token_ids + rng.integers(10, 2000, 12).tolist()
    with long_engine() as e:
        res = collect(e.generate(again, PARAMS))
        assert e.scheduler.conversations.disk.num_read == 1
        assert res.stats.num_cached_tokens >= len(a)
        assert (False, True) in jobs  # a restore, pinned around its copies
        e.reset()
        assert collect(e.generate(again, PARAMS)).token_ids == res.token_ids


def test_other_formats_are_left_alone(synth_path, tmp_path):
    path = synth_path("tiny", "q8_0")
    a = list(range(10, 200))
    with engine(path, tmp_path, kv_type="int8") as e:
        collect(e.generate(a, PARAMS))
    for device, kv_type in (("cuda", "f16"), ("cpu", "auto")):
        with engine(path, tmp_path, device=device, kv_type=kv_type) as e:
            assert e.scheduler.conversations.disk.num_entries == 0
            res = collect(e.generate(a + [5], PARAMS))
            assert res.stats.num_cached_tokens == 0
    # each engine left its own file; the int8 one is still there and still restores
    with engine(path, tmp_path, kv_type="int8") as e:
        assert e.scheduler.conversations.disk.num_entries == 1
        assert collect(e.generate(a + [5], PARAMS)).stats.num_cached_tokens == len(a)


@pytest.mark.parametrize("kv_type", ["f16", "int8"])
def test_a_slot_file_restores_into_another_engine(synth_path, tmp_path, kv_type):
    from strata.engine.slot_files import SlotFiles

    path = synth_path("tiny", "q8_0")
    rng = np.random.default_rng(6)
    a = rng.integers(10, 2000, 280).tolist()
    with Engine(EngineConfig(path, n_ctx=1024, device="cuda", kv_type=kv_type)) as e:
        first = collect(e.generate(a, PARAMS))
        saved = SlotFiles(tmp_path, e).save(0, "a.bin")
    again = a + first.token_ids + rng.integers(10, 2000, 9).tolist()
    with Engine(EngineConfig(path, n_ctx=1024, device="cuda", kv_type=kv_type)) as e:
        restored = SlotFiles(tmp_path, e).restore(0, "a.bin")
        assert restored["n_restored"] == saved["n_saved"] == len(a) + len(first.token_ids) - 1
        res = collect(e.generate(again, PARAMS))
        assert res.stats.num_cached_tokens == restored["n_restored"]
        e.reset()
        assert collect(e.generate(again, PARAMS)).token_ids == res.token_ids
