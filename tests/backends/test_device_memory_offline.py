"""runtime.DeviceMemory without a GPU: over a stand-in for PyCUDA's allocation, context and
Context.pop, a device allocation is its address, is freed once, with its context made current
around the free (unless it is), in whichever thread drops it or whose cyclic GC collects it,
and does nothing when the context is gone. (On the H200:
tests/backends/cuda/test_cuda_device_memory.py.)"""
import gc
import threading

import pytest
from gc_threads import collect_in_a_thread

from strata.backends.cuda.runtime import DeviceMemory


class Log:
    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def add(self, *call):
        with self.lock:
            self.calls.append(call + (threading.current_thread().name,))


class FakeAllocation:
    def __init__(self, log, address):
        self.log, self.address = log, address

    def __int__(self):
        return self.address

    def free(self):
        self.log.add("free", self.address)


class FakeContext:
    def __init__(self, log, is_gone=False):
        self.log, self.is_gone = log, is_gone

    def push(self):
        if self.is_gone:
            raise RuntimeError("cuCtxPushCurrent failed: context is destroyed")
        self.log.add("push")


class FakeDrv:
    def __init__(self, log):
        self.log = log
        self.Context = self
        self.current = threading.local()  # PyCUDA's context stack is per thread

    def get_current(self):
        return getattr(self.current, "context", None)

    def pop(self):
        self.log.add("pop")


def _memory(log, address=0x7F0000001000, is_gone=False, drv=None):
    drv = FakeDrv(log) if drv is None else drv
    return DeviceMemory(FakeAllocation(log, address), FakeContext(log, is_gone), drv)


def test_where_its_context_is_current_it_is_freed_as_it_is():
    log = Log()
    drv = FakeDrv(log)
    mem = _memory(log, drv=drv)
    drv.current.context = mem._context  # the engine thread's
    del mem
    assert [c[0] for c in log.calls] == ["free"]


def test_it_is_its_address():
    log = Log()
    mem = _memory(log)
    assert mem == 0x7F0000001000 and int(mem) == 0x7F0000001000
    assert type(int(mem)) is int and type(mem + 256) is int  # an offset does not own it
    assert f"{mem:x}" == "7f0000001000"
    del mem
    assert [c[0] for c in log.calls] == ["push", "free", "pop"]


def test_freed_once_with_its_context_current():
    log = Log()
    mem = _memory(log)
    mem.free()
    mem.free()
    del mem
    assert [c[:-1] for c in log.calls] == [("push",), ("free", 0x7F0000001000), ("pop",)]


def test_a_cycle_collected_in_another_thread_frees_it_there():
    log = Log()

    class Holder:  # a model-like object in a reference cycle with its buffers
        pass

    gc.collect()  # only this cycle for the thread to collect, nothing earlier tests left
    holder = Holder()
    holder.me = holder
    holder.buf = _memory(log)
    del holder
    collect_in_a_thread("io-thread")
    assert log.calls == [("push", "io-thread"), ("free", 0x7F0000001000, "io-thread"),
                         ("pop", "io-thread")]


def test_nothing_is_freed_once_the_context_is_gone():
    log = Log()
    mem = _memory(log, is_gone=True)
    mem.free()
    del mem
    assert log.calls == []


def test_a_failing_free_still_pops_the_context():
    log = Log()
    mem = _memory(log)

    def fail():
        log.add("free")
        raise RuntimeError("cuMemFree failed")

    mem._allocation.free = fail
    with pytest.raises(RuntimeError):
        mem.free()
    assert [c[0] for c in log.calls] == ["push", "free", "pop"]
