"""Build the CUDA backend's kernel modules into cubins on a machine with nvcc (no GPU needed), for
STRATA_CUBIN_DIR: a GPU machine then loads them instead of compiling (~60 s of a cold start
there: carry the folder to the device and point STRATA_CUBIN_DIR at it).

Usage: python tools/precompile_cubins.py --out build/cubins [--arch sm_90] [-j 2]
       [--kernel-dir DIR] [--keep]  (another tree's backends/cuda, beside this tree's cubins:
       tools/prepare_ab.sh uses them) [--pack .device/cubins.tar.xz]
File names carry a digest of each module's source and nvcc options (backends/cuda/cubins.py), so
after a kernel edit only that module's cubin is missing: run this again before the device call.
--pack FILE: the folder as an xz tarball too (two trees' cubins, ~33 MB, pack to ~3 MB: the
device tool carries at most 64 MiB; tools/device_check.sh unpacks .device/cubins.tar.xz).
"""
import argparse
import os
import pathlib
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor

from strata.backends.cuda.cubins import compile_with_nvcc, cubin_file_name
from strata.backends.cuda.runtime import MODULES


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the cubins (made if missing)")
    ap.add_argument("--arch", default="sm_90", help="GPU architecture, e.g. sm_86, sm_90")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--kernel-dir", default=None,
                    help="build the .cu modules of this folder instead of this package's")
    ap.add_argument("--keep", action="store_true",
                    help="keep the folder's other cubins (two trees' kernels in one folder)")
    ap.add_argument("--pack", default=None, metavar="FILE",
                    help="also write the folder's cubins as this xz tarball")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modules = [name for name in MODULES
               if args.kernel_dir is None or (pathlib.Path(args.kernel_dir) / name).is_file()]
    wanted = {name: out / cubin_file_name(name, args.arch, args.kernel_dir) for name in modules}
    for stale in out.glob(f"*-{args.arch}-*.cubin"):  # earlier sources of these modules
        if stale not in wanted.values() and not args.keep:
            stale.unlink()
    todo = [name for name, path in wanted.items() if not path.is_file()]
    t0 = time.perf_counter()

    def build(name):
        wanted[name].write_bytes(compile_with_nvcc(name, args.arch, args.kernel_dir))
        return name

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for name in pool.map(build, todo):
            print(f"built {wanted[name].name}", flush=True)
    print(f"{len(todo)} of {len(modules)} modules built for {args.arch} in "
          f"{time.perf_counter() - t0:.0f} s; the others were current ({out})")
    if args.pack:
        pack = pathlib.Path(args.pack)
        pack.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(pack, "w:xz") as tar:
            for cubin in sorted(out.glob("*.cubin")):
                tar.add(cubin, arcname=cubin.name)
        print(f"packed {pack} ({pack.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
