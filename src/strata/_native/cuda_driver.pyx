# cython: language_level=3, boundscheck=False, wraparound=False
"""The CUDA driver API opened at run time (dlopen of libcuda.so.1): cubin modules, kernel
launches from prepared argument buffers, events and async host->device copies (a whole list per
call, no Python per entry) and stream capture into CUDA graphs. Builds and imports without a
driver; using it there says so."""

from libc.stdint cimport uint64_t, uint32_t, int32_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, memset

from strata.errors import ConfigError

cdef extern from "<dlfcn.h>" nogil:
    void *dlopen(const char *filename, int flag)
    void *dlsym(void *handle, const char *symbol)
    char *dlerror()
    int RTLD_NOW
    int RTLD_LOCAL

# ---- the few driver types (declared here: no cuda.h at build time, no libcuda at link time) --
ctypedef int CUresult
ctypedef void *CUmodule
ctypedef void *CUfunction
ctypedef void *CUstream
ctypedef void *CUgraph
ctypedef void *CUgraphExec
ctypedef void *CUgraphNode
ctypedef void *CUcontext
ctypedef void *CUevent
ctypedef unsigned long long CUdeviceptr

ctypedef CUresult (*t_init)(unsigned int) noexcept nogil
ctypedef CUresult (*t_error_string)(CUresult, const char **) noexcept nogil
ctypedef CUresult (*t_ctx_get_current)(CUcontext *) noexcept nogil
ctypedef CUresult (*t_ctx_synchronize)() noexcept nogil
ctypedef CUresult (*t_module_load_data)(CUmodule *, const void *) noexcept nogil
ctypedef CUresult (*t_module_unload)(CUmodule) noexcept nogil
ctypedef CUresult (*t_module_get_function)(CUfunction *, CUmodule, const char *) noexcept nogil
ctypedef CUresult (*t_func_set_attribute)(CUfunction, int, int) noexcept nogil
ctypedef CUresult (*t_launch_kernel)(CUfunction, unsigned int, unsigned int, unsigned int,
                                     unsigned int, unsigned int, unsigned int, unsigned int,
                                     CUstream, void **, void **) noexcept nogil

# cuLaunchKernelEx's config with one launch attribute (cuda.h layout: id, 4 bytes of padding, a
# 64-byte value union whose first int is the programmatic-serialization flag)
cdef struct CUlaunchAttribute:
    int id
    char pad[4]
    int value[16]

cdef struct CUlaunchConfig:
    unsigned int gridDimX, gridDimY, gridDimZ
    unsigned int blockDimX, blockDimY, blockDimZ
    unsigned int sharedMemBytes
    CUstream hStream
    CUlaunchAttribute *attrs
    unsigned int numAttrs

ctypedef CUresult (*t_launch_kernel_ex)(const CUlaunchConfig *, CUfunction, void **,
                                        void **) noexcept nogil
ctypedef CUresult (*t_stream_begin_capture)(CUstream, int) noexcept nogil
ctypedef CUresult (*t_stream_end_capture)(CUstream, CUgraph *) noexcept nogil
ctypedef CUresult (*t_graph_instantiate)(CUgraphExec *, CUgraph, unsigned long long) noexcept nogil
ctypedef CUresult (*t_graph_launch)(CUgraphExec, CUstream) noexcept nogil
ctypedef CUresult (*t_graph_exec_destroy)(CUgraphExec) noexcept nogil
ctypedef CUresult (*t_graph_destroy)(CUgraph) noexcept nogil
ctypedef CUresult (*t_graph_get_nodes)(CUgraph, CUgraphNode *, size_t *) noexcept nogil
ctypedef CUresult (*t_memset_d8_async)(CUdeviceptr, unsigned char, size_t, CUstream) noexcept nogil
ctypedef CUresult (*t_stream_synchronize)(CUstream) noexcept nogil
ctypedef CUresult (*t_event_create)(CUevent *, unsigned int) noexcept nogil
ctypedef CUresult (*t_event_destroy)(CUevent) noexcept nogil
ctypedef CUresult (*t_event_record)(CUevent, CUstream) noexcept nogil
ctypedef CUresult (*t_event_query)(CUevent) noexcept nogil
ctypedef CUresult (*t_event_synchronize)(CUevent) noexcept nogil
ctypedef CUresult (*t_stream_wait_event)(CUstream, CUevent, unsigned int) noexcept nogil
ctypedef CUresult (*t_event_elapsed_time)(float *, CUevent, CUevent) noexcept nogil
ctypedef CUresult (*t_memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream) noexcept nogil
ctypedef CUresult (*t_mem_host_register)(void *, size_t, unsigned int) noexcept nogil
ctypedef CUresult (*t_mem_host_unregister)(void *) noexcept nogil
ctypedef CUresult (*t_mem_host_get_device_pointer)(CUdeviceptr *, void *, unsigned int) noexcept nogil
ctypedef CUresult (*t_stream_write_value32)(CUstream, CUdeviceptr, uint32_t, unsigned int) noexcept nogil

