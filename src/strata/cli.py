"""`strata`: run (generate from a prompt) and bench (prompt and decode speed, like llama-bench)."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import click
import numpy as np

from strata.cli_options import (Depths, ReadChunk, SlotCounts, ctx_size_option, device_option,
                                draft_options, expert_options, read_chunk_fields, slot_options)
from strata.cli_chat import COMMANDS_HELP, ReplyPrinter, chat, speed_line
from strata.errors import StrataError
from strata.sizes import size_text

MODEL_ENV = "STRATA_MODEL"
HOW_TO_GET_A_MODEL = ("give --model PATH or set $STRATA_MODEL to a GGUF file; for a small test "
                      "model run `strata-tool synth --shape tiny model.gguf`")


def default_model_path() -> Path | None:
    """The packaged default model `strata/data/default-model.gguf`, if this install has one."""
    from strata.data import default_model_path as packaged_model_path

    return packaged_model_path()


def resolve_model(model: str | None) -> Path:
    """--model, else $STRATA_MODEL, else the packaged default; exits 2 when none is usable."""
    if model:
        path = Path(model)
    elif os.environ.get(MODEL_ENV):
        path = Path(os.environ[MODEL_ENV])
    else:
        path = default_model_path()
        if path is None:
            fail(f"no model given and no packaged default model; {HOW_TO_GET_A_MODEL}")
    if path.is_dir():
        fail(f"model {str(path)!r} is a folder, not a GGUF file; {HOW_TO_GET_A_MODEL}")
    if not path.is_file():
        if path.exists():  # a device, a pipe, a socket
            fail(f"model {str(path)!r} is not a regular file; {HOW_TO_GET_A_MODEL}")
        fail(f"model file {str(path)!r} does not exist; {HOW_TO_GET_A_MODEL}")
    try:  # a file this user may not read (or one whose reads fail) named, not a traceback
        with open(path, "rb") as f:
            f.read(4)
    except OSError as e:
        fail(f"model file {str(path)!r} cannot be read ({e.strerror or e}); check its "
             "permissions, or give another file")
    return path


def fail(message: str) -> None:
    """One clear line on stderr and exit code 2 (no traceback for errors the user can fix)."""
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.group()
@click.version_option(package_name="strata")
def main():
    """Strata: Mixture-of-Experts inference."""


# ---- run -----------------------------------------------------------------------------------
@main.command()
@click.argument("prompt", required=False)
@click.option("-cnv/-no-cnv", "--conversation/--no-conversation", "conversation", default=None,
              help="Chat: a prompt (`> `), your turn, the reply streamed, the next turn; the "
                   "history stays in the KV, so each turn reads only its new tokens. Default: "
                   "on with no PROMPT on a terminal. PROMPT, if given, is the first turn. A line "
                   "ending in \\ continues on the next; " + COMMANDS_HELP + "; Ctrl-C stops a "
                   "reply, Ctrl-C or Ctrl-D at the prompt exits. With stdin not a terminal, "
                   "-cnv reads one turn a line.")
@click.option("--model", "-m", "model", default=None,
              help="GGUF model (default: $STRATA_MODEL, else the packaged default model).")
@click.option("-n", "--max-tokens", default=256, show_default=True, type=click.IntRange(min=1),
              help="Tokens to generate.")
@click.option("--temp", default=0.8, show_default=True, type=click.FloatRange(min=0),
              help="Temperature (0 = greedy).")
@click.option("--top-k", default=40, show_default=True, help="Top-k (0 = off).")
@click.option("--top-p", default=0.95, show_default=True, help="Top-p (1 = off).")
@click.option("--min-p", default=0.05, show_default=True, help="Min-p (0 = off).")
@click.option("--repeat-penalty", default=1.0, show_default=True,
              help="Repetition penalty on seen tokens (1 = off).")
@click.option("--repeat-last-n", default=64, show_default=True, type=click.IntRange(min=-1),
              help="Tokens the repetition penalty looks back over (-1 = all, 0 = none; 64 as "
                   "llama.cpp).")
@click.option("--seed", default=None, type=int, help="Sampling seed (default: random).")
@click.option("--threads", "-t", default=None, type=int,
              help="CPU threads (default: all usable cores; a CPU pool beside a GPU takes all "
                   "but one, since the engine thread that drives the GPU needs its own).")
@ctx_size_option
@click.option("--system", "-sys", "--system-prompt", "system", default=None,
              help="System message for the chat template.")
@click.option("--raw", is_flag=True, help="Feed the prompt as is, without the chat template "
              "(not with conversation mode, which needs the template).")
@click.option("--thinking", type=click.Choice(["show", "hide"]), default="show",
              show_default=True,
              help="A thinking model's <think> block: printed as the model wrote it (dimmed on "
                   "a terminal), or left out.")
@click.option("--grammar", default=None,
              help="GBNF grammar (llama.cpp's) the reply must follow, e.g. 'root ::= \"yes\" "
                   "| \"no\"'.")
@click.option("--grammar-file", default=None, type=click.Path(dir_okay=False),
              help="File holding the GBNF grammar (instead of --grammar).")
@device_option
@slot_options
@expert_options
@draft_options
def run(prompt, conversation, model, max_tokens, temp, top_k, top_p, min_p, repeat_penalty,
        repeat_last_n, seed, threads, ctx_size, system, raw, thinking, grammar, grammar_file,
        device, parallel, read_chunk, conversation_cache_mib, ctx_checkpoints,
        conversation_files, expert_config, draft_config):
    """Generate a reply to PROMPT and stream it to stdout ('-' reads the prompt from stdin);
    with no PROMPT on a terminal (or with -cnv), chat turn by turn."""
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.json_constraint import opens_reasoning
    from strata.engine.sampling import SamplingParams

    if conversation is None:
        conversation = prompt is None and sys.stdin.isatty()
    if conversation and raw:
        fail("--raw feeds one prompt without the chat template, and conversation mode needs "
             "the template to keep the turns apart: drop --raw, or give a PROMPT with -no-cnv")
    if prompt is None and not conversation:
        fail("no PROMPT given and stdin is not a terminal (or -no-cnv is given): give PROMPT, "
             "'-' to read it from stdin, or -cnv to read one turn a line")
    if prompt == "-":
        prompt = sys.stdin.read()
        if not prompt.strip():
            fail("'-' read an empty PROMPT from stdin: pipe the prompt in, or give it as PROMPT")
    path = resolve_model(model)
    if grammar_file is not None:
        if grammar is not None:
            fail("give --grammar or --grammar-file, not both")
        try:
            grammar = Path(grammar_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"--grammar-file {grammar_file}: {e}")
    try:
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=repeat_penalty,
                                repeat_last_n=repeat_last_n, max_tokens=max_tokens,
                                seed=seed, grammar=grammar or None,
                                reasoning_lead=not raw)  # --raw: the grammar holds it all
        engine = Engine(EngineConfig(path, n_ctx=ctx_size, threads=threads, seed=seed,
                                     device=device, parallel=parallel,
                                     **read_chunk_fields(read_chunk),
                                     conversation_cache_mib=conversation_cache_mib,
                                     ctx_checkpoints=ctx_checkpoints,
                                     **conversation_files,
                                     **expert_config, **draft_config))
    except StrataError as e:
        fail(str(e))
    plan_text = getattr(engine.model, "plan_text", None)  # a layer split's stages
    if plan_text:
        click.echo(plan_text, err=True)
    if conversation:
        with engine:
            chat(engine, params, system, thinking, prompt)
        return
    with engine:
        try:
            if raw:
                tokens = engine.tokenize(prompt)
            else:
                messages = [{"role": "system", "content": system}] if system else []
                messages.append({"role": "user", "content": prompt})
                tokens = engine.chat_prompt(messages)
            events = engine.generate(tokens, params)
            stats = None
            # --raw: the text as it comes (its grammar, if one, holds any <think> too)
            printer = ReplyPrinter("show" if raw else thinking,
                                   not raw and opens_reasoning(engine.tokenizer, tokens))
            for ev in events:
                printer.push(ev.text)
                stats = ev.stats or stats
            tier = engine.expert_tier
            cache_line = None
            if tier is not None and tier.arena is not None:
                from strata.engine.tier_stats import format_group

                tier.wait_idle(10)
                cache_line = format_group(tier.snapshot_totals(), 0, tier.mode)
        except StrataError as e:
            click.echo("")
            fail(str(e))
        except KeyboardInterrupt:
            click.echo("")
            click.echo("interrupted", err=True)
            sys.exit(130)
    printer.finish()
    if cache_line is not None:
        click.echo(cache_line, err=True)
    click.echo(speed_line(stats), err=True)
    if stats.num_draft_tokens:
        click.echo(f"drafts: {stats.num_accepted_draft_tokens} of {stats.num_draft_tokens} "
                   f"accepted, {stats.num_decode_tokens} tokens in {stats.num_decode_forwards} "
                   "decode windows", err=True)


# ---- bench ---------------------------------------------------------------------------------
def _weight_type(gguf) -> str:
    """The type most of the file's bytes are in (the routed experts, usually)."""
    totals: dict[str, int] = {}
    for name in gguf.tensor_names:
        t = gguf.tensor(name)
        totals[t.type_name] = totals.get(t.type_name, 0) + t.nbytes
    return max(totals, key=totals.get)


