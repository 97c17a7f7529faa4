"""Benchmark prompt reading interleaved with decoding: two slots, one decoding, the other reading
a long prompt; the decoding slot's tokens/s alone and while the prompt is read (the default
read-interleave policy must keep >= half).

Usage: python tools/bench_interleave.py MODEL.gguf [--prompt-tokens 16384] [--read-chunk 512]
                                         [--threads N]
The decode-alone rate replays the same tokens (greedy) without the read, so both rates cover the
same context lengths.
"""
import argparse
import time

import numpy as np

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def decode_windows(engine, handle, num_windows: int) -> float:
    """Seconds for `num_windows` windows in which `handle` gets one token each."""
    t0 = time.perf_counter()
    for _ in range(num_windows):
        engine.step()
    seconds = time.perf_counter() - t0
    assert len(handle.pop_events()) == num_windows
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file (qwen3moe / qwen2moe)")
    ap.add_argument("--prompt-tokens", type=int, default=16384, help="the long prompt's length")
    ap.add_argument("--read-chunk", type=int, default=512, help="prompt tokens per window")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: all)")
    args = ap.parse_args()

    n_ctx = args.prompt_tokens + 8
    config = EngineConfig(args.model, n_ctx=n_ctx, threads=args.threads, parallel=2,
                          prompt_chunk_tokens=args.read_chunk, conversation_cache_mib=0)
    with Engine(config) as engine:
        rng = np.random.default_rng(0)
        vocab = min(engine.tokenizer.vocab_size, engine.spec.vocab)
        short = [int(t) for t in rng.integers(10, vocab, 16)]
        long = [int(t) for t in rng.integers(10, vocab, args.prompt_tokens)]
        # With the read: the decoding slot decodes through the whole read.
        decoding = engine.submit(short, SamplingParams(max_tokens=n_ctx - len(short), **GREEDY))
        engine.step()  # reads the short prompt: first token
        engine.step()  # warm-up decode window
        decoding.pop_events()
        reading = engine.submit(long, SamplingParams(max_tokens=1, **GREEDY))
        num_windows = 0
        t0 = time.perf_counter()
        while not reading.is_finished:
            engine.step()
            num_windows += 1
        read_seconds = time.perf_counter() - t0
        if reading.error is not None:
            raise reading.error
        num_during = len(decoding.pop_events())
        decoding.cancel()
        engine.step()
        # Alone: the same request again (greedy: the same tokens at the same positions, so the
        # same attention lengths), timing as many decode windows.
        alone = engine.submit(short, SamplingParams(max_tokens=num_during + 2, **GREEDY))
        engine.step()
        engine.step()
        alone.pop_events()
        alone_seconds = decode_windows(engine, alone, num_during)

    alone_tps = num_during / alone_seconds
    during_tps = num_during / read_seconds
    print(f"model: {args.model}  prompt: {args.prompt_tokens} tokens  read chunk: "
          f"{args.read_chunk}  threads: {args.threads or 'all'}")
    print(f"decode alone:        {alone_tps:8.2f} tokens/s ({num_during} tokens in "
          f"{alone_seconds:.1f} s)")
    print(f"decode during read:  {during_tps:8.2f} tokens/s ({num_during} tokens in "
          f"{read_seconds:.1f} s, {num_windows} windows)")
    print(f"decode share:        {during_tps / alone_tps:8.3f} (the default policy aims at "
          f">= 0.50)")
    print(f"prompt read:         {args.prompt_tokens / read_seconds:8.2f} tokens/s while "
          f"interleaved ({read_seconds:.1f} s)")


if __name__ == "__main__":
    main()
