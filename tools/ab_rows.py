"""The CPU's decode rows of this checkout against an earlier revision's, in alternating runs of
tools/bench_decode_rows.py (one process per run, since two builds of the extension cannot share
one): per weight type every run's ms per call, then the median and the minimum of each side.
Shared machines run at several speeds from one run to the next (the dev machines here: ~0.9 or
~1.4 ms for the same call), so only alternating runs of both builds, read by their medians and
minima, compare them.

Usage: python tools/ab_rows.py --rev REV [--rounds 5] [--types q4_0,q8_0] [--threads 1]
                               [--tokens 1] [--repeats 15] [--old-site DIR]
--rev builds REV's tree (git archive, pip install --target) into a folder under the system's
temporary directory, reused while it exists; --old-site DIR uses a build that is already there
(e.g. one made with -Csetup-args=-Dc_args=-march=haswell for users' AVX2 CPUs).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench_decode_rows.py"


def build_rev(rev: str) -> Path:
    """REV's tree installed into <tmp>/strata-ab-<sha>, built once (pip, no build isolation)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    site = Path(tempfile.gettempdir()) / f"strata-ab-{sha}"
    if (site / "strata").is_dir():
        return site
    with tempfile.TemporaryDirectory() as src:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
        print(f"building {sha} into {site} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--target", str(site), src], check=True)
    return site


def one_run(site, args) -> dict[str, float]:
    """{type: ms per call} of one bench_decode_rows run (site None: this checkout's build)."""
    cmd = [sys.executable, str(BENCH), "--types", args.types, "--tokens", str(args.tokens),
           "-r", str(args.repeats)] + (["--site", str(site)] if site else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    times = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2:4] == ["ms", "per"]:
            times[parts[0]] = float(parts[1])
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--rev", help="the earlier revision, built here")
    which.add_argument("--old-site", help="a folder holding an earlier build of strata")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--types", default="q4_0,q8_0,q4_k,q6_k")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    old_site = Path(args.old_site) if args.old_site else build_rev(args.rev)
    if not (old_site / "strata").is_dir():
        ap.error(f"{old_site} holds no strata package")
    runs = {"old": [], "new": []}
    for i in range(args.rounds):
        runs["old"].append(one_run(old_site, args))
        runs["new"].append(one_run(None, args))
        print(f"round {i + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(f"{old_site} (old) against this checkout (new), {args.threads} thread(s), "
          f"{args.tokens} token(s), ms per call")
    for name in args.types.split(","):
        line = [f"{name:7s}"]
        for side in ("old", "new"):
            ms = [r[name] for r in runs[side] if name in r]
            if not ms:
                line.append(f"{side}: no figure")
                continue
            line.append(f"{side} {' / '.join(f'{t:.2f}' for t in ms)} (median "
                        f"{statistics.median(ms):.2f}, min {min(ms):.2f})")
        print("  ".join(line))


if __name__ == "__main__":
    main()
