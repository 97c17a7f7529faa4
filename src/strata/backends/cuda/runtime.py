"""The CUDA runtime of the backend: PyCUDA owns the context, memory and streams and compiles the
`.cu` modules (once, cached on disk); the kernels are loaded and launched through cuda_driver.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pathlib
import re
import warnings

import numpy as np

from strata._native import cuda_driver
from strata.errors import ConfigError

KERNEL_DIR = pathlib.Path(__file__).resolve().parent
MODULES = ("matmul.cu", "matvec.cu", "mmq.cu", "mmq_k.cu", "layer.cu", "attention.cu",
           "attention_prompt.cu", "router.cu", "sample.cu", "offload.cu", "delta_net.cu")
_INSTALL_HINT = ("pip install 'strata[cuda]' (PyCUDA; it needs the CUDA toolkit's nvcc and an "
                 "NVIDIA driver), or run with --device cpu")
_ALIGN_BYTES = 256


def import_pycuda():
    """pycuda.driver, initialised; ConfigError saying what to install when CUDA is missing."""
    try:
        import pycuda.driver as drv
    except ImportError as exc:
        raise ConfigError(f"the CUDA backend needs PyCUDA, which is not importable ({exc}); "
                          f"{_INSTALL_HINT}") from None
    cuda_driver.load()  # CudaUnavailable (a ConfigError) naming libcuda.so.1 when no driver
    drv.init()
    if drv.Device.count() == 0:
        raise ConfigError("the CUDA driver sees no GPU on this machine; run with --device cpu")
    return drv


def is_available() -> bool:
    """True when PyCUDA imports and the driver sees a GPU (a real probe)."""
    try:
        import_pycuda()
    except (ConfigError, cuda_driver.CudaError):
        return False
    except Exception:  # pycuda's own LogicError / RuntimeError from a broken driver
        return False
    return True


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"[ \t]*$', re.M)


def module_source(name: str, _seen: set[str] | None = None, kernel_dir=None) -> str:
    """A `.cu` file with its local headers (`#include "x.cuh"`, nested ones too) inlined, each
    once, so the compile needs no include path and its cache key covers the headers. From
    `kernel_dir` when given (another tree's kernels), else this package's."""
    seen = set() if _seen is None else _seen
    folder = KERNEL_DIR if kernel_dir is None else pathlib.Path(kernel_dir)

    def inline(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return module_source(header, seen, folder).replace("#pragma once\n", "")

    return _LOCAL_INCLUDE.sub(inline, (folder / name).read_text())


class Runtime:
    """One GPU: its (primary) context, a stream, allocations and the loaded kernel modules."""

    def __init__(self, device: int | None = None):
        drv = import_pycuda()
        self.drv = drv
        num_devices = drv.Device.count()
        index = 0 if device is None else int(device)
        if not 0 <= index < num_devices:
            raise ConfigError(f"CUDA device {device} does not exist: this machine has "
                              f"{num_devices} (0..{num_devices - 1})")
        self.device = drv.Device(index)
        self.index = index
        self.name = self.device.name()
        major, minor = self.device.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.context = self.device.retain_primary_context()
        self.context.push()
        # PyCUDA aborts at exit when a context is left on the stack: pop ours then
        atexit.register(_pop_if_current, drv, int(self.context.handle))
        self.stream = drv.Stream()
        self.stream_handle = int(self.stream.handle)
        self._kernels: dict[str, cuda_driver.Kernel] = {}
        # Programmatic dependent launch (cc >= 9.0), opt-in with STRATA_PDL=1: every kernel
        # begins with common.cuh's kernel_entry(), so its blocks may be scheduled while the
        # kernel before it finishes (plan.py: windows of <= PDL_MAX_ROWS rows). Off by default:
        # on the H200 it did not pay reliably (plan.py has the figures).
        self.programmatic = (major >= 9 and os.environ.get("STRATA_PDL", "0") == "1"
                             and cuda_driver.has_programmatic_launch())
        for name in MODULES:
            module = self._load_module(name)  # each Kernel keeps its module
            for fn in _kernel_names(module_source(name)):
                kernel = module.function(fn)
                kernel.programmatic = self.programmatic
                self._kernels[fn] = kernel

    def _load_module(self, name: str) -> cuda_driver.Module:
        """Module `name` from STRATA_CUBIN_DIR's prebuilt cubin (cubins.py) when there is one
        for this source and GPU and the driver takes it, else compiled here."""
        from strata.backends.cuda.cubins import ENV_DIR, prebuilt_cubin

        prebuilt = prebuilt_cubin(name, self.arch)
        if prebuilt is not None:
            try:
                return cuda_driver.Module(prebuilt)
            except cuda_driver.CudaError as exc:
                warnings.warn(f"the prebuilt cubin of {name} in {ENV_DIR} was refused ({exc}); "
                              "compiling it here")
        return cuda_driver.Module(self.compile(name))

    def compile(self, name: str) -> bytes:
        """The cubin of kernel module `name` for this GPU (PyCUDA caches it on disk)."""
        from pycuda.compiler import compile as nvcc_compile

        from strata.backends.cuda.cubins import NVCC_OPTIONS

        try:
            with warnings.catch_warnings():
                # PyCUDA warns with nvcc's remarks and leaves the cubin file to the GC
                warnings.simplefilter("ignore", UserWarning)
                warnings.simplefilter("ignore", ResourceWarning)
                cubin = nvcc_compile(module_source(name), no_extern_c=True, arch=self.arch,
                                     options=list(NVCC_OPTIONS))
                gc.collect()
            return cubin
        except Exception as exc:  # CompileError or a missing nvcc
            raise ConfigError(f"compiling the CUDA kernels of {name} for {self.arch} failed "
                              f"({exc}); the CUDA backend needs the CUDA toolkit's nvcc on PATH"
                              ) from None

    def kernel(self, name: str) -> cuda_driver.Kernel:
        return self._kernels[name]

    @contextlib.contextmanager
    def active(self):
        """Make this GPU's context current in the calling thread for the block."""
        if cuda_driver.current_context() == int(self.context.handle):
            yield
            return
        self.context.push()
        try:
            yield
        finally:
            self.drv.Context.pop()

    # ---- memory ---------------------------------------------------------------------------
    def free_bytes(self) -> tuple[int, int]:
        free, total = self.drv.mem_get_info()
        return int(free), int(total)

    def alloc(self, num_bytes: int):
        """A device allocation of num_bytes (at least 1), kept alive by the runtime's caller."""
        return self.drv.mem_alloc(max(int(num_bytes), _ALIGN_BYTES))

    def upload(self, array: np.ndarray):
        """A device copy of a (contiguous) host array; returns the allocation."""
        array = np.ascontiguousarray(array)
        buf = self.alloc(array.nbytes)
        if array.nbytes:
            self.drv.memcpy_htod(buf, array)
        return buf

    def pinned(self, shape, dtype) -> np.ndarray:
        return self.drv.pagelocked_empty(shape, dtype)

    def synchronize(self) -> None:
        self.stream.synchronize()


def _kernel_names(source: str) -> list[str]:
    """The extern "C" __global__ entry points of a module, macro-made ones included."""
    import re

    names = re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\(',
                       source)
    for macro, prefixes in (("MM_KERNELS", ("mm_store_", "mm_add_", "mm_gateup_", "mm_qkv_")),
                            ("MV_KERNELS", ("mv_store_", "mv_add_", "mv_gateup_", "mv_qkv_")),
                            ("EMBED_KERNEL", ("embed_",)),
                            ("MMQ_KERNELS", tuple(f"mmq{rows}_{kind}_" for rows in (64, 32)
                                                  for kind in ("store", "add", "gateup", "qkv"))),
                            ("MMF_KERNELS", ("mmf_store_", "mmf_add_")),
                            ("ATTENTION_KERNELS", ("attention_d", "attention_singles_d"))):
        for type_name in re.findall(rf"^{macro}\((\w+)[,)]", source, flags=re.M):
            names += [p + type_name for p in prefixes]
    # MMQ_TILE_KERNELS(BODY, NAME, QT, BN, TAG, RAW) at the top level: mmq{BN}{TAG}_{kind}_{NAME}
    for type_name, rows, tag in re.findall(
            r"^MMQ_TILE_KERNELS\(\w+, (\w+), \w+, (\d+), (\w*),", source, flags=re.M):
        names += [f"mmq{rows}{tag}_{kind}_{type_name}"
                  for kind in ("store", "add", "gateup", "qkv")]
    return [n for n in names if not n.startswith("__")]


def _pop_if_current(drv, handle: int) -> None:
    try:
        if cuda_driver.current_context() == handle:
            drv.Context.pop()
    except Exception:  # the driver may already be shutting down
        pass


def align(num_bytes: int) -> int:
    return (int(num_bytes) + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES
