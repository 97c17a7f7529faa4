"""Benchmark decoding through the engine (scheduler, sampler, detokenizer and stop checks: what
`strata serve` runs per token), beside the model's own pass over the same rows: decode tokens/s
of S concurrent requests with greedy, top-k and top-p sampling (and `json`: greedy held to a
JSON object, as response_format asks; with -n past the object's end the constraint keeps
choosing among the stop tokens, which ignore_eos reads on), medians of -r runs. The gap
between the two is the engine's host work per window (on the GPU: the sampling calls, the
window's build, the events).

Usage: python tools/bench_engine.py [MODEL.gguf] [--device auto|cpu|cuda] [-t THREADS]
           [-p 64] [-n 128] [-r 5] [--slots 1,4] [--sampling greedy,top-k,top-p] [--json]
MODEL defaults to the shipped default model. The timed part of a run starts once every request
has its first token (the prompts are read) and ends when the last one has its -n tokens.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

from strata.backends.window import Window
from strata.cli import resolve_model
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams

SAMPLING = {
    "greedy": dict(temperature=0.0),
    "top-k": dict(temperature=0.7, top_k=40, top_p=1.0),
    "top-p": dict(temperature=1.0, top_k=0, top_p=0.95),
    # greedy, held to a JSON object (response_format): every token on the host's whole row
    "json": dict(temperature=0.0, json_object=True),
}


def engine_decode(engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Decode tokens/s of the requests of `prompts` run together, from the step after which
    every request has its first token to the last step."""
    handles = [engine.submit(p, params) for p in prompts]
    t0 = base = None
    while engine.step():
        generated = [h.stats.num_generated_tokens for h in handles]
        if t0 is None and min(generated) >= 1:
            t0, base = time.perf_counter(), sum(generated)
    for h in handles:
        if h.error is not None:
            raise h.error
    seconds = time.perf_counter() - t0
    num = sum(h.stats.num_generated_tokens for h in handles) - base
    engine.reset()
    return num / seconds


def model_decode(model, prompts: list[list[int]], num_tokens: int) -> float:
    """Decode tokens/s of the model's own pass over one row per request (greedy ids where the
    model has them on the device, else its logits), after the same prompts."""
    kvs = [model.new_kv(len(p) + num_tokens + 1) for p in prompts]
    model.forward_window(Window.build([(kv, np.array(p, dtype=np.int32))
                                       for kv, p in zip(kvs, prompts)]))
    step = getattr(model, "forward_window_greedy", model.forward_window)
    tokens = [np.array([p[-1]], dtype=np.int32) for p in prompts]
    t0 = time.perf_counter()
    for _ in range(num_tokens - 1):
        step(Window.build(list(zip(kvs, tokens))))
    return len(prompts) * (num_tokens - 1) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=64)
    ap.add_argument("-n", "--decode-tokens", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--slots", default="1,4")
    ap.add_argument("--sampling", default="greedy,top-k,top-p")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    slot_counts = [int(s) for s in args.slots.split(",")]
    modes = [m.strip() for m in args.sampling.split(",")]
    unknown = [m for m in modes if m not in SAMPLING]
    if unknown or args.decode_tokens < 2 or min(slot_counts) < 1:
        ap.error(f"--sampling takes {', '.join(SAMPLING)}; -n >= 2; --slots >= 1"
                 + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    n_ctx = args.prompt_tokens + args.decode_tokens + 16
    engine = Engine(EngineConfig(resolve_model(args.model), device=args.device,
                                 threads=args.threads, parallel=max(slot_counts), n_ctx=n_ctx))
    rng = np.random.default_rng(0)
    vocab = engine.tokenizer.vocab_size
    rows = []
    with engine:
        for slots in slot_counts:
            prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(slots)]
            model_rates = [model_decode(engine.model, prompts, args.decode_tokens)
                           for _ in range(args.repeats)]
            model_rate = statistics.median(model_rates)
            for mode in modes:
                params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, seed=1,
                                        **SAMPLING[mode])
                engine_decode(engine, prompts, params)  # warm-up: plans, graphs, buffers
                rates = [engine_decode(engine, prompts, params) for _ in range(args.repeats)]
                rows.append(dict(sampling=mode, slots=slots, engine=statistics.median(rates),
                                 engine_runs=rates, model=model_rate, model_runs=model_rates))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"| sampling | slots | engine tokens/s (median of {args.repeats}) | model pass | "
          "engine / model | engine runs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['sampling']} | {r['slots']} | {r['engine']:,.1f} | {r['model']:,.1f} | "
              f"{r['engine'] / r['model']:.2f} | "
              f"{', '.join(f'{x:,.1f}' for x in r['engine_runs'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
