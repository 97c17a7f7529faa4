"""kv_copies.KVCopier without a GPU: over a stand-in for PyCUDA's streams, events and context,
the copy thread issues jobs in the order given (inside their `around`), device-to-host
jobs in pieces with a wait after each, restores whole; a landing holds the job's arrays until
it is done, reports a failed copy to whoever waits for it, and ASYNC = False waits in submit.
(The copies on the H200: tests/backends/cuda/test_cuda_kv_copies.py.)"""
import contextlib
import gc
import threading
import weakref

import numpy as np
import pytest

from strata.backends.cuda import kv_copies
from strata.backends.cuda.kv_copies import PIECE_BYTES, KVCopier

MIB = 2**20


class Log:
    def __init__(self):
        self.calls = []  # ("copy", name) / ("sync", stream) / ("wait", event) in order
        self.lock = threading.Lock()

    def add(self, *call):
        with self.lock:
            self.calls.append(call)


class FakeEvent:
    def __init__(self, log):
        self.log, self.stream = log, None

    def record(self, stream):
        self.stream = stream


class FakeStream:
    def __init__(self, log, flags=0):
        self.log, self.flags = log, flags

    def wait_for_event(self, event):
        self.log.add("wait", event.stream)

    def synchronize(self):
        self.log.add("sync", self)


class FakeDrv:
    def __init__(self, log):
        self.log = log
        self.Context = self  # Context.pop()

    def Event(self):
        return FakeEvent(self.log)

    def Stream(self, flags=0):
        return FakeStream(self.log, flags)

    def pop(self):
        self.log.add("pop", threading.current_thread().name)


class FakeContext:
    def __init__(self, log):
        self.log = log

    def push(self):
        self.log.add("push", threading.current_thread().name)


class FakeRuntime:
    def __init__(self):
        import contextlib

        self.log = Log()
        self.drv = FakeDrv(self.log)
        self.context = FakeContext(self.log)
        self.stream = FakeStream(self.log)
        self.active = contextlib.nullcontext


def copy(log, name, gate=None):
    def function(destination, source, stream):
        if gate is not None:
            assert gate.wait(10)
        log.add("copy", name)
        destination[:] = source
    return function


def job(rt, name, sizes, gate=None):
    """(copies, destinations): a copy of `size` bytes per entry, the first one gated."""
    copies, outs = [], []
    for i, size in enumerate(sizes):
        out = np.zeros(4, np.uint8)
        outs.append(out)
        copies.append((copy(rt.log, f"{name}{i}", gate if i == 0 else None), out,
                       np.full(4, i + 1, np.uint8), size))
    return copies, outs


