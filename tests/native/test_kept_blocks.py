"""The MoE block's buffers (G, U, Y, the activations and the pair index) are kept between calls
(matmul.c's st_block_take / st_block_give, one block a call): a call reuses them instead of
faulting fresh pages in, and calls on several threads at once, of different sizes, still each
get their own."""
import resource
import sys
import threading

import numpy as np
import pytest

from strata._native import kernels

from .test_moe import routed_layer

Q4_0 = 2


def _call(layer, out=None):
    gate, up, down, x, experts, weights = layer
    out = np.zeros_like(x) if out is None else out
    kernels.moe_ffn(x, gate, Q4_0, up, Q4_0, down, Q4_0, experts, weights, out)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor fault counts (Linux)")
def test_a_call_on_a_thread_reuses_the_last_calls_buffers():
    # 256 rows x 4 experts each: G, U [1024, 512] and Y [1024, 1024] float32, 8 MiB = 2048 pages
    layer = routed_layer(np.random.default_rng(3), (Q4_0,) * 3, E=8, H=1024, F=512, T_=256, K=4)
    out = np.zeros_like(layer[3])
    faults = []

    def work():
        _call(layer, out)                                  # the first call allocates them
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):
            _call(layer, out)
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert faults[0] < 1024, f"{faults[0]:.0f} minor faults a call: G, U and Y faulted in again"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor fault counts (Linux)")
def test_a_calls_activations_come_from_the_kept_block_too():
    # the same shape, counted closer: each call allocated its activations (x [256, 1024] and
    # the SiLU rows [1024, 512] in 8-bit form with their scales, ~2.5 MiB) and pair index: 36.5
    # minor faults a call on the dev machine (glibc's heap took most after the first), 4.5
    # with every buffer in the kept block
    layer = routed_layer(np.random.default_rng(5), (Q4_0,) * 3, E=8, H=1024, F=512, T_=256, K=4)
    out = np.zeros_like(layer[3])
    _call(layer, out)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        _call(layer, out)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
    assert faults < 16, f"{faults:.1f} minor faults a call: a buffer was allocated again"


def test_calls_on_several_threads_at_once_equal_the_same_calls_alone():
    rng = np.random.default_rng(4)
    layers = [routed_layer(rng, (Q4_0,) * 3, E=8, H=256, F=128 * (1 + i % 3), T_=32 + 48 * i, K=4)
              for i in range(4)]
    alone = [_call(layer) for layer in layers]
    results = [[] for _ in layers]

    def work(i):
        for _ in range(6):
            results[i].append(_call(layers[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(layers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, runs in enumerate(results):
        assert len(runs) == 6
        for out in runs:
            assert np.array_equal(out, alone[i])


_RESERVE_SCRIPT = """
import resource, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from helpers import random_weight
from strata._native import kernels
H, F, E, K, T, Q4_0 = 1024, 512, 8, 4, 256, 2
rng = np.random.default_rng(0)
mats = [[random_weight(rng, Q4_0, F, H), random_weight(rng, Q4_0, F, H),
         random_weight(rng, Q4_0, H, F)] for _ in range(E)]
ptrs = np.array([[m[p].ctypes.data for m in mats] for p in range(3)], dtype=np.uint64)
x = rng.standard_normal((T, H)).astype(np.float32)
experts = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
weights = rng.random((T, K)).astype(np.float32)
out = np.zeros((T, H), np.float32)
if sys.argv[1] == "reserve":
    types = np.full((1, 3), Q4_0, np.int32)
    kept = kernels.pool_reserve(T, H, F, K, np.ascontiguousarray(ptrs[None]), types,
                                kernels.pool_row_bytes(types, H, F))
    assert kept >= 8 << 20, kept  # G, U [1024, 512] and Y [1024, 1024] float32 at least
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
kernels.moe_ffn_ptrs(x, ptrs, Q4_0, Q4_0, Q4_0, F, experts, weights, out, allow_amx=True)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, float(out.sum()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor fault counts (Linux)")
def test_the_pools_reserve_faults_its_calls_buffers_in_beforehand():
    """kernels.pool_reserve (CpuPool.start): the kept blocks of a pool call of up to R rows are
    faulted in before its first window, so that call faults few pages in, and its result is
    the same. Each side in a fresh process (the kept blocks are the process's)."""
    import subprocess
    from pathlib import Path

    runs = {}
    for side in ("cold", "reserve"):
        done = subprocess.run([sys.executable, "-c", _RESERVE_SCRIPT, side,
                               str(Path(__file__).parent)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        faults, total = done.stdout.split()
        runs[side] = (int(faults), float(total))
    (cold, cold_sum), (reserved, reserved_sum) = runs["cold"], runs["reserve"]
    assert reserved_sum == cold_sum
    if cold < 1000:  # transparent huge pages for every allocation: few faults either way
        pytest.skip(f"the cold call faulted only {cold} pages in")
    assert reserved < cold / 4, runs
