"""The CPU's decode-shaped product per weight type: one token against 8 experts' gate rows of
qwen3-30b-a3b (6144 x 2048), as the CPU pool computes a routed expert, in ms per token and
GB/s of weight bytes (medians). `--site DIR` times a build installed there instead of this
checkout's, e.g. the AVX2-only build that users' CPUs without AVX-512 run:

  pip install --no-deps --no-build-isolation --target /tmp/avx2 \\
      -Csetup-args=-Dnative_arch=false -Csetup-args=-Dc_args=-march=haswell .
  python tools/bench_decode_rows.py --site /tmp/avx2
"""
import argparse
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default=None, help="import strata from this folder")
    ap.add_argument("--types", default="q4_0,q8_0,q4_1,q5_0,q5_1,iq4_nl,q2_k,q3_k,q4_k,q5_k,q6_k,"
                    "iq4_xs,iq2_xxs,iq2_xs,iq2_s,iq3_xxs,iq3_s,iq1_s,iq1_m")
    ap.add_argument("--tokens", type=int, default=1, help="activation rows per call")
    ap.add_argument("-r", "--repeats", type=int, default=15)
    args = ap.parse_args()
    if args.site:  # ahead of an editable install's finder
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not any(k in repr(f).lower() for k in ("editable", "mesonpy"))]
        sys.path.insert(0, args.site)
    import numpy as np
    from strata._native import kernels
    from strata.tool.synth import WEIGHT_TYPES, random_blocks

    print(f"{kernels.__file__} ({kernels.simd_level()}), {args.tokens} token(s) per call")
    rng = np.random.default_rng(0)
    rows, cols = 6144, 2048
    for name in args.types.split(","):
        qtype = WEIGHT_TYPES[name]
        w = random_blocks(qtype, rows * cols, 0.05, rng).reshape(rows, -1)
        x = rng.standard_normal((args.tokens, cols)).astype(np.float32)
        for _ in range(3):
            kernels.matmul(w, int(qtype), x)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            kernels.matmul(w, int(qtype), x)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(f"{name:7s} {1e3 * t:6.2f} ms per call, {w.nbytes / t / 1e9:6.2f} GB/s of weights")


if __name__ == "__main__":
    main()
