"""Splitting a model's layers over several GPUs (stages): `--split-device`, `--layer-split
auto|K1,K2,..`, `--batch-groups auto|N`. `auto` picks the split with the smallest predicted
decode time per token of the slowest stage, from each card's memory and the expert cache it
leaves (a stage's expert hit rate follows from its cache slots and the routing profile).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.engine.recurrent import RecurrentState
from strata.errors import ConfigError
from strata.model.arch import is_routed_expert

_HOP_MS = 0.02  # one activation copy between cards per window (tiny rows over PCIe/NVLink)
_RESERVE_BYTES = 512 << 20  # per card: work buffers, graphs, the driver


@dataclass(frozen=True)
class LayerCosts:
    """What each layer costs in memory: dense bytes [L] (attention, norms, router, shared
    expert), one expert's bytes [L], KV bytes per token [L]; the embedding and the head sit on
    the first and the last stage."""

    dense_bytes: tuple[int, ...]
    expert_bytes: tuple[int, ...]
    kv_bytes_per_token: tuple[int, ...]
    n_experts: int
    n_experts_used: int
    embed_bytes: int
    head_bytes: int

    @property
    def n_layers(self) -> int:
        return len(self.dense_bytes)


def layer_costs(gguf_model, kv_bytes_per_value: int = 2) -> LayerCosts:
    """The costs of a GGUF model's layers (KV cells of `kv_bytes_per_value`: 2 for fp16)."""
    spec = gguf_model.spec
    L = spec.n_layers
    dense, experts = [0] * L, [0] * L
    embed = head = 0
    for name in gguf_model.tensor_names:
        t = gguf_model.tensor(name)
        if name.startswith("blk."):
            layer = int(name.split(".")[1])
            if layer >= L:  # qwen3next's multi-token-prediction layer: not run
                continue
            if is_routed_expert(name):
                experts[layer] += t.nbytes // spec.n_experts
            else:
                dense[layer] += t.nbytes
        elif name == "token_embd.weight":
            embed = t.nbytes
        else:
            head += t.nbytes  # output.weight, output_norm.weight
    if spec.tied_output:
        head += embed
    kv = 2 * spec.n_kv_heads * spec.head_dim * kv_bytes_per_value
    # a hybrid model's recurrent layers have no cells but a state: its two buffers for one
    # sequence counted with the layer's weights
    state = 2 * RecurrentState.nbytes_per_state(spec) // max(1, len(spec.recurrent_layers))
    for layer in spec.recurrent_layers:
        dense[layer] += state
    kvs = tuple(0 if spec.is_recurrent(layer) else kv for layer in range(L))
    return LayerCosts(tuple(dense), tuple(experts), kvs, spec.n_experts,
                      spec.n_experts_used, embed, head)


@dataclass(frozen=True)
class Card:
    """A GPU a stage may run on: its index, free bytes, and the user's budget (None: free)."""

    index: int
    free_bytes: int
    budget_bytes: int | None = None
    cache_budget_bytes: int | None = None  # --vram-budget: the most its expert cache may take

    @property
    def usable_bytes(self) -> int:
        room = self.free_bytes if self.budget_bytes is None else min(self.budget_bytes,
                                                                     self.free_bytes)
        return max(room - _RESERVE_BYTES, 0)


@dataclass(frozen=True)
class Bandwidths:
    """What the prediction assumes: bytes per second of the experts and dense weights read from
    VRAM and of the missing experts served over PCIe and by the CPU pool together (`strata-tool
    calibrate`), and each layer's fixed time in a decode window, which is not bytes but its
    kernels' chain of launches and round trips (two H200, 2026-12-01: a one-row token took
    2.82-2.95 ms with every expert in VRAM, split 24+24 or on one card, of which ~0.6 ms is
    reading its ~1.6 GB; the rest is ~47 us per layer)."""

    vram_bytes_s: float = 3.0e12
    miss_bytes_s: float = 60e9
    layer_s: float = 45e-6


