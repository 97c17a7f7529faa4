"""CUDA-backend checks that run on any machine: the driver module imports and says clearly when
there is no driver, and every .cu module compiles with nvcc for sm_90 (skipped without nvcc).
(Outside tests/backends/cuda/: the root conftest skips every test under a folder named cuda.)"""
import shutil
import subprocess

import pytest

from strata._native import cuda_driver
from strata.backends.cuda import runtime as cuda_runtime
from strata.errors import ConfigError


def test_driver_module_reports_a_missing_driver():
    if cuda_driver.is_available():
        pytest.skip("this machine has a CUDA driver; the no-driver message cannot be seen here")
    with pytest.raises(cuda_driver.CudaUnavailable, match="libcuda.so.1") as info:
        cuda_driver.load()
    assert "--device cpu" in str(info.value)
    assert isinstance(info.value, ConfigError)
    with pytest.raises(cuda_driver.CudaUnavailable):
        cuda_driver.current_context()


def test_cuda_model_without_cuda_says_what_to_install(tmp_path):
    if cuda_runtime.is_available():
        pytest.skip("CUDA is usable here")
    from strata.backends.cuda import CudaModel
    from strata.model.gguf_file import GGUFModel
    from strata.tool.synth import synth_model

    synth_model(tmp_path / "tiny.gguf", shape="tiny", weight_type="f32")
    with pytest.raises(ConfigError, match=r"strata\[cuda\]|libcuda\.so\.1") as info:
        CudaModel(GGUFModel.open(tmp_path / "tiny.gguf"))
    assert "--device cpu" in str(info.value)


def test_kernel_names_cover_every_entry_point():
    names = set()
    for module in cuda_runtime.MODULES:
        names |= set(cuda_runtime._kernel_names(cuda_runtime.module_source(module)))
    for suffix in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"):
        assert {f"mm_store_{suffix}", f"mm_add_{suffix}", f"mm_gateup_{suffix}",
                f"mm_qkv_{suffix}", f"embed_{suffix}"} <= names
    for suffix in ("q4_0", "q8_0"):  # mmq.cu: int8 tensor-core tiles of 64 and 32 rows
        assert {f"mmq{rows}_{kind}_{suffix}" for rows in (64, 32)
                for kind in ("store", "add", "gateup", "qkv")} <= names
    assert {"mmf_store_f32", "mmf_add_f32", "mmf_store_f16", "mmf_store_bf16"} <= names
    assert {"quantize_q8", "rmsnorm_q8", "qk_rope_append", "attention", "router_topk",
            "group_pairs", "moe_combine", "argmax_rows"} <= names


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("module", cuda_runtime.MODULES)
def test_cu_module_compiles_for_sm90(module, tmp_path):
    src = tmp_path / module
    src.write_text(cuda_runtime.module_source(module))
    out = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-O3", str(src),
                          "-o", str(tmp_path / "out.cubin")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out.cubin").stat().st_size > 0
