"""Synthetic routing skew: router weights whose top-k favours a minority of experts (for
`strata-tool synth --routing-skew`), and synthetic traces with skew and locality (`synth-trace`).
"""
from __future__ import annotations

import math

import numpy as np

from strata.errors import ConfigError
from strata.experts.trace import RECORD_DTYPE, RoutingTrace


def check_skew(skew: float, what: str) -> None:
    """ConfigError unless `skew` is a finite number >= 0 (NaN made NaN popularities and routers
    silently; inf a single expert with every other at probability 0)."""
    if not (skew >= 0 and math.isfinite(skew)):
        raise ConfigError(f"{what} must be a finite number >= 0 (0 = uniform), not {skew}")


def check_seed(seed: int) -> None:
    """ConfigError unless `seed` lies in 0..2**64 - 1: numpy's generators take no negative one
    and the model file keeps it as a u64."""
    if not 0 <= seed < 1 << 64:
        raise ConfigError(f"the seed must be an integer in 0..{(1 << 64) - 1}, not {seed}")


def zipf_popularity(n_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """[E] float64 routing probabilities proportional to 1 / (rank + 1) ** skew, the ranks a
    random permutation of the experts (so each layer favours different experts)."""
    check_skew(skew, "routing skew")
    ranks = rng.permutation(n_experts)
    weights = 1.0 / (ranks + 1.0) ** skew
    return weights / weights.sum()


def skew_router_rows(router: np.ndarray, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Scale the rows of one layer's router `ffn_gate_inp` [E, H] by (rank + 1) ** -skew (random
    ranks, rms of the scales 1). On isotropic hidden states an expert's logit spread grows with
    its row norm, so top-k picks the large-norm experts more often: skew 0.5 gives the top 10% of
    64 experts about a quarter of the top-8 picks. Returns a new float32 array."""
    check_skew(skew, "--routing-skew")
    ranks = rng.permutation(router.shape[0])
    scales = (ranks + 1.0) ** -skew  # [E]
    scales /= np.sqrt(np.mean(scales ** 2))
    return (router * scales[:, None]).astype(np.float32)


def synth_trace(n_layers: int, n_experts: int, top_k: int, num_windows: int,
                rows_per_window: int = 4, skew: float = 1.0, locality: float = 0.5,
                phase_windows: int = 0, seed: int = 0, *,
                stream_topics: bool = False) -> RoutingTrace:
    """A decode trace of `rows_per_window` token streams. Per layer, each expert a stream's
    token was routed to is routed again for its next token with probability `locality` (so
    consecutive tokens share part of their experts); the rest of the `top_k` are drawn, distinct,
    from a Zipf(`skew`) popularity over the experts. The popularity is the layer's own, shared by
    all streams, and drawn again every `phase_windows` windows (0: never), as when the topic
    changes; with `stream_topics` each stream has its own popularity (its topic) and changes it
    every `phase_windows` windows at its own time (staggered), as separate conversations do."""
    if not 1 <= top_k <= n_experts:
        raise ConfigError(f"top-k {top_k} must lie in 1..{n_experts} (the number of experts)")
    check_skew(skew, "skew")
    check_seed(seed)
    if not 0.0 <= locality < 1.0:
        raise ConfigError(f"locality must lie in [0, 1), not {locality}")
    if phase_windows < 0:
        raise ConfigError(f"phase windows must be >= 0 (0 = one phase), not {phase_windows}")
    if num_windows < 1 or rows_per_window < 1:
        raise ConfigError(f"need at least one window and one row per window, not "
                          f"{num_windows} windows of {rows_per_window} rows")
    rng = np.random.default_rng(seed)
    num_streams = rows_per_window
    phase_length = phase_windows or num_windows
    # Stream s changes topic at windows offset_s + j * phase_length; shared topics change at once.
    offsets = (np.arange(num_streams) * phase_length // num_streams
               if stream_topics and phase_windows else np.zeros(num_streams, dtype=np.int64))
    num_phases = (num_windows + phase_length - 1) // phase_length + 1
    num_owners = num_streams if stream_topics else 1
    log_popularity = np.log(np.stack([  # [L, owners, phases, E]
        [[zipf_popularity(n_experts, skew, rng) for _ in range(num_phases)]
         for _ in range(num_owners)] for _ in range(n_layers)]))
    owner = np.arange(num_streams) % num_owners  # [S]
    rows = np.zeros((num_windows, n_layers, n_experts), dtype=np.int64)  # [W, L, E]
    is_chosen = np.zeros((n_layers, num_streams, n_experts), dtype=bool)  # [L, S, E]
    positions = np.arange(n_experts)
    for window in range(num_windows):
        phase = (window + offsets) // phase_length  # [S]
        keys = log_popularity[:, owner, phase, :] + rng.gumbel(size=is_chosen.shape)  # [L, S, E]
        is_kept = is_chosen & (rng.random(is_chosen.shape) < locality)
        num_needed = top_k - is_kept.sum(axis=2, keepdims=True)  # [L, S, 1]
        # Gumbel top-k over the experts not kept: distinct draws proportional to popularity.
        keys[is_kept] = -np.inf
        order = np.argsort(-keys, axis=2)
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, positions[None, None, :], axis=2)
        is_chosen = is_kept | (rank < num_needed)
        rows[window] = is_chosen.sum(axis=1)
    windows, layers, experts = np.nonzero(rows)  # sorted by (window, layer, expert)
    records = np.empty(len(windows), dtype=RECORD_DTYPE)
    records["window"], records["layer"], records["expert"] = windows, layers, experts
    records["rows"] = rows[windows, layers, experts]
    extra = {"synthetic": {"top_k": top_k, "rows_per_window": rows_per_window, "skew": skew,
                           "locality": locality, "phase_windows": phase_windows,
                           "stream_topics": stream_topics, "seed": seed}}
    return RoutingTrace(n_layers, n_experts, records, extra)
