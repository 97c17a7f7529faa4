"""Prompt chunks with experts in RAM (docs/offload.md, "Streaming prompt chunks"): a window of
many rows copies each layer's non-resident experts host->VRAM with the copy engine into staging
slots (borrowed from the expert cache, or a dedicated buffer), double-buffered against the
compute stream, and the same kernels read them there: only the device tables point elsewhere.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from strata._native import cuda_driver

log = logging.getLogger("strata.tier")

# Windows of at least this many rows stream their layers' missing experts; smaller ones read
# the misses over PCIe from inside the kernels. Measured on the H200 (qwen3-30b-a3b Q4_0, no
# cache): streaming costs ~296 ms per window whatever its rows (all 6144 experts at 55 GB/s);
# PCIe reads cost 93 / 132 / 543 ms at 32 / 64 / 512 rows: the two meet near 240 rows.
STREAM_MIN_ROWS = 256
NUM_STAGES = 2  # staging sets: the j-th streamed layer of a window is copied into set j % 2
# staging is borrowed from the cache when it takes at most this share of the slots, else a
# dedicated buffer holds it
BORROW_MAX_SHARE = 0.5
BORROW_TIMEOUT_S = 10.0
_MAX_LISTS = 8  # streamed launch lists kept (one per plan and residency version)
COMPUTE, COPY = "compute", "copy"
# A streamed window copies a missing expert whether or not the window routes to it. One it
# routes to rarely stays at its host copy instead (GPU reach: the kernels read it over PCIe only
# when routed): when its chance of being read in the window times REACH_COST is below 1. A read
# from inside the kernels costs more than a copy: the copies run ahead of the compute stream,
# while the products wait for such a read, done by the few blocks of one expert. Measured on the
# H200 (synth qwen3-30b-a3b Q4_0, routing skew 1, docs/offload.md): pp512 at 0% cache 1,707 ->
# 2,940 / 3,043 tokens/s at a cost of 2 / 1.5, 1,709 at 4 (too few windows for the counts to
# call an expert rare); at 1.5 the first window after a single 2048-row window lost 12%.
REACH_COST = 2.0
# Only windows of at most this many rows leave experts: 4096-row windows took longer than their
# copies (compute-bound: 10,528 tokens/s at 0% against 16 GB copied at 55 GB/s in 300 ms), so
# leaving copies saved them nothing and the reads cost them 7% (1.5: 9,815-9,849 tokens/s).
RARE_MAX_ROWS = 2048
# With a CPU pool attached, the pool computes the rare experts a window routes to after all
# (within the device's caps, share.PROMPT_POOL_ROWS), so leaving one costs the link nothing when
# it is not routed and little when it is: an expert is copied only when it is nearly sure to be
# read (a chance above 0.99: ~4.6 expected rows). Measured on the H200 (synth qwen3-30b-a3b Q4_0,
# routing skew 1, no expert cached, pp512, docs/offload.md): 1.05 / 1.1 / 1.2 gave 3,600-3,700 /
# 3,510-3,540 / 3,470-3,520 tokens/s against 3,010 without the pool; in later calls 1.01 gave
# 3,783-3,888 against 3,620-3,719 at 1.05 (1.003 3,776; 1.0, which copies only experts expected
# to get ~37 rows, 3,018); a rule by expected rows (copy from 8 / 16 / 32 rows) handed the pool
# more rows than it could compute in the layer's time and lost.
POOL_REACH_COST = 1.01
# Only windows of at most this many rows hand rare experts to the pool: a 2048-row window gives
# each routed rare expert ~4x the rows of a 512-row one, and pp2048 lost (medians of 4: 7,514
# against 9,230 without the pool), where pp1024 gained 18% (6,399 against 5,426).
PROMPT_POOL_MAX_ROWS = 1024
# The routing counts behind that chance: pairs routed per (layer, expert), halved every
# COUNT_HALF_LIFE_ROWS window rows (prompts weigh as much as their rows, decode tokens little),
# read with one pseudo-pair per expert, so that an expert is called rare only after enough rows.
COUNT_HALF_LIFE_ROWS = 4096
# The counts give each expert's rows on average, but a prompt window's rows are alike (one
# prompt's tokens), so its routing comes in bursts: on the synth qwen3-30b-a3b (routing skew 1)
# a deep layer's expert gets hundreds of rows in one 512-row window and none in the next, and
# the counts' chance of a read, from the mean, calls it sure: at 1.01 a window copied ~46
# experts a layer, ~13 of them not routed. So the streamer also keeps, per (layer, expert), the
# share of the recent streamed windows that routed to it (each window weighing HIT_DECAY times
# the one after it); from the second such window on, a window the pool serves takes the lower
# of the two chances, at a cost of HIT_REACH_COST. Measured on the H200 (that synth, no expert
# cached, pp512, medians of 6, alternating; docs/offload.md, "Bursts"): 5,242 / 5,216 / 5,238 /
# 5,081 against 4,545 / 4,613 with the counts alone (33.1 GiB streamed over 7 windows instead of
# 44.3); a cost of 1.01 gave 4,890-5,017, 1.43 5,183 / 5,199, 1.67 5,118.
HIT_DECAY = 0.8
HIT_REACH_COST = 1.25
# COLD_LAYERS_RARE: a layer whose counts are still all zero (a fresh server with no profile
# to seed them: its first prompt window) gives every expert the same chance, which at
# POOL_REACH_COST copies them all. With a CPU pool every missing expert of such a layer is left
# rare instead: the guessed copies, pull_rare and the pool then bring only what the window
# routes to. Measured on an H100 host (synth qwen3-30b-a3b Q4_0, routing skew 0, no expert
# cached, docs/offload.md, "Session 84"): that first 512-row window took 125-130 ms instead
# of 295 ms copying all 15.5 GiB (105-115 ms on the skew-1 synth); the later windows alike.
# STRATA_COLD_RARE=0 turns it off (read at import).
COLD_LAYERS_RARE = os.environ.get("STRATA_COLD_RARE", "1") != "0"
# STRATA_POOL_SURE=S (percent of a layer's copies, 0 off; or auto, below): a streamed
# window whose pool takes rare experts also leaves to the pool S% of each layer's sure experts
# (those it would copy), the fewest expected rows first (at most share.PROMPT_POOL_ROWS), and
# adds their cost to the pool's budget: each one the pool computes (AMX rows from 16 rows,
# amx.c) takes an expert's bytes off the link, which the copies of the sure experts hold.
ENV_POOL_SURE = "STRATA_POOL_SURE"
# STRATA_POOL_SURE=auto (the default; not with the tier frozen, --adapt-every 0: which side
# computes an expert then depends on timing, and the pool rounds differently; offload.py's
# build_vram_arena): the percent follows
# the pool's share of each streamed window it served (SurePercent): up SURE_AUTO_STEP while the
# pool computed under the band's low end of the window (its compute + its wait for the GPU),
# down above the high end, 0..SURE_AUTO_MAX. On an H100, skew-0 synth, pp512: S = 0 / 30 / 60
# put the pool at ~20% / ~31% / ~53% of the window; auto against 0: +8.3% there, +10.3% on
# the skew-1 synth (docs/offload.md, "Session 74").
SURE_AUTO_STEP = 10
SURE_AUTO_MAX = 50
SURE_AUTO_BAND = (0.35, 0.45)
# STRATA_POOL_BUDGET=auto (the default; with STRATA_POOL_SURE=auto, so not with the tier
# frozen): the pool's budget for a streamed window's rare experts (share.prompt_pool_budget's
# share of the layer's copy time) follows the same share of the window, before the sure percent
# does: a step up BUDGET_AUTO_SHARES while the pool computed under the band's low end (the sure
# percent up only at the top step), down while over its high end once the sure percent is 0.
# Why first: a rare expert costs the pool few rows for the bytes it takes off the link, a sure
# one many. Why it moves: the share that paid differs by host and routing (share.py's comment
# above PROMPT_POOL_ROWS): on an H100 host, skew-0 / skew-1 synth, pp512, medians of six
# alternating rounds, fixed 1.5 4,570 / 5,773, fixed 4.5 5,004 / 5,484, this 4,902 / 5,724
# (ending at 9 / 1.5; docs/offload.md, "Session 81"). The band's low end was 0.30 while only the
# sure percent moved (session 74).
# STRATA_POOL_BUDGET=S (a number > 0) fixes the share at S.
ENV_POOL_BUDGET = "STRATA_POOL_BUDGET"
BUDGET_AUTO_SHARES = (1.5, 2.25, 3.0, 4.5, 6.75, 9.0, 13.5, 18.0)
# STRATA_POOL_SURE=model (opt-in; against auto on H100 hosts, sessions 78-79, no gain in 12 rounds
# on either synth: docs/offload.md, "Session 79"): the same, but outside SURE_MODEL_BAND the
# percent goes to the highest multiple of SURE_AUTO_STEP up to SURE_MODEL_MAX, at most
# SURE_MODEL_RISE above the last, whose modelled pool time is the band's middle of the window: the
# last window's pool time per row unit (SURE_MODEL_EXPERT_ROWS an expert + its rows) times its
# units less the sure experts it had, plus the sure experts' at that percent (sure_costs). Why: on
# an H100 host, skew-0 synth, pp512, fixed percents 60 / 70 / 80 put the pool at 38% / 43% / 47%
# of the window and gained 5.1% / 5.8% / 0.8% over auto, whose climb of 10 a window from 0 a
# 7-window bench ends at 50; on the skew-1 synth 70 put it at 52% and lost 2.1%.
SURE_MODEL_MAX = 70
SURE_MODEL_RISE = 40
SURE_MODEL_BAND = (0.35, 0.45)
# An expert's pool cost in rows' worth, for the model above: the AMX rows (amx.c, from
# kernels.amx_rows() rows) on an H100 host's Xeon, tools/bench_pool_kernel.py --rows-per-expert
# at 15 threads from RAM: ~31 us an expert + ~2.4 a row (8 rows 50 us, 16 64, 24 89), so 13;
# without AMX, the lane tiles' share.POOL_EXPERT_ROWS. Session 79's host, with session 78's
# kernel: ~61 + ~2.0 a row, i.e. ~31 (left at 13, the value the A/B above ran with).
SURE_MODEL_EXPERT_ROWS = 13
# STRATA_STREAM_TIMELINE=1: every streamed window records timing events, waits for its end and
# logs where its time went (WindowTimeline; a diagnosis, it costs each window its overlap with
# the next).
ENV_TIMELINE = "STRATA_STREAM_TIMELINE"


@dataclass(frozen=True)
class Op:
    """One entry of a streamed window: `launches` [first, stop) of the plan's list, a `copy`
    of experts [first, stop) of `layer` into its staging set, or an event `record` / `wait`
    on the compute or the copy stream."""

    kind: str
    stream: str
    first: int = 0
    stop: int = 0
    layer: int = -1
    event: tuple = ()


@dataclass(frozen=True)
class Refill:
    """A borrowed slot given back: the expert it held, copied in again (a StreamCopier load)."""

    slot: int
    layer: int
    expert: int
    is_eviction: bool = False


def copy_runs(missing: np.ndarray) -> list[tuple[int, int]]:
    """(first, stop) of each run of consecutive True in `missing` [E]: one copy each (expert e
    sits at slot e of its staging set and of its layer's host copies)."""
    m = np.concatenate(([False], np.asarray(missing, dtype=bool), [False]))
    edges = np.flatnonzero(m[1:] != m[:-1])  # starts and stops alternate
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def run_bytes(copied: np.ndarray, slot_bytes: int, image_bytes: np.ndarray) -> np.ndarray:
    """[L, E] uint64: the bytes each expert's copy moves when `copied` [L, E] are copied one
    run of consecutive experts at a time: the run's first expert copies the whole run ((n - 1)
    slots and the last expert's image, `image_bytes` [L]), the others nothing (as copy_runs)."""
    L, E = copied.shape
    padded = np.zeros((L, E + 2), dtype=bool)
    padded[:, 1:-1] = copied
    edges = np.flatnonzero(padded.ravel()[1:] != padded.ravel()[:-1])  # starts, stops alternate
    starts, stops = edges[::2], edges[1::2]
    rows, cols = starts // (E + 2), starts % (E + 2)
    out = np.zeros((L, E), dtype=np.uint64)
    out[rows, cols] = ((stops - starts - 1).astype(np.uint64) * np.uint64(slot_bytes)
                       + np.asarray(image_bytes, dtype=np.uint64)[rows])
    return out


def streamed_layers(residency: np.ndarray) -> list[int]:
    """Layers with at least one non-resident expert in `residency` [L, E] (slot or -1)."""
    return [int(layer) for layer in np.flatnonzero((residency < 0).any(axis=1))]


def rare_experts(residency: np.ndarray, routed: np.ndarray, num_rows: int, top_k: int,
                 reach_cost: float | None = None, hit_share: np.ndarray | None = None,
                 hit_cost: float | None = None, cold_rare: bool = False) -> np.ndarray:
    """[L, E] bool: the missing experts a streamed window of `num_rows` rows leaves at their
    host copies (read over PCIe from inside the kernels if routed after all): those whose chance
    of being read, times `reach_cost` (None: REACH_COST), is below 1. Expected rows of expert e:
    (routed[e] + 1) / (sum(routed) + E) x num_rows x top_k, from `routed` [L, E] (decayed pairs),
    so that with few counts no expert looks rare. With `hit_share` [L, E] (the share of recent
    streamed windows that routed to each expert, HitShare) the chance is the lower of the two
    and the cost `hit_cost` (None: HIT_REACH_COST). `cold_rare`: a layer whose counts are all
    zero leaves every missing expert (COLD_LAYERS_RARE: where a CPU pool serves the window)."""
    from strata.backends.cuda.share import expected_reads

    routed = np.asarray(routed, dtype=np.float64)
    cost = REACH_COST if reach_cost is None else float(reach_cost)
    E = routed.shape[1]
    spread = (routed + 1.0) / (routed.sum(axis=1, keepdims=True) + E)  # [L, E]
    reads = expected_reads(spread * max(int(num_rows), 1) * int(top_k), num_rows)
    if hit_share is not None:
        reads = np.minimum(reads, hit_share)
        cost = HIT_REACH_COST if hit_cost is None else float(hit_cost)
    rare = (np.asarray(residency) < 0) & (reads * cost < 1.0)
    if cold_rare:
        cold = ~routed.any(axis=1)  # [L] no routing seen
        rare[cold] = np.asarray(residency)[cold] < 0
    return rare


def _sure_order(residency: np.ndarray, routed: np.ndarray, rare: np.ndarray, num_rows: int,
                top_k: int, rows_cap: float) -> tuple[np.ndarray, ...]:
    """(copied [L], order [L, E], rows [L, E], candidates [L]): per layer the experts a streamed
    window copies (missing, not `rare`), each layer's experts with those of them expected to get
    at most `rows_cap` rows first, fewest expected rows first (ties by expert), their expected
    rows (as in rare_experts), and how many there are."""
    routed = np.asarray(routed, dtype=np.float64)
    E = routed.shape[1]
    copied = (np.asarray(residency) < 0) & ~np.asarray(rare, dtype=bool)  # [L, E]
    spread = (routed + 1.0) / (routed.sum(axis=1, keepdims=True) + E)
    rows = spread * max(int(num_rows), 1) * int(top_k)  # [L, E] expected rows
    cand = copied & (rows <= rows_cap)
    order = np.argsort(np.where(cand, rows, np.inf), axis=1, kind="stable")  # [L, E]
    return copied.sum(axis=1), order, rows, cand.sum(axis=1)


def _sure_take(copied: np.ndarray, candidates: np.ndarray, percent: int) -> np.ndarray:
    """[L] int: how many experts a layer leaves to the pool at `percent`% of its copies."""
    take = np.floor(copied * max(0, int(percent)) / 100.0).astype(np.int64)
    return np.minimum(take, candidates)


def sure_for_pool(residency: np.ndarray, routed: np.ndarray, rare: np.ndarray, num_rows: int,
                  top_k: int, percent: int, rows_cap: int) -> tuple[np.ndarray, np.ndarray]:
    """([L, E] bool, [L] float64): per layer the `percent`% of its copied experts (missing,
    not `rare`) with the fewest expected rows, of those expected to get at most `rows_cap`
    (expected rows as in rare_experts), left to the CPU pool; and their expected rows per
    layer (the pool's added budget)."""
    copied, order, rows, candidates = _sure_order(residency, routed, rare, num_rows, top_k,
                                                  rows_cap)
    take = _sure_take(copied, candidates, percent)
    L, E = rows.shape
    sure = np.zeros((L, E), dtype=bool)
    picked = np.arange(E)[None, :] < take[:, None]  # [L, E] over each layer's order
    np.put_along_axis(sure, order, picked, axis=1)
    return sure, np.where(sure, rows, 0.0).sum(axis=1)


def sure_costs(residency: np.ndarray, routed: np.ndarray, rare: np.ndarray, num_rows: int,
               top_k: int, percents, rows_cap: int, expert_rows: float) -> np.ndarray:
    """[len(percents)] float64: the pool's row units (`expert_rows` an expert + its expected
    rows) of the sure experts sure_for_pool leaves it at each of `percents`, summed over the
    layers."""
    copied, order, rows, candidates = _sure_order(residency, routed, rare, num_rows, top_k,
                                                  rows_cap)
    ranked = np.take_along_axis(rows, order, axis=1)  # [L, E] fewest first
    L, E = rows.shape
    ranked[np.arange(E)[None, :] >= candidates[:, None]] = 0.0
    cum = np.concatenate((np.zeros((L, 1)), np.cumsum(ranked, axis=1)), axis=1)  # [L, E + 1]
    out = []
    for percent in percents:
        take = _sure_take(copied, candidates, percent)
        out.append(float(take.sum() * expert_rows + cum[np.arange(L), take].sum()))
    return np.asarray(out)


def pool_budget_setting(env=None) -> float | str:
    """STRATA_POOL_BUDGET: "auto" (unset or empty: SurePercent moves the budget along
    BUDGET_AUTO_SHARES) or a share of the copy time > 0, fixed."""
    from strata.errors import ConfigError

    env = os.environ if env is None else env
    text = env.get(ENV_POOL_BUDGET, "").strip().lower()
    if text in ("", "auto"):
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0.0):
        raise ConfigError(f"{ENV_POOL_BUDGET}={text!r}: give auto (the pool's share of each "
                          "window moves it) or the pool's budget per layer in copy times of "
                          "the layer's copied experts, a number > 0 (e.g. 4.5)")
    return value