cdef struct Driver:
    t_init init
    t_error_string error_string
    t_ctx_get_current ctx_get_current
    t_ctx_synchronize ctx_synchronize
    t_module_load_data module_load_data
    t_module_unload module_unload
    t_module_get_function module_get_function
    t_func_set_attribute func_set_attribute
    t_launch_kernel launch_kernel
    t_launch_kernel_ex launch_kernel_ex  # NULL on drivers without it (programmatic launch off)
    t_stream_begin_capture stream_begin_capture
    t_stream_end_capture stream_end_capture
    t_graph_instantiate graph_instantiate
    t_graph_launch graph_launch
    t_graph_exec_destroy graph_exec_destroy
    t_graph_destroy graph_destroy
    t_graph_get_nodes graph_get_nodes
    t_memset_d8_async memset_d8_async
    t_stream_synchronize stream_synchronize
    t_event_create event_create
    t_event_destroy event_destroy
    t_event_record event_record
    t_event_query event_query
    t_event_synchronize event_synchronize
    t_stream_wait_event stream_wait_event
    t_event_elapsed_time event_elapsed_time  # NULL where the driver lacks both names
    t_memcpy_htod_async memcpy_htod_async
    t_mem_host_register mem_host_register
    t_mem_host_unregister mem_host_unregister
    t_mem_host_get_device_pointer mem_host_get_device_pointer
    t_stream_write_value32 stream_write_value32  # NULL where the driver lacks it (no guesses)

cdef Driver drv
cdef bint _loaded = False

LIBRARY = "libcuda.so.1"
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
cdef enum:
    _LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_CAPTURE_MODE_THREAD_LOCAL = 1
_EVENT_DISABLE_TIMING = 2
_ERROR_NOT_READY = 600


class CudaUnavailable(ConfigError):
    """No usable CUDA driver on this machine (libcuda.so.1 missing or without a symbol)."""


class CudaError(RuntimeError):
    """A driver call returned an error code."""


cdef void *_sym(void *lib, str name) except NULL:
    cdef bytes b = name.encode()
    cdef void *p = dlsym(lib, b)
    if p == NULL:
        raise CudaUnavailable(
            f"{LIBRARY} has no symbol {name}: the NVIDIA driver is too old for Strata's CUDA "
            "backend; update the driver (CUDA 12 or later), or run with --device cpu")
    return p


