"""The PCIe share: how much of each layer's missing experts the GPU reads over PCIe and how much
the CPU pool computes (`miss_where`), from `--pcie-frac` or a stored calibration (`strata-tool
calibrate`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from strata.backends.cuda.exchange import WHERE_CPU, WHERE_PCIE, WHERE_VRAM
from strata.errors import ConfigError
from strata.user_cache import cache_dir

# With no calibration: the share that decoded fastest on the H200 machine with each layer's
# misses split on the device (1 and 4 slots: 0.3 gave 82.0-83.4 / 136.1-143.5 tokens/s, 0.35
# 81.3 / 135.1, 0.25 78.3 / 126.2, 0.4 69-70 / 129-132; docs/offload.md); consumer cards read
# PCIe slower than it, which moves the best share down, not up.
DEFAULT_PCIE_FRAC = 0.3
# Where the share comes from when neither --pcie-frac nor a calibration gives it (resolve_pcie_frac)
DEFAULT_SOURCE = "default"
# A decode window splits each layer's misses by cost (count_groups): an expert costs this plus
# its rows, so that the split follows the bytes (each side reads a missing expert once for all
# its rows) more than the rows.
DECODE_EXPERT_ROWS = 16
# Expert types the CPU pool reads more slowly than the others: the grid i-quants (IQ2_XXS 16,
# IQ2_XS 17, IQ3_XXS 18, IQ1_S 19, IQ3_S 21, IQ2_S 22, IQ1_M 29). With session 29's rows the pool
# read them at ~9 GB/s beside the GPU's 50, so such a model read every miss over PCIe (H200:
# 49.3 tokens/s at 1, 46.1 at 0.6). Sessions 100-101's integer rows read IQ2_XXS at 17-20 GB/s
# on the H100 host's 15 threads, and with the pool a share the same synth (qwen3-30b-a3b
# IQ2_XXS, every expert in RAM, tg64, session 102, one call) decoded 48.5 tokens/s at 1, 55.2 at
# 0.8 and 66.9 at 0.6 (four slots 58.2 / 66.2 / 87.2). So these types start at
# SLOW_POOL_PCIE_FRAC where the others start at DEFAULT_PCIE_FRAC; the pool kernel's experts/s
# per byte on that host were within 25% of each other for IQ2_XXS, IQ3_S and IQ1_M.
SLOW_POOL_TYPES = frozenset({16, 17, 18, 19, 21, 22, 29})
SLOW_POOL_PCIE_FRAC = 0.6


def check_pcie_frac(value, what: str = "--pcie-frac") -> float:
    """A share in [0, 1] as float; ConfigError naming the value otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
            or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{what} is {value!r}; give a fraction from 0 (every missing expert on "
                          "the CPU pool) to 1 (every one read by the GPU over PCIe)")
    return float(value)


# Windows of more rows read every miss over PCIe (no CPU pool share) and their plans have no
# hand-off to the pool (DeviceTier.pools): the GPU reads a missing expert once for all its
# rows, while the pool's time grows with them. Measured on the H200 at --pcie-frac 0.5: the
# pool lifts 1- and 4-row decode windows 1.45-1.58x and halves a 512-row prompt chunk; 16 lies
# between and is not measured (docs/offload.md).
POOL_MAX_ROWS = 16