class DepthKVs:
    """Each slot's KV for one bench depth: `depth` tokens of context read once through
    `forward` (untimed, as llama-bench's -d does) and taken back to them before every run;
    at depth 0 a fresh KV per run. `room`: the most tokens a run adds. The reading shows a
    progress bar on stderr (tqdm: on a terminal unless `progress` says otherwise; a 64K depth
    takes minutes on a CPU)."""

    def __init__(self, model, depth: int, room: int, chunk_tokens: int, forward=None,
                 kv_args: dict | None = None, seed: int = 0, progress: bool | None = None):
        self.model, self.depth, self.room = model, int(depth), int(room)
        self.chunk_tokens, self.kv_args = int(chunk_tokens), dict(kv_args or {})
        self.forward = forward or model.forward
        self.progress = progress
        self._context = np.random.default_rng(seed).integers(
            0, model.spec.vocab, self.depth, dtype=np.int32)
        self._kvs = []

    def take(self, num_slots: int = 1) -> list:
        """`num_slots` KVs holding the depth's tokens (and nothing after them)."""
        if not self.depth:
            return [self.model.new_kv(self.room, **self.kv_args) for _ in range(num_slots)]
        missing = num_slots - len(self._kvs)
        if missing > 0:
            from tqdm import tqdm

            with tqdm(total=missing * self.depth, unit="token", leave=False,
                      desc=f"-d {self.depth}: reading the context of {missing} slot(s)",
                      disable=None if self.progress is None else not self.progress) as bar:
                for _ in range(missing):
                    kv = self.model.new_kv(self.depth + self.room, **self.kv_args)
                    for start in range(0, self.depth, self.chunk_tokens):
                        chunk = self._context[start:start + self.chunk_tokens]
                        self.forward(chunk, kv)
                        bar.update(len(chunk))
                    kv.keep_checkpoint()  # a hybrid model's recurrent state at the depth
                    self._kvs.append(kv)
        for kv in self._kvs[:num_slots]:
            kv.truncate(self.depth)
        return self._kvs[:num_slots]


