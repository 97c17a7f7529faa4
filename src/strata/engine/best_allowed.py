"""The best token a constraint allows, found in the vocabulary's prefix tree
(model/tokenizer.py's PrefixTree) instead of by asking the candidates one by one in logit
order: `best_in_tree`, with `spelled_irregular` / `irregular_ids`, the tokens a constraint may
judge by more than their bytes read in order (engine/sampling.py's Sampler uses them)."""
from __future__ import annotations

import heapq

import numpy as np

from strata.engine.json_constraint import THINK_OPEN, spelled_ids


def best_in_tree(allows, logits: np.ndarray, candidates: np.ndarray, tree,
                 spelled: np.ndarray, irregular: set[int]) -> int | None:
    """The allowed token (`allows`) of the largest finite logit among `candidates` (ties: the
    lowest id), or None, by a best-first walk of the prefix tree: a constraint refuses a
    regular token whose bytes start with a refused regular token's bytes (each reads the
    bytes in order and a refused byte stays refused), so a node whose token is refused is
    dropped with its subtree, and a subtree whose best logit cannot beat a token found is
    never opened. The irregular tokens (`spelled_irregular`, `irregular`) are asked one
    by one. Python work is per node opened, numpy's per subtree."""
    num_tokens = tree.order.shape[0]
    is_irregular = spelled.copy()  # [V]
    named = np.fromiter(irregular, dtype=np.int64, count=len(irregular))
    is_irregular[named[(named >= 0) & (named < num_tokens)]] = True
    finite = candidates[np.isfinite(logits[candidates])]
    odd = np.zeros(finite.shape, dtype=bool)
    odd[finite < num_tokens] = is_irregular[finite[finite < num_tokens]]
    odd |= finite >= num_tokens  # (logits wider than the vocabulary)
    regular = finite[~odd]
    values = np.full(num_tokens, -np.inf)  # [V] by place in the tree: the regular
    values[tree.position[regular]] = logits[regular]  # candidates' logits
    # a heap of (-logit, id, -1) for a token to ask, (-bound, -1, node) for a subtree
    # (before a token of its bound: a token found is the best once it is on top)
    heap = [(-float(logits[t]), int(t), -1) for t in finite[odd].tolist()]
    if num_tokens:
        heap.append((-float(values.max()), -1, 0))
    heapq.heapify(heap)
    start, end, child_at, children = tree.start, tree.end, tree.child_at, tree.children
    while heap:
        neg, token, node = heapq.heappop(heap)
        if node < 0:
            if allows(token):
                return token
            continue
        if neg == np.inf:
            break  # only empty subtrees are left
        lo, hi = int(start[node]), int(start[node + 1])
        own = [t for t in tree.order[lo:hi].tolist() if not is_irregular[t]]
        if own:  # (without one, as at the root, nothing is known of the subtree)
            if not allows(own[0]):
                continue
            at = lo + int(np.argmax(values[lo:hi]))  # ties: the lowest id
            if values[at] > -np.inf:
                heapq.heappush(heap, (-float(values[at]), int(tree.order[at]), -1))
        first, last = int(child_at[node]), int(child_at[node + 1])
        if first == last:
            continue
        kids = children[first:last]
        bounds = np.maximum.reduceat(values[hi:int(end[node])], start[kids] - hi)
        for k in np.flatnonzero(bounds > -np.inf).tolist():
            heapq.heappush(heap, (-float(bounds[k]), -1, int(kids[k])))
    return None


def spelled_irregular(tokenizer, tree) -> np.ndarray:
    """bool [V]: the tokens a constraint may judge by more than their bytes read in order: the
    added and special ones, the empty ones, and any spelled `<think>` or `<think>` and more (a
    reasoning block's opening, allowed by its spelling where a plain token spells it). Made
    once per tree."""
    got = _SPELLED.get(id(tree))
    if got is not None and got[0] is tree:
        return got[1]
    num_tokens = tree.order.shape[0]
    out = np.zeros(num_tokens, dtype=bool)
    added = [t for t in tokenizer.added_ids if 0 <= t < num_tokens]
    out[added] = True
    out[spelled_ids(tokenizer, THINK_OPEN, is_prefix=True)] = True
    out[spelled_ids(tokenizer, b"")] = True
    if len(_SPELLED) >= 8:
        _SPELLED.clear()
    _SPELLED[id(tree)] = (tree, out)
    return out


_SPELLED: dict[int, tuple] = {}  # id(tree) -> (tree, spelled_irregular of it)


def irregular_ids(constraint) -> set[int] | None:
    """The ids this constraint (and the one it wraps, `inner`) judges by more than their bytes
    now: its stop tokens, the tokens its grammar's token items name; None when its judgement
    does not follow the bytes in order (a thinking budget forcing its close, which refuses a
    token that spells part of `</think>`; a negated token item, which takes any other token)."""
    out: set[int] = set()
    while constraint is not None:
        if getattr(constraint, "is_forcing", False):
            return None
        out.update(getattr(constraint, "_stop_ids", ()))
        recognizer = getattr(constraint, "recognizer", None)
        if getattr(recognizer, "has_tokens", False):
            named, negated = recognizer.token_candidates()
            if negated:
                return None
            out.update(named)
        constraint = getattr(constraint, "inner", None)
    return out
