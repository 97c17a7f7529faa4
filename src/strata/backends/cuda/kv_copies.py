"""KV copies between the GPU and pinned host blocks that do not hold up the other slots.

A park copies a slot's cells into a pinned block (host_pool.py) and a restore copies a parked
conversation's cells back; on Qwen3-30B-A3B a 12K-token agent is ~1.1 GiB each way. Run as
synchronous copies on the engine thread, every other slot's window waited for them. Here the
engine hands them to a thread ("kv-copies") that issues them on one copy stream per GPU
context, created non-blocking so that nothing on the legacy stream waits for it, and goes on:

- Device-to-host copies go out in pieces of `PIECE_BYTES`, the next once the last has landed:
  the GPU serves device-to-host copies one at a time (measured on the H200: a 4 KiB copy on
  another stream waited 19.4 ms behind a 1 GiB one, where host-to-device copies passed each
  other), and every window reads its sampled tokens back so. A window then waits for one piece
  at most (~0.6 ms). Restores (host to device) go out whole.
- A block the pinned pool had to make for a park is pinned here, around the copies (`around`),
  not on the engine thread (~0.4 s a 2.5 GiB), and so are a conversation file's cells, which
  come back in mappings of their own (kv_file.read_kv_file, host_pages.owns_pages). Cells in
  malloc's heap (a small file's) are copied on the engine thread: pinning rounds to whole
  pages, and a page shared with another array left that array's synchronous copy failing
  ("cuMemcpyHtoD failed: invalid argument", a hybrid model's recurrent state read from the
  same file, session 55).
- int8 cells: a park copies codes and scales into a pinned pool block and the copy thread
  then gathers them into the (codes, scale) records that parks and files hold (`then`); a
  restore has the copy thread take them out of the records into a block first (`before`).
  Until session 57 both ran on the engine thread.
- A `Landing` says when a job's copies are done; the job holds the host arrays it reads or
  writes until then (a block given back to the pool while its DMA runs could be leased or
  unpinned under it).
- Order: a job's copies start after the compute stream's work issued before it was handed
  over (the slot's last window may still be running), and jobs run in the order given (a
  park, then a restore into the same cells; a restore from an entry whose park has not landed
  yet). The scheduler keeps a request whose cells have not landed out of windows
  (`CudaKV.copies_pending`) while other slots have work, and waits for them when none has; a
  window that runs such a KV anyway waits for them first (`CudaKV.order_copies`), and so
  does every synchronous copy of cells (`settle`). Host readers of parked arrays (the
  conversation-file writer) wait for the entry's landing (`ParkedConversation.wait_landed`).

`ASYNC = False` waits for every landing before the copy call returns (the behaviour before:
the engine thread and the other slots wait), for benchmarks (tools/bench_park_pause.py).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import weakref

log = logging.getLogger(__name__)

ASYNC = True
STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit order with the legacy stream
# a device-to-host piece: what a window's own read-back may wait for (~0.6 ms at 53 GB/s)
PIECE_BYTES = 32 * 2**20


class Landing:
    """When one job's copies are done; `wait` raises the error that stopped them, if any."""

    def __init__(self):
        self._done = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        """Whether the copies have landed (does not wait)."""
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def order(self, stream) -> None:
        """Work queued on `stream` from now on runs after these copies (the copies may not be
        issued yet, so this waits for them)."""
        self.wait()


class KVCopier:
    """The copy stream of one GPU context and the thread that issues the jobs handed to it."""

    def __init__(self, rt):
        self.rt = rt
        with rt.active():
            self.stream = rt.drv.Stream(STREAM_NON_BLOCKING)
        self._jobs: queue.Queue | None = None
        self._last: Landing | None = None

    def submit(self, copies, keep, in_pieces: bool, around=None, before=None,
               then=None) -> Landing:
        """Hand over `copies`, (function, destination, source, bytes) each, called as
        function(destination, source, stream) (pycuda's memcpy_*_async); `keep` stays
        referenced until they are done. `in_pieces`: device-to-host copies (above).
        `around`: a context manager the copy thread enters before the copies and leaves once
        they have landed (a fresh pool block's pinning, host_pool.PinnedPool.lease_to_pin).
        `before` / `then`: host work the copy thread does inside `around`, before the copies
        are issued / once they have landed (int8 cells: codes and scales gathered into
        records and back, kv.py); the landing is done after `then`. Call in the active
        context."""
        after = self.rt.drv.Event()
        after.record(self.rt.stream)  # the compute stream's work so far comes first
        landing = Landing()
        if self._jobs is None:
            self._jobs = queue.Queue()
            # (the thread holds the context, not the runtime: a runtime that goes ends it)
            args = (self.rt.context, self.rt.drv, self.stream, self._jobs)
            thread = threading.Thread(target=_serve, args=args, name="kv-copies", daemon=True)
            thread.start()
            weakref.finalize(self, self._jobs.put, None)
            # PyCUDA aborts at exit when a thread still holds a context: end it before
            atexit.register(_stop, self._jobs, thread)
        self._jobs.put((around, before, after, list(copies), then, keep, in_pieces, landing))
        self._last = landing
        if not ASYNC:
            landing.wait()
        return landing

    def settle(self) -> None:
        """Wait for every job handed over so far (they run in order)."""
        if self._last is not None:
            self._last.wait()


def _serve(context, drv, stream, jobs: queue.Queue) -> None:
    """The copy thread: issue each job's copies on `stream`, in `context` (current in this
    thread for its life: what the thread frees, a collection included, frees there), until a
    None."""
    context.push()
    try:
        while (job := jobs.get()) is not None:
            around, before, after, copies, then, keep, in_pieces, landing = job
            try:
                with around if around is not None else contextlib.nullcontext():
                    if before is not None:
                        before()
                    stream.wait_for_event(after)
                    piece = 0
                    for function, destination, source, nbytes in copies:
                        function(destination, source, stream)
                        piece += nbytes
                        if in_pieces and piece >= PIECE_BYTES:
                            stream.synchronize()
                            piece = 0
                    stream.synchronize()
                    if then is not None:
                        then()
            except BaseException as exc:  # noqa: BLE001 - told to whoever waits for it
                log.exception("KV copies failed")
                landing.error = exc
            finally:
                landing._done.set()
            # the arrays go back to the pool now
            del job, around, before, after, copies, then, keep
    finally:
        drv.Context.pop()


def _stop(jobs: queue.Queue, thread: threading.Thread) -> None:
    jobs.put(None)
    thread.join(timeout=10)


def copier(rt) -> KVCopier:
    """The KV copier of `rt`'s context (one per context, made on first use)."""
    found = getattr(rt, "kv_copier", None)
    if found is None:
        found = rt.kv_copier = KVCopier(rt)
    return found