def _time_prompt(model, tokens: np.ndarray, chunk_tokens: int, forward=None,
                 kv_args: dict | None = None, kv=None) -> float:
    """Seconds to read `tokens` into `kv` (default: a fresh KV made with `kv_args`),
    `chunk_tokens` at a time (through `forward`, default `model.forward`)."""
    forward = forward or model.forward
    if kv is None:
        kv = model.new_kv(len(tokens), **(kv_args or {}))
    t0 = time.perf_counter()
    for start in range(0, len(tokens), chunk_tokens):
        forward(tokens[start:start + chunk_tokens], kv)
    return time.perf_counter() - t0


def _time_decode(model, tokens: np.ndarray, forward=None, kv_args: dict | None = None,
                 kv=None) -> float:
    """Seconds for len(tokens) single-token forwards into `kv` (default: an empty KV)."""
    forward = forward or model.forward
    if kv is None:
        kv = model.new_kv(len(tokens), **(kv_args or {}))
    t0 = time.perf_counter()
    for i in range(len(tokens)):
        forward(tokens[i:i + 1], kv)
    return time.perf_counter() - t0


def _time_slots(model, tokens: np.ndarray, forward_window=None,
                kv_args: dict | None = None, kvs=None) -> float:
    """Seconds for T decode windows of S rows, one token per slot, into `kvs` (default: S
    empty KVs): tokens [T, S] (slot s reads column s); on a layer split with batch groups the
    groups' windows pipelined, as the engine's scheduler runs them."""
    from strata.backends.window import Window

    T, S = tokens.shape
    if kvs is None:
        kvs = [model.new_kv(T, **(kv_args or {})) for _ in range(S)]
    forwarder = getattr(forward_window, "__self__", None) or model
    groups = min(int(getattr(model, "batch_groups", 1) or 1), S)
    t0 = time.perf_counter()
    if groups > 1 and callable(getattr(forwarder, "start_window", None)) and getattr(
            forwarder, "pipelines", True):
        _pipelined_slots(forwarder, kvs, tokens, groups)
        return time.perf_counter() - t0
    forward_window = forward_window or model.forward_window
    for t in range(T):
        forward_window(Window.build([(kv, tokens[t, s:s + 1]) for s, kv in enumerate(kvs)]))
    return time.perf_counter() - t0


