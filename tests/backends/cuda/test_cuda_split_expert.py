"""The expert a decode layer splits between the CPU pool and the GPU (offload.cu's count_groups):
where the pool's budget ends inside an expert, the pool computes that expert's gate/up rows and
down columns below the cut, the GPU's mv_* products the rest, and the combine adds both parts.
Logits as the resident model's within the pool's tolerance (docs/cuda.md), on a 32-column type
(Q8_0) and a 256-column one (Q4_K, whose pool rounds activations per 256: looser bounds), with
several outputs per warp in the down (the per-row staging of matvec.cu)."""
from __future__ import annotations

import numpy as np
import pytest

from strata import EngineConfig
from strata.backends.window import Window
from strata.experts.store import ExpertStore
from strata.model.gguf_file import GGUFModel

pytestmark = pytest.mark.cuda

# top-2, one row: each layer has two misses of cost DECODE_EXPERT_ROWS + 1 = 17; at --pcie-frac
# 0.3 the pool's budget is 0.7 * 34 = 23.8: one expert whole, 6.8 / 17 = 0.4 of the other
SHARE = 0.3


def write_model(path, weight_type: str, hidden: int, expert_ffn: int) -> None:
    from strata.tool.synth import synth_model

    synth_model(path, shape="tiny", weight_type=weight_type, seed=21, routing_skew=1.0,
                n_layers=4, hidden=hidden, expert_ffn=expert_ffn)


# Per token, max |pool - resident| / max |resident|: (the bound, the share of tokens that must
# be within it, the share of equal top-1 tokens). Q4_K's pool rounds activations per 256
# columns (fused_k.c, llama.cpp's Q8_K), the GPU per 32, and these models amplify that rounding
# (the CPU's own change from 32 to 256 moved this model's 16 decode tokens by 0.02-0.03 of the
# logit scale, one by 0.29; on an H100 host the pool moved one of them by 0.18 and the rows' 90th
# percentile reached 0.118): Q4_K is held as the transformers parity holds a quantised model,
# most rows. (The grid i-quants, which the pool also rounds per 256, are not among these models:
# their parity with the CPU is test_cuda_parity.py's, rows within K_TOLERANCE at IQ_SHARE.)
TOLERANCES = {"q8_0": (3e-2, 1.0, 0.9), "q4_k": (6e-2, 0.75, 0.8)}


@pytest.fixture(scope="module", params=[("q8_0", 64, 128, 32), ("q4_k", 256, 512, 256)],
                ids=["q8_0", "q4_k"])
def model_path(request, tmp_path_factory):
    weight_type, hidden, expert_ffn, step = request.param
    path = tmp_path_factory.mktemp("split") / f"tiny-split-{weight_type}.gguf"
    write_model(path, weight_type, hidden, expert_ffn)
    return path, step, TOLERANCES[weight_type]


def within(errors, bound: float, share: float) -> bool:
    """at least `share` of the errors below `bound`"""
    return float(np.mean(np.asarray(errors) < bound)) >= share


def decode(gguf, path, tokens, frac=SHARE):
    """Logits of each token decoded alone (cache 0%, the pool at `frac`), the pool's routed
    entries per window and the split the last layer published."""
    from strata.backends.cuda import CudaModel

    spec = gguf.spec
    model = CudaModel(gguf, experts_resident=False)
    config = EngineConfig(path, n_ctx=64, parallel=1, expert_cache=0, device="cuda",
                          pcie_frac=frac)
    arena = model.new_expert_arena(ExpertStore.from_gguf(gguf), config)
    try:
        kv, got, entries, splits = model.new_kv(64), [], [], []
        for t in tokens:
            arena.before_window(1)
            counts = np.zeros((spec.n_layers, spec.n_experts), dtype=np.int64)
            window = Window.build([(kv, [t])], logits="all")
            got.append(np.array(model.forward_window(window, routing_counts=counts)))
            arena.account_routed(arena.table.peek(), counts)
            entries.append(arena.pool.last_stats.num_entries)
            splits.append(tuple(int(v) for v in arena.pool.exchange.split))
    finally:
        arena.close()
    return got, entries, splits