# A streamed prompt window (stream.py) leaves its rare experts at their host copies; the pool
# computes those the window routes to after all, within caps set on the device once the
# routing is known (offload.cu's count_groups), so that a rare expert that takes many rows, or
# many of them, cannot keep the GPU's layer waiting: at most PROMPT_POOL_ROWS rows each, and
# per layer a budget of pool time, in row units (an expert costs POOL_EXPERT_ROWS + its rows),
# of POOL_SHARE_OF_COPY of the time the copy engine spends on the layer's copied experts, spent
# on the fewest rows first (each saves the link one expert's bytes). The others are read over
# PCIe. Measured on the H200 (docs/offload.md, "The CPU pool takes the rare experts"): caps of
# 3 rows gained 1-5%, 16-64 rows 16-23% at pp512 with no expert cached; session 47, the share
# 1.0 / 1.25 / 1.5 / 2 / 3: pp512 at 0% ~5,380 / 5,570 / 5,550 / 5,330 / 4,440. Since session
# 80 the pool starts on a layer before the wait for its guessed copies, and each rare expert it
# takes saves the link (which now bounds the window) the expert's bytes, so a larger budget
# pays where the pool has time to spare, and which one depends on the host and the routing:
# skew-0 / skew-1 synth, pp512, every expert in RAM (docs/offload.md, "Session 81"):
# - H200 host, two rounds: 4.5 ~5,000 / ~5,460, 7.5 ~5,020 / ~5,270, 15 ~4,880 / ~5,170, no
#   budget ~4,100 / ~5,180;
# - H100 host, medians of six alternating rounds: 1.5 4,570 / 5,773, 4.5 5,004 / 5,484.
# So by default (STRATA_POOL_BUDGET=auto, stream.SurePercent) the share moves while serving
# from this one, with the pool's share of each window (there: 4,902 / 5,724, ending at 9 and
# 1.5); this one stays where nothing moves it (the tier frozen, STRATA_POOL_SURE=P). Since
# session 87 the budget is the same in every layer (prompt_pool_budget): on an H100 host pp512
# 5,399 / 5,772 against 5,015 / 5,783 for each layer's own (medians of 16 / 4 runs, the walk
# ending at 2.25-6.75 on skew 0 instead of 9-13.5; fixed at 9 it lost 10%).
PROMPT_POOL_ROWS = 64
POOL_SHARE_OF_COPY = 4.5
# The pool's time per expert: tools/bench_pool_kernel.py --rows-per-expert on the H200 host
# (15 threads, a Q4_0 expert of Qwen3-30B-A3B) gives ~45 us at 1 row and 106 at 4, and in
# prompt windows the pool spent ~20 us per routed row (pp512 at 0%: 82 rows a layer in 1.4-1.8
# ms): an expert costs POOL_EXPERT_ROWS rows' worth, a row ~300 thread-us, while the copy
# engine copies that expert in ~48 us (both scale with the expert's bytes).
POOL_EXPERT_ROWS = 2
POOL_ROW_UNITS_PER_COPY_THREAD = 48.0 / 300.0
NO_BUDGET = 1 << 30
# STRATA_POOL_COSTS=E,U,C (a diagnosis, for measuring another pool kernel's costs): the three
# above, POOL_EXPERT_ROWS, POOL_ROW_UNITS_PER_COPY_THREAD and PROMPT_POOL_ROWS, read at import.
ENV_POOL_COSTS = "STRATA_POOL_COSTS"
# STRATA_POOL_BUDGET_FLAT=0 (a diagnosis): each layer's budget from its own copies, the rule
# before session 87, instead of the same budget in every layer (prompt_pool_budget)
ENV_POOL_BUDGET_FLAT = "STRATA_POOL_BUDGET_FLAT"


