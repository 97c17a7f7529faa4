"""Record a routing trace of the default model answering fixed questions (greedy, one slot).

Usage: `python tools/trace_default_model.py TRACE [--max-tokens 128]`, then
`strata-tool inspect --routing TRACE` and `strata-tool replay TRACE --slots N`.
"""
from __future__ import annotations

import argparse
import sys

# Topics of the corpus, stdlib names, and questions it has no answer for.
QUESTIONS = (
    "What is the for statement?", "Tell me about the while statement.",
    "Explain the with statement.", "What is the null object?", "How does the try statement work?",
    "What is the import statement?", "Tell me about class definitions.",
    "What is format string syntax?", "Explain lambdas.", "What is the raise statement?",
    "What does textwrap.dedent do?", "What is the json module?", "What does os.path.join do?",
    "What is collections.OrderedDict?", "What does shutil.copyfile do?",
    "Tell me about the sea.", "Why is the sky blue?", "Write a haiku about RAM.",
    "Hello! Who are you?", "How do I read a file in Python?",
)


def main(argv: list[str] | None = None) -> int:
    from strata.config import EngineConfig
    from strata.data import default_model_path
    from strata.engine.engine import Engine
    from strata.engine.sampling import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    config = EngineConfig(default_model_path(), dump_routing_path=args.trace)
    num_tokens = 0
    with Engine(config) as engine:
        for question in QUESTIONS:
            events = list(engine.chat([{"role": "user", "content": question}], params))
            num_tokens += len(events)
    print(f"wrote {args.trace}: {len(QUESTIONS)} questions, {num_tokens} generated tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
