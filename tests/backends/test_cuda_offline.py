"""CUDA-backend checks that run on any machine: the driver module imports and says clearly when
there is no driver, every .cu module compiles with nvcc for sm_90 and for consumer GPUs' archs
(skipped without nvcc), and a GPU below the kernels' floor is refused by name.
(Outside tests/backends/cuda/: the root conftest skips every test under a folder named cuda.)"""
import re
import shutil
import subprocess
import sys
import types

import pytest

from strata._native import cuda_driver
from strata.backends.cuda import plan as cuda_plan
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
    # PyCUDA missing, no driver, or a driver that sees no GPU (CUDA_VISIBLE_DEVICES="")
    missing = r"strata\[cuda\]|libcuda\.so\.1|no CUDA-capable|sees no GPU"
    with pytest.raises(ConfigError, match=missing) as info:
        CudaModel(GGUFModel.open(tmp_path / "tiny.gguf"))
    assert "--device cpu" in str(info.value)


class _HiddenGpuDriver(types.ModuleType):
    """pycuda.driver as it behaves with a driver and no visible GPU (CUDA_VISIBLE_DEVICES=""):
    cuInit raises its RuntimeError, a subclass of its Error (seen on the device's H100 host)."""

    class Error(Exception):
        pass

    class RuntimeError(Error):
        pass

    def init(self):
        raise self.RuntimeError("cuInit failed: no CUDA-capable device is detected")


def _libcuda_sees_no_gpu():
    """strata._native.cuda_driver.load as it behaves on a GPU host with CUDA_VISIBLE_DEVICES="":
    its own cuInit fails (session 97's H100 host; session 96's fix caught only PyCUDA's)."""
    raise cuda_driver.CudaError("cuInit failed: CUDA error 100 (no CUDA-capable device is "
                                "detected)")


@pytest.mark.parametrize("first_to_fail", ["strata's cuInit", "PyCUDA's cuInit"])
def test_a_driver_that_sees_no_gpu_is_a_config_error(monkeypatch, first_to_fail):
    # the real case is a GPU host with CUDA_VISIBLE_DEVICES="" (tests/backends/cuda/
    # test_cuda_hidden_gpu.py runs it there); here the driver and PyCUDA are stood in for
    driver = _HiddenGpuDriver("pycuda.driver")
    package = types.ModuleType("pycuda")
    package.driver = driver
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)
    load = _libcuda_sees_no_gpu if first_to_fail == "strata's cuInit" else (lambda: None)
    monkeypatch.setattr(cuda_runtime.cuda_driver, "load", load)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as info:
        cuda_runtime.import_pycuda()
    message = str(info.value)
    assert "no CUDA-capable device" in message and "--device cpu" in message
    assert "CUDA_VISIBLE_DEVICES=''" in message
    assert cuda_runtime.unavailable_reason() == message
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError) as info:
        cuda_runtime.import_pycuda()
    assert "CUDA_VISIBLE_DEVICES" not in str(info.value)


# 32-column block types beside Q4_0 / Q8_0 (llama.cpp's k-quant files' fallbacks, Q4_1 / Q5_1
# presets): embed, dp4a, mv_* and mmq.cu tiles
B32_TYPES = ("q4_1", "q5_0", "q5_1", "iq4_nl")
# the grid i-quants (256-column super-blocks, common.cuh's iq_group): embed, dp4a, mv_* and
# mmq_k.cu tiles
IQ_TYPES = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")


def test_plan_type_tables_cover_every_type_the_weights_read():
    """Every quantised type the CUDA weights accept has tensor-core prompt tiles and decode
    mv_* kernels (so free admission works for its experts)."""
    from strata.backends.cuda.weights import FLOAT_TYPES, TYPE_SUFFIX

    quantised = {s for t, s in TYPE_SUFFIX.items() if t not in FLOAT_TYPES}
    assert set(B32_TYPES) | set(IQ_TYPES) <= quantised
    assert quantised == set(cuda_plan.MMQ_TYPES) | set(cuda_plan.MMQ_K_TYPES)
    assert quantised == set(cuda_plan.MV_TYPES)