def pool_sure_setting(env=None) -> int | str:
    """STRATA_POOL_SURE: a percent 0..100 (0: off), "auto" (SurePercent; unset or empty) or
    "model" (SurePercent.modelled)."""
    from strata.backends.cuda.offload import count_setting
    from strata.errors import ConfigError

    env = os.environ if env is None else env
    word = env.get(ENV_POOL_SURE, "").strip().lower()
    if word in ("", "auto", "model"):
        return word or "auto"
    try:
        return count_setting(ENV_POOL_SURE, 0, "percent", 100, env)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or auto (the pool's share of each window decides) or model "
                          "(the same, jumping where the pool's modelled time fits)") from None


def pool_follower(sure: int | str, budget: float | str) -> tuple["SurePercent | None", float]:
    """(the SurePercent that moves the sure percent, and with STRATA_POOL_BUDGET=auto the rare
    experts' budget, or None; the budget's share of the copy time where none moves it) for
    the settings `sure` (pool_sure_setting) and `budget` (pool_budget_setting)."""
    from strata.backends.cuda.share import POOL_SHARE_OF_COPY

    fixed = POOL_SHARE_OF_COPY if budget == "auto" else float(budget)
    if sure == "auto":
        return SurePercent(shares=BUDGET_AUTO_SHARES if budget == "auto" else (fixed,)), fixed
    return (SurePercent.modelled(fixed) if sure == "model" else None), fixed