@dataclass(frozen=True)
class Stage:
    card: int
    first_layer: int
    stop_layer: int
    dense_bytes: int
    kv_bytes: int
    cache_slots: int
    hit_rate: float
    predicted_ms: float
    resident_expert_bytes: int = 0  # every expert of its layers, when they are not offloaded
    routed: bool = True  # False: a dense model, no experts

    @property
    def n_layers(self) -> int:
        return self.stop_layer - self.first_layer

    def experts_text(self) -> str:
        if not self.routed:
            return "no routed experts"
        if self.resident_expert_bytes:
            return f"every expert in VRAM ({self.resident_expert_bytes / 2**30:.2f} GiB)"
        return f"{self.cache_slots} expert slots (hit rate ~{100 * self.hit_rate:.0f}%)"


@dataclass(frozen=True)
class SplitPlan:
    stages: tuple[Stage, ...]
    how: str  # "auto" or "given"
    ranked: bool = False  # the hit rates come from a routing profile (else uniform routing)

    @property
    def counts(self) -> list[int]:
        return [s.n_layers for s in self.stages]

    @property
    def predicted_ms(self) -> float:
        """Decode time per token: the stages run one after the other for one window."""
        return sum(s.predicted_ms for s in self.stages) + _HOP_MS * (len(self.stages) - 1)

    def describe(self) -> str:
        """The lines printed at start."""
        cached = any(s.routed and not s.resident_expert_bytes for s in self.stages)
        lines = [f"layer split ({self.how}): " + ",".join(map(str, self.counts))
                 + f"; predicted {self.predicted_ms:.2f} ms per decode token"
                 + ("" if not cached else " (hit rates from the routing profile)" if self.ranked
                    else " (hit rates for uniform routing: --expert-profile ranks better)")]
        for s in self.stages:
            lines.append(
                f"  GPU {s.card}: layers {s.first_layer}-{s.stop_layer - 1}, dense "
                f"{s.dense_bytes / 2**30:.2f} GiB, KV {s.kv_bytes / 2**30:.2f} GiB, "
                f"{s.experts_text()}, {s.predicted_ms:.2f} ms")
        return "\n".join(lines)


def parse_split_devices(value: str | None, num_visible: int) -> list[int]:
    """`--split-device 0,1` -> [0, 1]; None: every visible GPU. Errors name the bad entry."""
    if value is None or str(value).strip() == "":
        return list(range(num_visible))
    out: list[int] = []
    for part in str(value).split(","):
        part = part.strip()
        if not part.isdigit():
            raise ConfigError(f"--split-device {value!r}: {part!r} is not a GPU index "
                              "(give indices like 0,1)")
        index = int(part)
        if index >= num_visible:
            raise ConfigError(f"--split-device {value!r}: GPU {index} does not exist (this "
                              f"machine has {num_visible}: 0..{num_visible - 1})")
        if index in out:
            raise ConfigError(f"--split-device {value!r}: GPU {index} is named twice")
        out.append(index)
    return out


