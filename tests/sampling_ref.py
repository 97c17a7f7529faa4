"""A float64 numpy reference of the device's sampling candidates (backends/cuda/sample.cu):
what the kernel must return for a logit row, and a host row with the device row's interface
so the sampler's candidate path can be checked against its whole-row path on the CPU."""
import numpy as np

from strata.backends.cuda.logits import CAND_MAX, Candidates


def reference_candidates(logits, num, temperature, penalties, num_valid, want_mass):
    """(ids, values, mass, has_nan) of one row: penalties as the host applies them, the `num`
    largest penalised values of ids < num_valid (ties: lowest id), the softmax mass."""
    x = np.array(logits[:num_valid], dtype=np.float32)
    if penalties is not None:
        ids, rep, sub = penalties
        keep = ids < num_valid
        ids, rep, sub = ids[keep], rep[keep], sub[keep]
        y = x[ids]
        y = np.where(rep != 1, np.where(y > 0, y / rep, y * rep), y).astype(np.float32)
        x[ids] = np.where(sub != 0, y - sub, y)
    has_nan = bool(np.isnan(x).any())
    order = np.lexsort((np.arange(x.shape[0]), -x.astype(np.float64)))[:min(num, num_valid)]
    mass = 0.0
    if want_mass and not has_nan:
        z = x.astype(np.float64) / temperature
        with np.errstate(invalid="ignore"):  # a row without a finite peak: NaN, as no mass
            mass = float(np.exp(z - z[order[0]]).sum())
    return order.astype(np.int32), x[order], mass, has_nan


class HostLogitRow:
    """A logit row on the host with DeviceLogitRow's interface (counts its calls)."""

    max_candidates = CAND_MAX

    def __init__(self, logits, with_greedy_id: bool = False):
        self.logits = np.asarray(logits, dtype=np.float32)
        self.num_candidate_calls = 0
        self.num_whole_copies = 0
        if with_greedy_id:  # as the CUDA pass's argmax_rows: lowest id on ties, -1 for a NaN
            self.greedy_id = -1 if np.isnan(self.logits).any() else int(np.argmax(self.logits))

    @property
    def shape(self):
        return self.logits.shape

    def candidates(self, num, temperature, penalties, num_valid, want_mass):
        self.num_candidate_calls += 1
        ids, values, mass, has_nan = reference_candidates(self.logits, num, temperature,
                                                          penalties, num_valid, want_mass)
        return None if has_nan else Candidates(ids, values, mass)

    def __array__(self, dtype=None, copy=None):
        self.num_whole_copies += 1
        return self.logits if dtype is None else self.logits.astype(dtype)