def test_kernel_names_cover_every_entry_point():
    names = set()
    for module in cuda_runtime.MODULES:
        names |= set(cuda_runtime._kernel_names(cuda_runtime.module_source(module)))
    for suffix in ("f32", "f16", "bf16", "q8_0", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                   "iq4_xs") + B32_TYPES + IQ_TYPES:
        assert {f"mm_store_{suffix}", f"mm_add_{suffix}", f"mm_gateup_{suffix}",
                f"mm_qkv_{suffix}", f"embed_{suffix}"} <= names
    for suffix in ("q4_0", "q8_0") + B32_TYPES:  # mmq.cu: int8 tensor-core tiles, 64 / 32 rows
        assert {f"mmq{rows}_{kind}_{suffix}" for rows in (64, 32)
                for kind in ("store", "add", "gateup", "qkv")} <= names
    assert {f"mmq{rows}r_{kind}_q4_0" for rows in (64, 32)  # RAW staging: Q4_0 only
            for kind in ("store", "add", "gateup", "qkv")} <= names
    for suffix in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs") + IQ_TYPES:  # mmq_k.cu
        assert {f"mmq32_{kind}_{suffix}" for kind in ("store", "add", "gateup", "qkv")} <= names
    for suffix in ("q4_0", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs") + B32_TYPES \
            + IQ_TYPES:
        assert {f"mv_{kind}_{suffix}" for kind in ("store", "add", "gateup", "qkv")} <= names
    assert {"mmf_store_f32", "mmf_add_f32", "mmf_store_f16", "mmf_store_bf16"} <= names
    assert {"quantize_q8", "rmsnorm_q8", "qk_rope_append", "router_topk", "group_pairs",
            "moe_combine", "argmax_rows", "gate_logit_rows"} <= names
    # qwen3next: the gated delta net (delta_net.cu) and the attention's output gate
    assert {"conv_silu_rows", "gated_delta_rows", "gated_rmsnorm_rows", "split_q_gate",
            "mul_sigmoid"} <= names
    for head_dim in (16, 64, 128, 256):  # attention.cu: a kernel per dims per lane ...
        assert set(cuda_plan.attention_kernels(head_dim)) <= names
        for group in (1, 2, 3, 4, 8, 16):  # ... attention_group.cu: and heads per block
            for form in ("mma", "simt"):
                assert cuda_plan.attention_group_kernel(
                    head_dim, group, {"STRATA_ATT_GROUP": form})[0] in names
    assert "attention_group_merge" in names  # ... and the launch that folds its splits
    # attention_prompt.cu: a kernel per KV cell type
    assert {name for _, name in cuda_plan.PROMPT_KERNELS} == {"attention_prompt",
                                                              "attention_prompt_i8"} <= names


def test_prompt_kernels_per_cell_type():
    """A prompt window launches attention_prompt for fp16 KVs, attention_prompt_i8 for int8
    ones, both (fp16 first) when its KVs mix them; a mask of neither is refused."""
    FP16, INT8 = cuda_plan.CELLS_FP16, cuda_plan.CELLS_INT8
    assert cuda_plan.prompt_kernels(FP16) == ["attention_prompt"]
    assert cuda_plan.prompt_kernels(INT8) == ["attention_prompt_i8"]
    assert cuda_plan.prompt_kernels(FP16 | INT8) == ["attention_prompt", "attention_prompt_i8"]
    for bad in (0, 4, FP16 | 8):
        with pytest.raises(ValueError, match="CELLS_FP16"):
            cuda_plan.prompt_kernels(bad)


def test_attention_deep_from():
    """Rows from ATT_DEEP_FROM take the group kernel; STRATA_ATT_DEEP_FROM moves or turns it
    off; heads the group kernel does not take (Q not a multiple of KVH) never do."""
    from types import SimpleNamespace

    spec = SimpleNamespace(n_heads=32, n_kv_heads=4)
    assert cuda_plan.attention_deep_from(spec, {}) == cuda_plan.ATT_DEEP_FROM
    assert cuda_plan.attention_deep_from(spec, {"STRATA_ATT_DEEP_FROM": "0"}) == 0
    assert cuda_plan.attention_deep_from(spec, {"STRATA_ATT_DEEP_FROM": "700"}) == 700
    assert cuda_plan.attention_deep_from(spec, {"STRATA_ATT_DEEP_FROM": "off"}) is None
    assert cuda_plan.attention_deep_from(SimpleNamespace(n_heads=6, n_kv_heads=4), {}) is None
    name, grid, block = cuda_plan.attention_group_launch(3, 32, 4, 128)
    assert (name, grid, block) == (f"attention_group_{cuda_plan.ATT_GROUP_FORM}_d128",
                                   (3, 4, cuda_plan.GQA_SPLITS), (32 * cuda_plan.GQA_WARPS,))
    assert cuda_plan.attention_group_kernel(128, 8, {"STRATA_ATT_GROUP": "simt"}) == (
        "attention_group_d4_g8", 8)
    assert cuda_plan.attention_group_kernel(16, 2) == ("attention_group_d1_g2", 2)
    # Qwen3-Next: 16 heads over 2 KV heads of 256: 4 heads a block, two blocks a group
    assert cuda_plan.attention_group_launch(100, 16, 2, 256) == (
        "attention_group_d8_g4", (cuda_plan.GQA_PART_ROWS, 4, cuda_plan.GQA_SPLITS),
        (32 * cuda_plan.GQA_WARPS,))
    # the merge launch: a block per (slot, query head), a thread per dim (whole warps); the
    # partials: 16-byte rows of 4 + D floats per (slot, head, split), and PR more slots for the
    # rows past GQA_PART_ROWS (each block folds its own there)
    PR, S = cuda_plan.GQA_PART_ROWS, cuda_plan.GQA_SPLITS
    assert cuda_plan.attention_group_merge_launch(3, 32, 128) == (
        "attention_group_merge", (3, 32), (128,))
    assert cuda_plan.attention_group_merge_launch(100, 16, 16) == (
        "attention_group_merge", (PR, 16), (32,))
    assert cuda_plan.attention_group_part_floats(3, 32, 128) == 3 * 32 * S * 132
    assert cuda_plan.attention_group_part_floats(PR, 32, 128) == PR * 32 * S * 132
    assert cuda_plan.attention_group_part_floats(PR + 1, 32, 128) == 2 * PR * 32 * S * 132
    assert cuda_plan.attention_group_part_floats(1, 8, 64, splits=64) == 8 * 64 * 68


def test_read_ahead_setting():
    """STRATA_READ_AHEAD: experts a decode layer stages with no cache slots (default 1, 0 off,
    at most READ_AHEAD_MAX); anything else is refused with the value named."""
    from strata.backends.cuda.device_tier import READ_AHEAD_EXPERTS, READ_AHEAD_MAX
    from strata.backends.cuda.offload import read_ahead_experts
    from strata.errors import ConfigError

    assert read_ahead_experts({}) == READ_AHEAD_EXPERTS
    assert read_ahead_experts({"STRATA_READ_AHEAD": " 0 "}) == 0
    assert read_ahead_experts({"STRATA_READ_AHEAD": str(READ_AHEAD_MAX)}) == READ_AHEAD_MAX
    for bad in ("two", "-1", str(READ_AHEAD_MAX + 1)):
        with pytest.raises(ConfigError, match=f"STRATA_READ_AHEAD={bad!r}|STRATA_READ_AHEAD={bad}"):
            read_ahead_experts({"STRATA_READ_AHEAD": bad})


def test_guess_rows_setting():
    """STRATA_GUESS_ROWS: the least guessed rows that get a rare expert copied a layer ahead
    (backends/cuda/guess.py; 16 by default, off with 0); anything else is refused with the
    value named."""
    from strata.backends.cuda.guess import guess_min_rows
    from strata.errors import ConfigError

    assert guess_min_rows({}) == 16
    assert guess_min_rows({"STRATA_GUESS_ROWS": " 0 "}) == 0
    assert guess_min_rows({"STRATA_GUESS_ROWS": "32"}) == 32
    for bad in ("eight", "-1", "1.5"):
        with pytest.raises(ConfigError, match="STRATA_GUESS_ROWS="):
            guess_min_rows({"STRATA_GUESS_ROWS": bad})


def test_pull_rows_setting():
    """STRATA_PULL_ROWS: the rows past which pull_rare copies a rare expert the GPU reads
    (device_tier.py; 0 by default: every one); anything else is refused with the value
    named."""
    from strata.backends.cuda.device_tier import PULL_MIN_ROWS, pull_min_rows
    from strata.errors import ConfigError

    assert pull_min_rows({}) == PULL_MIN_ROWS == 0
    assert pull_min_rows({"STRATA_PULL_ROWS": " 32 "}) == 32
    for bad in ("eight", "-1", "1.5"):
        with pytest.raises(ConfigError, match=f"STRATA_PULL_ROWS={bad!r}"):
            pull_min_rows({"STRATA_PULL_ROWS": bad})


def test_attention_prompt_shared_memory_is_what_the_runtime_allows():
    """attention_prompt's two buffers of K/V tiles need more than the default 48 KB of dynamic
    shared memory at D = 128: the runtime raises the kernel's limit to exactly the most any
    head dim takes, within the 99 KB an sm_86 / sm_89 / sm_120 block may opt in to."""
    sizes = [cuda_plan.attention_prompt_shared_bytes(d) for d in cuda_plan.PA_HEAD_DIMS]
    for name in ("attention_prompt", "attention_prompt_i8"):
        assert cuda_runtime.DYNAMIC_SHARED_MAX[name] == max(sizes) == 69_632
    assert max(sizes) <= 99 * 1024
    assert cuda_plan.attention_prompt_shared_bytes(16) == 2 * 2 * 64 * 24 * 2


# a PTX instruction that touches memory: its opcode and dotted qualifiers
_MEMORY_OP = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:ld|ldu|st|atom|red|cp\.async)(?:\.[\w:]+)*)\s")
_OWN_SPACES = (".param", ".shared", ".local", ".const")  # not written by the previous kernel
# reads of what no kernel writes (the model's weights, the window's row descriptors), which a
# kernel may issue before its wait: read-only global loads (__ldg) and cp.async copies from
# global into shared memory
_WEIGHT_READS = re.compile(r"^(?:ld\.global\.nc|cp\.async(?:\.\w+)*\.shared\.global)\b")