def load() -> None:
    """Open libcuda.so.1 and resolve the entry points (once); CudaUnavailable when absent."""
    global _loaded
    if _loaded:
        return
    cdef void *lib = dlopen(LIBRARY.encode(), RTLD_NOW | RTLD_LOCAL)
    if lib == NULL:
        err = dlerror()
        why = err.decode(errors="replace") if err != NULL else "not found"
        raise CudaUnavailable(
            f"the CUDA driver library {LIBRARY} could not be loaded ({why}): this machine has no "
            "NVIDIA driver. Install the driver for your GPU, or run with --device cpu")
    drv.init = <t_init>_sym(lib, "cuInit")
    drv.error_string = <t_error_string>_sym(lib, "cuGetErrorString")
    drv.ctx_get_current = <t_ctx_get_current>_sym(lib, "cuCtxGetCurrent")
    drv.ctx_synchronize = <t_ctx_synchronize>_sym(lib, "cuCtxSynchronize")
    drv.module_load_data = <t_module_load_data>_sym(lib, "cuModuleLoadData")
    drv.module_unload = <t_module_unload>_sym(lib, "cuModuleUnload")
    drv.module_get_function = <t_module_get_function>_sym(lib, "cuModuleGetFunction")
    drv.func_set_attribute = <t_func_set_attribute>_sym(lib, "cuFuncSetAttribute")
    drv.launch_kernel = <t_launch_kernel>_sym(lib, "cuLaunchKernel")
    drv.launch_kernel_ex = <t_launch_kernel_ex>dlsym(lib, b"cuLaunchKernelEx")
    drv.stream_begin_capture = <t_stream_begin_capture>_sym(lib, "cuStreamBeginCapture_v2")
    drv.stream_end_capture = <t_stream_end_capture>_sym(lib, "cuStreamEndCapture")
    drv.graph_instantiate = <t_graph_instantiate>_sym(lib, "cuGraphInstantiateWithFlags")
    drv.graph_launch = <t_graph_launch>_sym(lib, "cuGraphLaunch")
    drv.graph_exec_destroy = <t_graph_exec_destroy>_sym(lib, "cuGraphExecDestroy")
    drv.graph_destroy = <t_graph_destroy>_sym(lib, "cuGraphDestroy")
    drv.graph_get_nodes = <t_graph_get_nodes>_sym(lib, "cuGraphGetNodes")
    drv.memset_d8_async = <t_memset_d8_async>_sym(lib, "cuMemsetD8Async")
    drv.stream_synchronize = <t_stream_synchronize>_sym(lib, "cuStreamSynchronize")
    drv.event_create = <t_event_create>_sym(lib, "cuEventCreate")
    drv.event_destroy = <t_event_destroy>_sym(lib, "cuEventDestroy_v2")
    drv.event_record = <t_event_record>_sym(lib, "cuEventRecord")
    drv.event_query = <t_event_query>_sym(lib, "cuEventQuery")
    drv.event_synchronize = <t_event_synchronize>_sym(lib, "cuEventSynchronize")
    drv.stream_wait_event = <t_stream_wait_event>_sym(lib, "cuStreamWaitEvent")
    drv.event_elapsed_time = <t_event_elapsed_time>dlsym(lib, b"cuEventElapsedTime_v2")
    if drv.event_elapsed_time == NULL:
        drv.event_elapsed_time = <t_event_elapsed_time>dlsym(lib, b"cuEventElapsedTime")
    drv.memcpy_htod_async = <t_memcpy_htod_async>_sym(lib, "cuMemcpyHtoDAsync_v2")
    drv.mem_host_register = <t_mem_host_register>_sym(lib, "cuMemHostRegister_v2")
    drv.mem_host_unregister = <t_mem_host_unregister>_sym(lib, "cuMemHostUnregister")
    drv.mem_host_get_device_pointer = <t_mem_host_get_device_pointer>_sym(
        lib, "cuMemHostGetDevicePointer_v2")
    drv.stream_write_value32 = <t_stream_write_value32>dlsym(lib, b"cuStreamWriteValue32_v2")
    _loaded = True  # _check reads the error's text through cuGetErrorString
    rc = drv.init(0)
    if rc != 0:
        # no GPU visible (CUDA_VISIBLE_DEVICES="", a driver that lost the device): the next
        # load() must try cuInit again and fail again, not find the driver loaded
        try:
            _check(rc, "cuInit")
        finally:
            _loaded = False


def is_available() -> bool:
    """True when the driver library loads and initialises (a real probe, no exception)."""
    try:
        load()
    except (CudaUnavailable, CudaError):
        return False
    return True


cdef int _check(CUresult rc, str what) except -1:
    cdef const char *msg = NULL
    if rc == 0:
        return 0
    if _loaded and drv.error_string(rc, &msg) == 0 and msg != NULL:
        text = msg.decode(errors="replace")
    else:
        text = "unknown error"
    raise CudaError(f"{what} failed: CUDA error {rc} ({text})")


cdef inline void _need() except *:
    if not _loaded:
        load()


def current_context() -> int:
    """The calling thread's current CUDA context handle (0 when none)."""
    _need()
    cdef CUcontext ctx = NULL
    _check(drv.ctx_get_current(&ctx), "cuCtxGetCurrent")
    return <uintptr_t>ctx


def synchronize_stream(uintptr_t stream) -> None:
    _need()
    with nogil:
        rc = drv.stream_synchronize(<CUstream>stream)
    _check(rc, "cuStreamSynchronize")


cdef enum:
    _HOST_REGISTER_DEVICEMAP = 0x02  # CU_MEMHOSTREGISTER_DEVICEMAP


