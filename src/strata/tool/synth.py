"""Random-weight GGUF models at a preset's shape (`strata-tool synth`), deterministic per seed.

Quantised weights are drawn directly as random blocks with their fp16 scales set by hand (never by
quantising floats), so even the qwen3-30b-a3b shape is written in minutes with bounded memory.
"""
from __future__ import annotations

import collections
import json
import math
import os
import zlib
from dataclasses import fields
from functools import lru_cache
from importlib import resources

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType

from strata.errors import ConfigError, ModelFormatError
from strata.model import arch as model_arch
from strata.model.arch import ModelSpec
from strata.model.writer import row_bytes, write_gguf
from strata.tool.presets import get_preset
from strata.tool.routing import check_seed, check_skew, skew_router_rows

WEIGHT_TYPES: dict[str, QT] = {
    "f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0,
    "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "iq4_nl": QT.IQ4_NL,
    "q2_k": QT.Q2_K, "q3_k": QT.Q3_K, "q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K,
    "iq4_xs": QT.IQ4_XS, "iq1_s": QT.IQ1_S, "iq1_m": QT.IQ1_M, "iq2_xxs": QT.IQ2_XXS,
    "iq2_xs": QT.IQ2_XS, "iq2_s": QT.IQ2_S, "iq3_xxs": QT.IQ3_XXS, "iq3_s": QT.IQ3_S,
}
# the grid i-quants: random blocks, d set so that the weights get their std (_iq_unit_rms)
IQ_GRID_TYPES = (QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S)
# llama.cpp's quantiser (llama_tensor_get_type): a k-quant or IQ4_XS tensor whose rows are not a
# multiple of 256 columns is written in a 32-column type instead (F16 where 32 does not divide
# them either): e.g. Qwen1.5-MoE's expert down projections (1408 columns) in its Q4_K_M files
FALLBACK_TYPES: dict[QT, QT] = {QT.Q2_K: QT.IQ4_NL, QT.Q3_K: QT.IQ4_NL, QT.IQ4_XS: QT.IQ4_NL,
                                QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
                                **{t: QT.IQ4_NL for t in IQ_GRID_TYPES}}
