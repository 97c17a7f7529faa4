"""The async tier's copy thread (engine/tier_copier.py): it reports busy from a round's submit
until that round is applied, also when the round comes in as the thread turns from one round to
the next (the engine plans the next round and KV grow lends slots only while it is idle)."""
from __future__ import annotations

import queue
import threading

from strata.engine.tier_copier import TierCopier

WAIT_S = 30.0  # only a hung thread takes this long


class _SubmitsAtTheTurn(queue.Queue):
    """The copier's round queue; once round 1 is applied, the thread's next look at the queue
    (whether it is empty, or taking the next round) first submits round 2, as the engine
    thread may at that moment."""

    def __init__(self, copier: TierCopier, applied: list):
        super().__init__()
        self._copier, self._applied, self._fired = copier, applied, False

    def _turn(self) -> None:
        if self._applied == [1] and not self._fired:
            self._fired = True
            self._copier.submit(2)

    def empty(self) -> bool:
        was_empty = super().empty()
        self._turn()
        return was_empty  # what the thread saw just before the submit

    def get(self, *args, **kwargs):
        self._turn()
        return super().get(*args, **kwargs)


def test_a_round_submitted_as_the_previous_one_ends_keeps_the_copier_busy():
    applied: list = []
    in_round_2, release_round_2 = threading.Event(), threading.Event()

    def apply(loads, stop):
        if loads == 2:
            in_round_2.set()
            assert release_round_2.wait(WAIT_S)
        applied.append(loads)

    copier = TierCopier(apply)
    copier._rounds = _SubmitsAtTheTurn(copier, applied)
    copier.start()
    try:
        copier.submit(1)
        assert in_round_2.wait(WAIT_S)
        # round 2 is queued or copying, so a round planned now would not see its loads, and
        # KV grow would lend slots it is copying into: the copier must say it is busy
        assert copier.is_busy
        assert not copier.wait_idle(0)
        release_round_2.set()
        assert copier.wait_idle(WAIT_S)
        assert applied == [1, 2] and not copier.is_busy
    finally:
        release_round_2.set()
        copier.stop()


def test_busy_from_each_submit_until_its_round_is_applied():
    applied: list = []
    gates = {n: threading.Event() for n in range(3)}

    def apply(loads, stop):
        assert gates[loads].wait(WAIT_S)
        applied.append(loads)

    copier = TierCopier(apply)
    copier.start()
    try:
        assert not copier.is_busy
        for n in range(3):
            copier.submit(n)
        for n in range(3):
            assert copier.is_busy
            gates[n].set()
        assert copier.wait_idle(WAIT_S)
        assert applied == [0, 1, 2] and not copier.is_busy
    finally:
        for gate in gates.values():
            gate.set()
        copier.stop()