def host_register(uintptr_t ptr, size_t num_bytes) -> int:
    """Pin `num_bytes` of host memory at `ptr` (page-aligned) and map them into the current
    context's device address space (cuMemHostRegister, DEVICEMAP); returns their device
    address. CudaError when the driver refuses (e.g. the locked-memory limit)."""
    _need()
    cdef CUdeviceptr device = 0
    with nogil:
        rc = drv.mem_host_register(<void *>ptr, num_bytes, _HOST_REGISTER_DEVICEMAP)
    _check(rc, "cuMemHostRegister")
    rc = drv.mem_host_get_device_pointer(&device, <void *>ptr, 0)
    if rc != 0:
        drv.mem_host_unregister(<void *>ptr)
        _check(rc, "cuMemHostGetDevicePointer")
    return device


def host_unregister(uintptr_t ptr) -> None:
    """Undo host_register (the memory stays allocated, no longer pinned)."""
    _need()
    _check(drv.mem_host_unregister(<void *>ptr), "cuMemHostUnregister")


def memset_d8_async(uint64_t ptr, unsigned char value, size_t num_bytes, uintptr_t stream) -> None:
    _need()
    _check(drv.memset_d8_async(<CUdeviceptr>ptr, value, num_bytes, <CUstream>stream),
           "cuMemsetD8Async")


cdef class Module:
    """A loaded cubin in the current context; `function(name)` gives its kernels."""

    cdef CUmodule handle
    cdef bytes image

    def __cinit__(self, bytes image):
        _need()
        self.image = image  # the driver reads the image during the load only; kept for clarity
        _check(drv.module_load_data(&self.handle, <const char *>self.image), "cuModuleLoadData")

    def function(self, str name) -> Kernel:
        cdef CUfunction fn = NULL
        cdef bytes b = name.encode()
        _check(drv.module_get_function(&fn, self.handle, b),
               f"cuModuleGetFunction({name!r})")
        k = Kernel()
        k.handle = fn
        k.name = name
        k.module = self
        return k


def has_programmatic_launch() -> bool:
    """Whether this driver can launch kernels with programmatic stream serialization."""
    _need()
    return drv.launch_kernel_ex != NULL


cdef class Kernel:
    """One __global__ function of a Module. `programmatic` (set before prepare; only for
    kernels that begin with griddepcontrol.wait, on cc >= 9.0): its launches may start while
    the previous kernel in the stream finishes (programmatic dependent launch)."""

    cdef CUfunction handle
    cdef public str name
    cdef object module  # keeps the module loaded while the kernel lives
    cdef public bint programmatic

    def set_max_dynamic_shared(self, int num_bytes) -> None:
        _check(drv.func_set_attribute(self.handle, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      num_bytes), f"cuFuncSetAttribute({self.name})")

    def prepare(self, grid, block, str fmt, args, unsigned int shared_bytes=0,
                programmatic=None, uintptr_t stream=0) -> Launch:
        """A launch of this kernel with its arguments packed once. fmt has one letter per
        argument: 'P' a device pointer (int), 'i' int32, 'I' uint32, 'q' int64, 'f' float32.
        programmatic False launches it plainly even where the kernel allows more. `stream`
        (a LaunchList entry): run on that stream instead of the list's (0)."""
        cdef Launch launch = Launch(self, grid, block, fmt, args, shared_bytes)
        if programmatic is not None and not programmatic:
            launch.rec.programmatic = 0
        launch.rec.stream = <CUstream>stream
        return launch


# entry kinds of a LaunchList
cdef enum:
    KIND_KERNEL = 0
    KIND_RECORD = 1     # cuEventRecord(event, stream)
    KIND_WAIT = 2       # cuStreamWaitEvent(stream, event)
    KIND_COPY_HTOD = 3  # cuMemcpyHtoDAsync(dst, src, nbytes, stream)


cdef struct LaunchRec:
    int kind
    CUstream stream  # NULL: the stream the list runs on
    CUfunction fn
    int programmatic  # cuLaunchKernelEx with programmatic stream serialization
    unsigned int grid[3]
    unsigned int block[3]
    unsigned int shared_bytes
    void **params
    CUevent event
    CUdeviceptr dst
    const void *src
    size_t nbytes