def parse_layer_split(value: str | None, num_layers: int, num_stages: int) -> list[int] | None:
    """`--layer-split K1,K2,..` -> layers per stage (they must add up to the model's layers);
    None or "auto" -> None (plan it)."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    parts = [p.strip() for p in str(value).split(",")]
    if not all(p.isdigit() for p in parts):
        raise ConfigError(f"--layer-split {value!r}: give auto or layer counts per GPU such "
                          f"as {num_layers // 2},{num_layers - num_layers // 2}")
    counts = [int(p) for p in parts]
    if len(counts) != num_stages:
        raise ConfigError(f"--layer-split {value!r} names {len(counts)} stages but "
                          f"{num_stages} GPUs take part (--split-device)")
    if any(c == 0 for c in counts):
        raise ConfigError(f"--layer-split {value!r}: every GPU needs at least one layer")
    if sum(counts) != num_layers:
        raise ConfigError(f"--layer-split {value!r} adds up to {sum(counts)} layers; the "
                          f"model has {num_layers}")
    return counts


def plan_split(costs: LayerCosts, cards: list[Card], counts: list[int] | None = None, *,
               kv_tokens: int = 4096, bandwidths: Bandwidths = Bandwidths(),
               profile: np.ndarray | None = None, experts_resident: bool = False) -> SplitPlan:
    """The stages for `counts` (layers per card, in card order), or with counts None the
    feasible split with the smallest predicted time of its slowest stage (ties: the smallest
    total). `profile` [L, E]: routing counts that rank each layer's experts (uniform without).
    `experts_resident`: every expert of a stage's layers sits in its VRAM (no offload), so they
    take memory as the dense weights do and a token reads the K it routes to from VRAM.
    ConfigError when the dense part of some stage cannot fit its card."""
    L, S = costs.n_layers, len(cards)
    if S == 0:
        raise ConfigError("the layer split needs at least one GPU")
    freq = _expert_freq(costs, profile)
    if counts is not None:
        stages = _stages(costs, cards, counts, kv_tokens, bandwidths, freq, experts_resident)
        bad = [s for s in stages if s is None]
        if bad:
            raise ConfigError(_no_fit(costs, cards, counts, kv_tokens, experts_resident))
        return SplitPlan(tuple(stages), "given", profile is not None)
    best, best_key = None, None
    for split in _compositions(L, S):
        stages = _stages(costs, cards, split, kv_tokens, bandwidths, freq, experts_resident)
        if any(s is None for s in stages):
            continue
        key = (max(s.predicted_ms for s in stages), sum(s.predicted_ms for s in stages))
        if best_key is None or key < best_key:
            best, best_key = stages, key
    if best is None:
        raise ConfigError(_no_fit(costs, cards, None, kv_tokens, experts_resident))
    return SplitPlan(tuple(best), "auto", profile is not None)


def plan_for_model(costs: LayerCosts, cards: list[Card], counts: list[int] | None, *,
                   kv_tokens: int, offload: bool,
                   profile: np.ndarray | None = None) -> tuple[SplitPlan, bool, str | None]:
    """(plan, offload, why) for a model whose experts stay in VRAM unless `offload` (an expert
    option was given). When every expert does not fit the cards, a Mixture-of-Experts model
    keeps them in pinned RAM behind each card's VRAM cache instead, as one GPU does with
    `--device auto`: offload True and `why` names what did not fit (the caller asks for
    `--expert-cache auto`). ConfigError when the dense part does not fit either."""
    if offload or not costs.n_experts:
        return plan_split(costs, cards, counts, kv_tokens=kv_tokens, profile=profile,
                          experts_resident=not offload), offload, None
    try:
        return plan_split(costs, cards, counts, kv_tokens=kv_tokens,
                          experts_resident=True), False, None
    except ConfigError as exc:
        return (plan_split(costs, cards, counts, kv_tokens=kv_tokens, profile=profile), True,
                str(exc))


def choose_batch_groups(value: str | int | None, num_stages: int, num_slots: int, *,
                        blocking_tier: bool = False, cpu_pool: bool = False,
                        drafts: bool = False) -> tuple[int, str]:
    """(slot groups pipelined over the stages, the log line saying why). With N groups slot i
    belongs to group i % N and the scheduler keeps one decode window per group in flight, so
    group A's rows run on stage 2 while group B's run on stage 1. `auto` takes one group
    where pipelining would switch off something asked for (a blocking tier, whose rounds wait
    until no window holds the table they replace; a CPU pool given by --pcie-frac, which
    takes one window at a time; draft tokens); an explicit N is honoured and the line says
    what it turned off."""
    wanted_off = [what for what, on in (("the blocking tier (--adapt-async 0)", blocking_tier),
                                        ("the CPU pool (--pcie-frac < 1)", cpu_pool),
                                        ("draft tokens", drafts)) if on]
    if value is None or str(value).strip().lower() == "auto":
        if num_stages < 2 or num_slots < 2:
            return 1, "batch groups: 1 (one stage or one slot: nothing to pipeline)"
        if wanted_off:
            return 1, ("batch groups: 1, since pipelining would switch off "
                       + " and ".join(wanted_off))
        groups = min(num_stages, num_slots)
        return groups, (f"batch groups: {groups} (decode windows of slot groups pipelined over "
                        f"{num_stages} stages)")
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--batch-groups {value!r}: give auto or a number of groups >= 1")
    groups = int(text)
    if groups > num_slots:
        raise ConfigError(f"--batch-groups {groups} is more than the {num_slots} slots "
                          "(--parallel); each group needs at least one slot")
    if groups > 1 and wanted_off:
        return groups, (f"batch groups: {groups} as asked; this turns off "
                        + " and ".join(wanted_off))
    return groups, f"batch groups: {groups} as asked"


# ---- helpers ----------------------------------------------------------------------------------
def _expert_freq(costs: LayerCosts, profile: np.ndarray | None) -> np.ndarray:
    """[L, E] each layer's experts' share of its routed rows, sorted best first."""
    L, E = costs.n_layers, costs.n_experts
    if profile is None:
        return np.full((L, E), 1.0 / max(E, 1))  # a dense model: [L, 0]
    p = np.asarray(profile, dtype=np.float64)
    if p.shape != (L, E):
        raise ConfigError(f"the routing profile is {p.shape[0]}x{p.shape[1]} but the model "
                          f"has {L} layers x {E} experts")
    totals = p.sum(axis=1, keepdims=True)
    p = np.where(totals > 0, p / np.where(totals > 0, totals, 1), 1.0 / E)
    return -np.sort(-p, axis=1)


def _stages(costs, cards, counts, kv_tokens, bw, freq, experts_resident) -> list[Stage | None]:
    stages: list[Stage | None] = []
    first = 0
    for i, (card, n) in enumerate(zip(cards, counts)):
        stop = first + n
        dense = sum(costs.dense_bytes[first:stop])
        resident = costs.n_experts * sum(costs.expert_bytes[first:stop]) if experts_resident else 0
        dense += costs.embed_bytes if i == 0 else 0
        dense += costs.head_bytes if i == len(cards) - 1 else 0
        kv = kv_tokens * sum(costs.kv_bytes_per_token[first:stop])
        room = card.usable_bytes - dense - resident - kv
        if room < 0:
            stages.append(None)
            first = stop
            continue
        per_expert = max(costs.expert_bytes[first:stop]) or 1
        if card.cache_budget_bytes is not None:
            room = min(room, card.cache_budget_bytes)
        if experts_resident or not costs.n_experts:
            slots, hit = 0, 1.0
        else:
            slots = min(room // per_expert, n * costs.n_experts)
            hit = _hit_rate(freq[first:stop], slots)
        K = costs.n_experts_used
        expert_read = K * sum(costs.expert_bytes[first:stop])
        active_dense = sum(costs.dense_bytes[first:stop]) + (
            costs.head_bytes if i == len(cards) - 1 else 0)
        seconds = (n * bw.layer_s + (active_dense + hit * expert_read) / bw.vram_bytes_s
                   + (1 - hit) * expert_read / bw.miss_bytes_s)
        stages.append(Stage(card.index, first, stop, dense, kv, int(slots), hit, 1e3 * seconds,
                            resident, costs.n_experts > 0))
        first = stop
    return stages


def _hit_rate(freq: np.ndarray, slots: int) -> float:
    """The share of routed rows the best `slots` (layer, expert) pairs of these layers take."""
    if slots <= 0 or freq.size == 0:
        return 0.0
    flat = -np.sort(-freq.reshape(-1))
    return float(flat[:slots].sum() / flat.sum())


def _compositions(total: int, parts: int):
    """Every way to write `total` as `parts` positive counts, in order."""
    if parts == 1:
        yield [total]
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield [first, *rest]


def _no_fit(costs, cards, counts, kv_tokens, experts_resident) -> str:
    experts_resident = experts_resident and costs.n_experts > 0
    need = sum(costs.dense_bytes) + costs.embed_bytes + costs.head_bytes
    if experts_resident:
        need += costs.n_experts * sum(costs.expert_bytes)
    need += kv_tokens * sum(costs.kv_bytes_per_token)
    have = sum(c.usable_bytes for c in cards)
    what = (f"the layer split {','.join(map(str, counts))} does not fit" if counts
            else "no layer split fits")
    weights = "the dense weights, every expert" if experts_resident else "the dense weights"
    return (f"{what} {weights} and KV ({need / 2**30:.2f} GiB in all, for {kv_tokens} "
            "KV tokens) into the GPUs' usable memory ("
            + ", ".join(f"GPU {c.index}: {c.usable_bytes / 2**30:.2f} GiB" for c in cards)
            + f"; {have / 2**30:.2f} GiB after a {_RESERVE_BYTES >> 20} MiB reserve each); "
            "give the cards larger budgets, fewer KV tokens, or another split"
            + (", or keep the experts in RAM (--expert-cache)" if experts_resident else ""))
