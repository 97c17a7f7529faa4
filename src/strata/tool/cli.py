"""`strata-tool`: maintenance commands; synth and inspect here, the others in their modules."""
from __future__ import annotations

import os

import click

from strata.errors import StrataError
from strata.tool.fail import fail, read_or_fail


@click.group()
def main():
    """Strata maintenance tool."""


@main.command()
@click.option("--shape", default="tiny", show_default=True, help="Preset model shape (--list).")
@click.option("--type", "weight_type", default="q4_0", show_default=True,
              help="Type of the weight matrices: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, "
                   "iq4_nl, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs, iq1_s, iq1_m, iq2_xxs, "
                   "iq2_xs, iq2_s, iq3_xxs, iq3_s, or the mixes q4_k_m and q5_k_m "
                   "(llama.cpp's). Rows a k-quant cannot hold take llama.cpp's fallback type "
                   "(q4_k: q5_0, q5_k: q5_1, q6_k: q8_0, q2_k/q3_k/i-quants: iq4_nl).")
@click.option("--arch", "arch_name", default=None, help="Switch the preset's architecture.")
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed.")
@click.option("--layers", default=None, type=click.IntRange(min=1), help="Number of layers.")
@click.option("--context-length", default=None, type=click.IntRange(1, 2**32 - 1),
              help="Context length the file declares (default: the preset's), e.g. 131072 "
                   "for benchmarks deep into a context (`strata bench -d`).")
@click.option("--list", "list_presets", is_flag=True, help="List the preset shapes and exit.")
@click.option("--routing-skew", default=0.0, show_default=True, type=float,
              help="Make routers favour a minority of experts (0: none beyond what random "
                   "routers do, which concentrate in deep layers; 0.5 is moderate).")
@click.option("--jobs", "-j", default=1, show_default=True, type=click.IntRange(min=1),
              help="Processes making the tensors (the same file whatever the count).")
@click.argument("out", required=False, type=click.Path(dir_okay=False))
def synth(shape, weight_type, arch_name, seed, layers, context_length, list_presets, routing_skew,
          jobs, out):
    """Write a random-weight MoE model at a preset shape to OUT (a .gguf file). An existing OUT
    is replaced once the new file is whole."""
    from strata.tool.inspect import format_spec
    from strata.tool.output import output_target
    from strata.tool.presets import PRESETS
    from strata.tool.synth import synth_model

    if list_presets:
        for name, (spec, description) in PRESETS.items():
            click.echo(f"{name:<22} {description}")
        return
    if out is None:
        fail("give the output path, e.g. `strata-tool synth --shape tiny tiny.gguf`")
    overrides = {} if layers is None else {"n_layers": layers}
    if context_length is not None:
        overrides["context_length"] = context_length
    try:
        spec = synth_model(output_target(out), shape, weight_type, arch=arch_name, seed=seed,
                           progress=True, routing_skew=routing_skew, jobs=jobs, **overrides)
    except StrataError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    click.echo(f"wrote {out}: {spec.arch}, shape {shape}, {weight_type}, seed {seed}, "
               f"{os.path.getsize(out)} bytes ({os.path.getsize(out) / 2**20:.1f} MiB)")
    for line in format_spec(spec):
        click.echo(line)


@main.command()
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@click.option("--routing", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="Also print the measured skew and locality of this routing trace.")
def inspect(path, trace_path):
    """Describe the GGUF model at PATH: hyperparameters, file and tensor types, tokenizer, chat
    template, bytes per token; and/or the routing trace of --routing."""
    from strata.tool.inspect import format_report, inspect_model

    if path is None and trace_path is None:
        fail("give a model path, e.g. `strata-tool inspect model.gguf`, or --routing TRACE")
    trace = None
    if trace_path is not None:
        from strata.experts.trace import read_trace

        trace = read_or_fail(read_trace, trace_path)
    report = None
    if path is not None:
        report = read_or_fail(inspect_model, path)
    if trace is not None and report is not None and \
            (trace.n_layers, trace.n_experts) != (report.spec.n_layers, report.spec.n_experts):
        fail(f"{trace_path} routes {trace.n_layers} layers x {trace.n_experts} experts but "
             f"{path} has {report.spec.n_layers} x {report.spec.n_experts}: the trace was "
             "recorded from another model")
    if trace is not None:
        _echo_trace(trace, trace_path)
    if report is not None:
        click.echo(format_report(report))


def _echo_trace(trace, trace_path) -> None:
    from strata.experts.trace import format_skew_summary

    if len(trace.records):
        click.echo("\n".join(format_skew_summary(trace)))
    else:  # its skew and locality would read as 0.0%, as though measured
        click.echo(f"routing trace: {trace.n_layers} layers x {trace.n_experts} experts, no "
                   f"records: nothing was routed while {trace_path} was recorded")


from strata.tool.calibrate import calibrate  # noqa: E402
from strata.tool.conversations_cmd import conversations  # noqa: E402
from strata.tool.pack_cmd import pack  # noqa: E402
from strata.tool.plugins_cmd import plugins  # noqa: E402
from strata.tool.replay_cmd import profile, replay, synth_trace_cmd  # noqa: E402

for _command in (calibrate, conversations, pack, plugins, profile, replay, synth_trace_cmd):
    main.add_command(_command)