def _touches_before_wait(op: str) -> bool:
    """Whether PTX memory op `op` (opcode and qualifiers) may read or write what the kernel
    before it writes: anything but its own spaces and weight reads."""
    if _WEIGHT_READS.match(op):
        return False
    if op.startswith("cp.async"):  # a copy into shared memory from anywhere else
        return True
    return not any(s in op for s in _OWN_SPACES)


def test_the_wait_check_tells_weight_reads_from_other_memory_ops():
    for op in ("ld.global.nc.v4.f32", "cp.async.cg.shared.global", "cp.async.ca.shared.global.L2",
               "ld.param.u64", "st.shared.u32", "ld.local.f32"):
        assert not _touches_before_wait(op), op
    for op in ("ld.global.f32", "ld.u32", "st.global.f32", "st.u32", "atom.global.add.u32",
               "red.global.add.f32", "ld.global.cg.f32", "ld.global.v4.u32"):
        assert _touches_before_wait(op), op


def _entries(ptx: str) -> dict[str, list[str]]:
    """PTX text -> {entry name: its body lines}."""
    found = {}
    for match in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):
        body_start = ptx.index("{", ptx.index(")", match.end()))
        depth, i = 0, body_start
        while True:
            depth += {"{": 1, "}": -1}.get(ptx[i], 0)
            if depth == 0:
                break
            i += 1
        found[match.group(1)] = ptx[body_start:i].splitlines()
    return found


