"""Prebuilt kernel modules: a directory named by STRATA_CUBIN_DIR holds cubins that nvcc built
elsewhere (a machine with the toolkit and no GPU: `python tools/precompile_cubins.py --arch
sm_90 --out DIR`), each named by its module, arch and a digest of the exact source and nvcc
options, so a stale one is never taken. The runtime loads a module from there when it finds it
and compiles it (PyCUDA, cached on disk) otherwise.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import tempfile

from strata.backends.cuda.runtime import module_source
from strata.errors import ConfigError

NVCC_OPTIONS = ("-std=c++17", "-O3")
ENV_DIR = "STRATA_CUBIN_DIR"


def cubin_file_name(name: str, arch: str, kernel_dir=None) -> str:
    """`{module}-{arch}-{digest}.cubin`: the digest covers the module's source with its headers
    inlined (from kernel_dir when given, see module_source), the arch and the nvcc options."""
    source = module_source(name, kernel_dir=kernel_dir)
    digest = hashlib.sha256("\0".join((source, arch, *NVCC_OPTIONS)).encode())
    return f"{pathlib.Path(name).stem}-{arch}-{digest.hexdigest()[:20]}.cubin"


def prebuilt_cubin(name: str, arch: str) -> bytes | None:
    """The prebuilt cubin of module `name` for `arch` from STRATA_CUBIN_DIR, or None."""
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return None
    path = pathlib.Path(folder) / cubin_file_name(name, arch)
    return path.read_bytes() if path.is_file() else None


def compile_with_nvcc(name: str, arch: str, kernel_dir=None) -> bytes:
    """Module `name` (from kernel_dir when given) compiled for `arch` by the nvcc on PATH (no
    GPU needed)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = pathlib.Path(tmp) / name, pathlib.Path(tmp) / "out.cubin"
        src.write_text(module_source(name, kernel_dir=kernel_dir))
        try:
            done = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", *NVCC_OPTIONS, str(src),
                                   "-o", str(out)], capture_output=True, text=True)
        except FileNotFoundError:
            raise ConfigError("nvcc is not on PATH: install the CUDA toolkit to build "
                              "cubins") from None
        if done.returncode != 0:
            raise ConfigError(f"nvcc could not compile {name} for {arch}:\n{done.stderr}")
        return out.read_bytes()