cdef class Launch:
    """A prepared launch: kernel, grid, block and an argument buffer (8 bytes per argument)."""

    cdef LaunchRec rec
    cdef uint64_t *values
    cdef int num_args
    cdef Kernel kernel

    def __cinit__(self, Kernel kernel, grid, block, str fmt, args, unsigned int shared_bytes):
        cdef int i
        cdef float f
        cdef int32_t i32
        cdef uint32_t u32
        cdef int64_t i64
        if len(fmt) != len(args):
            raise ValueError(f"{kernel.name}: format {fmt!r} names {len(fmt)} arguments, "
                             f"got {len(args)}")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        self.kernel = kernel
        self.num_args = len(args)
        self.values = <uint64_t *>calloc(max(1, self.num_args), sizeof(uint64_t))
        self.rec.params = <void **>calloc(max(1, self.num_args), sizeof(void *))
        if self.values == NULL or self.rec.params == NULL:
            raise MemoryError()
        for i in range(self.num_args):
            c = fmt[i]
            if c == "P":
                self.values[i] = <uint64_t>int(args[i])
            elif c == "q":
                i64 = int(args[i])
                memcpy(&self.values[i], &i64, 8)
            elif c == "i":
                i32 = int(args[i])
                memcpy(&self.values[i], &i32, 4)
            elif c == "I":
                u32 = int(args[i])
                memcpy(&self.values[i], &u32, 4)
            elif c == "f":
                f = float(args[i])
                memcpy(&self.values[i], &f, 4)
            else:
                raise ValueError(f"{kernel.name}: unknown argument kind {c!r} in {fmt!r}")
            self.rec.params[i] = &self.values[i]
        self.rec.kind = KIND_KERNEL
        self.rec.stream = NULL
        self.rec.fn = kernel.handle
        self.rec.programmatic = kernel.programmatic and drv.launch_kernel_ex != NULL
        for i in range(3):
            self.rec.grid[i] = grid[i]
            self.rec.block[i] = block[i]
        self.rec.shared_bytes = shared_bytes
        if min(grid) <= 0 or min(block) <= 0:
            raise ValueError(f"{kernel.name}: empty launch grid {grid} block {block}")

    def __dealloc__(self):
        free(self.values)
        free(self.rec.params)

    @property
    def name(self) -> str:
        return self.kernel.name

    def launch(self, uintptr_t stream) -> None:
        cdef CUresult rc
        with nogil:
            rc = _launch(&self.rec, <CUstream>stream)
        _check(rc, f"cuLaunchKernel({self.kernel.name})")


cdef inline CUresult _launch_programmatic(LaunchRec *r, CUstream stream) noexcept nogil:
    cdef CUlaunchAttribute attr
    cdef CUlaunchConfig config
    memset(&attr, 0, sizeof(attr))
    attr.id = _LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1
    config.gridDimX, config.gridDimY, config.gridDimZ = r.grid[0], r.grid[1], r.grid[2]
    config.blockDimX, config.blockDimY, config.blockDimZ = r.block[0], r.block[1], r.block[2]
    config.sharedMemBytes = r.shared_bytes
    config.hStream = stream
    config.attrs = &attr
    config.numAttrs = 1
    return drv.launch_kernel_ex(&config, r.fn, r.params, NULL)


cdef inline CUresult _launch(LaunchRec *r, CUstream stream) noexcept nogil:
    if r.stream != NULL:
        stream = r.stream
    if r.kind == KIND_KERNEL:
        if r.programmatic:
            return _launch_programmatic(r, stream)
        return drv.launch_kernel(r.fn, r.grid[0], r.grid[1], r.grid[2], r.block[0], r.block[1],
                                 r.block[2], r.shared_bytes, stream, r.params, NULL)
    if r.kind == KIND_RECORD:
        return drv.event_record(r.event, stream)
    if r.kind == KIND_WAIT:
        return drv.stream_wait_event(stream, r.event, 0)
    if r.nbytes == 0:  # a copy switched off for this run (LaunchList.set_copy_bytes)
        return 0
    return drv.memcpy_htod_async(r.dst, r.src, r.nbytes, stream)


