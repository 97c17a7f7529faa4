"""The PCIe share that decodes fastest, timed: `strata-tool calibrate`'s sweep.

The two rates `calibrate` measures apart (the pool's kernel alone, a long streaming read over
PCIe alone) suggest a share, but a decode window reads a few experts per layer on each side at
once, and both sides draw on the same RAM: on the H200 machine the rates suggested 0.46 while
0.3 decoded 17% faster (docs/offload.md, "CPU pool"). So calibrate times the real thing: the
model on the GPU with no expert cache (every routed expert a miss), decode windows of 1 and of
4 slots, the misses split at each share in turn, and keeps the share with the best speed.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from strata.errors import ModelFormatError

# finer where the best lies (a share between two whole splits splits one expert by columns)
SHARES = (0.0, 0.1, 0.2, 0.25, 0.3, 0.35, 0.375, 0.4, 0.45, 0.5, 0.6, 0.8, 1.0)


def sweep_shares(model_path, threads: int, device_index: int = 0, shares=SHARES,
                 slot_counts=(1, 4), steps: int = 8, passes: int = 3, seed: int = 0,
                 progress: bool = True) -> dict:
    """Decode tokens/s at each PCIe share for each slot count: `passes` rounds over the shares
    (interleaved, so drift of the machine spreads over all of them), each `steps` timed windows
    after one untimed; the median window time per share. Returns {"shares", "tokens_per_s":
    {slots: [per share]}, "best": the share with the highest mean speed relative to each slot
    count's best, "pool_ms" / "wait_ms" / "lag_ms": {slots: [per share]}: the pool's median
    compute, wait for the GPU and start after the window's post, per window}. A window's time
    is about the pool's compute plus its wait: at share 0 the wait is the GPU's serial part
    (dense work and the per-layer hand-offs), and where the wait grows with the share, the
    GPU's reads are what the pool waits for."""
    from tqdm import tqdm

    from strata.backends.cuda import CudaModel
    from strata.backends.cuda.offload import HostExperts, VramExpertArena, slot_layout
    from strata.backends.window import Window
    from strata.experts.store import ExpertStore
    from strata.model.gguf_file import GGUFModel

    gguf = GGUFModel.open(model_path)
    model = CudaModel(gguf, device=device_index, experts_resident=False)
    store = ExpertStore.from_gguf(gguf)
    offsets, slot_bytes = slot_layout(store)
    host = HostExperts(model.runtime, store, offsets, slot_bytes, progress=progress)
    arena = VramExpertArena(model, store, 0, host)  # no cache: every routed expert a miss
    model.expert_arena = arena
    rng = np.random.default_rng(seed)
    spec = model.spec
    counts = np.zeros((store.n_layers, store.n_experts), dtype=np.int64)
    speeds, pool_ms, wait_ms, lag_ms = {}, {}, {}, {}
    try:
        arena.attach_pool(0.5, max_rows=max(slot_counts), threads=threads)
        windows = len(slot_counts) * passes * len(shares) * (steps + 1)
        bar = tqdm(total=windows, desc="timing PCIe shares", unit="window", disable=not progress)
        for num_slots in slot_counts:
            kvs = [model.new_kv(passes * len(shares) * (steps + 1) + 2) for _ in range(num_slots)]
            tok = rng.integers(0, spec.vocab, num_slots).astype(np.int32)
            seconds = {share: [] for share in shares}
            pool = {share: [] for share in shares}    # (compute, wait, lag) ms per window
            for _ in range(passes):
                for share in shares:
                    arena.pcie_frac = share
                    for step in range(steps + 1):
                        counts[:] = 0
                        arena.before_window(num_slots)
                        t0 = time.perf_counter()
                        tok = model.forward_window_greedy(
                            Window.build([(kv, tok[i:i + 1]) for i, kv in enumerate(kvs)]),
                            routing_counts=counts)
                        if (tok < 0).any():  # argmax_rows: -1 for a row holding a NaN
                            raise ModelFormatError(
                                "the model produced NaN logits while the CPU pool's share was "
                                "measured; its weights are likely corrupt (check it with "
                                "`strata-tool inspect`)")
                        if step:  # the first window of a share sets its where table up
                            seconds[share].append(time.perf_counter() - t0)
                            stats = arena.pool.last_stats
                            pool[share].append((stats.pool_ms, stats.wait_ms, stats.start_lag_ms))
                        arena.account_routed(arena.table.peek(), counts)
                        bar.update()
            speeds[num_slots] = [num_slots / statistics.median(seconds[s]) for s in shares]
            for i, table in enumerate((pool_ms, wait_ms, lag_ms)):
                table[num_slots] = [statistics.median(v[i] for v in pool[s]) for s in shares]
            del kvs
        bar.close()
    finally:
        arena.close()
        model.expert_arena = None
    relative = np.mean([np.array(v) / max(v) for v in speeds.values()], axis=0)
    return {"shares": list(shares), "tokens_per_s": speeds, "pool_ms": pool_ms,
            "wait_ms": wait_ms, "lag_ms": lag_ms, "best": float(shares[int(np.argmax(relative))])}
