"""Synthetic routing skew: router weights whose top-k favours a minority of experts (for
`strata-tool synth --routing-skew`), and synthetic traces with skew and locality (`synth-trace`).
"""
from __future__ import annotations

import numpy as np

from strata.errors import ConfigError
from strata.experts.trace import RECORD_DTYPE, RoutingTrace


def zipf_popularity(n_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """[E] float64 routing probabilities proportional to 1 / (rank + 1) ** skew, the ranks a
    random permutation of the experts (so each layer favours different experts)."""
    if skew < 0:
        raise ConfigError(f"routing skew must be >= 0 (0 = uniform), not {skew}")
    ranks = rng.permutation(n_experts)
    weights = 1.0 / (ranks + 1.0) ** skew
    return weights / weights.sum()


def skew_router_rows(router: np.ndarray, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Scale the rows of one layer's router `ffn_gate_inp` [E, H] by (rank + 1) ** -skew (random
    ranks, rms of the scales 1). On isotropic hidden states an expert's logit spread grows with
    its row norm, so top-k picks the large-norm experts more often: skew 0.5 gives the top 10% of
    64 experts about a quarter of the top-8 picks. Returns a new float32 array."""
    if skew < 0:
        raise ConfigError(f"--routing-skew must be >= 0 (0 = uniform), not {skew}")
    ranks = rng.permutation(router.shape[0])
    scales = (ranks + 1.0) ** -skew  # [E]
    scales /= np.sqrt(np.mean(scales ** 2))
    return (router * scales[:, None]).astype(np.float32)


def synth_trace(n_layers: int, n_experts: int, top_k: int, num_windows: int,
                rows_per_window: int = 4, skew: float = 1.0, locality: float = 0.5,
                phase_windows: int = 0, seed: int = 0) -> RoutingTrace:
    """A decode trace of `rows_per_window` token streams: per layer, each stream's next token
    keeps its previous token's top-k experts with probability `locality`, else draws `top_k`
    distinct experts from that layer's Zipf(`skew`) popularity. Every `phase_windows` windows
    (0: never) each layer's popularity ranks are drawn again, as when the topic changes."""
    if not 1 <= top_k <= n_experts:
        raise ConfigError(f"top-k {top_k} must lie in 1..{n_experts} (the number of experts)")
    if not 0.0 <= locality < 1.0:
        raise ConfigError(f"locality must lie in [0, 1), not {locality}")
    if phase_windows < 0:
        raise ConfigError(f"phase windows must be >= 0 (0 = one phase), not {phase_windows}")
    if num_windows < 1 or rows_per_window < 1:
        raise ConfigError(f"need at least one window and one row per window, not "
                          f"{num_windows} windows of {rows_per_window} rows")
    rng = np.random.default_rng(seed)
    window_ids = np.arange(num_windows)
    parts = []
    for layer in range(n_layers):
        num_phases = 1 if phase_windows == 0 else -(-num_windows // phase_windows)
        phase = window_ids // (phase_windows or num_windows)  # [W]
        log_popularity = np.log(np.stack([zipf_popularity(n_experts, skew, rng)
                                          for _ in range(num_phases)]))[phase]  # [W, E]
        # Gumbel top-k: k distinct experts drawn with probabilities proportional to popularity.
        gumbel = rng.gumbel(size=(num_windows, rows_per_window, n_experts))  # [W, S, E]
        keys = log_popularity[:, None, :] + gumbel
        fresh = np.argpartition(-keys, top_k - 1, axis=2)[:, :, :top_k]  # [W, S, K]
        is_kept = rng.random((num_windows, rows_per_window)) < locality  # [W, S]
        is_kept[0] = False
        # Each (window, stream) uses the experts drawn at its stream's last fresh window.
        last_fresh = np.maximum.accumulate(np.where(is_kept, 0, window_ids[:, None]), axis=0)
        chosen = np.take_along_axis(fresh, last_fresh[:, :, None], axis=0)  # [W, S, K]
        rows = np.zeros((num_windows, n_experts), dtype=np.int64)  # [W, E]
        np.add.at(rows, (np.repeat(window_ids, rows_per_window * top_k), chosen.reshape(-1)), 1)
        windows, experts = np.nonzero(rows)
        part = np.empty(len(windows), dtype=RECORD_DTYPE)
        part["window"], part["layer"], part["expert"] = windows, layer, experts
        part["rows"] = rows[windows, experts]
        parts.append(part)
    records = np.concatenate(parts)
    records = records[np.lexsort((records["expert"], records["layer"], records["window"]))]
    extra = {"synthetic": {"top_k": top_k, "rows_per_window": rows_per_window, "skew": skew,
                           "locality": locality, "phase_windows": phase_windows,
                           "seed": seed}}
    return RoutingTrace(n_layers, n_experts, records, extra)