def _pipelined_slots(forwarder, kvs, tokens: np.ndarray, groups: int) -> None:
    """The windows of _time_slots as the scheduler pipelines them on a layer split (slot s in
    group s % groups; a group's next window starts once its last one finished, while the
    others are in flight)."""
    from collections import deque

    from strata.backends.window import Window

    T, S = tokens.shape
    lanes = [[s for s in range(S) if s % groups == g] for g in range(groups)]
    step = [0] * groups
    flying = deque()

    def start(g: int) -> None:
        window = Window.build([(kvs[s], tokens[step[g], s:s + 1]) for s in lanes[g]])
        flying.append((g, forwarder.start_window(window, g, "logits")))
        step[g] += 1

    for g in range(groups):
        start(g)
    while flying:
        g, ticket = flying.popleft()
        forwarder.finish_window(ticket)
        if step[g] < T:
            start(g)


def _bench_tier(config, gguf, model):
    """The expert tier for `strata bench` (None when no option asks for one)."""
    from strata.engine.expert_tier import ExpertTier
    from strata.plugins import get_plugin_manager, resolve_choosers

    tier = ExpertTier.build(config, gguf, model)
    if tier is not None:
        choosers = resolve_choosers(get_plugin_manager(), config=config, spec=gguf.spec,
                                    num_slots=1)
        tier.start(choosers.tier_policy)
    return tier


