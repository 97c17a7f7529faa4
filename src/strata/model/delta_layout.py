"""Where a qwen3next gated delta-net layer's matrices sit in llama.cpp's GGUF and the row order
the kernels of both backends take: q | k | v channels (attn_qkv, or the first converter's
ssm_in regrouped), the output gate z, and ssm_ba's beta logits then alpha inputs.
"""
from __future__ import annotations

import numpy as np

from strata.model.arch import ModelSpec, legacy_ssm_in

# Hk / Hv = key / value heads, Dk / Dv = key / value head dims, r = Hv / Hk,
# C = conv channels (2*Hk*Dk + Hv*Dv), VI = Hv*Dv


def ba_rows(spec: ModelSpec) -> np.ndarray:
    """ssm_ba's rows in the order the kernels take them, beta logits of value heads 0..Hv-1
    then their alpha inputs: the file groups them by key head, [b (r heads), a (r heads)]."""
    r = spec.ssm_heads // spec.ssm_groups
    group = np.arange(spec.ssm_groups)[:, None] * 2 * r  # [Hk, 1]
    b = (group + np.arange(r)).reshape(-1)
    return np.concatenate([b, b + r])


def legacy_qkvz_rows(spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """(q|k|v rows, z rows) of a legacy ssm_in (HF's in_proj_qkvz: per key head q, k, then v
    and z of its r value heads): the order of attn_qkv and attn_gate."""
    dk, dv, r = spec.ssm_state, spec.ssm_v_dim, spec.ssm_heads // spec.ssm_groups
    width = 2 * dk + 2 * r * dv  # rows per key head
    starts = np.arange(spec.ssm_groups)[:, None] * width  # [Hk, 1]
    q = (starts + np.arange(dk)).reshape(-1)
    k = (starts + dk + np.arange(dk)).reshape(-1)
    v = (starts + 2 * dk + np.arange(r * dv)).reshape(-1)
    z = (starts + 2 * dk + r * dv + np.arange(r * dv)).reshape(-1)
    return np.concatenate([q, k, v]), z


def recurrent_matrices(spec: ModelSpec, names, layer: int) -> dict[str, tuple[str, object]]:
    """The product matrices of recurrent layer `layer`: {qkv [C, H], gate [VI, H], ba [2*Hv, H],
    out [H, VI]} -> (tensor name, rows to take in order, or None for all as stored)."""
    p = f"blk.{layer}."
    if legacy_ssm_in(spec, names):
        qkv_rows, z_rows = legacy_qkvz_rows(spec)
        qkv, gate = (p + "ssm_in.weight", qkv_rows), (p + "ssm_in.weight", z_rows)
    else:
        qkv, gate = (p + "attn_qkv.weight", None), (p + "attn_gate.weight", None)
    return {"qkv": qkv, "gate": gate, "ba": (p + "ssm_ba.weight", ba_rows(spec)),
            "out": (p + "ssm_out.weight", None)}
