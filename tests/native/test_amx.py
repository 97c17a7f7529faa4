"""amx.c's AMX-BF16 rows (the CPU pool's experts of many rows): with the tile operations
emulated in C (amx_check.c; any x86-64 machine with gcc and AVX-512 BF16) and, where the CPU has
AMX, the real ones through the pool's call (allow_amx) against a float64 reference."""
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from strata._native import kernels

from .helpers import cpu_flags, dequant64, silu64
from .test_moe import routed_layer

SRC_DIR = Path(__file__).resolve().parents[2] / "src" / "strata" / "_native"
C_FILES = ["amx.c", "moe.c", "matmul.c", "quant_ref.c", "tiles.c", "unpack_simd.c",
           "unpack_neon.c", "fused.c", "fused_k.c", "fused_iq.c"]


@pytest.mark.skipif(shutil.which("gcc") is None or not (SRC_DIR / "amx.c").exists(),
                    reason="needs the source tree and gcc")
@pytest.mark.skipif("avx512_bf16" not in cpu_flags(),
                    reason="the emulated tiles still run amx.c's AVX-512 BF16 packing")
def test_amx_rows_emulated(tmp_path):
    exe = tmp_path / "amx_check"
    subprocess.run(["gcc", "-std=c11", "-O2", "-ffp-contract=off", "-fopenmp",
                    "-DST_AMX_EMULATE", f"-I{SRC_DIR}",
                    str(Path(__file__).resolve().parent / "amx_check.c"),
                    *(str(SRC_DIR / f) for f in C_FILES), "-lm", "-o", str(exe)],
                   check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("PASSED"), run.stdout


@pytest.mark.skipif(kernels.amx_available(), reason="checks the fallback of a CPU without AMX")
def test_allow_amx_without_amx_is_the_default_path():
    # allow_amx on a CPU (or build) without the AMX rows: the lane tiles, bit for bit
    rng = np.random.default_rng(77)
    E, H, F, K, T_ = 4, 256, 192, 4, 40
    gate, up, down, x, experts, weights = routed_layer(rng, (2, 2, 2), E, H, F, T_, K)
    pointers = np.array([[m[e].ctypes.data for e in range(E)] for m in (gate, up, down)],
                        dtype=np.uint64)
    got, plain = np.zeros((T_, H), np.float32), np.zeros((T_, H), np.float32)
    kernels.moe_ffn_ptrs(x, pointers, 2, 2, 2, F, experts, weights, got, allow_amx=True)
    kernels.moe_ffn_ptrs(x, pointers, 2, 2, 2, F, experts, weights, plain)
    assert np.array_equal(got, plain)


@pytest.mark.skipif(not kernels.amx_available(), reason="needs a CPU with AMX-BF16")
def test_strata_amx_0_set_in_the_process_turns_the_amx_rows_off(monkeypatch):
    # read at every call (a test of the GPU pool sets it to compare greedy paths with the GPU)
    rng = np.random.default_rng(78)
    E, H, F, K, T_ = 4, 256, 192, 4, 40
    gate, up, down, x, experts, weights = routed_layer(rng, (2, 2, 2), E, H, F, T_, K)
    pointers = np.array([[m[e].ctypes.data for e in range(E)] for m in (gate, up, down)],
                        dtype=np.uint64)
    on, off, plain = (np.zeros((T_, H), np.float32) for _ in range(3))
    kernels.moe_ffn_ptrs(x, pointers, 2, 2, 2, F, experts, weights, on, allow_amx=True)
    monkeypatch.setenv("STRATA_AMX", "0")
    assert not kernels.amx_available()
    kernels.moe_ffn_ptrs(x, pointers, 2, 2, 2, F, experts, weights, off, allow_amx=True)
    kernels.moe_ffn_ptrs(x, pointers, 2, 2, 2, F, experts, weights, plain)
    monkeypatch.delenv("STRATA_AMX")
    assert kernels.amx_available()
    assert np.array_equal(off, plain) and not np.array_equal(on, plain)


def _exact(x, gate, up, down, qtype, experts, weights):
    """float64 result of the routed experts, weights and activations unrounded."""
    out = np.zeros(x.shape, np.float64)
    for t, k in np.ndindex(experts.shape):
        e = experts[t, k]
        g = dequant64(gate[e], qtype) @ x[t].astype(np.float64)
        u = dequant64(up[e], qtype) @ x[t].astype(np.float64)
        out[t] += weights[t, k] * (dequant64(down[e], qtype) @ (silu64(g) * u))
    return out


@pytest.mark.skipif(not kernels.amx_available(), reason="needs a CPU with AMX-BF16")
@pytest.mark.parametrize("qtype", [2, 8], ids=["Q4_0", "Q8_0"])
@pytest.mark.parametrize("num_tokens", [16, 29, 37, 90])  # C tiles 4 x 1, 2 x 2, then 2 x 1
@pytest.mark.parametrize("H,F", [(256, 192), (64, 32)], ids=["wide", "tiny"])
def test_pool_products_on_amx_match_the_reference(qtype, num_tokens, H, F):
    # every token routed to all 4 experts: each has num_tokens rows, over amx_rows(); the AMX
    # rows' error against float64 is that of the lane tiles' 8-bit activations or less, and
    # their bits are not the lane tiles' (they ran). "tiny": the synth shape of the GPU pool's
    # tests (hidden 64, expert width 32: one column step for the down; written in session 80
    # with no AMX host at hand, its emulated twin in amx_check.c passes)
    rng = np.random.default_rng(500 + qtype + num_tokens)
    E, K = 4, 4
    gate, up, down, x, experts, weights = routed_layer(rng, (qtype,) * 3, E, H, F, num_tokens, K)
    pointers = np.array([[m[e].ctypes.data for e in range(E)] for m in (gate, up, down)],
                        dtype=np.uint64)
    exact = _exact(x, gate, up, down, qtype, experts, weights)
    got, tiles = np.zeros((num_tokens, H), np.float32), np.zeros((num_tokens, H), np.float32)
    kernels.moe_ffn_ptrs(x, pointers, qtype, qtype, qtype, F, experts, weights, got,
                         allow_amx=True)
    kernels.moe_ffn_ptrs(x, pointers, qtype, qtype, qtype, F, experts, weights, tiles)
    scale = np.linalg.norm(exact, axis=1)
    amx_err = np.linalg.norm(got - exact, axis=1) / scale
    tile_err = np.linalg.norm(tiles - exact, axis=1) / scale
    assert amx_err.max() < 0.02
    assert np.median(amx_err) <= 1.5 * np.median(tile_err)
    assert not np.array_equal(got, tiles)
