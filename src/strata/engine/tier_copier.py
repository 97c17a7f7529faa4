"""The async tier's copy thread (CPU arena): lands each round's loads while windows run."""
from __future__ import annotations

import logging
import queue
import threading

log = logging.getLogger("strata.tier")

COPY_TIMEOUT_S = 120.0  # a copy waits this long for readers of older versions, then gives up


class TierCopier:
    """The async tier's copy thread: applies each round's loads while windows run. The arena's
    ordered path makes that safe: a slot is published missing before its bytes change, the copy
    waits out readers of older versions, and an expert is published only once landed."""

    def __init__(self, apply):
        self._apply = apply  # apply(loads, stop_event): the tier's ordered loads
        self._rounds: queue.Queue = queue.Queue()
        # rounds submitted and not yet applied; `_idle` is set exactly when it is 0. Both
        # change under `_lock` only: a round submitted while the thread finishes the one
        # before must never find `_idle` set after it (a round planned, or a KV grow lending
        # slots, while its copies are still to land).
        self._lock = threading.Lock()
        self._num_pending = 0
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-tier-copier",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_busy(self) -> bool:
        return not self._idle.is_set()

    def submit(self, loads: list) -> None:
        with self._lock:
            self._num_pending += 1
            self._idle.clear()
        self._rounds.put(loads)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        return self._idle.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._rounds.put(None)
        self._thread.join(COPY_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            loads = self._rounds.get()
            if loads is None:
                return
            try:
                self._apply(loads, self._stop)
            except Exception:  # noqa: BLE001 - a failed copy must not kill the thread
                log.exception("the tier's copier failed on a round; its remaining swaps were "
                              "dropped")
            finally:
                with self._lock:
                    self._num_pending -= 1
                    if not self._num_pending:
                        self._idle.set()
