"""The PCIe share: which missing experts the GPU reads over PCIe and which the CPU pool computes
(`assign_where`), from `--pcie-frac` or a stored calibration (`strata-tool calibrate`).
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

# With no calibration: the share that decoded fastest with the pool's serve loop on the H200
# machine (1 and 4 slots, calibrate's sweep, docs/offload.md); consumer cards read PCIe slower
# than it, which moves the best share down, not up.
DEFAULT_PCIE_FRAC = 0.4
# Expert types the CPU pool is slow on: the grid i-quants (IQ2_XXS 16, IQ2_XS 17, IQ3_XXS 18,
# IQ1_S 19, IQ3_S 21, IQ2_S 22, IQ1_M 29). Even with fused rows (fused_iq.c, AVX2 and AVX-512
# VNNI) a row costs 2-4x a Q4_K row per call, so the pool reads them at ~9 GB/s beside the GPU's
# 50: synth qwen3-30b-a3b at IQ2_XXS with every expert in RAM decoded (H200, AVX-512 rows)
# 49.3 tokens/s at 1, 48.9 at 0.8, 47.9 at 0.7, 46.1 at 0.6 and 40.2 at 0.5 (docs/offload.md).
# So with no calibration such a model reads every miss over PCIe.
SLOW_POOL_TYPES = frozenset({16, 17, 18, 19, 21, 22, 29})


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
# of POOL_SHARE_OF_COPY of the time the copy engine spends on the layer's copied experts. The
# others are read over PCIe. Measured on the H200 (docs/offload.md, "The CPU pool takes the
# rare experts"): caps of 3 rows gained 1-5%, 16-64 rows 16-23% at pp512 with no expert cached.
PROMPT_POOL_ROWS = 64
POOL_SHARE_OF_COPY = 1.5
# The pool's time per expert: tools/bench_pool_kernel.py --rows-per-expert on the H200 host
# (15 threads, a Q4_0 expert of Qwen3-30B-A3B) gives ~45 us at 1 row and 106 at 4, and in
# prompt windows the pool spent ~20 us per routed row (pp512 at 0%: 82 rows a layer in 1.4-1.8
# ms): an expert costs POOL_EXPERT_ROWS rows' worth, a row ~300 thread-us, while the copy
# engine copies that expert in ~48 us (both scale with the expert's bytes).
POOL_EXPERT_ROWS = 2
POOL_ROW_UNITS_PER_COPY_THREAD = 48.0 / 300.0
NO_BUDGET = 1 << 30


def prompt_pool_budget(copied: np.ndarray, threads: int) -> np.ndarray:
    """[L] int32: the pool's budget per layer (row units, above) in a streamed prompt window
    that copies `copied` [L] experts a layer, with `threads` pool threads."""
    per_copy = POOL_ROW_UNITS_PER_COPY_THREAD * max(1, threads)
    return np.floor(POOL_SHARE_OF_COPY * np.asarray(copied) * per_copy).astype(np.int32)


def window_share(pcie_frac: float, num_rows: int) -> float:
    """The PCIe share for a window of `num_rows` rows: `pcie_frac` up to POOL_MAX_ROWS rows,
    1 (no pool) beyond."""
    return pcie_frac if num_rows <= POOL_MAX_ROWS else 1.0


def expected_reads(rows_per_window: np.ndarray, num_rows: int) -> np.ndarray:
    """The chance each expert is read at all in a window of `num_rows` rows, from the routed
    rows it is expected to get per window ([L, E] float64): a row routes to an expert at most
    once, so with m expected rows over R rows, 1 - (1 - m / R) ** R (m itself, capped at 1, for
    one row). A window reads a routed expert's bytes once for all its rows, over PCIe or in
    the pool alike, so this is what a decode window's split balances: by rows, 4 slots gave
    PCIe the few hot experts and the pool most of the distinct ones (more bytes than its share).
    """
    r = max(int(num_rows), 1)
    p = np.clip(np.asarray(rows_per_window, dtype=np.float64) / r, 0.0, 1.0)
    return 1.0 - (1.0 - p) ** r


def assign_where(residency: np.ndarray, pcie_frac: float,
                 expected_counts: np.ndarray) -> np.ndarray:
    """where [L, E] uint8: 0 (VRAM) for resident experts (residency >= 0, a slot), and per layer
    the missing ones split so that the PCIe side (1) gets about `pcie_frac` of their expected
    weight, the CPU pool (2) the rest. The arena gives expected reads (`expected_reads`); any
    per-expert weight works, routed rows included (the docs below say rows).

    Per layer, missing experts with expected rows > 0 are taken hottest first (ties: lower id
    first); one goes to PCIe when that keeps the PCIe rows nearer the target (pcie + c / 2 <
    target), else to the CPU. Experts expected to get no rows are split by number: the lowest
    round(pcie_frac * n) ids go to PCIe. pcie_frac 0 and 1 give every missing expert to one side.
    """
    residency = np.asarray(residency)
    counts = np.asarray(expected_counts, dtype=np.float64)
    if residency.ndim != 2 or counts.shape != residency.shape:
        raise ConfigError(f"residency {residency.shape} and expected counts {counts.shape} must "
                          "both be [layers, experts]")
    if (counts < 0).any() or not np.isfinite(counts).all():
        raise ConfigError("expected routed rows must be finite and >= 0")
    frac = check_pcie_frac(pcie_frac, "pcie_frac")
    if frac >= 1.0 or frac <= 0.0:
        return np.where(residency >= 0, WHERE_VRAM,
                        WHERE_PCIE if frac >= 1.0 else WHERE_CPU).astype(np.uint8)
    from strata._native import kernels

    # the split runs every few windows on the engine thread: one sort and a native pass (a
    # Python loop per expert took 3 ms at 48 x 128 on the H200 host)
    counts = np.ascontiguousarray(counts)
    order = np.argsort(-counts, axis=1, kind="stable")  # hottest first, ties: lower id
    where = np.empty(residency.shape, dtype=np.uint8)
    return kernels.pool_assign_where(np.ascontiguousarray(residency, dtype=np.int32), frac,
                                     counts, order.astype(np.int64, copy=False), where)


def pcie_share(where: np.ndarray, counts: np.ndarray) -> float:
    """The fraction of the missing experts' routed rows in `counts` [L, E] that `where` gives
    the GPU over PCIe (0.0 when there are none)."""
    counts = np.asarray(counts, dtype=np.float64)
    pcie = counts[where == WHERE_PCIE].sum()
    cpu = counts[where == WHERE_CPU].sum()
    return float(pcie / (pcie + cpu)) if pcie + cpu > 0 else 0.0


# ---- the stored calibration (`strata-tool calibrate`) -----------------------------------------
CALIBRATION_FILE = "pcie-share.json"
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
                 measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    entries[calibration_key(model_path, gpu_name, threads)] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)  # readers never see half a file
    return path


def load_calibration(model_path, gpu_name: str, threads: int) -> dict | None:
    """The stored entry for this model, GPU and threads, or None."""
    entry = _read_entries(cache_dir() / CALIBRATION_FILE).get(
        calibration_key(model_path, gpu_name, threads))
    if entry is None:
        return None
    try:
        check_pcie_frac(entry.get("pcie_frac"))
    except ConfigError:
        return None
    return entry


def resolve_pcie_frac(pcie_frac: float | None, model_path, gpu_name: str,
                      threads: int, expert_types=()) -> tuple[float, str]:
    """(share, where it came from): --pcie-frac when given, else the stored calibration, else
    DEFAULT_PCIE_FRAC, or 1 when `expert_types` (the routed experts' ggml type ids) hold a
    SLOW_POOL_TYPES type. Logged once, so a user sees which one a run used."""
    if pcie_frac is not None:
        frac, source = check_pcie_frac(pcie_frac), "--pcie-frac"
    else:
        entry = load_calibration(model_path, gpu_name, threads)
        slow = sorted({int(t) for t in expert_types} & SLOW_POOL_TYPES)
        if entry is not None:
            frac = float(entry["pcie_frac"])
            source = f"calibrated {entry.get('measured_at', '')} ({cache_dir() / CALIBRATION_FILE})"
        else:
            frac = 1.0 if slow else DEFAULT_PCIE_FRAC
            why = (f"the experts' types ({', '.join(_type_name(t) for t in slow)}) have no SIMD "
                   "rows on the CPU pool, so every miss is read over PCIe" if slow else
                   "default")
            source = (f"{why}: no calibration for this model, {gpu_name} and {threads} threads; "
                      f"`strata-tool calibrate {model_path} --threads {threads}` measures it")
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
