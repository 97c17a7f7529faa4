"""Offload-tier pieces that run on any machine: offload.cu compiles for sm_90 and names its
kernels, the slot layout (parts 256-aligned, one slot size), the VRAM arena's `auto` sizing."""
import shutil
import subprocess

import numpy as np
import pytest

from strata.backends.cuda import runtime as cuda_runtime
from strata.backends.cuda.offload import PART_ALIGN_BYTES, slot_layout, work_buffer_bytes
from strata.experts.store import ExpertStore
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model


def test_offload_kernels_are_named():
    names = set(cuda_runtime._kernel_names(cuda_runtime.module_source("offload.cu")))
    assert names == {"tier_groups", "tier_groups_keep", "tier_groups_ahead", "pool_publish",
                     "pool_wait", "moe_combine_pool", "pull_rare", "read_ahead", "ahead_point",
                     "guess_publish", "guess_claim", "guess_point"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_offload_cu_compiles_for_sm90(tmp_path):
    src = tmp_path / "offload.cu"
    src.write_text(cuda_runtime.module_source("offload.cu"))
    out = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-O3", str(src),
                          "-o", str(tmp_path / "out.cubin")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out.cubin").stat().st_size > 0


@pytest.mark.parametrize("weight_type, part_bytes", [
    # tiny: hidden 64, expert width 32 -> gate/up [32, 64], down [64, 32]
    ("f32", (32 * 64 * 4, 32 * 64 * 4, 64 * 32 * 4)),
    ("q8_0", (32 * 2 * 34, 32 * 2 * 34, 64 * 1 * 34)),
])
def test_slot_layout_aligns_each_part(tmp_path, weight_type, part_bytes):
    path = tmp_path / f"tiny-{weight_type}.gguf"
    synth_model(path, shape="tiny", weight_type=weight_type, n_layers=3)
    with GGUFModel.open(path) as gguf:
        store = ExpertStore.from_gguf(gguf)
        assert tuple(p.nbytes for p in store.layouts[0].parts) == part_bytes
        offsets, slot_bytes = slot_layout(store)

    def up(n):
        return -(-n // PART_ALIGN_BYTES) * PART_ALIGN_BYTES

    gate, upb, down = part_bytes
    assert offsets.shape == (3, 3) and offsets.dtype == np.uint64
    assert [list(row) for row in offsets] == [[0, up(gate), up(gate) + up(upb)]] * 3
    assert slot_bytes == up(gate) + up(upb) + up(down)


def test_work_buffer_estimate_grows_with_rows(tmp_path):
    path = tmp_path / "tiny.gguf"
    spec = synth_model(path, shape="tiny", weight_type="f32", n_layers=2)
    one, many = work_buffer_bytes(spec, 1), work_buffer_bytes(spec, 512)
    assert many == 512 * one
    assert one >= 4 * spec.vocab + spec.n_experts_used * 4 * spec.hidden  # logits + ybuf rows


def test_work_buffer_estimate_counts_logits_for_logit_rows_only(tmp_path):
    path = tmp_path / "tiny.gguf"
    spec = synth_model(path, shape="tiny", weight_type="f32", n_layers=2)
    all_rows, one_row = work_buffer_bytes(spec, 4096), work_buffer_bytes(spec, 4096, 1)
    assert all_rows - one_row == 4095 * 4 * spec.vocab
    assert work_buffer_bytes(spec, 8, 64) == work_buffer_bytes(spec, 8)  # capped at the rows


def test_which_layers_may_split_an_expert(monkeypatch):
    # plan.expert_split_step: the down's staged unit (32 columns, 256 for k-quants / grid
    # i-quants) when the routed products run on mv_* and the expert is 2 units wide or more
    from types import SimpleNamespace as NS

    from strata.backends.cuda.plan import expert_split_step

    def layer(suffix, F=768, H=2048, is_float=False, up=None):
        w = NS(suffix=suffix, rows=F, cols=H, is_float=is_float)
        down = NS(suffix=suffix, rows=H, cols=F, is_float=is_float)
        return NS(gate_exps=w, up_exps=NS(**{**vars(w), "suffix": up or suffix}),
                  down_exps=down)

    def model(F):
        return NS(spec=NS(expert_ffn=F))

    assert expert_split_step(model(768), layer("q4_0")) == 32
    assert expert_split_step(model(768), layer("iq4_nl")) == 32
    assert expert_split_step(model(768), layer("q4_k")) == 256
    assert expert_split_step(model(512), layer("iq2_xxs", F=512)) == 256
    assert expert_split_step(model(256), layer("q6_k", F=256)) == 0      # one unit wide
    assert expert_split_step(model(32), layer("q8_0", F=32)) == 0
    assert expert_split_step(model(768), layer("f16", is_float=True)) == 0
    assert expert_split_step(model(768), layer("q4_0", up="q8_0")) == 0  # gate/up on mm_*
    monkeypatch.setenv("STRATA_DECODE_DOWN", "mm")                        # down on mm_*
    assert expert_split_step(model(768), layer("q4_0")) == 0
    monkeypatch.delenv("STRATA_DECODE_DOWN")
    monkeypatch.setenv("STRATA_DECODE_MM", "dp4a")
    assert expert_split_step(model(768), layer("q4_k")) == 0