# llama.cpp's Q4_K_M and Q5_K_M files (its llama_tensor_get_type): the base type, with Q6_K for
# the head and, in the layers use_more_bits picks, for attn_v and ffn_down (experts too)
MIXES: dict[str, QT] = {"q4_k_m": QT.Q4_K, "q5_k_m": QT.Q5_K}
_MIX_FILE_TYPES = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M}
_FILE_TYPES = {
    QT.F32: LlamaFileType.ALL_F32, QT.F16: LlamaFileType.MOSTLY_F16,
    QT.BF16: LlamaFileType.MOSTLY_BF16, QT.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    QT.Q4_0: LlamaFileType.MOSTLY_Q4_0, QT.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    QT.Q5_K: LlamaFileType.MOSTLY_Q5_K_M, QT.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    QT.Q2_K: LlamaFileType.MOSTLY_Q2_K, QT.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    QT.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS, QT.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    QT.Q5_0: LlamaFileType.MOSTLY_Q5_0, QT.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    QT.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL, QT.IQ1_S: LlamaFileType.MOSTLY_IQ1_S,
    QT.IQ1_M: LlamaFileType.MOSTLY_IQ1_M, QT.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS,
    QT.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS, QT.IQ2_S: LlamaFileType.MOSTLY_IQ2_S,
    QT.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS, QT.IQ3_S: LlamaFileType.MOSTLY_IQ3_S,
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>")
# Qwen's fill-in-the-middle tokens, in its order; a synth vocabulary larger than the shipped
# tokenizer holds them after it (strata.model.fim finds them by these spellings).
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>")
# Added tokens that stay in decoded text (llama.cpp's USER_DEFINED, type 4), as in Qwen's files.
TEXT_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_CHUNK_BYTES = 32 << 20  # rows are generated this many bytes at a time (fixed: keeps determinism)
_EMBED_STD = 0.03
_NORM_SPREAD = 0.1  # norm weights are uniform in 1 +- this
_BIAS_STD = 0.01


# ---------------------------------------------------------------- tokenizer and template

def data_text(name: str) -> str:
    return resources.files("strata.data").joinpath(name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _tokenizer_vocab() -> tuple[list[str], list[str], set[str]]:
    """(tokens in id order, merges as "a b", special tokens) of the shipped tokenizer."""
    doc = json.loads(data_text("synth_tokenizer.json"))
    vocab: dict[str, int] = dict(doc["model"]["vocab"])
    specials = set()
    for added in doc.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            specials.add(added["content"])
    tokens = [""] * len(vocab)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    if "" in tokens:
        raise ModelFormatError("the shipped synth_tokenizer.json has gaps in its token ids; "
                               "rebuild it with tools/train_synth_tokenizer.py")
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    return tokens, merges, specials


def synth_tokenizer_meta(vocab: int | None = None) -> dict[str, object]:
    """llama.cpp's tokenizer.* GGUF keys for the shipped tokenizer, padded to `vocab` tokens."""
    tokens, merges, specials = _tokenizer_vocab()
    vocab = len(tokens) if vocab is None else vocab
    if vocab < len(tokens):
        raise ConfigError(f"vocab {vocab} is smaller than the shipped tokenizer's "
                          f"{len(tokens)} tokens; use vocab >= {len(tokens)}")
    token_types = [3 if t in specials else 4 if t in TEXT_TAGS else 1 for t in tokens]
    # Where the vocabulary has room, Qwen's fill-in-the-middle tokens come next, typed as in
    # Qwen's files (user-defined), and llama.cpp's unused [PAD{id}] tokens fill the rest.
    fim = list(FIM_TOKENS) if vocab - len(tokens) >= len(FIM_TOKENS) else []
    pad_ids = range(len(tokens) + len(fim), vocab)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens + fim + [f"[PAD{i}]" for i in pad_ids],
        "tokenizer.ggml.token_type": token_types + [4] * len(fim) + [5] * len(pad_ids),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": data_text("chat_template.jinja"),
    }


# ---------------------------------------------------------------- random blocks

def _scales_f16(rng: np.random.Generator, num_blocks: int, scale: float,
                signed: bool) -> np.ndarray:
    """[num_blocks, 2] uint8: fp16 scales of `scale` +- 20%, with a random sign if `signed`.

    A random sign per block cancels the -0.5 mean of formats whose codes are asymmetric."""
    d = scale * rng.uniform(0.8, 1.2, num_blocks)
    if signed:
        d *= rng.choice(np.array([-1.0, 1.0]), num_blocks)
    return d.astype(np.float16).view(np.uint8).reshape(num_blocks, 2)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block into Q4_K/Q5_K's 12 bytes. sc, m: [N, 8]."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _pack_q3_k_scales(sc: np.ndarray) -> np.ndarray:
    """Pack 16 six-bit scales per block into Q3_K's 12 bytes. sc: [N, 16] in 0..63."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:8] = (sc[:, :8] & 15) | ((sc[:, 8:] & 15) << 4)
    hi = (sc >> 4) & 3                                        # byte 8 + t, bits 2s: scale 4s + t
    out[:, 8:12] = hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6)
    return out


def _random_bytes(rng: np.random.Generator, num_blocks: int, n: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(num_blocks * n), dtype=np.uint8).reshape(num_blocks, n)


def _iq_raw(rng: np.random.Generator, num_blocks: int, qtype: QT, scale: float) -> np.ndarray:
    """[num_blocks, bytes] random i-quant blocks (grid indices, signs, sub-scales) whose fp16 d
    is `scale` +- 20% (IQ1_M keeps d in the top nibbles of its four u16 scales)."""
    _, type_bytes = GGML_QUANT_SIZES[qtype]
    blocks = _random_bytes(rng, num_blocks, type_bytes).copy()
    d = _scales_f16(rng, num_blocks, scale, False)
    if qtype != QT.IQ1_M:
        blocks[:, 0:2] = d
        return blocks
    bits = d.copy().view(np.uint16).reshape(num_blocks)
    scales = blocks[:, 48:56].copy().view(np.uint16)
    for i in range(4):
        scales[:, i] = (scales[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
    blocks[:, 48:56] = scales.view(np.uint8)
    return blocks


@lru_cache(maxsize=None)
def _iq_unit_rms(qtype: QT) -> float:
    """rms of the weights of random `qtype` blocks with d = 1 (a fixed sample)."""
    from strata._native import kernels

    blocks = _iq_raw(np.random.default_rng(1234), 512, qtype, 1.0)
    w = kernels.dequantize(blocks, int(qtype), 512 * 256).astype(np.float64)
    return float(np.sqrt(np.mean(w ** 2)))


def random_blocks(qtype: QT, num_values: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """`num_values` random weights of about `std` (mean 0) encoded as `qtype`: flat uint8."""
    if qtype in (QT.F32, QT.F16, QT.BF16):
        values = rng.standard_normal(num_values, dtype=np.float32) * np.float32(std)
        if qtype == QT.F32:
            return values.view(np.uint8)
        if qtype == QT.F16:
            return values.astype(np.float16).view(np.uint8)
        bits = values.view(np.uint32)  # BF16: round to nearest even on the top 16 bits
        bits = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    n = num_values // block_size
    if qtype == QT.Q4_0:  # codes 0..15 - 8: rms 4.637
        parts = [_scales_f16(rng, n, std / 4.637, True), _random_bytes(rng, n, 16)]
    elif qtype in (QT.Q4_1, QT.Q5_1):
        # w = d*q + m with m = -d*mid: w = d*(q - mid), mean 0 (rms 4.610 / 9.233)
        mid, q_rms = (7.5, 4.610) if qtype == QT.Q4_1 else (15.5, 9.233)
        d = _scales_f16(rng, n, std / q_rms, False)
        m = (-d.view(np.float16).astype(np.float32) * mid).astype(np.float16).view(np.uint8)
        parts = [d, m.reshape(n, 2)]
        if qtype == QT.Q5_1:
            parts.append(_random_bytes(rng, n, 4))  # qh: the fifth bits
        parts.append(_random_bytes(rng, n, 16))
    elif qtype == QT.Q5_0:  # codes 0..31 - 16: rms 9.247 (mean -0.5: signed scales cancel it)
        parts = [_scales_f16(rng, n, std / 9.247, True), _random_bytes(rng, n, 4 + 16)]
    elif qtype == QT.IQ4_NL:  # kvalues: rms 67.4 (mean -5.9: signed scales cancel it)
        parts = [_scales_f16(rng, n, std / 67.4, True), _random_bytes(rng, n, 16)]
    elif qtype == QT.Q8_0:  # int8 codes: rms 73.9
        parts = [_scales_f16(rng, n, std / 73.9, True), _random_bytes(rng, n, 32)]
    elif qtype in (QT.Q4_K, QT.Q5_K):
        # w = d*sc*q - dmin*m; with m = sc and dmin = d*mid, w = d*sc*(q - mid): mean 0.
        num_levels = 16 if qtype == QT.Q4_K else 32
        mid = (num_levels - 1) / 2
        sc = rng.integers(32, 64, (n, 8), dtype=np.uint8)  # rms 48.39
        q_rms = math.sqrt((num_levels ** 2 - 1) / 12)
        d = _scales_f16(rng, n, std / (q_rms * 48.39), False)
        dmin = (d.view(np.float16).astype(np.float32) * mid).astype(np.float16).view(np.uint8)
        parts = [d, dmin, _pack_k_scales(sc, sc)]
        if qtype == QT.Q5_K:
            parts.append(_random_bytes(rng, n, 32))  # qh: the fifth bit
        parts.append(_random_bytes(rng, n, 128))
    elif qtype == QT.Q2_K:
        # w = d*sc*q - dmin*m per 16 values, q 0..3; m = sc and dmin = 1.5 d: w = d*sc*(q - 1.5)
        sc = rng.integers(8, 16, (n, 16), dtype=np.uint8)  # rms 11.73
        d = _scales_f16(rng, n, std / (1.118 * 11.73), False)
        dmin = (d.view(np.float16).astype(np.float32) * 1.5).astype(np.float16).view(np.uint8)
        parts = [sc | (sc << 4), _random_bytes(rng, n, 64), d, dmin]
    elif qtype == QT.Q3_K:
        # w = d*(sc - 32)*q per 16 values, q -4..3 (rms 2.345, mean -0.5: signed scales cancel
        # it); sc - 32 = +-[8, 31]: rms 20.69
        signed = rng.integers(8, 32, (n, 16)) * rng.choice(np.array([-1, 1]), (n, 16))
        parts = [_random_bytes(rng, n, 32 + 64), _pack_q3_k_scales((signed + 32).astype(np.uint8)),
                 _scales_f16(rng, n, std / (2.345 * 20.69), False)]
    elif qtype == QT.IQ4_XS:
        # w = d*(ls - 32)*kvalue per 32 values, kvalues rms 67.4 (mean -5.9: signed scales
        # cancel it); ls - 32 = +-[8, 31]: rms 20.69
        signed = rng.integers(8, 32, (n, 8)) * rng.choice(np.array([-1, 1]), (n, 8))
        ls = (signed + 32).astype(np.uint16)
        high = np.zeros(n, dtype=np.uint16)
        for b in range(8):
            high |= ((ls[:, b] >> 4) & 3) << (2 * b)
        low = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
        parts = [_scales_f16(rng, n, std / (67.4 * 20.69), False),
                 high.view(np.uint8).reshape(n, 2), low.astype(np.uint8),
                 _random_bytes(rng, n, 128)]
    elif qtype == QT.Q6_K:  # codes -32..31: rms 18.48; int8 sub-scales +-[32, 63]: rms 48.39
        sc = rng.integers(32, 64, (n, 16), dtype=np.int16)
        sc *= rng.choice(np.array([-1, 1], dtype=np.int16), (n, 16))
        parts = [_random_bytes(rng, n, 128 + 64), sc.astype(np.int8).view(np.uint8),
                 _scales_f16(rng, n, std / (18.48 * 48.39), False)]
    elif qtype in IQ_GRID_TYPES:  # values of both signs around 0: only d sets the std
        parts = [_iq_raw(rng, n, qtype, std / _iq_unit_rms(qtype))]
    else:
        raise ConfigError(f"synth cannot generate {qtype.name} weights; "
                          f"use one of {', '.join(WEIGHT_TYPES)}")
    return np.concatenate(parts, axis=1).reshape(-1)


def _tensor_std(spec: ModelSpec, name: str) -> float:
    """Target std: inputs scaled by 1/sqrt(fan_in) so pre-activations are O(1); outputs written
    to the residual stream by a further 1/sqrt(2 * n_layers) so it stays O(1) over the layers."""
    fan_in = model_arch.expected_tensors(spec)[name][-1]
    if name == "token_embd.weight":
        return _EMBED_STD
    if name.endswith(("attn_output.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight",
                      "ssm_out.weight")):
        return 1.0 / math.sqrt(fan_in * 2 * spec.n_layers)
    return 1.0 / math.sqrt(fan_in)


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    # Seeded by name, so a tensor's values do not depend on which others the model has.
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _make_tensor(spec: ModelSpec, name: str, qtype: QT, seed: int, routing_skew: float = 0.0):
    """A zero-argument callable producing tensor `name` (data as `write_gguf` takes it)."""
    shape = model_arch.expected_tensors(spec)[name]

    def make() -> np.ndarray:
        rng = _tensor_rng(seed, name)
        recurrent = _recurrent_small(name, shape, rng)
        if recurrent is not None:
            return recurrent
        if model_arch.is_small_tensor(name) and not name.endswith("ffn_gate_inp_shexp.weight"):
            if name.endswith(".bias"):
                return (rng.standard_normal(shape) * _BIAS_STD).astype(np.float32)
            return rng.uniform(1 - _NORM_SPREAD, 1 + _NORM_SPREAD, shape).astype(np.float32)
        std = _tensor_std(spec, name)
        num_rows, num_cols = int(np.prod(shape[:-1])), shape[-1]
        bytes_per_row = row_bytes(qtype, num_cols)
        out = np.empty((num_rows, bytes_per_row), dtype=np.uint8)
        rows_per_chunk = max(1, _CHUNK_BYTES // bytes_per_row)
        for start in range(0, num_rows, rows_per_chunk):
            stop = min(num_rows, start + rows_per_chunk)
            out[start:stop] = random_blocks(qtype, (stop - start) * num_cols, std,
                                            rng).reshape(stop - start, bytes_per_row)
        if qtype == QT.F32:
            values = out.view(np.float32).reshape(shape)
            if routing_skew > 0 and name.endswith("ffn_gate_inp.weight"):
                # A separate stream: skew 0 leaves every file byte-identical to before.
                skew_rng = np.random.default_rng([seed, zlib.crc32(name.encode()), 1])
                values = skew_router_rows(values, routing_skew, skew_rng)
            return values
        return out.reshape(*shape[:-1], bytes_per_row)

    return make


def _recurrent_small(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray | None:
    """qwen3next's small recurrent tensors at the scales the model is initialised with: A =
    -exp(A_log) for A_log = log(U(0.01, 16)), dt bias N(0, 0.5), conv taps of std 1/sqrt(taps);
    None for every other tensor."""
    if name.endswith(".ssm_a"):
        return -rng.uniform(0.01, 16.0, shape).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)
    if name.endswith("ssm_conv1d.weight"):
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
    return None


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third."""
    return (layer < n_layers // 8 or layer >= 7 * n_layers // 8
            or (layer - n_layers // 8) % 3 == 2)


def tensor_type(name: str, weight_type: QT, n_layers: int = 0, mixed: bool = False,
                cols: int | None = None) -> QT:
    """The type synth stores `name` as: F32 for norms, biases and routers, else `weight_type`;
    `mixed` (a Q4_K_M / Q5_K_M file of n_layers layers): Q6_K for the head, and for attn_v and
    ffn_down in the layers _more_bits picks. Rows of `cols` columns that a k-quant cannot hold
    take llama.cpp's fallback type (FALLBACK_TYPES)."""
    qtype = _base_type(name, weight_type, n_layers, mixed)
    if cols is not None and qtype in FALLBACK_TYPES and cols % 256:
        return FALLBACK_TYPES[qtype] if cols % 32 == 0 else QT.F16
    return qtype


def _base_type(name: str, weight_type: QT, n_layers: int, mixed: bool) -> QT:
    if model_arch.is_small_tensor(name) or name.endswith("ffn_gate_inp.weight"):
        return QT.F32
    if mixed:
        if name == "output.weight":
            return QT.Q6_K
        parts = name.split(".")
        if (parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps",
                                               "ffn_down_shexp")
                and _more_bits(int(parts[1]), n_layers)):
            return QT.Q6_K
    return weight_type


# ---------------------------------------------------------------- the model

_ROW_NAMES = {"attn_output.weight": "q_dim (heads x head_dim)", "ffn_down_exps.weight":
              "expert_ffn", "ffn_down_shexp.weight": "shared_ffn"}


def build_spec(shape: str = "tiny", arch_name: str | None = None, **overrides) -> ModelSpec:
    """The preset's spec, switched to `arch_name` and with `overrides` applied, checked."""
    spec = get_preset(shape)
    if arch_name is not None and arch_name != spec.arch:
        if arch_name not in model_arch.ARCHITECTURES:
            raise ConfigError(f"unknown architecture {arch_name!r}; choose one of "
                              f"{', '.join(model_arch.ARCHITECTURES)}")
        if arch_name == "qwen3next":
            raise ConfigError(f"shape {shape!r} has no gated delta-net sizes to switch to "
                              "qwen3next; use --shape tiny-qwen3next or qwen3-next-80b-a3b")
        # llama.cpp's qwen3moe has no shared expert; qwen2moe needs one. Leaving qwen3next
        # drops its recurrent layers (every layer attends) and partial RoPE.
        shared_ffn = spec.hidden if arch_name == "qwen2moe" else 0
        spec = spec.with_(arch=arch_name, shared_ffn=shared_ffn,
                          norm_topk=arch_name == "qwen3moe", full_attn_interval=0, ssm_conv=0,
                          ssm_state=0, ssm_groups=0, ssm_heads=0, ssm_inner=0, rope_dim=0)
    known = {f.name for f in fields(ModelSpec)} - {"arch"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"cannot override {', '.join(unknown)}; spec fields are "
                          f"{', '.join(sorted(known))}")
    spec = spec.with_(**overrides)
    try:
        model_arch._check_spec(spec, f"shape {shape!r}")
    except ModelFormatError as exc:
        raise ConfigError(str(exc)) from None
    return spec


def _check_rows(spec: ModelSpec, shape: str, types: dict[str, QT]) -> None:
    for name, dims in model_arch.expected_tensors(spec).items():
        qtype = types[name]
        block_size, _ = GGML_QUANT_SIZES[qtype]
        if qtype == QT.F32 or dims[-1] % block_size == 0:
            continue
        field = next((v for k, v in _ROW_NAMES.items() if name.endswith(k)), "hidden")
        raise ConfigError(
            f"shape {shape!r} with {qtype.name.lower()}: {field} {dims[-1]} is not a multiple of "
            f"{block_size}, the block size of {qtype.name} (rows of {name}); use f32, f16, bf16, "
            f"q8_0 or q4_0, or a larger shape")


def synth_model(path: str | os.PathLike, shape: str = "tiny", weight_type: str = "q4_0",
                arch: str | None = None, seed: int = 0, progress: bool = False,
                routing_skew: float = 0.0, jobs: int = 1, **overrides) -> ModelSpec:
    """Write a random-weight model at preset `shape` to `path`; return its spec.

    The same arguments give a byte-identical file. `overrides` replace spec fields
    (e.g. n_layers=2); `arch` switches the preset's architecture. `routing_skew` > 0 makes each
    layer's router favour a minority of experts (tool/routing.py). `jobs` > 1 makes the tensors
    in that many processes (the same bytes; a 30B-shaped model takes ~1 min with 16).
    """
    kind = weight_type.lower()
    mixed = kind in MIXES
    qtype = MIXES.get(kind) or WEIGHT_TYPES.get(kind)
    if qtype is None:
        raise ConfigError(f"unknown weight type {weight_type!r}; choose one of "
                          f"{', '.join([*WEIGHT_TYPES, *MIXES])}")
    check_skew(routing_skew, "routing skew")
    check_seed(seed)
    spec = build_spec(shape, arch, **overrides)
    names = _write_order(spec)
    shapes = model_arch.expected_tensors(spec)
    types = {n: tensor_type(n, qtype, spec.n_layers, mixed, shapes[n][-1]) for n in names}
    _check_rows(spec, shape, types)
    tokenizer_meta = synth_tokenizer_meta(spec.vocab)
    file_type = _MIX_FILE_TYPES[kind] if mixed else _FILE_TYPES[qtype]
    extra = {"general.file_type": int(file_type), "general.quantization_version": 2,
             "strata.synth.seed": int(seed), "strata.synth.shape": shape}
    if routing_skew > 0:
        extra["strata.synth.routing_skew"] = float(routing_skew)
    name = f"strata-synth-{shape}-{weight_type.lower()}"
    if jobs <= 1:
        tensors = [(n, types[n], _make_tensor(spec, n, types[n], seed, routing_skew))
                   for n in names]
        write_gguf(path, spec, tensors, tokenizer_meta, extra_meta=extra, progress=progress,
                   name=name)
        return spec
    import signal
    from concurrent.futures import ProcessPoolExecutor

    # Ctrl-C reaches the whole process group: only this process handles it (the partial file
    # goes, the jobs not started are cancelled, those running end and are dropped); a worker
    # interrupted too printed its traceback and left the pool waiting for it forever.
    # Not multiprocessing.Pool: its terminate() could hang for good (CI, under load): its
    # result thread had stopped reading, a worker blocked writing a big tensor into the full
    # result pipe while holding the pipe's lock, and terminate() waited for that lock to put
    # its sentinel. The executor's thread reads results until its workers have exited.
    jobs_args = iter([(spec, n, int(types[n]), seed, routing_skew) for n in names])
    with ProcessPoolExecutor(jobs, initializer=signal.signal,
                             initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
        ahead = collections.deque()   # futures in write order; 2 a worker made ahead at most

        def next_tensor() -> np.ndarray:
            while len(ahead) < 2 * jobs and (job := next(jobs_args, None)) is not None:
                ahead.append(pool.submit(_make_job, job))
            return ahead.popleft().result()

        try:
            tensors = [(n, types[n], next_tensor) for n in names]
            write_gguf(path, spec, tensors, tokenizer_meta, extra_meta=extra,
                       progress=progress, name=name)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return spec


def _make_job(job) -> np.ndarray:
    spec, name, qtype, seed, routing_skew = job
    return _make_tensor(spec, name, QT(qtype), seed, routing_skew)()


def _write_order(spec: ModelSpec) -> list[str]:
    """llama.cpp's order: embeddings, the layers, then the output norm and head."""
    names = list(model_arch.expected_tensors(spec))
    head = [n for n in names if n in ("output_norm.weight", "output.weight")]
    return [n for n in names if n not in head] + head