def test_device_to_host_jobs_go_in_pieces_and_restores_whole_in_order():
    rt = FakeRuntime()
    copier = KVCopier(rt)
    assert copier.stream.flags == kv_copies.STREAM_NON_BLOCKING
    park, _ = job(rt, "park", [PIECE_BYTES // 2] * 5)
    restore, outs = job(rt, "restore", [PIECE_BYTES // 2] * 5)
    first = copier.submit(park, keep=None, in_pieces=True)
    second = copier.submit(restore, keep=None, in_pieces=False)
    copier.settle()
    assert first.done() and second.done()
    assert all((o == i + 1).all() for i, o in enumerate(outs))
    calls = [c for c in rt.log.calls if c[0] in ("copy", "sync", "wait")]
    names = [c[1] if c[0] == "copy" else c[0] for c in calls]
    # each job first waits for the compute stream's work, then: the park a wait for its copies
    # after every full piece (2 copies) and at the end; the restore once, at the end
    assert names == ["wait", "park0", "park1", "sync", "park2", "park3", "sync", "park4", "sync",
                     "wait", "restore0", "restore1", "restore2", "restore3", "restore4", "sync"]
    assert all(c[1] is rt.stream for c in calls if c[0] == "wait")
    assert all(c[1] is copier.stream for c in calls if c[0] == "sync")
    pushes = [c for c in rt.log.calls if c[0] == "push"]
    assert len(pushes) == 1 and pushes[0][1] == "kv-copies"  # the context, for the thread's life


def test_a_landing_holds_the_arrays_until_its_copies_are_done():
    rt = FakeRuntime()
    copier = KVCopier(rt)
    gate = threading.Event()
    copies, _ = job(rt, "park", [MIB], gate=gate)
    block = np.zeros(1 << 20, np.uint8)
    held = weakref.ref(block)
    landing = copier.submit(copies, keep=block, in_pieces=True)
    del block, copies
    gc.collect()
    assert held() is not None and not landing.done()
    gate.set()
    landing.wait()
    copier.settle()
    for _ in range(100):  # the thread drops its references after setting the landing
        gc.collect()
        if held() is None:
            break
        threading.Event().wait(0.01)
    assert held() is None


def test_a_failed_copy_is_raised_to_whoever_waits_and_later_jobs_still_run(caplog):
    rt = FakeRuntime()
    copier = KVCopier(rt)

    def broken(destination, source, stream):
        raise RuntimeError("cuMemcpyDtoHAsync failed: an illegal memory access")

    bad = copier.submit([(broken, None, None, MIB)], keep=None, in_pieces=True)
    good_copies, outs = job(rt, "next", [MIB])
    good = copier.submit(good_copies, keep=None, in_pieces=False)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bad.wait()
    good.wait()
    assert (outs[0] == 1).all() and "KV copies failed" in caplog.text


def test_not_async_waits_in_submit(monkeypatch):
    monkeypatch.setattr(kv_copies, "ASYNC", False)
    rt = FakeRuntime()
    copier = KVCopier(rt)
    copies, outs = job(rt, "park", [MIB, MIB])
    landing = copier.submit(copies, keep=None, in_pieces=True)
    assert landing.done() and all((o == i + 1).all() for i, o in enumerate(outs))


def test_around_is_entered_on_the_copy_thread_before_the_copies_and_left_after():
    rt = FakeRuntime()
    copier = KVCopier(rt)
    copies, outs = job(rt, "park", [MIB, MIB])

    @contextlib.contextmanager
    def pinned():  # like host_pool's pin of a fresh block
        rt.log.add("pin", threading.current_thread().name)
        yield
        rt.log.add("unpin", threading.current_thread().name)

    copier.submit(copies, keep=None, in_pieces=True, around=pinned()).wait()
    calls = [c for c in rt.log.calls if c[0] in ("pin", "copy", "wait", "sync", "unpin")]
    assert calls[0] == ("pin", "kv-copies") and calls[-1] == ("unpin", "kv-copies")
    assert [c[0] for c in calls[1:-1]] == ["wait", "copy", "copy", "sync"]
    assert all((o == i + 1).all() for i, o in enumerate(outs))


def test_before_runs_ahead_of_the_copies_and_then_after_they_landed_in_the_copy_thread():
    rt = FakeRuntime()
    copier = KVCopier(rt)
    copies, outs = job(rt, "park", [MIB, MIB])

    def host(name):
        return lambda: rt.log.add(name, threading.current_thread().name)

    copier.submit(copies, keep=None, in_pieces=True, before=host("before"),
                  then=host("then")).wait()
    calls = [c for c in rt.log.calls if c[0] in ("before", "copy", "wait", "sync", "then")]
    assert [c[0] for c in calls] == ["before", "wait", "copy", "copy", "sync", "then"]
    assert calls[0][1] == calls[-1][1] == "kv-copies"


def test_a_failing_then_is_raised_to_whoever_waits(caplog):
    rt = FakeRuntime()
    copier = KVCopier(rt)
    copies, _ = job(rt, "park", [MIB])

    def gather():
        raise MemoryError("no room for the records")

    with caplog.at_level("ERROR"):
        landing = copier.submit(copies, keep=None, in_pieces=True, then=gather)
        with pytest.raises(MemoryError, match="no room"):
            landing.wait()
    assert "KV copies failed" in caplog.text