def _pool_costs_from_env() -> None:
    global POOL_EXPERT_ROWS, POOL_ROW_UNITS_PER_COPY_THREAD, PROMPT_POOL_ROWS
    text = os.environ.get(ENV_POOL_COSTS, "").strip()
    if not text:
        return
    try:
        expert, units, cap = (float(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{ENV_POOL_COSTS}={text!r}: give three numbers, expert cost (rows), "
                          "row units per copy and thread, and the rows cap, e.g. 28,0.96,64")
    POOL_EXPERT_ROWS, POOL_ROW_UNITS_PER_COPY_THREAD, PROMPT_POOL_ROWS = (
        int(expert), units, int(cap))


_pool_costs_from_env()


def prompt_pool_budget(copied: np.ndarray, threads: int,
                       share_of_copy: float = POOL_SHARE_OF_COPY) -> np.ndarray:
    """[L] int32: the pool's budget per layer (row units, above) in a streamed prompt window
    that copies `copied` [L] experts a layer, with `threads` pool threads: the same in every
    layer, from the window's copies a layer on average (STRATA_POOL_BUDGET_FLAT=0: from each
    layer's own copies, the rule before session 87). A layer's GPU time
    does not follow its own copies: the experts the streamer leaves rare come back as the
    layer's guessed copies and pulls, so every layer moves about as many experts over the
    link, while the copies gather in a few layers (the skew-0 synth: 0 / 2 / 17 a layer at the
    10th / 50th / 90th percentile, none in 16% of the layers). Each layer's own copies leave the
    pool no budget in the layers that copy nothing, whose light rare experts the GPU then
    pulls on the layer's path; replayed, the even budget moves ~8 experts a layer from the
    link to the pool there (docs/offload.md, "Session 86"); measured, pp512 +7.7% on the
    skew-0 synth and a tie on skew 1 ("Session 87")."""
    per_copy = POOL_ROW_UNITS_PER_COPY_THREAD * max(1, threads)
    copied = np.asarray(copied, dtype=np.float64)
    if copied.size and os.environ.get(ENV_POOL_BUDGET_FLAT, "1") != "0":
        copied = np.full_like(copied, copied.mean())
    return np.floor(share_of_copy * copied * per_copy).astype(np.int32)


def window_share(pcie_frac: float, num_rows: int) -> float:
    """The PCIe share for a window of `num_rows` rows: `pcie_frac` up to POOL_MAX_ROWS rows,
    1 (no pool) beyond."""
    return pcie_frac if num_rows <= POOL_MAX_ROWS else 1.0


def whole_expert_share(pcie_frac: float, top_k: int) -> float:
    """The share at which a one-row window's pool takes the whole experts that `pcie_frac`
    gave it before a layer's boundary expert was split by columns (count_groups: of top_k equal
    misses, the budget rounded, then whole experts only): 0.3 of 8 -> the pool 5, the GPU 3,
    0.375. With no measured share (DEFAULT_SOURCE) one-row windows keep that split: the default
    was measured under it, and a host whose pool is the slower side loses by the pool's part
    of a sixth expert (H200, 67-72 against 75-81 tokens/s at 0.3; docs/offload.md)."""
    k = max(int(top_k), 1)
    cost = DECODE_EXPERT_ROWS + 1
    budget = int(np.floor((1.0 - check_pcie_frac(pcie_frac, "pcie_frac")) * k * cost + 0.5))
    return 1.0 - min(budget // cost, k) / k


def expected_reads(rows_per_window: np.ndarray, num_rows: int) -> np.ndarray:
    """The chance each expert is read at all in a window of `num_rows` rows, from the routed
    rows it is expected to get per window ([L, E] float64): a row routes to an expert at most
    once, so with m expected rows over R rows, 1 - (1 - m / R) ** R (m itself, capped at 1, for
    one row)."""
    r = max(int(num_rows), 1)
    p = np.clip(np.asarray(rows_per_window, dtype=np.float64) / r, 0.0, 1.0)
    return 1.0 - (1.0 - p) ** r


def miss_where(residency: np.ndarray, pcie_frac: float) -> tuple[np.ndarray, float]:
    """(where [L, E] uint8, the pool's share of each layer's misses) for a window with this PCIe
    share: resident experts (residency >= 0, a slot) VRAM (0); with a share below 1 every
    missing one the CPU pool's (2), of which the device gives the pool 1 - pcie_frac of each
    layer's routed ones by cost once it sees the routing (offload.cu's count_groups; -1: all
    of them, at share 0); at share 1 every missing one PCIe's (1), no pool share.

    Why on the device: a split fixed before the window (by each expert's expected reads, until
    session 32) gave one side 2 of a token's 8 misses in one layer and 6 in the next, and each
    layer waits for the slower side; split per layer, one slot at 0% decoded 82.0-83.4 tokens/s
    against 74.3-74.6 (H200, docs/offload.md)."""
    residency = np.asarray(residency)
    if residency.ndim != 2:
        raise ConfigError(f"residency {residency.shape} must be [layers, experts]")
    frac = check_pcie_frac(pcie_frac, "pcie_frac")
    where = np.where(residency >= 0, WHERE_VRAM, WHERE_PCIE if frac >= 1.0 else WHERE_CPU)
    pool_frac = -1.0 if frac <= 0.0 or frac >= 1.0 else 1.0 - frac
    return where.astype(np.uint8), pool_frac


# ---- the stored calibration (`strata-tool calibrate`) -----------------------------------------
CALIBRATION_FILE = "pcie-share.json"
# How a decode window applies the share; a stored share measured under another split is ignored
# (the best share moved from 0.4-0.5 to 0.3 when the split moved onto the device, session 32;
# since session 60 the expert a layer's budget ends in is split by columns, so a share between
# two whole splits means something else)
SPLIT_METHOD = "per-layer-on-device-split-expert"
_log = logging.getLogger("strata.pool")


def calibration_key(model_path, gpu_name: str, threads: int) -> str:
    """Model (resolved path and size), GPU name and CPU pool threads: what the share depends on."""
    path = Path(model_path).resolve()
    return f"{path}|{path.stat().st_size}|{gpu_name}|{int(threads)}"


def share_from_rates(gpu_experts_per_s: float, cpu_experts_per_s: float) -> float:
    """The PCIe share that makes both sides finish together: with M missing experts, the GPU
    takes f * M / g and the pool (1 - f) * M / c seconds, equal at f = g / (g + c)."""
    if not gpu_experts_per_s > 0 or not cpu_experts_per_s > 0:
        raise ConfigError(f"measured rates must be > 0 (GPU {gpu_experts_per_s}, CPU pool "
                          f"{cpu_experts_per_s} experts/s)")
    return gpu_experts_per_s / (gpu_experts_per_s + cpu_experts_per_s)


def store_calibration(model_path, gpu_name: str, threads: int, pcie_frac: float,
                      details: dict | None = None) -> Path:
    """Record the share (and the measurements behind it) for this model, GPU and threads in
    the user cache dir; returns the file."""
    path = cache_dir() / CALIBRATION_FILE
    entries = _read_entries(path)
    entry = dict(details or {})
    entry.update(pcie_frac=check_pcie_frac(pcie_frac, "pcie_frac"),
                 model=str(Path(model_path).resolve()), gpu=gpu_name, threads=int(threads),
                 measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), split=SPLIT_METHOD)
    entries[calibration_key(model_path, gpu_name, threads)] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)  # readers never see half a file
    return path


