"""The CUDA runtime of the backend: PyCUDA owns the context, memory and streams and compiles the
`.cu` modules (once, cached on disk); the kernels are loaded and launched through cuda_driver.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os
import pathlib
import re
import sys
import threading
import warnings

import numpy as np

from strata._native import cuda_driver
from strata.errors import ConfigError

_log = logging.getLogger("strata.cuda")

KERNEL_DIR = pathlib.Path(__file__).resolve().parent
MODULES = ("matmul.cu", "matvec.cu", "mmq.cu", "mmq_k.cu", "layer.cu", "attention.cu",
           "attention_group.cu", "attention_prompt.cu", "router.cu", "sample.cu", "offload.cu",
           "delta_net.cu")
# kernels that take more dynamic shared memory than the default 48 KB, and the most they take:
# attention_prompt(_i8)'s two buffers of K/V tiles at D = 128 (plan.attention_prompt_shared_bytes)
DYNAMIC_SHARED_MAX = {name: 2 * 2 * 64 * (128 + 8) * 2
                      for name in ("attention_prompt", "attention_prompt_i8")}
_INSTALL_HINT = ("pip install 'strata[cuda]' (PyCUDA; it needs the CUDA toolkit's nvcc and an "
                 "NVIDIA driver), or run with --device cpu")
_ALIGN_BYTES = 256
# The kernels use cp.async and the int8 / fp16 m16n8k16 / m16n8k32 tensor-core mma: Ampere
# (RTX 30xx, A100) and newer. nvcc builds every module for sm_80 and above (sm_86, sm_89,
# sm_90, sm_120 checked by tests/backends/test_cuda_offline.py) and refuses sm_75.
MIN_COMPUTE_CAPABILITY = (8, 0)


def import_pycuda():
    """pycuda.driver, initialised; ConfigError saying what to install when CUDA is missing."""
    try:
        import pycuda.driver as drv
    except ImportError as exc:
        raise ConfigError(f"the CUDA backend needs PyCUDA, which is not importable ({exc}); "
                          f"{_INSTALL_HINT}") from None
    try:
        # CudaUnavailable (a ConfigError) naming libcuda.so.1 when there is no driver; both
        # cuInit calls (ours, then PyCUDA's) fail with "no CUDA-capable device" when no GPU is
        # visible, ours with a CudaError, PyCUDA's with a drv.Error
        cuda_driver.load()
        drv.init()
        count = drv.Device.count()
    except (cuda_driver.CudaError, drv.Error) as exc:
        raise ConfigError(f"the CUDA driver could not start ({exc}){_visible_devices_hint()}; "
                          "run with --device cpu") from None
    if count == 0:
        raise ConfigError("the CUDA driver sees no GPU on this machine"
                          f"{_visible_devices_hint()}; run with --device cpu")
    return drv


def _visible_devices_hint() -> str:
    """The CUDA_VISIBLE_DEVICES the process runs under, when set: it hides every GPU it does not
    name ("" hides them all), the usual cause of a driver that sees none."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return ""
    return f" (CUDA_VISIBLE_DEVICES={value!r} hides every GPU it does not name)"


def is_available() -> bool:
    """True when PyCUDA imports and the driver sees a GPU that the kernels run on (a real
    probe); unavailable_reason() says why not."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here (PyCUDA, the driver, no GPU, GPU 0 too old), or
    None when it can."""
    try:
        drv = import_pycuda()
        check_compute_capability(drv.Device(0))
    except (ConfigError, cuda_driver.CudaError) as exc:
        return str(exc)
    except Exception as exc:  # pycuda's own LogicError / RuntimeError from a broken driver
        return f"the CUDA driver failed ({exc})"
    return None


def check_compute_capability(device) -> None:
    """ConfigError naming the GPU when its compute capability is below what the kernels need."""
    major, minor = device.compute_capability()
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        raise ConfigError(
            f"the GPU {device.name()} has compute capability {major}.{minor}; Strata's CUDA "
            f"kernels need {need} or newer (Ampere: RTX 30xx, A100, and later GPUs); run with "
            "--device cpu")


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"[ \t]*$', re.M)
# A header no file holds: module_source writes it from strata/model/iq_grids.py (gguf's grids)
IQ_TABLES = "iq_tables.cuh"


def _table(ctype: str, name: str, words, digits: int) -> str:
    items = [f"0x{int(w):0{digits}x}" + ("ull" if digits > 8 else "u") for w in words]
    lines = [", ".join(items[i:i + 6]) for i in range(0, len(items), 6)]
    return (f"static __device__ const {ctype} {name}[{len(items)}] = {{\n    "
            + ",\n    ".join(lines) + "};\n")