class SurePercent:
    """STRATA_POOL_SURE=auto's percent, and with it the pool's budget for the rare experts
    (`share_of_copy`, a step of `shares`, starting at share.POOL_SHARE_OF_COPY or the nearest
    one below): `record` each streamed window the pool served (its seq, compute and wait ms,
    the row units it computed, and `costs`, a function giving the sure experts' modelled row
    units at the percents of `grid`, or None; a window seen before changes nothing). While the
    pool's compute is within `band` of the window both stay. Under it the budget moves a step
    up, or at the top step the percent `step` up (to `most`); over it the percent moves `step`
    down, or at 0 the budget a step down. With `costs` (STRATA_POOL_SURE=model, `modelled`, one
    share) the percent goes to the highest of `grid` (0..`most` by `step`; at most `rise`
    above the last) whose modelled pool time is the band's middle of the window (the module's
    comment above SURE_MODEL_MAX)."""

    def __init__(self, step: int = SURE_AUTO_STEP, most: int = SURE_AUTO_MAX,
                 band: tuple[float, float] = SURE_AUTO_BAND, rise: int | None = None,
                 shares=None):
        from strata.backends.cuda.share import POOL_SHARE_OF_COPY

        self.step, self.most, self.band = int(step), int(most), band
        self.rise = self.step if rise is None else int(rise)
        self.grid = list(range(0, self.most + 1, self.step))
        self.percent = 0
        self.shares = tuple(shares) if shares else (POOL_SHARE_OF_COPY,)
        self.level = max([0] + [i for i, v in enumerate(self.shares) if v <= POOL_SHARE_OF_COPY])
        self._seen = None

    @property
    def share_of_copy(self) -> float:
        return float(self.shares[self.level])

    @classmethod
    def modelled(cls, share_of_copy: float | None = None) -> "SurePercent":
        """STRATA_POOL_SURE=model's, with the budget fixed at `share_of_copy` (default
        share.POOL_SHARE_OF_COPY)."""
        return cls(SURE_AUTO_STEP, SURE_MODEL_MAX, SURE_MODEL_BAND, SURE_MODEL_RISE,
                   shares=None if share_of_copy is None else (share_of_copy,))

    def record(self, seq: int, pool_ms: float, wait_ms: float, units: float = 0.0,
               costs=None) -> int:
        window_ms = pool_ms + wait_ms
        if seq == self._seen or window_ms <= 0.0:
            return self.percent
        self._seen = seq
        share = pool_ms / window_ms
        if self.band[0] <= share <= self.band[1]:
            return self.percent
        if costs is None:  # a step towards the band: the budget's first going up, last down
            top = len(self.shares) - 1
            if share < self.band[0] and self.level < top:
                self.level += 1
            elif share > self.band[1] and self.percent == 0 and self.level > 0:
                self.level -= 1
            else:
                step = self.step if share < self.band[0] else -self.step
                self.percent = min(self.most, max(0, self.percent + step))
            return self.percent
        modelled = np.asarray(costs(self.grid), dtype=np.float64)  # [grid] row units
        now = modelled[self.grid.index(self.percent)] if self.percent in self.grid else 0.0
        if units > 0.0 and pool_ms > 0.0:  # ms per row unit, and the units besides the sure
            per_unit, rest = pool_ms / units, max(0.0, units - now)
            fits = per_unit * (rest + modelled) <= 0.5 * sum(self.band) * window_ms
        else:  # the pool computed nothing timed: the model has no figures, all fit
            fits = np.ones(len(self.grid), dtype=bool)
        best = max((p for p, ok in zip(self.grid, fits)
                    if ok and p <= self.percent + self.rise), default=0)
        # the model moves it the way the measured share asks, never the other way
        self.percent = max(best, self.percent) if share < self.band[0] else min(best, self.percent)
        return self.percent