cdef class Event:
    """A driver event, recorded and waited on by LaunchList entries; timing off unless
    `timing` (then elapsed_ms measures between two of them)."""

    cdef CUevent handle

    def __cinit__(self, bint timing=False):
        _need()
        _check(drv.event_create(&self.handle, 0 if timing else _EVENT_DISABLE_TIMING),
               "cuEventCreate")

    def __dealloc__(self):
        if _loaded and self.handle != NULL:
            drv.event_destroy(self.handle)

    def query(self) -> bool:
        """True once the work before its last record has completed (or it was never recorded)."""
        cdef CUresult rc = drv.event_query(self.handle)
        if rc == _ERROR_NOT_READY:
            return False
        _check(rc, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        cdef CUresult rc
        with nogil:
            rc = drv.event_synchronize(self.handle)
        _check(rc, "cuEventSynchronize")


def elapsed_ms(Event start, Event end) -> float:
    """Milliseconds between the completed records of two timing events (Event(timing=True))."""
    cdef float ms = 0
    if drv.event_elapsed_time == NULL:
        raise CudaUnavailable(f"{LIBRARY} has no cuEventElapsedTime: this driver cannot time "
                              "events; update the NVIDIA driver")
    _check(drv.event_elapsed_time(&ms, start.handle, end.handle), "cuEventElapsedTime")
    return ms


cdef class StreamOp:
    """A LaunchList entry that is not a kernel: an event record, a stream's wait on an event,
    or an async host->device copy (pinned source). Made by record_event / wait_event /
    copy_htod; `stream` 0 runs it on the list's stream."""

    cdef LaunchRec rec
    cdef public str name
    cdef object keep  # the Event it names

    def launch(self, uintptr_t stream) -> None:
        cdef CUresult rc
        with nogil:
            rc = _launch(&self.rec, <CUstream>stream)
        _check(rc, self.name)


cdef StreamOp _op(int kind, str name, uintptr_t stream):
    _need()
    op = StreamOp()
    op.rec.kind = kind
    op.rec.stream = <CUstream>stream
    op.rec.fn = NULL
    op.rec.programmatic = 0
    op.rec.params = NULL
    op.rec.event = NULL
    op.rec.dst = 0
    op.rec.src = NULL
    op.rec.nbytes = 0
    op.name = name
    return op


def record_event(Event event, uintptr_t stream=0) -> StreamOp:
    """Entry: record `event` on `stream` (0: the list's stream)."""
    op = _op(KIND_RECORD, "event_record", stream)
    op.rec.event = event.handle
    op.keep = event
    return op


def wait_event(Event event, uintptr_t stream=0) -> StreamOp:
    """Entry: `stream` (0: the list's stream) waits for the last record of `event` issued
    before this entry."""
    op = _op(KIND_WAIT, "stream_wait_event", stream)
    op.rec.event = event.handle
    op.keep = event
    return op


def copy_htod(uint64_t dst, uint64_t src, size_t num_bytes, uintptr_t stream=0) -> StreamOp:
    """Entry: copy num_bytes from pinned host address `src` to device address `dst` on
    `stream` (0: the list's stream), asynchronously (the copy engine)."""
    if num_bytes == 0 or dst == 0 or src == 0:
        raise ValueError(f"copy_htod: empty copy (dst {dst:#x}, src {src:#x}, {num_bytes} "
                         "bytes); give both addresses and a positive size")
    op = _op(KIND_COPY_HTOD, "copy_htod", stream)
    op.rec.dst = <CUdeviceptr>dst
    op.rec.src = <const void *><uintptr_t>src
    op.rec.nbytes = num_bytes
    return op


cdef class LaunchList:
    """Prepared launches run in order by one call (a C loop, GIL released). Entries may also be
    StreamOps (event records / waits, async copies), each on its own stream or the list's."""

    cdef LaunchRec *recs
    cdef int num, cap
    cdef list keep  # the Launch / StreamOp objects own argument buffers and events

    def __cinit__(self):
        self.keep = []
        self.num = 0
        self.cap = 0
        self.recs = NULL

    def __dealloc__(self):
        free(self.recs)

    def append(self, entry) -> None:
        """Add a kernel Launch or a StreamOp (event record / wait, async copy)."""
        cdef LaunchRec rec
        if isinstance(entry, Launch):
            rec = (<Launch>entry).rec
        elif isinstance(entry, StreamOp):
            rec = (<StreamOp>entry).rec
        else:
            raise TypeError(f"a LaunchList takes Launch or StreamOp entries, not "
                            f"{type(entry).__name__}")
        self._push(rec, entry)

    def extend(self, LaunchList other, int start=0, int stop=-1) -> None:
        """Append entries [start, stop) of `other` (stop -1: to its end)."""
        cdef int i
        if stop < 0:
            stop = other.num
        if not 0 <= start <= stop <= other.num:
            raise IndexError(f"entries {start}..{stop} of a list of {other.num}")
        for i in range(start, stop):
            self._push(other.recs[i], other.keep[i])

    cdef _push(self, LaunchRec rec, object owner):
        cdef LaunchRec *grown
        if self.num == self.cap:
            self.cap = max(64, 2 * self.cap)
            grown = <LaunchRec *>malloc(self.cap * sizeof(LaunchRec))
            if grown == NULL:
                raise MemoryError()
            if self.recs != NULL:
                memcpy(grown, self.recs, self.num * sizeof(LaunchRec))
                free(self.recs)
            self.recs = grown
        self.recs[self.num] = rec
        self.keep.append(owner)
        self.num += 1

    def set_copy_bytes(self, const int64_t[::1] entries, const uint64_t[::1] num_bytes) -> None:
        """Resize async copies in place, between runs: entry entries[i] (a copy_htod) copies
        num_bytes[i] bytes from its addresses on, 0 skipping it. A list whose copies change
        from run to run is built once with every copy it may need."""
        cdef Py_ssize_t i
        cdef int64_t j
        if entries.shape[0] != num_bytes.shape[0]:
            raise ValueError(f"set_copy_bytes: {entries.shape[0]} entries, "
                             f"{num_bytes.shape[0]} sizes")
        for i in range(entries.shape[0]):
            j = entries[i]
            if not 0 <= j < self.num or self.recs[j].kind != KIND_COPY_HTOD:
                raise ValueError(f"set_copy_bytes: entry {j} of a list of {self.num} is not an "
                                 "async copy")
        for i in range(entries.shape[0]):
            self.recs[entries[i]].nbytes = num_bytes[i]

    def __len__(self) -> int:
        return self.num

    def names(self) -> list:
        return [l.name for l in self.keep]

    def launch_one(self, int i, uintptr_t stream) -> None:
        """Launch entry i alone (profiling: events between launches)."""
        if not 0 <= i < self.num:
            raise IndexError(f"launch {i} of a list of {self.num}")
        self.keep[i].launch(stream)

    def run(self, uintptr_t stream) -> None:
        cdef int i, failed = -1
        cdef CUresult rc = 0
        with nogil:
            for i in range(self.num):
                rc = _launch(&self.recs[i], <CUstream>stream)
                if rc != 0:
                    failed = i
                    break
        if failed >= 0:
            _check(rc, f"{self.keep[failed].name} (entry {failed} of the launch list)")


cdef class Graph:
    """A LaunchList captured from a stream into an executable CUDA graph, replayed by launch()."""

    cdef CUgraph graph
    cdef CUgraphExec exec_
    cdef public int num_nodes
    cdef LaunchList source  # the argument buffers must outlive the capture only; kept anyway

    def __cinit__(self, LaunchList launches, uintptr_t stream):
        cdef CUresult rc
        cdef CUgraph g = NULL
        cdef size_t n = 0
        _need()
        self.source = launches
        _check(drv.stream_begin_capture(<CUstream>stream, _CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")
        try:
            launches.run(stream)
        finally:
            rc = drv.stream_end_capture(<CUstream>stream, &g)
        _check(rc, "cuStreamEndCapture")
        self.graph = g
        _check(drv.graph_get_nodes(self.graph, NULL, &n), "cuGraphGetNodes")
        self.num_nodes = <int>n
        _check(drv.graph_instantiate(&self.exec_, self.graph, 0), "cuGraphInstantiate")

    def __dealloc__(self):
        if _loaded:
            if self.exec_ != NULL:
                drv.graph_exec_destroy(self.exec_)
            if self.graph != NULL:
                drv.graph_destroy(self.graph)

    def launch(self, uintptr_t stream) -> None:
        cdef CUresult rc
        with nogil:
            rc = drv.graph_launch(self.exec_, <CUstream>stream)
        _check(rc, "cuGraphLaunch")


# ---- guessed copies (backends/cuda/guess.py; docs/offload.md, "Guessed copies") -------------
cdef extern from *:
    """
    #include <stdint.h>
    #include <time.h>
    static inline int64_t st_load_acquire_i64(const int64_t *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline int32_t st_load_acquire_i32(const int32_t *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void st_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }
    static inline void st_nap(void) {  /* the pool's threads hold the other cores */
        struct timespec t = {0, 20000};
        nanosleep(&t, NULL);
    }
    static inline int64_t st_now_ns(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
    }
    """
    int64_t st_load_acquire_i64(const int64_t *p) nogil
    int32_t st_load_acquire_i32(const int32_t *p) nogil
    void st_relax() nogil
    void st_nap() nogil
    int64_t st_now_ns() nogil


def has_stream_write_value() -> bool:
    """Does the driver have cuStreamWriteValue32 (guessed copies need it)?"""
    _need()
    return drv.stream_write_value32 != NULL


def issue_guessed_copies(uintptr_t flags, uintptr_t lists, int num_experts,
                         const int32_t[::1] layers, int64_t seq, const uint64_t[::1] stage,
                         uint64_t host_base, uint64_t slot_bytes,
                         const uint64_t[::1] image_bytes, uint64_t landed, uintptr_t stream,
                         double timeout_s) -> tuple:
    """Serve a window's guesses, layer by layer in `layers`' order (GIL released): wait until
    the device's guess_publish wrote flags [l] == seq (int64, mapped host memory), then copy
    each expert e of its list (lists [L, 1 + E] int32: count, experts) from the pinned host
    copies [host_base + (l * E + e) * slot_bytes] into [stage [l] + e * slot_bytes] on
    `stream`, image_bytes [l] each (a run of consecutive experts in one copy), then write
    landed [l] = (uint32) seq there (a device address; cuStreamWriteValue32 fences the copies
    before it), which the layer's guess_point waits for. It spins briefly, then naps 20 us at a
    time (the CPU pool's threads hold the other cores). After `timeout_s` without a flag the
    layer and the rest are given up: their landed words are still written, so no kernel waits
    for copies that never come. Returns (experts, copies, bytes, the first layer given up or
    -1)."""
    _need()
    if drv.stream_write_value32 == NULL:
        raise CudaUnavailable(f"{LIBRARY} has no cuStreamWriteValue32_v2: guessed copies need "
                              "a CUDA 12 or later driver")
    cdef int E = num_experts, n = layers.shape[0], i, j, k, l, cnt, e, first
    cdef int64_t deadline_ns = <int64_t>(timeout_s * 1e9), t0
    cdef int64_t experts = 0, copies = 0, gave_up = -1
    cdef uint64_t nbytes = 0, size
    cdef const int64_t *flag = <const int64_t *>flags
    cdef const int32_t *lst
    cdef int32_t *ids = <int32_t *>malloc(sizeof(int32_t) * (E if E > 0 else 1))
    cdef CUresult rc = 0
    cdef CUstream st = <CUstream>stream
    if ids == NULL:
        raise MemoryError()
    try:
        with nogil:
            for i in range(n):
                l = layers[i]
                if gave_up < 0:
                    t0 = st_now_ns()
                    k = 0
                    while st_load_acquire_i64(flag + l) != seq:
                        k += 1
                        if k < 64:
                            st_relax()
                        else:  # a layer is ~1-3 ms: a nap of 20 us costs it little
                            st_nap()
                            if st_now_ns() - t0 > deadline_ns:
                                gave_up = l
                                break
                if gave_up < 0:
                    lst = <const int32_t *>lists + <int64_t>l * (E + 1)
                    cnt = st_load_acquire_i32(lst)
                    if cnt > E:
                        cnt = E
                    for j in range(cnt):  # insertion sort: the list comes in no order
                        e = lst[1 + j]
                        k = j
                        while k > 0 and ids[k - 1] > e:
                            ids[k] = ids[k - 1]
                            k -= 1
                        ids[k] = e
                    j = 0
                    while j < cnt and rc == 0:
                        first = ids[j]
                        while j + 1 < cnt and ids[j + 1] == ids[j] + 1:
                            j += 1
                        size = <uint64_t>(ids[j] - first) * slot_bytes + image_bytes[l]
                        rc = drv.memcpy_htod_async(
                            <CUdeviceptr>(stage[l] + <uint64_t>first * slot_bytes),
                            <const void *><uintptr_t>(
                                host_base + (<uint64_t>l * E + first) * slot_bytes),
                            size, st)
                        nbytes += size
                        copies += 1
                        j += 1
                    experts += cnt
                if rc == 0:
                    rc = drv.stream_write_value32(st, <CUdeviceptr>(landed + 4 * <uint64_t>l),
                                                  <uint32_t>seq, 0)
                if rc != 0:
                    break
    finally:
        free(ids)
    _check(rc, "guessed copies (cuMemcpyHtoDAsync / cuStreamWriteValue32)")
    return int(experts), int(copies), int(nbytes), int(gave_up)
