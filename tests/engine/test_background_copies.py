"""Parks and restores that copy beside the windows (a CUDA KV's export_prefix_async /
restore_cells_async, backends/cuda/kv_copies.py): the scheduler keeps the slot out of windows
until its copy is done while the other slots decode, and everything reading the parked arrays
waits for it. Here a host KV copies late on purpose: its cells move only when the copy is
seen done, so a window that touched the slot earlier, or a reader that did not wait, would
change the tokens. The GPU's own copies: tests/backends/cuda/test_cuda_background_copies.py."""
from __future__ import annotations

import numpy as np

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.kv import KVCache

GREEDY = dict(temperature=0.0, ignore_eos=True)


class _LateCopy:
    """Done at the `polls`-th `is_done` (or at `wait`); the copy itself runs then."""

    def __init__(self, run, polls: int):
        self._run, self.polls_left = run, polls
        self.polls_while_copying = 0

    def is_done(self) -> bool:
        if self._run is not None:
            self.polls_left -= 1
            if self.polls_left > 0:
                self.polls_while_copying += 1
                return False
            self.wait()
        return True

    def wait(self) -> None:
        if self._run is not None:
            self._run()
            self._run = None


class LateCopyKV(KVCache):
    copies: list = []  # every copy made, for the test to read

    def export_prefix_async(self, num_tokens: int):
        shape = (self.num_layers,) + self.keys(0)[:, :num_tokens].shape
        k = np.full(shape, np.nan, self.keys(0).dtype)
        v = np.full(shape, np.nan, self.keys(0).dtype)

        def run():  # the cells as they are when the copy is seen done (as a device copy,
            held = self.num_tokens  # it reads them whatever the count says by then)
            self.num_tokens = num_tokens
            k[...], v[...] = self.export_prefix(num_tokens)
            self.num_tokens = held

        copy = _LateCopy(run, polls=12)
        self.copies.append(copy)
        return k, v, copy

    def restore_cells_async(self, keys, values, num_tokens: int):
        self.truncate(0)
        self.check_room(num_tokens)
        copy = _LateCopy(lambda: self._land(keys, values, num_tokens), polls=12)
        self.copies.append(copy)
        self.commit(num_tokens)  # counted at once, as the device's: the cells land later
        return copy

    def _land(self, keys, values, num_tokens):
        assert not np.isnan(keys[:, :, :num_tokens]).any()  # its park's copy came first
        held, self.num_tokens = self.num_tokens, 0
        for layer in range(self.num_layers):
            self.append(layer, keys[layer][:, :num_tokens], values[layer][:, :num_tokens])
        self.num_tokens = held


def _turns(path, late: bool):
    """Slot 0 decodes a long answer while slot 1 serves three turns that park and restore:
    A, then B (parks A), then A's next turn (parks B, restores A)."""
    with Engine(EngineConfig(path, n_ctx=512, threads=2, parallel=2,
                             conversation_cache_mib=64)) as engine:
        if late:
            for kv in engine.scheduler.kvs:
                kv.__class__ = LateCopyKV
            LateCopyKV.copies = []
        tok = engine.tokenize
        long = engine.submit(tok("one two three four"), SamplingParams(max_tokens=400, **GREEDY))
        out = []
        prompt_a = tok("red green blue red green")
        for prompt in (prompt_a, tok("cat dog bird cat dog"), None):
            if prompt is None:  # A's next turn: its tokens, its answer, new words
                prompt = prompt_a + out[0] + tok(" yellow")
            handle = engine.submit(prompt, SamplingParams(max_tokens=8, **GREEDY))
            tokens = []
            while not handle.is_finished:
                assert engine.step()
                tokens += [e.token_id for e in handle.pop_events()]
            assert handle.error is None, handle.error
            out.append(tokens + [e.token_id for e in handle.pop_events()])
        assert not long.is_finished  # it decoded through all of them
        while not long.is_finished:
            engine.step()
        assert long.error is None
        stats = engine.last_stats
        return out, stats


def test_late_copies_give_the_tokens_of_copies_made_at_once(tiny_model_path):
    plain, _ = _turns(tiny_model_path, late=False)
    late, _ = _turns(tiny_model_path, late=True)
    assert late == plain
    copies = LateCopyKV.copies
    assert len(copies) >= 3  # A parked, B parked, A restored
    # other windows ran while they copied (the slot sat them out)
    assert all(c.polls_while_copying > 0 for c in copies)