def sure_model_expert_rows() -> float:
    """SURE_MODEL_EXPERT_ROWS where the pool's kernel takes the AMX rows, else the lane tiles'
    share.POOL_EXPERT_ROWS."""
    from strata._native import kernels
    from strata.backends.cuda.share import POOL_EXPERT_ROWS

    return float(SURE_MODEL_EXPERT_ROWS if kernels.amx_available() else POOL_EXPERT_ROWS)


class HitShare:
    """Per (layer, expert) the share of the recent streamed windows that routed to it, each
    window weighing HIT_DECAY times the next: [L, E] in 0..1, or None before two windows."""

    def __init__(self, num_layers: int, num_experts: int, decay: float = HIT_DECAY):
        self.decay = float(decay)
        self.hits = np.zeros((num_layers, num_experts))  # [L, E] decayed windows routed to it
        self.weight = 0.0  # decayed windows

    def add(self, counts: np.ndarray) -> None:
        """A streamed window's routed pairs [L, E]."""
        self.hits *= self.decay
        self.hits += np.asarray(counts) > 0
        self.weight = self.weight * self.decay + 1.0

    def share(self) -> np.ndarray | None:
        return self.hits / self.weight if self.weight >= 1.0 + self.decay - 1e-9 else None


def decay_counts(routed: np.ndarray, counts: np.ndarray, top_k: int) -> None:
    """Into `routed` [L, E] (decayed pairs), a window's routed pairs `counts` [L, E]: the old
    ones halved every COUNT_HALF_LIFE_ROWS of the window's rows, then the new ones added."""
    rows = counts.sum() / max(1, routed.shape[0] * int(top_k))
    routed *= 0.5 ** (rows / COUNT_HALF_LIFE_ROWS)
    routed += counts


def seeded_counts(rows: np.ndarray, top_k: int) -> np.ndarray:
    """[L, E] decayed pairs to start from, from a profile's `rows` [L, E]: each layer's rows
    shared out over the counts' steady state, COUNT_HALF_LIFE_ROWS x top_k / ln 2 pairs (the
    sum of top_k pairs a row halved every COUNT_HALF_LIFE_ROWS rows); a layer the profile saw
    nothing of stays at zero (PromptStreamer.left_for: every expert of it rare with a pool,
    none without)."""
    rows = np.asarray(rows, dtype=np.float64)
    total = rows.sum(axis=1, keepdims=True)  # [L, 1]
    steady = COUNT_HALF_LIFE_ROWS * int(top_k) / math.log(2)
    return rows * np.where(total > 0, steady / np.maximum(total, 1.0), 0.0)


def stream_tables(mirror: np.ndarray, residency: np.ndarray, stage_bases, slot_bytes: int,
                  part_offsets: np.ndarray, rare: np.ndarray | None = None) -> np.ndarray:
    """[L, 3, E] uint64, the device tables of a streamed window: the j-th streamed layer's
    missing experts at their staging slot (set j % 2, expert e at slot e of it), the rest as
    `mirror` (resident experts: their cache slot; `rare` [L, E] ones: their host copy)."""
    out = mirror.copy()
    for j, layer in enumerate(streamed_layers(residency)):
        copied = residency[layer] < 0 if rare is None else (residency[layer] < 0) & ~rare[layer]
        missing = np.flatnonzero(copied)  # [m]
        starts = (np.uint64(stage_bases[j % NUM_STAGES])
                  + missing.astype(np.uint64) * np.uint64(slot_bytes))  # [m]
        out[layer][:, missing] = starts[None, :] + part_offsets[layer][:, None]
    return out


