"""Parks and restores that run beside the windows: a KV's cells copied between the GPU and a
pinned host block on a stream of their own (non-blocking: the windows' streams and the legacy
stream never wait for it), while the other slots go on decoding. The scheduler keeps the slot
out of windows until the copy is done (`CopyDone`), and everything that reads the host arrays
(a synchronous restore, a conversation file) waits for it first."""
from __future__ import annotations

_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING


class CopyDone:
    """The end of copies enqueued on `copy_stream`: `is_done` polls, `wait` blocks. Holds the
    host arrays (and so their pinned block) until the copies are seen done."""

    def __init__(self, rt, event, keep):
        self._rt, self._event, self._keep = rt, event, keep

    def is_done(self) -> bool:
        if self._keep is None:
            return True
        with self._rt.active():
            done = self._event.query()
        if done:
            self._keep = None
        return done

    def wait(self) -> None:
        if self._keep is None:
            return
        with self._rt.active():
            self._event.synchronize()
        self._keep = None


def copy_stream(rt):
    """The stream of one context's KV copies (made at first use, with the context current)."""
    stream = getattr(rt, "kv_copy_stream", None)
    if stream is None:
        stream = rt.kv_copy_stream = rt.drv.Stream(_NON_BLOCKING)
    return stream


def after_compute(rt, stream) -> None:
    """`stream` waits for everything the compute stream was given so far (the last window's
    writes to the cells it copies)."""
    event = rt.drv.Event()
    event.record(rt.stream)
    stream.wait_for_event(event)


def finish(rt, stream, keep) -> CopyDone:
    event = rt.drv.Event()
    event.record(stream)
    return CopyDone(rt, event, keep)