def _compile_unoptimised(module, arch, folder):
    """nvcc's result for `module` built for `arch` with the device optimiser off (cicc and
    ptxas -O0: seconds instead of minutes; what an arch lacks fails there all the same)."""
    src = folder / module
    src.write_text(cuda_runtime.module_source(module))
    return subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-Xcicc", "-O0",
                           "-Xptxas", "-O0", str(src), "-o", str(folder / "out.cubin")],
                          capture_output=True, text=True)


# Users' GPUs besides the H200 (sm_90) the suite runs on: the floor, Ampere (sm_80; RTX 30xx
# are sm_86, RTX 40xx sm_89, with no feature the kernels use beyond sm_80's) and the newest
# consumer cards (RTX 50xx, sm_120).
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_120"])
def test_every_module_compiles_for_consumer_gpus(arch, tmp_path):
    failed = {}
    for module in cuda_runtime.MODULES:
        out = _compile_unoptimised(module, arch, tmp_path)
        if out.returncode != 0:
            failed[module] = out.stderr[-2000:]
    assert not failed, failed


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_the_compute_capability_floor_is_where_nvcc_says(tmp_path):
    """Below MIN_COMPUTE_CAPABILITY the kernels do not build (cp.async, m16n8k16 mma), which
    is why the runtime refuses such a GPU by name instead of failing in nvcc."""
    assert cuda_runtime.MIN_COMPUTE_CAPABILITY == (8, 0)
    out = _compile_unoptimised("matvec.cu", "sm_75", tmp_path)
    assert out.returncode != 0 and "sm_80" in out.stderr