@functools.lru_cache(maxsize=1)
def iq_tables_source() -> str:
    """The i-quants' grids as `__device__ const` tables (common.cuh's iq_group): entry i of a
    grid as its 8 (or 4) int8 values packed little endian, value j in byte j; IQ1_S / IQ1_M's
    shared grid as 8 * (value + 1) (0, 8, 16), whose bytes iq1_values turns into 8 * value +- 1.
    The sign patterns (iq_grids.ksigns) are not a table: iq_ksign computes them, checked here."""
    from gguf import GGMLQuantizationType as QT

    from strata.model import iq_grids

    index = np.arange(128)
    parity = np.array([bin(i).count("1") & 1 for i in index])
    if not np.array_equal(iq_grids.ksigns(), index | (parity << 7)):
        raise ValueError("gguf's ksigns are not the 7 index bits plus a parity bit")
    iq1 = iq_grids.grid(QT.IQ1_S)
    if not np.array_equal(iq1, iq_grids.grid(QT.IQ1_M)):
        raise ValueError("gguf's IQ1_S and IQ1_M grids differ")
    parts = ["// generated by runtime.iq_tables_source() from strata/model/iq_grids.py\n"]
    for name, qtype in (("st_iq2xxs_grid", QT.IQ2_XXS), ("st_iq2xs_grid", QT.IQ2_XS),
                        ("st_iq2s_grid", QT.IQ2_S)):
        packed = np.ascontiguousarray(iq_grids.grid(qtype)).view("<u8").reshape(-1)
        parts.append(_table("unsigned long long", name, packed, 16))
    for name, qtype in (("st_iq3xxs_grid", QT.IQ3_XXS), ("st_iq3s_grid", QT.IQ3_S)):
        packed = np.ascontiguousarray(iq_grids.grid(qtype)).view("<u4").reshape(-1)
        parts.append(_table("uint32_t", name, packed, 8))
    shifted = np.ascontiguousarray((8 * (iq1.astype(np.int16) + 1)).astype(np.uint8))
    parts.append(_table("unsigned long long", "st_iq1_grid", shifted.view("<u8").reshape(-1), 16))
    return "".join(parts)


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
        if header == IQ_TABLES:
            return iq_tables_source()
        return module_source(header, seen, folder).replace("#pragma once\n", "")

    return _LOCAL_INCLUDE.sub(inline, (folder / name).read_text())


# the driver (CUDA 12.3) from which stream capture turns programmatic launches into graph edges
PDL_MIN_DRIVER = 12030


def programmatic_launch(major: int, driver_version: int, env=None) -> tuple[bool, str]:
    """Whether kernels may be launched as programmatic dependent launches on a GPU of compute
    capability `major`.x under a driver of `driver_version` (e.g. 13000 for CUDA 13.0), and
    why in words. Every kernel reaches common.cuh's kernel_entry() before it reads what an
    earlier kernel wrote, so its blocks may be scheduled, and stage their weights, while the
    kernel before it finishes (plan.py: windows of <= PDL_MAX_ROWS rows, with the figures).
    Needs cc >= 9.0 and a CUDA 12.3 driver (decode windows run as captured graphs);
    STRATA_PDL=0 turns it off."""
    env = os.environ if env is None else env
    if major < 9:
        return False, f"off (needs compute capability 9.0, this GPU has {major}.x)"
    if env.get("STRATA_PDL", "1").strip() == "0":
        return False, "off (STRATA_PDL=0)"
    if driver_version < PDL_MIN_DRIVER or not cuda_driver.has_programmatic_launch():
        return False, (f"off (needs a CUDA 12.3 driver, this one is {driver_version // 1000}."
                       f"{driver_version % 1000 // 10})")
    return True, "on"


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
        check_compute_capability(self.device)
        major, minor = self.device.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.context = self.device.retain_primary_context()
        self.context.push()
        _pushed_handles.add(int(self.context.handle))
        # PyCUDA aborts at exit when a context is left on the main thread's stack: pop ours
        # then (another thread that builds a model pops them as it ends: release_thread)
        atexit.register(_pop_if_current, drv, int(self.context.handle))
        self.stream = drv.Stream()
        self.stream_handle = int(self.stream.handle)
        self._kernels: dict[str, cuda_driver.Kernel] = {}
        self.programmatic, why = programmatic_launch(major, drv.get_driver_version())
        _log.info("GPU %d: %s (%s); programmatic dependent launch of one-row windows: %s",
                  index, self.name, self.arch, why)
        for name in MODULES:
            module = self._load_module(name)  # each Kernel keeps its module
            for fn in _kernel_names(module_source(name)):
                kernel = module.function(fn)
                kernel.programmatic = self.programmatic
                if fn in DYNAMIC_SHARED_MAX:
                    kernel.set_max_dynamic_shared(DYNAMIC_SHARED_MAX[fn])
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

    def alloc(self, num_bytes: int) -> DeviceMemory:
        """A device allocation of num_bytes (at least 1), kept alive by the runtime's caller."""
        return DeviceMemory(self.drv.mem_alloc(max(int(num_bytes), _ALIGN_BYTES)),
                            self.context, self.drv)

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