def resident_logits(gguf, tokens):
    from strata.backends.cuda import CudaModel

    resident = CudaModel(gguf)
    kv = resident.new_kv(64)
    return [np.array(resident.forward_window(Window.build([(kv, [t])], logits="all")))
            for t in tokens]


def test_the_pool_and_the_gpu_split_the_boundary_expert(model_path, monkeypatch):
    path, step, (tolerance, share, top1) = model_path
    monkeypatch.setenv("STRATA_READ_AHEAD", "0")  # no staged expert: two misses every layer
    gguf = GGUFModel.open(path)
    spec = gguf.spec
    tokens = [int(t) for t in np.random.default_rng(5).integers(10, 4000, 16)]
    want = resident_logits(gguf, tokens)
    got, entries, splits = decode(gguf, path, tokens)
    units = spec.expert_ffn // step
    cut = int(np.floor(0.4 * units + 0.5)) * step
    assert 0 < cut < spec.expert_ffn
    # every layer: one expert whole and the split one (its routed entry counted by the pool)
    assert entries == [2 * spec.n_layers] * len(tokens)
    assert all(0 <= e < spec.n_experts and c == cut for e, c in splits), splits
    errors = [np.abs(a - b).max() / np.abs(a).max() for a, b in zip(want, got)]
    assert within(errors, tolerance, share), np.round(errors, 3)
    assert np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(want, got)]) >= top1

    # no share given or calibrated: one-row windows keep the whole experts the default gave
    # (share.whole_expert_share: the pool one of the two)
    monkeypatch.setenv("STRATA_CACHE_DIR", str(path.parent / "cache"))
    default, entries, splits = decode(gguf, path, tokens, frac=None)
    assert entries == [spec.n_layers] * len(tokens) and set(splits) == {(-1, 0)}

    # whole experts only (STRATA_SPLIT_EXPERT=0): the pool takes one of the two
    monkeypatch.setenv("STRATA_SPLIT_EXPERT", "0")
    whole, entries, splits = decode(gguf, path, tokens)
    assert entries == [spec.n_layers] * len(tokens)
    assert set(splits) == {(-1, 0)}
    assert all(np.array_equal(a, b) for a, b in zip(whole, default))  # the same split
    # the split moves results only by rounding: the parts are summed in another order (and
    # Q4_K's pool part takes activations rounded per 256 columns)
    errors = [np.abs(a - b).max() / np.abs(a).max() for a, b in zip(whole, got)]
    assert within(errors, tolerance, share), np.round(errors, 3)


def test_several_rows_and_the_read_ahead_keep_the_results(model_path):
    # 3 slots a window (the split expert's pairs of several rows) and the read-ahead on; the
    # greedy tokens of the windows equal the resident model's where its top-1 is clear
    from strata.backends.cuda import CudaModel

    path, _, (tolerance, share, top1) = model_path
    gguf = GGUFModel.open(path)
    spec = gguf.spec
    rng = np.random.default_rng(9)
    plans = [[rng.integers(10, 4000, 1) for _ in range(3)] for _ in range(12)]

    def run(model, arena=None):
        kvs = [model.new_kv(64) for _ in range(3)]
        out = []
        for plan in plans:
            if arena is not None:
                arena.before_window(3)
            counts = np.zeros((spec.n_layers, spec.n_experts), dtype=np.int64)
            window = Window.build(list(zip(kvs, plan)), logits="all")
            out.append(np.array(model.forward_window(window, routing_counts=counts)))
            if arena is not None:
                arena.account_routed(arena.table.peek(), counts)
        return out

    want = run(CudaModel(gguf))
    model = CudaModel(gguf, experts_resident=False)
    config = EngineConfig(path, n_ctx=64, parallel=3, expert_cache=0, device="cuda",
                          pcie_frac=SHARE)
    arena = model.new_expert_arena(ExpertStore.from_gguf(gguf), config)
    try:
        got = run(model, arena)
        assert arena.pool.total_entries > 0
    finally:
        arena.close()
    errors = np.concatenate([np.abs(a - b).max(axis=1) / np.abs(a).max(axis=1)
                             for a, b in zip(want, got)])
    assert within(errors, tolerance, min(share, 0.9)), np.round(errors, 3)
    assert np.mean([np.mean(a.argmax(1) == b.argmax(1)) for a, b in zip(want, got)]) >= top1