def stream_schedule(num_launches: int, spans, runs: dict[int, list[tuple[int, int]]],
                    timeline: bool = False,
                    tier_spans: dict[str, dict[int, tuple[int, int]]] | None = None
                    ) -> list[Op]:
    """The entries of a streamed window in issue order. `spans[l]` = (first, stop) of layer
    l's expert launches in the plan's list; `runs[l]` its copies (streamed layers only).

    The copy stream starts after the compute stream's work so far (event start), copies the
    first two streamed layers, then streamed layer j + 2 once streamed layer j's expert
    launches are done (event read j: they share a staging set); the compute stream waits for
    a layer's copies (event copied l) right before its expert launches.
    `timeline` adds records of timing events, keys ("t", what, ...) (WindowTimeline), and
    nothing else: the order of the other entries is the same. With it, `tier_spans` {name:
    {layer: (first, stop)}} (WindowPlan.tier_spans) adds ("t", name, l) and ("t", name +
    "_end", l) around each streamed layer's span outside its expert launches."""
    layers = sorted(runs)
    ops = [Op("record", COMPUTE, event=("start",)), Op("wait", COPY, event=("start",))]
    at_launch: dict[int, list[tuple]] = {}  # launch index -> the marks recorded before it
    for name, per_layer in (tier_spans or {}).items() if timeline else ():
        for layer in layers:
            first, stop = per_layer.get(layer, (0, 0))
            if first < stop:
                at_launch.setdefault(first, []).append((name, layer))
                at_launch.setdefault(stop, []).append((name + "_end", layer))

    def mark(stream: str, *key) -> None:
        if timeline:
            ops.append(Op("record", stream, event=("t",) + key))

    def launches(first: int, stop: int) -> None:
        """Launches [first, stop) on the compute stream, the marks at_launch from first to stop
        among them (a span ending at stop is marked before what follows the launches)."""
        for index in sorted(i for i in at_launch if first <= i <= stop):
            if index > first:
                ops.append(Op("launches", COMPUTE, first, index))
            for key in at_launch.pop(index):
                mark(COMPUTE, *key)
            first = index
        if stop > first:
            ops.append(Op("launches", COMPUTE, first, stop))

    mark(COMPUTE, "start")

    def copies(layer: int) -> None:
        mark(COPY, "copy", layer)
        ops.extend(Op("copy", COPY, first, stop, layer) for first, stop in runs[layer])
        ops.append(Op("record", COPY, event=("copied", layer)))
        mark(COPY, "copied", layer)

    for layer in layers[:NUM_STAGES]:
        copies(layer)
    at = 0
    for j, layer in enumerate(layers):
        first, stop = spans[layer]
        launches(at, first)
        mark(COMPUTE, "ready", layer)
        ops.append(Op("wait", COMPUTE, event=("copied", layer)))
        mark(COMPUTE, "go", layer)
        launches(first, stop)
        mark(COMPUTE, "done", layer)
        at = stop
        if j + NUM_STAGES < len(layers):
            ops += [Op("record", COMPUTE, event=("read", layer)),
                    Op("wait", COPY, event=("read", layer))]
            copies(layers[j + NUM_STAGES])
    launches(at, num_launches)
    for key in at_launch.pop(num_launches, []):
        mark(COMPUTE, *key)
    mark(COMPUTE, "end")
    return ops


def minor_faults() -> int:
    """The process's minor page faults so far (getrusage), -1 where the platform has none."""
    try:
        import resource
    except ImportError:  # not on Windows
        return -1
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


@dataclass(frozen=True)
class WindowTimeline:
    """Where a streamed window's time went, from its timing events (ms; `STRATA_STREAM_TIMELINE`
    = 1): `total` from the window's start to its last launch; `fill` until the first streamed
    layer's experts could start; the copy engine `copying` (sum of each layer's copies) and
    `held` (waiting for the compute stream to release a staging set); the compute stream
    `waiting` for copies and `experts` (the streamed layers' expert launches); `tail` from the
    last copy to the end; `grouping` (the tier's launches after each layer's grouping), of it
    `guess` (the wait for the guessed copies), `pulls` (pull_rare) and `publish` (the rows to
    the pool), and `pool` (the combine with the pool's y, its wait for the pool included),
    summed over the streamed layers; `faults`, the process's minor page faults since the last
    timed window (or the streamer's start), -1 where unknown (the first windows' pool ran
    slower, docs/offload.md "Session 81": its kept blocks fault in as its calls grow)."""

    rows: int
    total: float
    fill: float
    copying: float
    held: float
    waiting: float
    experts: float
    tail: float
    copied_bytes: int
    grouping: float = 0.0
    pool: float = 0.0
    guess: float = 0.0
    pulls: float = 0.0
    publish: float = 0.0
    faults: int = -1

    @classmethod
    def measure(cls, rows: int, layers: list[int], elapsed, copied_bytes: int,
                faults: int = -1) -> "WindowTimeline":
        """`elapsed(a, b)` = ms from key a's record to key b's (keys without the leading "t")."""
        at = lambda *key: elapsed(("start",), key)  # noqa: E731
        held = sum(at("copy", b) - at("copied", a) for a, b in zip(layers, layers[1:]))

        def span(name: str) -> float:  # a tier span's sum over the layers that have it
            total = 0.0
            for j in layers:
                try:
                    total += elapsed((name, j), (name + "_end", j))
                except KeyError:
                    pass
            return total

        return cls(rows, at("end"), at("go", layers[0]),
                   sum(elapsed(("copy", j), ("copied", j)) for j in layers), max(0.0, held),
                   sum(elapsed(("ready", j), ("go", j)) for j in layers),
                   sum(elapsed(("go", j), ("done", j)) for j in layers),
                   at("end") - at("copied", layers[-1]), copied_bytes,
                   span("grouping"), span("pool"), span("guess"), span("pulls"),
                   span("publish"), faults)

    def describe(self) -> str:
        rate = self.copied_bytes / max(self.copying, 1e-6) / 1e6  # GB/s
        return (f"streamed window of {self.rows} rows: {self.total:.1f} ms; copy engine "
                f"{self.copying:.1f} ms copying {self.copied_bytes / 2**30:.2f} GiB "
                f"({rate:.1f} GB/s), {self.held:.1f} ms held for a staging set; compute waited "
                f"{self.waiting:.1f} ms for copies, {self.experts:.1f} ms in the streamed layers' "
                f"experts, {self.grouping:.1f} ms in the tier's launches after the grouping "
                f"({self.guess:.1f} waiting for the guessed copies, {self.pulls:.1f} pulling, "
                f"{self.publish:.1f} publishing rows to the pool), {self.pool:.1f} ms combining "
                f"with the pool (its wait); first experts at {self.fill:.1f} ms, "
                f"{self.tail:.1f} ms after the last copy"
                + (f"; {self.faults} minor page faults in the process since the last timed "
                   "window" if self.faults >= 0 else ""))


