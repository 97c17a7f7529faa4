"""`strata-tool replay`, `profile` and `synth-trace`: routing traces into hit rates, ranked
profiles, and synthetic skewed traces for tier benchmarks.
"""
from __future__ import annotations

import math
import types
from decimal import ROUND_HALF_UP, Decimal

import click
from tqdm import tqdm

from strata.errors import StrataError
from strata.tool.fail import fail, read_or_fail


def _read_traces(paths):
    """The traces at `paths` merged in order; exits naming the file that is unreadable, of
    another model than the first, or when together they hold no routing at all."""
    from strata.experts.trace import merge_traces, read_trace

    traces = []
    for path in paths:
        trace = read_or_fail(read_trace, path)
        if traces and (trace.n_layers, trace.n_experts) != (traces[0].n_layers,
                                                            traces[0].n_experts):
            fail(f"{path} routes {trace.n_layers} layers x {trace.n_experts} experts, "
                 f"{paths[0]} {traces[0].n_layers} x {traces[0].n_experts}: only traces of "
                 "one model merge")
        traces.append(trace)
    try:
        trace = traces[0] if len(traces) == 1 else merge_traces(traces)
    except StrataError as exc:
        fail(str(exc))
    if not len(trace.records):  # its profile would rank by layer order, its hit rates be 0%
        fail(f"{', '.join(paths)} hold{'s' if len(paths) == 1 else ''} no routing records: "
             "nothing was routed while recording; record a trace of some requests")
    return trace


def parse_slots(text: str, num_experts_total: int) -> int:
    """`--slots` value: a count ("150") or a share of all experts ("10%", rounded to the
    nearest count, halves up: "12.5%" of 4 experts is 1 slot)."""
    try:
        if text.endswith("%"):
            share = Decimal(text[:-1].strip())  # decimal: "29%" of 50 is 14.5, not 14.4999...
            if not share.is_finite() or not 0 <= share <= 100:
                raise click.BadParameter(f"{text!r}: a share of all experts lies in 0..100%",
                                         param_hint="--slots")
            return int((share * num_experts_total / 100).to_integral_value(ROUND_HALF_UP))
        count = int(text)
    except (ValueError, ArithmeticError):  # (decimal's InvalidOperation is the latter)
        raise click.BadParameter(f"{text!r} is neither a slot count (e.g. 150) nor a share of "
                                 "all experts (e.g. 10%)", param_hint="--slots") from None
    if not 0 <= count <= num_experts_total:
        raise click.BadParameter(f"{count} slots: the trace has {num_experts_total} experts, so "
                                 f"0..{num_experts_total}", param_hint="--slots")
    return count


def find_tier_policy(name: str | None, num_slots: int, adapt_swaps: int):
    """The installed tier policy called `name` (None: the one the engine would use)."""
    from strata.plugins import get_plugin_manager, implementations_in_call_order

    pm = get_plugin_manager()
    context = {"config": types.SimpleNamespace(expert_cache_slots=num_slots,
                                               adapt_swaps=adapt_swaps),
               "spec": None, "num_slots": 1}
    names = []
    for impl in implementations_in_call_order(pm, "strata_tier_policy"):
        policy = impl.function(**{a: context[a] for a in impl.argnames})
        if policy is None:
            continue
        if name is None or policy.name == name:
            return policy
        names.append(policy.name)
    fail(f"no installed tier policy is called {name!r}; installed: {', '.join(names) or 'none'}")


@click.command()
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--slots", "slots_text", multiple=True, required=True,
              help="Cache slots: a count or a share of all experts (10%); repeatable.")
@click.option("--policy", "policy_name", default=None,
              help="Tier policy by name (default: the one the engine would use).")
@click.option("--adapt-every", default=4, show_default=True, type=click.IntRange(min=1),
              help="Windows between tier rounds.")
@click.option("--adapt-min-gain", default=0.0, show_default=True, type=float,
              help="Smallest gain a swap must clear, in the policy's score (about routed "
                   "rows expected next window for window-score).")
@click.option("--adapt-swaps", default=64, show_default=True, type=click.IntRange(min=1),
              help="Most swaps per round.")
@click.option("--profile", "profile_path", default=None, type=click.Path(dir_okay=False),
              help="Profile for the static cache (default: the trace's own, in hindsight).")
@click.option("--free-admission", is_flag=True,
              help="Also replay the policy keeping missed experts whose bytes crossed the link "
                   "anyway (GPU reach), a row named <policy>+admit.")
def replay(traces, slots_text, policy_name, adapt_every, adapt_min_gain, adapt_swaps,
           profile_path, free_admission):
    """Replay routing TRACES (merged in order) through N cache slots: the tier policy beside
    LRU, LFU, the static profile cache, the per-round oracle and the Belady optimum."""
    from strata.experts.profile import read_profile
    from strata.experts.replay import replay_all, replay_tier

    if not 0 <= adapt_min_gain < math.inf:  # also NaN, which no gain would ever clear
        raise click.BadParameter(f"{adapt_min_gain!r}: give a finite number >= 0, as the "
                                 "engine's --adapt-min-gain", param_hint="--adapt-min-gain")
    trace = _read_traces(traces)
    total = trace.n_layers * trace.n_experts
    profile = None
    if profile_path is not None:
        profile = read_or_fail(read_profile, profile_path)
        if (profile.n_layers, profile.n_experts) != (trace.n_layers, trace.n_experts):
            fail(f"{profile_path} ranks {profile.n_layers} layers x {profile.n_experts} "
                 f"experts but the trace routes {trace.n_layers} x {trace.n_experts}; use a "
                 "profile made from traces of the same model")
    # every --slots, the profile and the policy checked before the first line is printed
    runs = [(num_slots, find_tier_policy(policy_name, num_slots, adapt_swaps))
            for num_slots in (parse_slots(text, total) for text in slots_text)]
    click.echo(f"{trace.num_windows} windows, {len(trace.records)} accesses, "
               f"{trace.n_layers} layers x {trace.n_experts} experts ({total})")
    click.echo(f"{'slots':>7}  {'policy':<16} {'hit rate':>8}  {'hits':>10}  {'loads':>9}")
    for num_slots, policy in runs:
        # a bar per --slots value on a terminal (a long real trace takes minutes), cleared
        # before its rows are printed
        with tqdm(total=6 + free_admission, desc=f"{num_slots} slots", unit="row",
                  leave=False, disable=None) as bar:
            try:
                results = replay_all(trace, num_slots, policy, adapt_every, adapt_min_gain,
                                     profile, progress=bar)
                if free_admission:  # a fresh policy: they keep state
                    results.insert(1, replay_tier(
                        trace, num_slots, find_tier_policy(policy_name, num_slots, adapt_swaps),
                        adapt_every, adapt_min_gain, free_admission=True))
                    bar.update(1)
            except StrataError as exc:
                bar.close()
                fail(str(exc))
        for result in results:
            click.echo(f"{num_slots:>7}  {result.name:<16} {result.hit_rate:>8.1%}  "
                       f"{result.num_hits:>10}  {result.num_loads:>9}")


@click.command()
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False),
              help="Where to write the ranked profile.")
@click.option("--show", default=10, show_default=True, type=click.IntRange(min=0),
              help="How many of the hottest experts to print.")
def profile(traces, out, show):
    """Rank every (layer, expert) of routing TRACES (merged) by how often it is routed to. An
    existing OUT is replaced once the new profile is whole."""
    from strata.experts.profile import build_profile, write_profile
    from strata.tool.output import output_target, replacing

    try:
        target = output_target(out, inputs=traces)
    except StrataError as exc:
        fail(str(exc))
    routing_profile = build_profile(_read_traces(traces))
    try:
        with replacing(target) as partial:
            write_profile(partial, routing_profile)
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    click.echo(f"wrote {out}: {len(routing_profile.ranking)} experts ranked")
    for rank in range(min(show, len(routing_profile.ranking))):
        layer, expert = routing_profile.ranking[rank]
        click.echo(f"  {rank:>4}  layer {layer:>3} expert {expert:>4}  "
                   f"{routing_profile.accesses[rank]} windows, {routing_profile.rows[rank]} rows")


@click.command("synth-trace")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--layers", default=24, show_default=True, type=click.IntRange(1, 65535),
              help="MoE layers of the model the trace is of.")
@click.option("--experts", default=64, show_default=True, type=click.IntRange(1, 65535),
              help="Routed experts per layer.")
@click.option("--top-k", default=8, show_default=True, type=click.IntRange(min=1),
              help="Experts each token is routed to per layer (at most --experts).")
@click.option("--windows", default=3000, show_default=True, type=click.IntRange(min=1),
              help="Decode windows (steps) to record.")
@click.option("--rows", default=4, show_default=True, type=click.IntRange(min=1),
              help="Decode rows (token streams) per window.")
@click.option("--skew", default=1.0, show_default=True, type=float,
              help="Zipf exponent of expert popularity (0 = uniform).")
@click.option("--locality", default=0.5, show_default=True, type=float,
              help="Chance that each expert of a stream's token is routed again for its "
                   "next token.")
@click.option("--phase-windows", default=0, show_default=True, type=click.IntRange(min=0),
              help="Windows between popularity changes (topic shifts); 0 = never.")
@click.option("--stream-topics", is_flag=True,
              help="Each stream its own popularity (its topic), changed every --phase-windows "
                   "windows at its own, staggered time, as separate conversations do; by "
                   "default the streams share one and change it together.")
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed.")
def synth_trace_cmd(out, layers, experts, top_k, windows, rows, skew, locality, phase_windows,
                    stream_topics, seed):
    """Write a synthetic routing trace with skew and locality to OUT. An existing OUT is
    replaced once the new trace is whole."""
    from strata.experts.trace import format_skew_summary, write_trace
    from strata.tool.output import output_target, replacing
    from strata.tool.routing import synth_trace

    try:
        target = output_target(out)
        trace = synth_trace(layers, experts, top_k, windows, rows, skew, locality, phase_windows,
                            seed, stream_topics=stream_topics)
        with replacing(target) as partial:
            write_trace(partial, trace)
    except StrataError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    click.echo(f"wrote {out}")
    for line in format_skew_summary(trace):
        click.echo(line)
