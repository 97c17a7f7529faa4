"""Run several requests through an engine at once (submit all, step until every one finished):
the helper the engine, tier and GPU tests share."""
from __future__ import annotations


def run_requests(engine, prompts, params) -> list:
    """(token ids, handle) of every request, in submission order; asserts none failed."""
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    tokens = [[] for _ in handles]
    while not all(h.is_finished for h in handles):
        assert engine.step()
        for out, h in zip(tokens, handles):
            out += [e.token_id for e in h.pop_events()]
    for out, h in zip(tokens, handles):
        assert h.error is None, h.error
        out += [e.token_id for e in h.pop_events()]
    return list(zip(tokens, handles))
