"""What a draft costs: the time of one slot's decode window with its token plus k draft
tokens, as the engine runs it (the tier, the split, the samplers reading every row's logits on
the device), and the decode tokens/s that follow at a given acceptance rate.

A window of 1 + k rows gives 1 + (accepted drafts) tokens. With each draft token accepted with
probability a (independently, until the first miss), a window gives on average
(1 - a^(k+1)) / (1 - a) tokens, so tokens/s = that / t(k); printed for a few rates beside
k = 0 (no drafts). Every row's logits are read (the cost when the whole draft is accepted).
The drafter's length rule (strata.engine.drafts.best_length) uses DRAFT_ROW_COST, a figure
this benchmark measures: (t(k) / t(0) - 1) / k.

`--engine N` instead runs the engine itself: greedy requests of N tokens after a random prompt
and after a prompt that repeats a passage, without and with `--spec-type ngram-simple`
(`--ngram` tokens of key); decode tokens/s (medians), drafts accepted, and whether the tokens
are the same (they must be).

Usage: python tools/bench_drafts.py MODEL.gguf [--device cuda] [--drafts 0,1,2,4,8,16]
       [--context 256] [--steps 24] [-r 3] [--rates 0.5,0.7,0.9]
       [--expert-cache N --pcie-frac F] [--split-device 0,1 --layer-split auto]
       [--engine N --ngram 12]
"""
import argparse
import statistics
import time

import numpy as np

from strata import Engine, EngineConfig, SamplingParams
from strata.backends.window import Window
from strata.engine.drafts import expected_tokens
from strata.engine.sampling import Sampler


def window_seconds(engine, kv, k: int, steps: int, rng) -> float:
    """Median seconds of `steps` windows of one slot with 1 + k rows at the KV's length (each
    window's rows dropped again after it), every row's greedy token read as the samplers do."""
    tier = engine.expert_tier
    model = engine.scheduler.model
    vocab = engine.tokenizer.vocab_size
    sampler = Sampler(SamplingParams(temperature=0.0))
    times = []
    for _ in range(steps):
        tokens = rng.integers(10, min(vocab, 4000), 1 + k)
        window = Window.build([(kv, tokens)], logits="all" if k else "last")
        t0 = time.perf_counter()
        if tier is not None:
            logits = tier.forward_window(window, lazy=True)
        else:
            logits = getattr(model, "forward_window_lazy", model.forward_window)(window)
        for i in range(len(logits)):
            row = logits[i]
            if hasattr(row, "candidates"):
                sampler.sample_candidates(row, vocab)
            else:
                int(np.argmax(np.asarray(row)))
        times.append(time.perf_counter() - t0)
        kv.truncate(kv.num_tokens - len(tokens))
    return statistics.median(times)


def engine_runs(config_args: dict, spec: str, ngram: int, prompts, num_tokens: int,
                repetitions: int):
    """Per prompt: (median decode tokens/s, token ids, drafted, accepted) of greedy requests."""
    config = EngineConfig(**config_args, spec_type=spec, spec_ngram_size_n=ngram)
    out = []
    with Engine(config) as engine:
        for prompt in prompts:
            speeds = []
            for _ in range(repetitions):
                engine.reset()  # the whole prompt read again: every run alike
                result = engine.generate_text(prompt, SamplingParams(
                    max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
                speeds.append(result.stats.decode_tokens_per_s)
            s = result.stats
            out.append((statistics.median(speeds), result.token_ids, s.num_draft_tokens,
                        s.num_accepted_draft_tokens))
    return out


def engine_main(args, config_args: dict) -> None:
    rng = np.random.default_rng(1)
    passage = [int(t) for t in rng.integers(10, 4000, 64)]
    prompts = {"random": [int(t) for t in rng.integers(10, 4000, args.context)],
               "repeated passage": passage * max(args.context // 64, 2)}
    plain = engine_runs(config_args, "none", args.ngram, prompts.values(), args.engine,
                        args.repetitions)
    drafted = engine_runs(config_args, "ngram-simple", args.ngram, prompts.values(),
                          args.engine, args.repetitions)
    print(f"model {args.model}, device {args.device}, {args.engine} greedy tokens, medians of "
          f"{args.repetitions}, key of {args.ngram} tokens")
    print("| prompt | no drafts | ngram-simple | drafts accepted | same tokens |")
    print("| --- | --- | --- | --- | --- |")
    for name, (t0, ids0, _, _), (t1, ids1, num, acc) in zip(prompts, plain, drafted):
        print(f"| {name} | {t0:.1f} | {t1:.1f} ({t1 / t0:.2f}x) | {acc} of {num} | "
              f"{ids0 == ids1} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--drafts", default="0,1,2,4,8,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--rates", default="0.5,0.7,0.9")
    ap.add_argument("--expert-cache", default=None)
    ap.add_argument("--pcie-frac", type=float, default=None)
    ap.add_argument("--split-device", default=None)
    ap.add_argument("--layer-split", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--engine", type=int, default=0, metavar="N")
    ap.add_argument("--ngram", type=int, default=12)
    args = ap.parse_args()
    drafts = [int(x) for x in args.drafts.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    config_args = dict(model_path=args.model, device=args.device,
                       n_ctx=args.context + max(args.engine, 64), threads=args.threads,
                       expert_cache=args.expert_cache, pcie_frac=args.pcie_frac,
                       split_devices=args.split_device, layer_split=args.layer_split)
    if args.engine:
        engine_main(args, config_args)
        return
    config = EngineConfig(**config_args)
    rng = np.random.default_rng(0)
    with Engine(config) as engine:
        prompt = [int(t) for t in rng.integers(10, 4000, args.context)]
        engine.generate_text(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        kv = engine.kv
        window_seconds(engine, kv, max(drafts), args.steps, rng)  # warm-up
        runs = {k: [] for k in drafts}
        for _ in range(args.repetitions):
            for k in drafts:  # alternating, so drift hits every k alike
                runs[k].append(window_seconds(engine, kv, k, args.steps, rng))
        base = statistics.median(runs[drafts[0]])
        print(f"model {args.model}, device {args.device}, context {args.context}, "
              f"medians of {args.repetitions} x {args.steps} windows")
        head = " | ".join(f"a={r:g}" for r in rates)
        print(f"| drafts k | window ms | x k={drafts[0]} | row cost | tokens/s {head} |")
        print("| --- | --- | --- | --- |" + " --- |" * len(rates))
        for k in drafts:
            t = statistics.median(runs[k])
            speeds = " | ".join(f"{expected_tokens(r, k) / t:.1f}" for r in rates)
            cost = f"{(t / base - 1) / k:.2f}" if k else "-"
            print(f"| {k} | {t * 1e3:.2f} | {t / base:.2f} | {cost} | {speeds} |")


if __name__ == "__main__":
    main()