class PromptStreamer:
    """The staging of a VramExpertArena for windows of >= `min_rows` rows (0: never).

    `before_window(num_rows)` (the arena's, engine thread, no window running) readies the
    staging for such a window: it borrows 2 x E slots at the end of the cache through the
    ordered path (their experts published missing, so they are streamed too) when that is at
    most half the cache, else allocates a dedicated buffer once; a smaller window gives the
    borrowed slots back, refilled with what they held by a StreamCopier on the side stream.
    `run(plan, stream)` (from WindowPlan.run) points the device tables at the staging for the
    window, runs the plan with the copies interleaved, and points them back after it."""

    def __init__(self, arena, min_rows: int = STREAM_MIN_ROWS):
        self.arena, self.min_rows = arena, min_rows
        self._rt = rt = arena._rt
        store = arena.store
        self.num_layers, self.num_experts = store.n_layers, store.n_experts
        with rt.active():
            self.copy_stream = rt.drv.Stream()
            self._table_host = rt.pinned((store.n_layers, 3, store.n_experts), np.uint64)
            self._pull_host = rt.pinned((store.n_layers,), np.uint64)
        self._pull_key = None
        self.num_pulled = 0  # rare experts pull_rare copied into staging (up to the last window)
        self.copy_stream_handle = int(self.copy_stream.handle)
        self.stage_bases: list[int] | None = None  # device address of each staging set
        self._dedicated = None
        self._borrowed: list[tuple[int, tuple[int, int] | None]] = []  # (slot, what it held)
        self._refills = None  # StreamCopier of the refills (made on first use)
        self._lists: OrderedDict = OrderedDict()  # id(plan) -> (plan, key, LaunchList, bytes)
        self._table_key = None
        # totals since start-up
        self.streamed_bytes = self.num_windows = 0
        self.num_borrowed = self.num_refilled = self.refilled_bytes = 0
        self.num_left = 0  # missing experts left at their host copies (rare_experts), all windows
        self._streak_bytes = self._streak_windows = self._streak_left = 0
        self._streak_by_share = 0  # of _streak_left: those the counts alone would have copied
        self._routed = np.zeros((store.n_layers, store.n_experts))  # [L, E] decayed pairs
        self._hits = HitShare(store.n_layers, store.n_experts)  # streamed windows' routing
        self._top_k = arena.model.spec.n_experts_used
        self.timeline = os.environ.get(ENV_TIMELINE, "0") == "1"
        self._image_bytes: np.ndarray | None = None  # [L] of an expert's image (made by _build)
        self.timelines: list[WindowTimeline] = []  # with timeline on: one per streamed window
        self._faults = minor_faults() if self.timeline else -1  # at the last timed window
        sure = pool_sure_setting()
        # (build_vram_arena drops sure_auto with the tier frozen: fixed_share then)
        self.sure_auto, self.fixed_share = pool_follower(sure, pool_budget_setting())
        self.sure_model = sure == "model"
        self.sure_percent = 0 if isinstance(sure, str) else sure

    @property
    def pool_share_of_copy(self) -> float:
        """The pool's budget for a streamed window's rare experts, in copy times of the layer's
        copied experts (share.prompt_pool_budget): SurePercent's step, else fixed."""
        return self.fixed_share if self.sure_auto is None else self.sure_auto.share_of_copy

    # ---- between windows ----------------------------------------------------------------
    def before_window(self, num_rows: int) -> None:
        if self._refills is not None:
            self._refills.pump()
        if self.wants(num_rows):
            if self.stage_bases is None and self._has_misses():
                self._ready_staging()
            self._follow_pool(num_rows)
        elif self._streak_windows or self._borrowed:
            self.release()

    def _follow_pool(self, num_rows: int) -> None:
        """STRATA_POOL_SURE=auto, before a streamed window (and before the arena's where table,
        so that the table and run() leave the same experts): the percent and the rare experts'
        budget after the last streamed window the pool served (SurePercent; with
        STRATA_POOL_SURE=model, the percent modelled on that window's rows)."""
        stats = self.arena.pool.last_stats if self.arena.pool is not None else None
        if self.sure_auto is None or stats is None or not self.pools_rare(num_rows):
            return
        from strata.backends.cuda.share import POOL_MAX_ROWS

        if getattr(self, "timeline", False) and stats.num_rows > POOL_MAX_ROWS:
            log.info("the pool's last window (%d rows): %d experts, %d routed entries, %.1f ms "
                     "computing, %.1f ms waiting for the GPU", stats.num_rows,
                     stats.num_experts, stats.num_entries, stats.pool_ms, stats.wait_ms)
        if stats.num_rows > POOL_MAX_ROWS and self.pools_rare(stats.num_rows):
            before = self.sure_percent, self.pool_share_of_copy
            units, costs = 0.0, None
            if getattr(self, "sure_model", False):  # STRATA_POOL_SURE=model
                expert_rows = sure_model_expert_rows()
                units = stats.num_experts * expert_rows + stats.num_entries
                costs = functools.partial(self.sure_costs, stats.num_rows,
                                          expert_rows=expert_rows)
            self.sure_percent = self.sure_auto.record(stats.seq, stats.pool_ms, stats.wait_ms,
                                                      units, costs)
            if (self.sure_percent, self.pool_share_of_copy) != before:
                log.info("prompt streaming: the pool computed %.1f of %.1f ms of the last "
                         "window; STRATA_POOL_SURE=%s now leaves it %d%% of the sure experts, "
                         "and its budget for the rare ones is %.2f x the layer's copy time",
                         stats.pool_ms, stats.pool_ms + stats.wait_ms,
                         "model" if costs is not None else "auto", self.sure_percent,
                         self.pool_share_of_copy)

    def sure_costs(self, num_rows: int, percents, expert_rows: float) -> np.ndarray:
        """[len(percents)]: the pool's modelled row units of the sure experts a window of
        `num_rows` rows would leave it at each of `percents` (stream.sure_costs)."""
        from strata.backends.cuda.share import PROMPT_POOL_ROWS

        rare, _, _ = self.left_for(num_rows)
        return sure_costs(self.arena.table.peek().table, self._routed, rare, num_rows,
                          self._top_k, percents, PROMPT_POOL_ROWS, expert_rows)

    def account(self, counts: np.ndarray) -> None:
        """A window's routed pairs [L, E] (the arena's account_routed): into the decayed counts
        rare_experts reads, and a streamed window's into the share of windows per expert."""
        decay_counts(self._routed, counts, self._top_k)
        rows = int(round(np.asarray(counts).sum(axis=1).max(initial=0) / max(1, self._top_k)))
        if self.leaves_rare(rows):
            self._hits.add(counts)

    def seed(self, rows: np.ndarray) -> None:
        """Start the counts from a profile's rows [L, E] (seeded_counts), so that a fresh server
        leaves rare experts from its first prompt instead of after ~2 windows of its size."""
        self._routed[:] = seeded_counts(rows, self._top_k)
        left = rare_experts(np.full(self._routed.shape, -1), self._routed, 512, self._top_k,
                            self._reach_cost(512))
        log.info("prompt streaming: routing counts seeded from the profile; a 512-row window "
                 "with no expert cached would leave %.1f of %d experts per layer to PCIe reads",
                 left.sum() / max(1, self.num_layers), self.num_experts)

    def leaves_rare(self, num_rows: int) -> bool:
        """Does a window of `num_rows` rows, when it streams, leave rare experts at their host
        copies (windows of min_rows to RARE_MAX_ROWS rows)?"""
        return self.wants(num_rows) and num_rows <= RARE_MAX_ROWS

    def rare_for(self, num_rows: int) -> np.ndarray:
        """[L, E] bool: the missing experts a streamed window of `num_rows` rows leaves at their
        host copies now (rare_experts on the published residency and the counts; none past
        RARE_MAX_ROWS). The same before the window (the arena's where table) and in run()."""
        rare, sure, _ = self.left_for(num_rows)
        return rare | sure

    def left_for(self, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rare [L, E], sure [L, E], sure's expected rows [L]): the rare experts, and the sure
        ones left to the pool (STRATA_POOL_SURE, sure_for_pool) that rare_for adds to them."""
        residency = self.arena.table.peek().table  # [L, E]
        none = np.zeros(residency.shape, dtype=bool)
        if num_rows > RARE_MAX_ROWS:
            return none, none, np.zeros(self.num_layers)
        hits = self._hits.share() if self.pools_rare(num_rows) else None
        rare = rare_experts(residency, self._routed, num_rows, self._top_k,
                            self._reach_cost(num_rows), hits,
                            cold_rare=COLD_LAYERS_RARE and self.pools_rare(num_rows))
        if not (self.sure_percent and self.pools_rare(num_rows)):
            return rare, none, np.zeros(self.num_layers)
        from strata.backends.cuda.share import PROMPT_POOL_ROWS

        return (rare, *sure_for_pool(residency, self._routed, rare, num_rows, self._top_k,
                                     self.sure_percent, PROMPT_POOL_ROWS))

    def _reach_cost(self, num_rows: int) -> float:
        """REACH_COST, or POOL_REACH_COST where the CPU pool computes the rare experts a window
        of `num_rows` rows routes to after all (pools_rare)."""
        return POOL_REACH_COST if self.pools_rare(num_rows) else REACH_COST

    def pools_rare(self, num_rows: int) -> bool:
        """Does a streamed window of `num_rows` rows hand its rare experts to the CPU pool (a
        pool attached, at most PROMPT_POOL_MAX_ROWS rows)?"""
        return (self.arena.pool is not None and self.leaves_rare(num_rows)
                and num_rows <= PROMPT_POOL_MAX_ROWS)

    def wants(self, num_rows: int) -> bool:
        return bool(self.min_rows) and num_rows >= self.min_rows

    def is_ready_for(self, num_rows: int) -> bool:
        """True when a window of `num_rows` rows streams (staging ready, something missing)."""
        return self.wants(num_rows) and self.stage_bases is not None and self._has_misses()

    @property
    def is_lending(self) -> bool:
        """Slots borrowed from the cache, or their refills not landed yet."""
        return bool(self._borrowed) or (self._refills is not None and self._refills.is_busy)

    def _has_misses(self) -> bool:
        return bool((self.arena.table.peek().table < 0).any())

    def _lends(self) -> bool:
        """True when the staging is borrowed from the cache (at most half of it)."""
        return self.arena.n_slots * BORROW_MAX_SHARE >= NUM_STAGES * self.num_experts

    def reserved_slots(self) -> frozenset[int]:
        """The slots this streamer borrows (the last 2 x E of the cache), or none."""
        n = self.arena.n_slots
        return frozenset(range(n - NUM_STAGES * self.num_experts, n)) if self._lends() else (
            frozenset())

    def _ready_staging(self) -> None:
        stage_slots = NUM_STAGES * self.num_experts
        if self._lends():
            self._borrow(stage_slots)
        else:
            self._allocate(stage_slots)
        tier, a = self.arena.model.tier, self.arena
        if self.stage_bases is not None and tier is not None and tier._pull_args is None:
            image = np.array([a._image_bytes(layer) for layer in range(self.num_layers)],
                             dtype=np.uint64)
            with self._rt.active():
                tier.enable_pulls(a.host.device_base, a.slot_bytes, a.host.part_offsets, image)

    def _allocate(self, stage_slots: int) -> None:
        a, rt = self.arena, self._rt
        nbytes = stage_slots * a.slot_bytes
        if self._dedicated is None:
            try:
                with rt.active():
                    self._dedicated = rt.alloc(nbytes)
            except Exception as exc:  # pycuda's MemoryError
                log.warning("prompt streaming off: no VRAM for its staging buffer (%.2f GiB: "
                            "%s); prompt chunks read their missing experts over PCIe. Lower "
                            "--vram-budget or --expert-cache to leave room", nbytes / 2**30, exc)
                self.min_rows = 0
                return
            log.info("prompt streaming: a staging buffer of %d expert slots (%.2f GiB) for "
                     "windows of >= %d rows (the cache has %d slots, too few to lend them)",
                     stage_slots, nbytes / 2**30, self.min_rows, a.n_slots)
        base = int(self._dedicated)
        self.stage_bases = [base + k * self.num_experts * a.slot_bytes for k in range(NUM_STAGES)]

    def _borrow(self, stage_slots: int) -> None:
        """Claim the last `stage_slots` slots through the ordered path: each held expert is
        published missing (its entries back at its host copy) before the slot is overwritten."""
        a, rt, table = self.arena, self._rt, self.arena.table
        first = a.n_slots - stage_slots
        slots = range(first, a.n_slots)
        if any(table.is_claimed(s) for s in slots):  # a swap or refill is landing there
            for copier in (a.copier, self._refills):
                if copier is not None:
                    copier.wait_idle(BORROW_TIMEOUT_S)
            if any(table.is_claimed(s) for s in slots):
                log.warning("prompt streaming skipped this window: slots %d-%d are still being "
                            "copied into", first, a.n_slots - 1)
                return
        tickets = []
        with rt.active():
            for slot in slots:
                ticket = table.begin_evict(slot)
                if ticket.evicted is not None:
                    a._point(*ticket.evicted, -1)
                tickets.append(ticket)
            a._publish()  # kernels issued from here read those experts from RAM
        self._borrowed = [(t.slot, t.evicted) for t in tickets]
        table.wait_overwritable(tickets[-1], BORROW_TIMEOUT_S)  # no host reader pins them
        base = a.slot_base + first * a.slot_bytes
        self.stage_bases = [base + k * self.num_experts * a.slot_bytes
                            for k in range(NUM_STAGES)]
        self.num_borrowed += len(slots)
        log.info("prompt streaming: borrowed slots %d-%d as staging (%d experts evicted)",
                 first, a.n_slots - 1, sum(t.evicted is not None for t in tickets))

    def release(self) -> None:
        """End of a run of streamed windows: log it; give the borrowed slots back, refilled
        with what they held (copies on the side stream, landed by later pumps)."""
        if self._streak_windows:
            per_window = self._streak_windows * self.num_layers
            log.info("prompt streaming: %d windows streamed %.2f GiB of experts into staging; "
                     "%.1f rarely routed missing experts per layer and window left to PCIe reads, "
                     "%.1f of them by the share of windows that routed to them (%d pulled into "
                     "staging since start-up: routed to many rows)",
                     self._streak_windows, self._streak_bytes / 2**30,
                     self._streak_left / per_window, self._streak_by_share / per_window,
                     self.pulled)
            tier = self.arena.model.tier
            windows, listed, routed, _, _ = tier.guess_totals() if tier else (0,) * 5
            if windows:
                log.info("prompt streaming: guessed copies since start-up: %d rare experts "
                         "copied a layer ahead in %d windows, %d of them routed (%.1f%%)",
                         listed, windows, routed, 100.0 * routed / max(1, listed))
            self._streak_windows = self._streak_bytes = self._streak_left = 0
            self._streak_by_share = 0
        if not self._borrowed:
            return
        from strata.backends.cuda.copier import StreamCopier

        a, borrowed = self.arena, self._borrowed
        self._borrowed, self.stage_bases = [], None
        refills = [Refill(slot, *held) for slot, held in borrowed if held is not None]
        for slot, held in borrowed:
            if held is None:
                a.table.abort(slot)  # it was free: free again
        if self._refills is None:
            self._refills = StreamCopier(a, self._refilled)
        self._refills.submit_claimed(refills)
        self._refills.pump()
        log.info("prompt streaming: %d borrowed slots given back, %d being refilled",
                 len(borrowed), len(refills))

    def _refilled(self, load: Refill) -> None:
        self.num_refilled += 1
        self.refilled_bytes += self.arena._image_bytes(load.layer)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Until every refill landed (tests, benchmarks)."""
        return self._refills is None or self._refills.wait_idle(timeout_s)

    def close(self) -> None:
        if self._refills is not None:
            self._refills.stop()
        for slot, _ in self._borrowed:
            self.arena.table.abort(slot)
        self._borrowed, self.stage_bases = [], None
        self._lists.clear()
        self._dedicated = None

    # ---- the window ---------------------------------------------------------------------
    def run(self, plan, stream: int) -> None:
        """Run `plan` (a WindowPlan, its descriptor uploaded) with the experts streamed."""
        a, rt = self.arena, self._rt
        residency = a.table.peek().table  # [L, E]
        rare = self.rare_for(plan.num_rows)  # [L, E]
        key = (a.table.version, tuple(self.stage_bases))
        entry = self._lists.get(id(plan))
        if entry is None or entry[1] != key:
            launches, copy_entries, marks = self._build(plan, residency)
            entry = self._lists[id(plan)] = (plan, key, launches, copy_entries, marks)
            while len(self._lists) > _MAX_LISTS:
                self._lists.popitem(last=False)
        self._lists.move_to_end(id(plan))
        table_key = key + (np.packbits(rare).tobytes(),)
        if self._table_key != table_key:  # the compute stream is idle: no upload reads it now
            self._table_host[:] = stream_tables(a._mirror, residency, self.stage_bases,
                                                a.slot_bytes, a.host.part_offsets, rare)
            self._table_key = table_key
        missing = residency < 0  # [L, E]: each has a copy entry; the rare ones skip it
        sizes = run_bytes(missing & ~rare, a.slot_bytes, self._image_bytes)  # [L, E]
        entry[2].set_copy_bytes(entry[3][missing], sizes[missing])
        num_bytes = int(sizes.sum())
        rt.drv.memcpy_htod_async(a.model.expert_tables_ptr, self._table_host, rt.stream)
        tier = a.model.tier
        pulls = tier is not None and tier._pull_args is not None and tier.pools(plan.num_rows)
        if pulls:  # pull_rare's staging set per layer, for this window only
            self.num_pulled += int(tier.pulled_host.sum())  # the last window's (landed)
            tier.pulled_host[:] = 0
            bases = self._pull_bases(residency)
            if tier.guess_stage_bases is not None:  # before the upload: before any guess
                tier.guess_stage_bases[:] = bases
            rt.drv.memcpy_htod_async(tier.pull_base_ptr, bases, rt.stream)
        entry[2].run(stream)
        a._publish()  # the tables back to the residency's, behind the window's kernels
        if pulls:
            rt.drv.memset_d32_async(tier.pull_base_ptr, 0, 2 * self.num_layers, rt.stream)
            rt.drv.memcpy_dtoh_async(tier.pulled_host, tier.pulled_ptr, rt.stream)
            rt.drv.memset_d32_async(tier.pulled_ptr, 0, self.num_layers, rt.stream)
        if pulls:  # the guessed copies' worker has seen the window through (guess.py)
            tier.issue_guesses()
        if self.timeline:
            self._time(plan.num_rows, entry[4], num_bytes)
        self.streamed_bytes += num_bytes
        self._streak_bytes += num_bytes
        self.num_windows += 1
        self._streak_windows += 1
        self._count_left(rare, residency, plan.num_rows)

    def _count_left(self, rare: np.ndarray, residency: np.ndarray, num_rows: int) -> None:
        """Count a window's rare experts [L, E], and those of them the counts alone would
        have copied (left by the share of windows), for the streak's log line."""
        left = int(rare.sum())
        self.num_left += left
        self._streak_left += left
        if self.pools_rare(num_rows) and self._hits.share() is not None:
            by_counts = rare_experts(residency, self._routed, num_rows, self._top_k,
                                     self._reach_cost(num_rows))
            self._streak_by_share += int((rare & ~by_counts).sum())

    @property
    def pulled(self) -> int:
        """Rare experts pull_rare copied into staging over all windows (after a synchronize)."""
        tier = self.arena.model.tier
        return self.num_pulled + (int(tier.pulled_host.sum()) if tier is not None else 0)

    def _pull_bases(self, residency: np.ndarray) -> np.ndarray:
        """[L] uint64 (pinned): each streamed layer's staging set (pull_rare's), 0 for others."""
        key = (self.arena.table.version, tuple(self.stage_bases))
        if self._pull_key != key:
            self._pull_host[:] = 0
            for j, layer in enumerate(streamed_layers(residency)):
                self._pull_host[layer] = self.stage_bases[j % NUM_STAGES]
            self._pull_key = key
        return self._pull_host

    def _time(self, rows: int, marks: dict, copied_bytes: int) -> None:
        """Wait for the window and log its WindowTimeline (timeline on)."""
        marks[("t", "end")].synchronize()
        layers = sorted(key[2] for key in marks if key[1] == "go")
        faults = minor_faults()
        t = WindowTimeline.measure(
            rows, layers, lambda a, b: cuda_driver.elapsed_ms(marks[("t",) + a],
                                                              marks[("t",) + b]), copied_bytes,
            faults - self._faults if faults >= 0 <= self._faults else -1)
        self._faults = faults
        self.timelines.append(t)
        log.info("%s", t.describe())

    def _build(self, plan, residency: np.ndarray):
        """(LaunchList of the streamed window, the index of each missing expert's copy entry
        [L, E] (-1: resident), its timing events by key: empty unless timeline). Every missing
        expert gets its own copy entry; run() sizes them per window (run_bytes: one copy per
        run of consecutive copied experts, none for rare ones), so a new rare set costs no
        rebuild."""
        a, E, slot_bytes = self.arena, self.num_experts, self.arena.slot_bytes
        if self._image_bytes is None:  # a slot may hold more than the image
            self._image_bytes = np.array(
                [a._image_bytes(layer) for layer in range(self.num_layers)], dtype=np.uint64)
        missing = residency < 0  # [L, E]
        runs = {layer: [(int(e), int(e) + 1) for e in np.flatnonzero(missing[layer])]
                for layer in streamed_layers(residency)}
        stage = {layer: j % NUM_STAGES for j, layer in enumerate(sorted(runs))}
        out, events = cuda_driver.LaunchList(), {}
        entries = np.full(residency.shape, -1, dtype=np.int64)  # [L, E]
        for op in stream_schedule(len(plan.launches), plan.expert_spans, runs, self.timeline,
                                  plan.tier_spans):
            stream = 0 if op.stream == COMPUTE else self.copy_stream_handle
            if op.kind == "launches":
                out.extend(plan.launches, op.first, op.stop)
            elif op.kind == "copy":
                entries[op.layer, op.first] = len(out)
                out.append(cuda_driver.copy_htod(
                    self.stage_bases[stage[op.layer]] + op.first * slot_bytes,
                    a.host.host_base + (op.layer * E + op.first) * slot_bytes,
                    int(self._image_bytes[op.layer]), stream))
            else:
                event = events.get(op.event)
                if event is None:
                    event = events[op.event] = cuda_driver.Event(timing=op.event[0] == "t")
                make = cuda_driver.record_event if op.kind == "record" else cuda_driver.wait_event
                out.append(make(event, stream))
        return out, entries, {k: e for k, e in events.items() if k[0] == "t"}