def tier_summary(tier) -> dict:
    """The expert cache's totals over a whole bench (warm-up included)."""
    t = tier.snapshot_totals()
    out = {"source": tier.store.source, "windows": t.num_windows}
    if tier.arena is not None:
        optimum = tier.recent.optimum()
        out.update(slots=tier.arena.n_slots,
                   experts=tier.store.n_layers * tier.store.n_experts,
                   hits=t.num_hits, misses=t.num_misses, hit_rate=t.hit_rate,
                   access_hit_rate=t.num_access_hits / max(1, t.num_accesses),
                   optimum_access_hit_rate_recent=optimum.optimum_hit_rate,
                   rounds=t.num_rounds, rounds_skipped=t.num_rounds_skipped,
                   fills=t.num_fills, evictions=t.num_evictions, admissions=t.num_admissions,
                   mib_moved=t.num_bytes_moved / 2**20, tier_wait_ms=t.wait_s * 1e3)
        pool = getattr(tier.arena, "pool", None)
        if pool is not None and pool.busy_windows:
            out.update(pool_entries=t.num_pool_entries, pool_windows=pool.busy_windows,
                       pool_compute_ms=pool.busy_pool_ms / pool.busy_windows,
                       pool_wait_ms=pool.busy_wait_ms / pool.busy_windows)
        tuner = getattr(tier.arena, "share_tuner", None)
        if tuner is not None and tuner.summary():  # --pcie-frac auto: where each class ended
            out["pcie_shares"] = tuner.summary()
        staged, routed, entries = getattr(tier.arena, "read_ahead_totals", lambda: (0, 0, 0))()
        if staged:
            out.update(ahead_staged=staged, ahead_routed=routed, ahead_entries=entries)
        streamer = getattr(tier.arena, "streamer", None)
        if streamer is not None and streamer.num_windows:
            out.update(streamed_windows=streamer.num_windows,
                       streamed_gib=streamer.streamed_bytes / 2**30,
                       streamed_left=streamer.num_left / streamer.num_windows
                       / max(1, streamer.num_layers), streamed_pulled=streamer.pulled)
            # STRATA_POOL_SURE: the rule that moved the percent ("auto", "model") or "" (fixed)
            rule = ("" if getattr(streamer, "sure_auto", None) is None
                    else "model" if getattr(streamer, "sure_model", False) else "auto")
            if rule or getattr(streamer, "sure_percent", 0):
                out.update(streamed_sure=streamer.sure_percent, streamed_sure_auto=rule)
            if getattr(tier.arena, "pool", None) is not None:  # STRATA_POOL_BUDGET
                auto = getattr(streamer, "sure_auto", None)
                out.update(streamed_budget=streamer.pool_share_of_copy,
                           streamed_budget_auto=auto is not None and len(auto.shares) > 1)
        device_tier = getattr(getattr(tier.arena, "model", None), "tier", None)
        guessed = getattr(device_tier, "guess_totals", lambda: (0,) * 5)()
        if guessed[0]:  # backends/cuda/guess.py
            out.update(guess_windows=guessed[0], guess_listed=guessed[1],
                       guess_routed=guessed[2], guess_gib=guessed[4] / 2**30)
        if streamer is not None and getattr(streamer, "timelines", None):
            out["stream_timeline"] = timeline_medians(streamer.timelines)
    return out


def run_bench(model_path: Path, n_prompt: int, n_gen: int, repetitions: int,
              threads: int | None, chunk_tokens: int | str, seed: int = 0,
              expert_config: dict | None = None, device: str = "cpu",
              slot_counts: tuple[int, ...] = (1,), depths: tuple[int, ...] = (0,)) -> list[dict]:
    """One row per test and depth (pp<n_prompt>, tg<n_gen>, and tg<n_gen> x<S> for each slot
    count S > 1 in `slot_counts`: S slots decoding together, aggregate tokens/s; each with
    every depth D of `depths` tokens already in each slot's context, named "... @ dD" when D >
    0) with tokens/s of every repetition; with an expert cache each row also has its totals
    (`expert_cache`, over the whole run)."""
    from strata.backends.select import build_model, is_cuda_model
    from strata.config import EngineConfig
    from strata.model.gguf_file import GGUFModel

    # slots: the most any test decodes together (a layer split's --batch-groups auto
    # pipelines slot groups from that many)
    config = EngineConfig(model_path, threads=threads, device=device,
                          parallel=max(slot_counts, default=1),
                          **read_chunk_fields(chunk_tokens), **(expert_config or {}))
    # --expert-profile auto: start from the stored profile, but never fold the random tokens'
    # routing into it (it is what the model's real prompts route to that the next run wants)
    config.expert_profile_save = None
    with GGUFModel.open(model_path) as gguf:
        model = build_model(gguf, config.device, threads,
                            needs_cpu_experts=config.has_expert_tier, config=config)
        kv_dtype = config.kv_dtype(is_cuda_model(model))
        if getattr(model, "plan_text", None):  # a layer split's stages
            click.echo(model.plan_text, err=True)
        tier = _bench_tier(config, gguf, model)
        # the prompt test reads with no other slot decoding: the solo chunk (auto: larger
        # where prompt windows stream their experts, as the engine reads them)
        chunk_tokens = config.resolve_solo_chunk(tier is not None
                                                 and tier.streams_prompt_experts)
        try:
            rows = _bench_rows(model_path, gguf, model, tier, n_prompt, n_gen, repetitions,
                               threads, chunk_tokens, seed,
                               {} if kv_dtype is None else {"dtype": kv_dtype}, slot_counts,
                               depths)
            if tier is not None:  # before close: that stops the CPU pool
                summary = tier_summary(tier)
                for row in rows:
                    row["expert_cache"] = summary
        finally:
            if tier is not None:
                tier.close()
    return rows


