"""amx.c's AMX rows: with the tile operations emulated in C (amx_check.c; any machine with gcc)
and, where the CPU has AMX-INT8, the real ones through the CPU pool's call (allow_amx) against
the float64 reference of test_moe."""
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from strata._native import kernels

from .test_moe import reference, routed_layer

SRC_DIR = Path(__file__).resolve().parents[2] / "src" / "strata" / "_native"
C_FILES = ["amx.c", "matmul.c", "quant_ref.c", "tiles.c", "unpack_simd.c", "unpack_neon.c",
           "fused.c", "fused_k.c", "fused_iq.c"]


@pytest.mark.skipif(not (SRC_DIR / "amx.c").exists() or shutil.which("gcc") is None,
                    reason="needs the source tree and gcc")
def test_amx_rows_emulated(tmp_path):
    exe = tmp_path / "amx_check"
    subprocess.run(["gcc", "-std=c11", "-O2", "-ffp-contract=off", "-fopenmp", "-DST_AMX_EMULATE",
                    f"-I{SRC_DIR}", str(Path(__file__).resolve().parent / "amx_check.c"),
                    *(str(SRC_DIR / f) for f in C_FILES), "-lm", "-o", str(exe)],
                   check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("PASSED"), run.stdout


@pytest.mark.skipif(not kernels.amx_available(), reason="needs a CPU with AMX-INT8")
@pytest.mark.parametrize("qtype", [2, 8], ids=["Q4_0", "Q8_0"])
@pytest.mark.parametrize("num_tokens", [12, 16, 37])
def test_pool_products_on_amx_match_the_reference(qtype, num_tokens):
    # the pool's call (allow_amx) on experts of many rows (every token routed to all 4, so
    # each has num_tokens rows): within test_moe's bound of the float64 reference, and not the
    # lane tiles' bits (the AMX rows ran)
    rng = np.random.default_rng(500 + qtype + num_tokens)
    E, H, F, K = 4, 256, 192, 4
    gate, up, down, x, experts, weights = routed_layer(rng, (qtype,) * 3, E, H, F, num_tokens, K)
    pointers = np.array([[m[e].ctypes.data for e in range(E)] for m in (gate, up, down)],
                        dtype=np.uint64)
    zeros = np.zeros((num_tokens, H), np.float32)
    expected, bound = reference(x, gate, up, down, (qtype,) * 3, experts, weights, zeros)
    got, tiles = zeros.copy(), zeros.copy()
    kernels.moe_ffn_ptrs(x, pointers, qtype, qtype, qtype, F, experts, weights, got,
                         allow_amx=True)
    kernels.moe_ffn_ptrs(x, pointers, qtype, qtype, qtype, F, experts, weights, tiles)
    assert np.all(np.abs(got - expected) <= bound)
    assert not np.array_equal(got, tiles)
