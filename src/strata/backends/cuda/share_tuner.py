"""`--pcie-frac auto`: the PCIe share of each decode window's misses found while serving.

The best share is where the CPU pool's side and the GPU's side of a layer take as long as each
other, and that moves with the host: the pool's RAM throughput beside the GPU (the H200 machine's
pool computed a token's misses in 7.3 ms in one call and 11.6 in another, same build), the
number of threads, other work on the CPU, the link. `strata-tool calibrate` measures it once;
this measures it as windows run, from each window's own figures, and keeps measuring.

Per class of windows by rows (1, 2, 3-4, 5-8, 9-16: a row's routed misses split differently
with more rows), the tuner keeps a share and times windows at it: the pool's compute plus its
wait for the GPU (cpu_pool.PoolWindowStats), which is the window minus the host's work and the
head, so the host's noise stays out. A round of tries comes `WARMUP` windows of a class in,
`PROBE` windows after a move, and `EVERY` windows after a round that kept the share. A round
tries each neighbour for `PROBE` windows: the share -+ 1/K and -+ 1/(2K) for K experts a row;
a neighbour whose median beats the share's median over the windows just before by more than
`MARGIN` becomes the share (logged; a round that keeps it is logged too). A one-row window's
split changes in whole experts, each 1/K of the share wide (Qwen3-30B-A3B, K = 8: the pool
takes 5 of a token's 8 misses from 0.26 to 0.375, 4 up to 0.5): a step of 1/K reaches the next
split on either side, where 0.1 from 0.4 would stay on 4 and see no difference.

Shares change which side computes an expert, so results move by float rounding between the CPU
and GPU kernels: with the tier frozen (`--adapt-every 0`, deterministic greedy output) the
engine keeps the starting share instead (offload.build_vram_arena).
"""
from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass, field

from strata.errors import ConfigError

log = logging.getLogger("strata.pool")

CLASS_ROWS = (1, 2, 4, 8, 16)  # a window of R rows is in the first class of >= R rows
PROBE = 8          # windows timed at a neighbour share per try
WARMUP = 16        # windows at the starting share before the first tries
EVERY = 512        # windows of a class between rounds that keep the share (PROBE after a move)
FIRST_GAP = 64     # backoff=1: the gap after the first round that keeps the share, doubling
MARGIN = 0.03      # a neighbour must be this much faster (median window) to be taken
LOWEST, HIGHEST = 0.0, 0.9  # the shares tried (1: no pool at all is --pcie-frac 1's)
# STRATA_SHARE_TUNER=NAME=V,... (a diagnosis): warmup, probe, every and margin for this run
# instead of the four above, e.g. warmup=64,every=128.
# backoff=1 (opt-in; the default in session 90 only): after a round that keeps the share the
# next comes FIRST_GAP windows on, then twice as far each time up to EVERY (a move starts
# again), so a first round read while the host's clocks settle after the model loads is looked
# at again soon (session 89's host kept the starting one-row share all run). On an H100 host
# in session 92, both orders of each pair, it cost 8-9% at four sequences on a skew-1 model
# (tg128 x4 130.0 / 131.9 against 141.7 / 143.0 tokens/s) and 1-3% at one, and tied on skew
# 0: its extra rounds' tries cost more than the early second look gained there
# (docs/offload.md, "Session 92").
# interleave=1 (opt-in; session 93, H100 host, order turned: 1.026 / 1.047x the default at one
# slot / four sequences on skew 0, 0.982 / 0.965x on skew 1, where its rounds saw 0.362 ~2%
# faster than 0.300 at 3-4 rows, under MARGIN, and kept 0.300; session 94, with margin=0.015:
# 1.064 / 0.984x on skew 0, 0.970 / 1.019x on skew 1, mostly with the same shares, while the
# default against itself gave 0.983-1.026x: within the noise; docs/offload.md) times a round's
# neighbours between windows at the share itself (share, n1, share, n2, ...) and against those
# windows, so a host that speeds up or slows down during the round (the CPU's clocks settling
# after the model loads) moves every side's figures alike: one after another, the later tries
# look better or worse than the windows before the round by the drift alone
ENV_TUNER = "STRATA_SHARE_TUNER"


def _settings_from_env() -> dict:
    text = os.environ.get(ENV_TUNER, "").strip()
    got = {"warmup": WARMUP, "probe": PROBE, "every": EVERY, "margin": MARGIN, "interleave": 0,
           "backoff": 0}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            if name not in got:
                raise ValueError
            got[name] = float(value) if name == "margin" else int(value)
            switch = name in ("interleave", "backoff")
            if got[name] < (0 if switch or name == "margin" else 1) or switch and got[name] > 1:
                raise ValueError
        except ValueError:
            raise ConfigError(f"{ENV_TUNER}={text!r}: give NAME=VALUE items separated by "
                              "commas, NAME one of warmup, probe, every (whole windows, >= 1), "
                              "margin (a fraction >= 0), interleave and backoff (0 or 1), e.g. "
                              "warmup=64,every=128")
    return got


@dataclass
class _Class:
    rows: int
    share: float
    base: list = field(default_factory=list)      # window times at `share`, the latest last
    queue: list = field(default_factory=list)     # neighbours still to try this round
    trying: float | None = None
    tried: list = field(default_factory=list)     # window times at `trying`
    results: dict = field(default_factory=dict)   # neighbour -> median of its windows
    until_round: int = WARMUP
    plan: list = field(default_factory=list)      # interleave: the round's shares in order
    at: int = 0                                   # interleave: the next window's place in plan
    moves: int = 0
    kept: int = 0                                 # rounds in a row that kept the share
    windows: int = 0                              # windows whose figures came in