def _bench_rows(model_path, gguf, model, tier, n_prompt, n_gen, repetitions, threads,
                chunk_tokens, seed, kv_args, slot_counts=(1,), depths=(0,)) -> list[dict]:
    """The timed tests at each depth, each forward through `tier` when there is one."""
    from strata.backends.select import is_cuda_model

    rows = []
    forward = tier.forward if tier is not None else None
    forward_window = tier.forward_window if tier is not None else None
    spec = gguf.spec
    rng = np.random.default_rng(seed)
    info = {
        "model": f"{spec.arch} {model_path.name}",
        "size_bytes": model_path.stat().st_size,
        "type": _weight_type(gguf),
        "threads": threads if threads is not None else _default_threads(),
        "backend": "cuda" if is_cuda_model(model) else "cpu",
    }
    room = max(n_prompt, n_gen)
    for depth in depths:
        if depth + room > spec.context_length:
            raise click.UsageError(
                f"{'-p' if n_prompt >= n_gen else '-n'} {room}"
                + (f" at -d {depth}" if depth else "")
                + f" needs {depth + room} tokens of context but the model's context is "
                  f"{spec.context_length}")
    for depth in depths:
        start = DepthKVs(model, depth, room, chunk_tokens, forward, kv_args, seed=seed + 1)
        rows += _depth_rows(model, info, start, n_prompt, n_gen, repetitions, chunk_tokens,
                            forward, forward_window, kv_args, slot_counts, rng)
    return rows


def _depth_rows(model, info, start, n_prompt, n_gen, repetitions, chunk_tokens, forward,
                forward_window, kv_args, slot_counts, rng) -> list[dict]:
    """The timed tests with `start.depth` tokens of context in each slot."""
    depth = start.depth
    at = f" @ d{depth}" if depth else ""
    tests = []  # (name, tokens per slot, slots, timer of a [tokens] or [tokens, slots] draw)
    if n_prompt > 0:
        tests.append((f"pp{n_prompt}{at}", n_prompt, 1,
                      lambda toks: _time_prompt(model, toks, chunk_tokens, forward, kv_args,
                                                start.take()[0] if depth else None)))
    if n_gen > 0:
        for slots in slot_counts:
            if slots == 1:
                tests.append((f"tg{n_gen}{at}", n_gen, 1,
                              lambda toks: _time_decode(model, toks, forward, kv_args,
                                                        start.take()[0] if depth else None)))
            else:  # aggregate: slots x n_gen tokens per run
                tests.append((f"tg{n_gen} x{slots}{at}", n_gen, slots,
                              lambda toks, s=slots: _time_slots(
                                  model, toks, forward_window, kv_args,
                                  start.take(s) if depth else None)))
    rows = []
    for name, n_tokens, slots, timer in tests:
        shape = n_tokens if slots == 1 else (n_tokens, slots)
        timer(rng.integers(0, model.spec.vocab, shape, dtype=np.int32))  # warm-up
        speeds = []
        for _ in range(repetitions):
            seconds = timer(rng.integers(0, model.spec.vocab, shape, dtype=np.int32))
            speeds.append(slots * n_tokens / seconds)
        rows.append(dict(info, test=name, n_tokens=n_tokens, slots=slots, depth=depth,
                         tokens_per_s=speeds,
                         median_tokens_per_s=statistics.median(speeds),
                         stdev_tokens_per_s=(statistics.stdev(speeds)
                                             if len(speeds) > 1 else 0.0)))
    return rows


