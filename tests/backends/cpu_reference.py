"""A float64 numpy forward pass written straight from the model definition, for tests only.

It dequantises every weight with `gguf.quants` (not Strata's kernels) and loops per head and per
token, so it shares no code with `strata.backends.cpu`.
"""
import numpy as np
from gguf import GGMLQuantizationType, quants

from strata.model.gguf_file import GGUFModel


def weight(model: GGUFModel, name: str) -> np.ndarray:
    t = model.tensor(name)
    return quants.dequantize(t.raw, GGMLQuantizationType(t.qtype)).astype(np.float64)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rope(x, pos, theta):  # x [T, heads, D], NEOX: rotate the two halves
    half = x.shape[-1] // 2
    inv = theta ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
    ang = pos[:, None, None] * inv[None, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def reference_logits(model: GGUFModel, tokens) -> np.ndarray:
    """Logits [T, V] (float64) of `tokens` at positions 0..T-1."""
    s = model.spec
    tokens = np.asarray(tokens)
    T, D, G = len(tokens), s.head_dim, s.n_heads // s.n_kv_heads
    pos = np.arange(T, dtype=np.float64)
    x = weight(model, "token_embd.weight")[tokens]
    for i in range(s.n_layers):
        def w(name):
            return weight(model, f"blk.{i}.{name}")

        h = _rms(x, w("attn_norm.weight"), s.rms_eps)
        q, k, v = h @ w("attn_q.weight").T, h @ w("attn_k.weight").T, h @ w("attn_v.weight").T
        if s.has_attn_bias:
            q, k, v = q + w("attn_q.bias"), k + w("attn_k.bias"), v + w("attn_v.bias")
        q, k, v = q.reshape(T, -1, D), k.reshape(T, -1, D), v.reshape(T, -1, D)
        if s.has_qk_norm:
            q = _rms(q, w("attn_q_norm.weight"), s.rms_eps)
            k = _rms(k, w("attn_k_norm.weight"), s.rms_eps)
        q, k = _rope(q, pos, s.rope_theta), _rope(k, pos, s.rope_theta)
        att = np.zeros((T, s.n_heads, D))
        for head in range(s.n_heads):
            for t in range(T):
                scores = k[:t + 1, head // G] @ q[t, head] / np.sqrt(D)
                p = np.exp(scores - scores.max())
                att[t, head] = (p / p.sum()) @ v[:t + 1, head // G]
        x = x + att.reshape(T, -1) @ w("attn_output.weight").T

        h = _rms(x, w("ffn_norm.weight"), s.rms_eps)
        logits = h @ w("ffn_gate_inp.weight").T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        gate, up = w("ffn_gate_exps.weight"), w("ffn_up_exps.weight")
        down = w("ffn_down_exps.weight")
        moe = np.zeros_like(x)
        for t in range(T):
            ids = np.argsort(-probs[t], kind="stable")[:s.n_experts_used]
            wts = probs[t, ids] / (probs[t, ids].sum() if s.norm_topk else 1.0)
            for e, wt in zip(ids, wts):
                moe[t] += wt * (down[e] @ (_silu(gate[e] @ h[t]) * (up[e] @ h[t])))
        if s.has_shared_expert:
            inner = _silu(h @ w("ffn_gate_shexp.weight").T) * (h @ w("ffn_up_shexp.weight").T)
            sig = 1.0 / (1.0 + np.exp(-(h @ w("ffn_gate_inp_shexp.weight"))))
            moe += sig[:, None] * (inner @ w("ffn_down_shexp.weight").T)
        x = x + moe
    x = _rms(x, weight(model, "output_norm.weight"), s.rms_eps)
    head = "token_embd.weight" if s.tied_output else "output.weight"
    return x @ weight(model, head).T
