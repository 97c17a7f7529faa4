"""`strata bench` with the engine's logs on (the command sets up no logging of its own), e.g.
the streamed prompt windows' timelines:

    STRATA_STREAM_TIMELINE=1 python tools/bench_logged.py -- -m M --device cuda -t 15 \\
        --expert-cache 0 -p 512 -n 0 -r 5

Usage: python tools/bench_logged.py [--log NAME=LEVEL ...] -- BENCH ARGS
`--log` sets one logger's level (repeatable; default strata.tier=INFO, the tier's and the
prompt streamer's decisions); everything else stays at WARNING. Log lines go to stderr.
"""
import argparse
import logging
import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, bench = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else ([], argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--log", action="append", default=None, metavar="NAME=LEVEL")
    args = ap.parse_args(ours)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    for item in args.log or ["strata.tier=INFO"]:
        name, _, level = item.partition("=")
        if not name or not hasattr(logging, level.upper()):
            ap.error(f"--log {item!r}: give NAME=LEVEL, e.g. strata.tier=INFO")
        logging.getLogger(name).setLevel(getattr(logging, level.upper()))
    from strata.cli import main as strata_main

    strata_main(["bench", *bench], prog_name="strata")


if __name__ == "__main__":
    main()