def _default_threads() -> int:
    from strata._native import kernels

    get = getattr(kernels, "get_num_threads", None)
    return int(get()) if get is not None else (os.cpu_count() or 1)


def format_table(rows: list[dict]) -> str:
    header = ["model", "size", "type", "backend", "threads", "test", "t/s"]
    body = [[r["model"], size_text(r["size_bytes"]), r["type"], r.get("backend", "cpu"),
             str(r["threads"]), r["test"],
             f"{r['median_tokens_per_s']:.2f} ± {r['stdev_tokens_per_s']:.2f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule] + [line(b) for b in body])


@main.command()
@click.option("--model", "-m", "model", default=None,
              help="GGUF model (default: $STRATA_MODEL, else the packaged default model).")
@click.option("-p", "--n-prompt", default=512, show_default=True,
              help="Prompt tokens to read (0 skips the test).")
@click.option("-n", "--n-gen", default=128, show_default=True,
              help="Tokens to generate one at a time (0 skips the test).")
@click.option("-r", "--repetitions", default=5, show_default=True, help="Timed runs per test.")
@click.option("--threads", "-t", default=None, type=int,
              help="CPU threads (default: all usable cores; a CPU pool beside a GPU takes all "
                   "but one, since the engine thread that drives the GPU needs its own).")
@click.option("--chunk", default="auto", show_default=True, type=ReadChunk(),
              help="Prompt tokens per forward pass (auto: as the engine reads a prompt while "
                   "no other slot decodes, see --read-chunk).")
@click.option("--parallel", "-np", "slot_counts", default="1", show_default=True,
              type=SlotCounts(),
              help="Slot counts for the tg test: S > 1 decodes S slots together, one token "
                   "each per window, and reports their aggregate tokens/s (tg<n> x<S>); "
                   "several, e.g. 1,4,8, give a row each.")
@click.option("-d", "--n-depth", "depths", default="0", show_default=True, type=Depths(),
              help="Tokens already in each slot's context before every test (read once, "
                   "untimed); several, e.g. 0,16384,65536, give rows each (\"tg128 @ "
                   "d16384\").")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@device_option
@expert_options
def bench(model, n_prompt, n_gen, repetitions, threads, chunk, slot_counts, depths, as_json,
          device, expert_config):
    """Time prompt processing (pp) and text generation (tg) on random tokens."""
    for name, value, minimum in (("-p", n_prompt, 0), ("-n", n_gen, 0),
                                 ("-r", repetitions, 1)):
        if value < minimum:
            raise click.BadParameter(f"{value} must be >= {minimum}", param_hint=name)
    if n_prompt == 0 and n_gen == 0:
        raise click.UsageError("nothing to time: -p 0 and -n 0 skip both tests; give -p N "
                               "(prompt tokens) or -n N (generated tokens)")
    path = resolve_model(model)
    if expert_config.get("kv_grow") is not None:
        click.echo("strata bench: --kv-grow is ignored: each test's KVs are made at its own "
                   "length, so none grows (it acts in `strata run` and `strata serve`)", err=True)
        expert_config = dict(expert_config, kv_grow=None)
    try:
        rows = run_bench(path, n_prompt, n_gen, repetitions, threads, chunk,
                         expert_config=expert_config, device=device, slot_counts=slot_counts,
                         depths=depths)
    except StrataError as e:
        fail(str(e))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo(format_table(rows))
        if rows and "hits" in rows[0].get("expert_cache", {}):
            click.echo(format_tier_summary(rows[0]["expert_cache"]))


def timeline_medians(timelines) -> dict:
    """Medians over streamed windows' WindowTimelines (STRATA_STREAM_TIMELINE=1), ms."""
    out = {name: float(np.median([getattr(t, name) for t in timelines]))
           for name in ("total", "fill", "copying", "held", "waiting", "experts", "tail",
                        "grouping", "pool", "guess", "pulls", "publish")}
    out["copy_gb_per_s"] = float(np.median([t.copied_bytes / max(t.copying, 1e-6) / 1e6
                                            for t in timelines]))
    out["windows"] = len(timelines)
    return out


def format_tier_summary(s: dict) -> str:
    return (f"expert cache: {s['slots']} of {s['experts']} experts, {s['windows']} windows: "
            f"routed entries {s['hit_rate']:.1%} hit ({s['hits']} cache + {s['misses']} miss), "
            f"accesses {s['access_hit_rate']:.1%} hit (Belady on the last windows: "
            f"{s['optimum_access_hit_rate_recent']:.1%}), {s['rounds']} rounds, "
            f"{s['fills'] + s['evictions']} swaps ({s['fills']} free fills + {s['evictions']} "
            f"evictions), {s['mib_moved']:.1f} MiB moved, tier wait {s['tier_wait_ms']:.1f} ms"
            + (f"; CPU pool: {s['pool_entries']} routed entries in {s['pool_windows']} windows, "
               f"per window {s['pool_compute_ms']:.2f} ms computing and {s['pool_wait_ms']:.2f} "
               "ms waiting for the GPU"
               if "pool_entries" in s else "")
            + ("; PCIe share (--pcie-frac auto) by window rows: " + ", ".join(
                f"{rows}: {share:.3f} ({moves} move{'s' if moves != 1 else ''} in {n} windows)"
                for rows, share, moves, n in s["pcie_shares"])
               if "pcie_shares" in s else "")
            + (f"; read-ahead: {s['ahead_staged']} experts staged before their routing, "
               f"{s['ahead_routed']} of them routed ({s['ahead_routed'] / s['ahead_staged']:.1%}"
               f", {s['ahead_entries']} routed entries)"
               if "ahead_staged" in s else "")
            + (f"; prompt windows: {s['streamed_windows']} streamed {s['streamed_gib']:.2f} GiB "
               f"of experts, {s['streamed_left']:.1f} rare ones per layer left to PCIe reads "
               f"(the GPU pulled {s['streamed_pulled']} of them into staging)"
               if "streamed_windows" in s else "")
            + (f"; {s['streamed_sure']}% of the copied experts left to the pool "
               + (f"(STRATA_POOL_SURE={s['streamed_sure_auto']}, where it ended)"
                  if s["streamed_sure_auto"]
                  else f"(STRATA_POOL_SURE={s['streamed_sure']})")
               if "streamed_sure" in s else "")
            + (f"; the pool's budget for the rare experts {s['streamed_budget']:g} x the copy "
               "time" + (" (STRATA_POOL_BUDGET=auto, where it ended)"
                         if s["streamed_budget_auto"] else "")
               if "streamed_budget" in s else "")
            + (f"; guessed copies: {s['guess_listed']} rare experts copied a layer ahead in "
               f"{s['guess_windows']} windows, {s['guess_routed']} of them routed "
               f"({s['guess_routed'] / max(1, s['guess_listed']):.1%}), "
               f"{s['guess_gib']:.2f} GiB"
               if "guess_windows" in s else "")
            + (f"; timeline, medians of {t['windows']} streamed windows: {t['total']:.1f} ms, "
               f"the copy engine {t['copying']:.1f} ms copying ({t['copy_gb_per_s']:.1f} GB/s) "
               f"and {t['held']:.1f} ms held, the compute stream {t['waiting']:.1f} ms waiting "
               f"for copies, {t['experts']:.1f} ms in the experts, {t['grouping']:.1f} ms "
               f"after the grouping ({t['guess']:.1f} waiting for guessed copies, "
               f"{t['pulls']:.1f} pulling, {t['publish']:.1f} publishing) and "
               f"{t['pool']:.1f} ms combining with the pool"
               if (t := s.get("stream_timeline")) else ""))


# ---- serve (defined with the server; it uses resolve_model and fail from above) -----------
from strata.server.command import serve  # noqa: E402

main.add_command(serve)