class ShareTuner:
    """share(num_rows) before a window, record(num_rows, share, seconds) once its pool's
    figures are in. Pure bookkeeping: the arena applies the share (its where table)."""

    def __init__(self, start: float, experts_per_row: int = 8, one_row_start=None):
        """one_row_start: the one-row class's start when it differs (share.whole_expert_share
        of an unmeasured default)."""
        self.start = float(start)
        settings = _settings_from_env()
        self.warmup, self.probe = settings["warmup"], settings["probe"]
        self.every, self.margin = settings["every"], settings["margin"]
        self.interleave = bool(settings["interleave"])
        self.backoff = bool(settings["backoff"])
        k = max(int(experts_per_row), 1)
        self.steps = (1.0 / k, -1.0 / k, 0.5 / k, -0.5 / k)
        self._classes = {rows: _Class(rows, self.start, until_round=self.warmup)
                         for rows in CLASS_ROWS}
        if one_row_start is not None:
            self._classes[CLASS_ROWS[0]] = _Class(CLASS_ROWS[0], float(one_row_start),
                                                  until_round=self.warmup)

    @staticmethod
    def class_of(num_rows: int) -> int | None:
        return next((rows for rows in CLASS_ROWS if num_rows <= rows), None)

    def share(self, num_rows: int) -> float | None:
        """The share for a window of `num_rows` rows (None: a window the pool takes no part
        of, beyond the largest class)."""
        rows = self.class_of(num_rows)
        if rows is None:
            return None
        c = self._classes[rows]
        if c.plan:
            return c.plan[c.at]
        return c.trying if c.trying is not None else c.share

    def shares(self) -> dict[int, float]:
        """{class rows: its share} (what /metrics shows)."""
        return {rows: c.share for rows, c in self._classes.items()}

    def summary(self) -> list[tuple[str, float, int, int]]:
        """(rows, e.g. "3-4"; share; moves; windows timed) of each class that had windows."""
        return [(_rows_name(c.rows), c.share, c.moves, c.windows)
                for c in self._classes.values() if c.windows]

    def record(self, num_rows: int, share: float, seconds: float) -> None:
        rows = self.class_of(num_rows)
        if rows is None or not seconds > 0:
            return
        c = self._classes[rows]
        c.windows += 1
        if c.plan:
            self._record_interleaved(c, share, seconds)
            return
        if c.trying is not None:
            if share == c.trying:
                c.tried.append(seconds)
                if len(c.tried) >= self.probe:
                    c.results[c.trying] = statistics.median(c.tried)
                    self._next_try(c)
            return
        if share != c.share:
            return  # a window planned before the last change
        c.base.append(seconds)
        del c.base[:-2 * self.probe]
        c.until_round -= 1
        if c.until_round <= 0 and len(c.base) >= self.probe:
            c.queue = [s for s in (round(c.share + d, 4) for d in self.steps)
                       if LOWEST <= s <= HIGHEST and s != c.share]
            c.results = {}
            if self.interleave and c.queue:
                c.plan = [s for n in c.queue for s in (c.share, n)]
                c.at, c.base, c.results = 0, [], {n: [] for n in c.queue}
                c.queue = []
            else:
                self._next_try(c)

    def _record_interleaved(self, c: _Class, share: float, seconds: float) -> None:
        """A window of an interleaved round: its time to the share's or a neighbour's; the
        round ends once each has `probe` windows (a window planned twice, its figures late,
        or skipped, the plan goes round again)."""
        if share == c.share:
            c.base.append(seconds)
        elif share in c.results:
            c.results[share].append(seconds)
        else:
            return  # planned before the last change
        c.at = (c.at + 1) % len(c.plan)
        if len(c.base) < self.probe or any(len(t) < self.probe for t in c.results.values()):
            return
        c.plan, c.at = [], 0
        self._decide(c, statistics.median(c.base),
                     {n: statistics.median(t) for n, t in c.results.items()})

    def _next_try(self, c: _Class) -> None:
        c.tried = []
        if c.queue:
            c.trying = c.queue.pop(0)
            return
        c.trying = None
        self._decide(c, statistics.median(c.base[-self.probe:]), c.results)

    def _decide(self, c: _Class, base: float, results: dict) -> None:
        """The end of a round: the fastest neighbour (median window) becomes the share if it
        beat `base`, the share's median, by more than the margin."""
        c.results = results
        best = min(c.results, key=c.results.get, default=None)
        if best is not None and c.results[best] < base * (1.0 - self.margin):
            log.info("PCIe share of %s-row windows %.3f -> %.3f: the CPU pool's compute + "
                     "wait %.2f -> %.2f ms a window (medians of %d; --pcie-frac auto)",
                     _rows_name(c.rows), c.share, best, base * 1e3, c.results[best] * 1e3,
                     self.probe)
            c.share, c.base, c.moves, c.kept = best, [], c.moves + 1, 0
            c.until_round = self.probe
        else:
            c.kept += 1
            c.until_round = (min(self.every, FIRST_GAP << min(c.kept - 1, 16)) if self.backoff
                             else self.every)
            # a decision too (a round at most every `every` windows of the class)
            log.info("PCIe share of %s-row windows stays %.3f (%.2f ms a window; tried %s; "
                     "the next round in %d windows)", _rows_name(c.rows), c.share, base * 1e3,
                     ", ".join(f"{s:.3f}: {t * 1e3:.2f}" for s, t in sorted(c.results.items())),
                     c.until_round)


def _rows_name(rows: int) -> str:
    i = CLASS_ROWS.index(rows)
    low = CLASS_ROWS[i - 1] + 1 if i else 1
    return str(rows) if low == rows else f"{low}-{rows}"
