"""make_trace: a RoutingTrace from hand-written windows (shared by the tier/replay tests)."""
from __future__ import annotations

import numpy as np

from strata.experts.trace import RECORD_DTYPE, RoutingTrace


def make_trace(n_layers: int, n_experts: int, windows) -> RoutingTrace:
    """`windows[w][layer]` is a dict {expert: rows} or an iterable of experts (1 row each)."""
    records = []
    for window, layers in enumerate(windows):
        for layer, experts in enumerate(layers):
            rows = experts if isinstance(experts, dict) else {e: 1 for e in experts}
            records += [(window, layer, e, r) for e, r in sorted(rows.items())]
    return RoutingTrace(n_layers, n_experts, np.array(records, dtype=RECORD_DTYPE), {})