class DeviceMemory(int):
    """A device allocation as its address (an int: PyCUDA's copies, cuda_driver and the
    launches take it as it is; `alloc + offset` is a plain int that does not keep it alive),
    freed when its last reference goes, from whichever thread that is.

    PyCUDA frees its own allocations only in the thread that made the context, or where the
    context is current; elsewhere it warns "device_allocation in out-of-thread context could
    not be cleaned up" and the memory stays taken. The cyclic GC frees whatever it collects in
    the thread that happens to trigger it: the HTTP server's threads, the conversation files'
    I/O threads, the copy threads. So the free makes the context current around itself."""

    def __new__(cls, allocation, context, drv):
        self = super().__new__(cls, int(allocation))
        self._allocation = allocation
        self._context = context
        # (held: at exit the module's names may be gone first)
        self._current, self._pop = drv.Context.get_current, drv.Context.pop
        return self

    def free(self) -> None:
        """Free it now (at most once; later uses of the address are the caller's error)."""
        allocation = self.__dict__.pop("_allocation", None)
        if allocation is None:
            return
        if self._current() == self._context:  # the engine thread, the copy thread
            allocation.free()
            return
        try:
            self._context.push()
        except Exception:  # noqa: BLE001 - the context is gone, and the memory with it
            return
        try:
            allocation.free()
        finally:
            self._pop()

    def __del__(self):
        if sys.is_finalizing():  # PyCUDA frees it as before (the main thread made the context)
            self.__dict__.pop("_allocation", None)
            return
        self.free()


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
                            ("ATTENTION_KERNELS", ("attention_d", "attention_singles_d")),
                            ("ATTENTION_GROUP_KERNEL", ("attention_group_",))):
        for type_name in re.findall(rf"^{macro}\((\w+)[,)]", source, flags=re.M):
            names += [p + type_name for p in prefixes]
    # MMQ_TILE_KERNELS(BODY, NAME, QT, BN, TAG, RAW) at the top level: mmq{BN}{TAG}_{kind}_{NAME}
    for type_name, rows, tag in re.findall(
            r"^MMQ_TILE_KERNELS\(\w+, (\w+), \w+, (\d+), (\w*),", source, flags=re.M):
        names += [f"mmq{rows}{tag}_{kind}_{type_name}"
                  for kind in ("store", "add", "gateup", "qkv")]
    return [n for n in names if not n.startswith("__")]


# The contexts a Runtime made current in the thread that built it (a GPU's primary context:
# one handle per GPU however many Runtimes it has).
_pushed_handles: set[int] = set()


def release_thread() -> None:
    """Take every context a Runtime made current off the calling thread's stack, for a thread
    that built CUDA models and now ends: PyCUDA aborts the whole process (SIGABRT, "the
    context stack was not empty") when a thread ends with a context on its stack. `strata
    serve` builds its engine on the engine thread; a stop used to end in that abort."""
    if not _pushed_handles:
        return  # no Runtime was built in this process (CUDA may not even be there)
    drv = import_pycuda()
    try:
        while cuda_driver.current_context() in _pushed_handles:
            drv.Context.synchronize()  # the thread's last work lands before it lets go
            drv.Context.pop()
    except Exception as exc:  # a failed GPU: nothing left to hand back
        _log.warning("releasing the GPU context of thread %s: %s",
                     threading.current_thread().name, exc)


def _pop_if_current(drv, handle: int) -> None:
    try:
        if cuda_driver.current_context() == handle:
            drv.Context.pop()
    except Exception:  # the driver may already be shutting down
        pass


def align(num_bytes: int) -> int:
    return (int(num_bytes) + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES
