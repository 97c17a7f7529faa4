"""The kernels' other instruction-set paths (scalar, AVX2, AVX-512 without VNNI, NEON under
qemu) compiled from source into arch_check.c's harness and run: this build tests only one."""
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from .helpers import cpu_flags

SRC_DIR = Path(__file__).resolve().parents[2] / "src" / "strata" / "_native"
C_FILES = ["amx.c", "matmul.c", "quant_ref.c", "tiles.c", "unpack_simd.c", "unpack_neon.c",
           "fused.c", "fused_k.c", "fused_iq.c", "moe.c", "attention.c", "window_ops.c"]
HARNESS = Path(__file__).resolve().parent / "arch_check.c"


def _x86_variant(march, needed_flags):
    is_x86 = platform.machine() in ("x86_64", "AMD64")
    has_flags = needed_flags <= cpu_flags()
    return pytest.param(
        ("gcc", march, None), id=march,
        marks=pytest.mark.skipif(not (is_x86 and has_flags and shutil.which("gcc")),
                                 reason=f"needs gcc on an x86-64 CPU with {sorted(needed_flags)}"))


def _arm_variant(march):
    tools = shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64-static")
    return pytest.param(
        ("aarch64-linux-gnu-gcc", march, "qemu-aarch64-static"), id=march,
        marks=pytest.mark.skipif(not tools,
                                 reason="needs aarch64-linux-gnu-gcc and qemu-aarch64-static"))


@pytest.mark.slow
@pytest.mark.skipif(not (SRC_DIR / "quant.h").exists(), reason="needs the source tree")
@pytest.mark.parametrize("variant", [
    _x86_variant("x86-64", set()),                                      # scalar
    _x86_variant("haswell", {"avx2", "fma", "f16c"}),                   # AVX2
    _x86_variant("alderlake", {"avx2", "fma", "f16c", "avx_vnni"}),     # AVX2 + AVX-VNNI
    _x86_variant("skylake-avx512", {"avx512f", "avx512bw", "f16c"}),    # AVX-512, no VNNI
    # AVX-512 VNNI without VBMI: fused.c's two-block Q4_0 path, not the vpermb one
    _x86_variant("cascadelake", {"avx512f", "avx512bw", "avx512_vnni", "f16c"}),
    _arm_variant("armv8-a"),                                            # NEON
    _arm_variant("armv8.2-a+dotprod"),                                  # NEON vdotq
])
def test_other_instruction_sets(variant, tmp_path):
    compiler, march, runner = variant
    run = _build_and_run(compiler, march, runner, tmp_path / "arch_check")
    expected_level = {"x86-64": "scalar", "haswell": "avx2", "alderlake": "avx2",
                      "skylake-avx512": "avx512", "cascadelake": "avx512"}
    assert run.stdout.splitlines()[0] == f"simd={expected_level.get(march, 'neon')}"
    assert run.returncode == 0 and run.stdout.rstrip().endswith("PASSED"), run.stdout


def _build_and_run(compiler, march, runner, exe, extra=()):
    """arch_check.c with the kernels built for `march` (+ extra flags), run: its output."""
    cmd = [compiler, "-std=c11", "-O2", "-ffp-contract=off", f"-march={march}", "-fopenmp",
           *extra, f"-I{SRC_DIR}", str(HARNESS), *(str(SRC_DIR / f) for f in C_FILES), "-lm",
           "-o", str(exe)]
    if runner:
        cmd.insert(1, "-static")
    subprocess.run(cmd, check=True, capture_output=True)
    return subprocess.run([runner, str(exe)] if runner else [str(exe)], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(not (platform.machine() in ("x86_64", "AMD64") and shutil.which("gcc")
                         and {"avx512bw", "avx512_vnni", "f16c"} <= cpu_flags()),
                    reason="needs gcc on an x86-64 CPU with AVX-512 BW and VNNI")
def test_k_rows_on_512_bits_give_the_avx2_rows_bits(tmp_path):
    """fused_k_avx512.h's Q4_K / Q5_K / Q6_K rows against the AVX2 ones (ST_NO_K512) in the
    same AVX-512 VNNI build: every product's result bits (arch_check's bits=) equal."""
    outs = [_build_and_run("gcc", "cascadelake", None, tmp_path / f"arch_check{i}", extra)
            for i, extra in enumerate(((), ("-DST_NO_K512",)))]
    for run in outs:
        assert run.returncode == 0 and run.stdout.rstrip().endswith("PASSED"), run.stdout
    k_lines = [[line for line in run.stdout.splitlines()
                if line.startswith(("type=12 ", "type=13 ", "type=14 "))] for run in outs]
    assert k_lines[0] and k_lines[0] == k_lines[1]