class _Gpu:
    def __init__(self, major, minor):
        self.capability = (major, minor)

    def compute_capability(self):
        return self.capability

    def name(self):
        return "NVIDIA GeForce RTX 2080"


def test_a_gpu_below_the_floor_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"RTX 2080 has compute capability 7\.5.*8\.0 or "
                       r"newer.*--device cpu"):
        cuda_runtime.check_compute_capability(_Gpu(7, 5))
    for major, minor in ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0)):
        cuda_runtime.check_compute_capability(_Gpu(major, minor))


def test_auto_says_why_an_old_gpu_leaves_the_model_on_the_cpu(monkeypatch):
    """unavailable_reason (what `--device auto` logs) carries the floor's message."""
    import types

    fake = types.SimpleNamespace(Device=lambda index: _Gpu(7, 5))
    monkeypatch.setattr(cuda_runtime, "import_pycuda", lambda: fake)
    assert not cuda_runtime.is_available()
    assert "compute capability 7.5" in cuda_runtime.unavailable_reason()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("module", cuda_runtime.MODULES)
def test_cu_module_compiles_for_sm90(module, tmp_path):
    """nvcc and ptxas accept the module for sm_90, and every kernel waits for the previous
    kernel (griddepcontrol.wait, common.cuh's kernel_entry) before it reads or writes global
    memory other than weights (read-only loads, cp.async into shared memory): the runtime
    launches them as programmatic dependent launches there."""
    src = tmp_path / module
    src.write_text(cuda_runtime.module_source(module))
    ptx = tmp_path / "out.ptx"
    out = subprocess.run(["nvcc", "-ptx", "-arch=sm_90", "-std=c++17", "-O3", str(src),
                          "-o", str(ptx)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(["ptxas", "-arch=sm_90", str(ptx), "-o", str(tmp_path / "out.cubin")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    entries = _entries(ptx.read_text())
    assert set(entries) == set(cuda_runtime._kernel_names(src.read_text()))
    for name, lines in entries.items():
        waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        assert waits, f"{name} never waits for the previous kernel (kernel_entry missing)"
        for line in lines[:waits[0]]:
            match = _MEMORY_OP.match(line)
            assert not (match and _touches_before_wait(match.group(1))), \
                f"{name} touches memory before griddepcontrol.wait: {line.strip()}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_prebuilt_cubins_are_found_by_source_and_arch(tmp_path, monkeypatch):
    """A cubin built here for STRATA_CUBIN_DIR is what the runtime's lookup returns for the same
    module and arch; another arch, another source or no folder find none."""
    from strata.backends.cuda import cubins

    built = cubins.compile_with_nvcc("sample.cu", "sm_90")
    assert built[:4] == b"\x7fELF"  # a cubin is an ELF image
    (tmp_path / cubins.cubin_file_name("sample.cu", "sm_90")).write_bytes(built)
    monkeypatch.setenv(cubins.ENV_DIR, str(tmp_path))
    assert cubins.prebuilt_cubin("sample.cu", "sm_90") == built
    assert cubins.prebuilt_cubin("sample.cu", "sm_86") is None
    assert cubins.prebuilt_cubin("offload.cu", "sm_90") is None
    source = cuda_runtime.module_source("sample.cu")
    monkeypatch.setattr(cubins, "module_source", lambda name, **_: source + "\n// edited\n")
    assert cubins.prebuilt_cubin("sample.cu", "sm_90") is None  # the digest follows the source
    monkeypatch.setattr(cubins, "module_source", cuda_runtime.module_source)
    # another tree's kernels (tools/prepare_ab.sh): same files, same name; an edit, another
    other = tmp_path / "other"
    shutil.copytree(cuda_runtime.KERNEL_DIR, other, ignore=shutil.ignore_patterns("*.py*"))
    name = cubins.cubin_file_name("sample.cu", "sm_90")
    assert cubins.cubin_file_name("sample.cu", "sm_90", kernel_dir=other) == name
    (other / "common.cuh").write_text((other / "common.cuh").read_text() + "\n// edited\n")
    assert cubins.cubin_file_name("sample.cu", "sm_90", kernel_dir=other) != name
    monkeypatch.delenv(cubins.ENV_DIR)
    monkeypatch.setattr(cubins, "module_source", cuda_runtime.module_source)
    assert cubins.prebuilt_cubin("sample.cu", "sm_90") is None


def test_weight_bytes_leave_out_layers_no_pass_runs():
    """A multi-token-prediction layer past block_count - nextn_predict_layers (Qwen3-Next's)
    is not uploaded, so it is not counted against the VRAM either."""
    from types import SimpleNamespace

    from strata.backends.cuda.weights import weight_bytes

    sizes = {"token_embd.weight": 100, "blk.0.attn_q.weight": 10, "blk.0.ffn_up_exps.weight": 1000,
             "blk.1.attn_q.weight": 10, "blk.2.attn_q.weight": 7, "blk.2.ffn_up_exps.weight": 700}
    model = SimpleNamespace(spec=SimpleNamespace(n_layers=2), tensor_names=list(sizes),
                            tensor=lambda name: SimpleNamespace(nbytes=sizes[name]))
    assert weight_bytes(model) == 1120
    assert weight_bytes(model, routed_experts=False) == 120


def test_programmatic_launch_is_on_where_the_gpu_and_driver_allow(monkeypatch):
    """On for cc >= 9.0 under a CUDA 12.3 driver with cuLaunchKernelEx unless STRATA_PDL=0,
    and the log's reason says which of those turned it off."""
    monkeypatch.setattr(cuda_runtime.cuda_driver, "has_programmatic_launch", lambda: True)
    launch = cuda_runtime.programmatic_launch
    assert launch(9, 13000, {}) == (True, "on")
    assert launch(12, 12030, {"STRATA_PDL": "1"}) == (True, "on")
    on, why = launch(8, 13000, {})
    assert not on and "9.0" in why and "8.x" in why
    assert launch(9, 13000, {"STRATA_PDL": "0"}) == (False, "off (STRATA_PDL=0)")
    on, why = launch(9, 12020, {})
    assert not on and "12.3" in why and "12.2" in why
    monkeypatch.setattr(cuda_runtime.cuda_driver, "has_programmatic_launch", lambda: False)
    assert not launch(9, 13000, {})[0]


def test_pdl_window_rows_default_and_override(monkeypatch):
    monkeypatch.delenv("STRATA_PDL_ROWS", raising=False)
    assert cuda_plan.pdl_max_rows() == cuda_plan.PDL_MAX_ROWS == 1
    monkeypatch.setenv("STRATA_PDL_ROWS", "3")
    assert cuda_plan.pdl_max_rows() == 3
    monkeypatch.setenv("STRATA_PDL_ROWS", "x")  # not a count: the default
    assert cuda_plan.pdl_max_rows() == 1