def load_calibration(model_path, gpu_name: str, threads: int) -> dict | None:
    """The stored entry for this model, GPU and threads, or None (also for one measured under
    another split of the misses than SPLIT_METHOD: `stale_calibration`)."""
    entry = _stored_entry(model_path, gpu_name, threads)
    return entry if entry is not None and entry.get("split") == SPLIT_METHOD else None


def stale_calibration(model_path, gpu_name: str, threads: int) -> bool:
    """Is there a stored share for this model, GPU and threads that an earlier Strata measured
    under another split of the misses (so `load_calibration` ignores it)?"""
    entry = _stored_entry(model_path, gpu_name, threads)
    return entry is not None and entry.get("split") != SPLIT_METHOD


def _stored_entry(model_path, gpu_name: str, threads: int) -> dict | None:
    entry = _read_entries(cache_dir() / CALIBRATION_FILE).get(
        calibration_key(model_path, gpu_name, threads))
    if not isinstance(entry, dict):
        return None
    try:
        check_pcie_frac(entry.get("pcie_frac"))
    except ConfigError:
        return None
    return entry


def resolve_pcie_frac(pcie_frac: float | None, model_path, gpu_name: str,
                      threads: int, expert_types=()) -> tuple[float, str]:
    """(share, where it came from): --pcie-frac when given, else the stored calibration, else
    DEFAULT_PCIE_FRAC, or SLOW_POOL_PCIE_FRAC when `expert_types` (the routed experts' ggml type
    ids) hold a SLOW_POOL_TYPES type. Logged once, so a user sees which one a run used."""
    if pcie_frac is not None:
        frac, source = check_pcie_frac(pcie_frac), "--pcie-frac"
    else:
        entry = load_calibration(model_path, gpu_name, threads)
        slow = sorted({int(t) for t in expert_types} & SLOW_POOL_TYPES)
        if entry is not None:
            frac = float(entry["pcie_frac"])
            source = f"calibrated {entry.get('measured_at', '')} ({cache_dir() / CALIBRATION_FILE})"
        else:
            frac = SLOW_POOL_PCIE_FRAC if slow else DEFAULT_PCIE_FRAC
            why = (f"{DEFAULT_SOURCE} for the experts' types "
                   f"({', '.join(_type_name(t) for t in slow)}), which the CPU pool reads more "
                   "slowly than the others" if slow else DEFAULT_SOURCE)
            what = ("the stored calibration for this model, "
                    f"{gpu_name} and {threads} threads was measured under an earlier split of "
                    "the misses and is ignored" if stale_calibration(model_path, gpu_name, threads)
                    else f"no calibration for this model, {gpu_name} and {threads} threads")
            source = (f"{why}: {what}; `strata-tool calibrate {model_path} --threads {threads}` "
                      "measures it")
    _log.info("PCIe share of cache misses %.2f (CPU pool %.2f): %s", frac, 1 - frac, source)
    return frac, source


def _type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


def _read_entries(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or unreadable: nothing calibrated (the next store rewrites it)
    return entries if isinstance(entries, dict) else {}
