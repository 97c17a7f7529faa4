"""Parked conversations: KV copies of slots given to other requests, kept in host RAM within a
byte budget (`--conversation-cache-mib` / `--cache-ram`), least recently used dropped first, or
written to the disk tier below it (`--conversation-cache-dir`, conversation_disk.py).
"""
from __future__ import annotations

import functools
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from strata.engine.slots import common_prefix_len
from strata.errors import ConfigError

log = logging.getLogger("strata.engine")

# Parked KV may take at most this share of the host RAM available at start, whatever the option
# asks: past it the experts' pages (or the host) would be pushed out of RAM.
RAM_SHARE = 0.5


def resolve_budget_mib(asked_mib: float, available_bytes: int | None) -> float:
    """The conversation cache's budget: `asked_mib` (-1: no limit of its own, as llama.cpp's
    --cache-ram -1), at most RAM_SHARE of `available_bytes` when known."""
    if asked_mib == 0:
        return 0.0
    bound = None if available_bytes is None else RAM_SHARE * available_bytes / 2**20
    if asked_mib < 0:
        if bound is None:
            raise ConfigError("--conversation-cache-mib -1 (no limit) needs the RAM available "
                              "from /proc/meminfo, which this system lacks; give a size in MiB")
        budget = bound
    else:
        budget = asked_mib if bound is None else min(asked_mib, bound)
    asked = "no limit" if asked_mib < 0 else f"{asked_mib:.0f} MiB"
    if budget < asked_mib or asked_mib < 0:
        log.info("conversation cache: up to %.0f MiB of host RAM for parked conversations "
                 "(asked: %s; %.0f%% of the %.0f MiB available)", budget, asked,
                 100 * RAM_SHARE, available_bytes / 2**20)
    return budget


@dataclass(frozen=True)
class ParkedConversation:
    """One parked KV: the cells of `tokens`, in whatever arrays the backend copied them to."""

    key: int
    tokens: tuple[int, ...]
    kv_arrays: Any
    nbytes: int
    # the lengths it can be restored at (a hybrid model's recurrent state exists only at its
    # checkpoints and end); None: any length
    reuse_points: tuple[int, ...] | None = None
    # the copies into kv_arrays (a device KV's park, backends/cuda/kv_copies.py): None, or
    # has wait(); host readers of the arrays call wait_landed() first
    landing: Any = None

    def wait_landed(self) -> None:
        if self.landing is not None:
            self.landing.wait()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def token_array(self) -> np.ndarray:
        """`tokens` as int64, made once: every placement compares the prompt with each entry
        (a tuple made into an array per comparison took 168 ms a request with 225 entries of
        2.3K tokens)."""
        return np.asarray(self.tokens, dtype=np.int64)

    def kept(self, num_used: int | None) -> ParkedConversation:
        """This entry as a slot that keeps `num_used` of its tokens restores it: a hybrid
        model's reuse points past `num_used` dropped, so its state goes in at `num_used`
        (restored at its end, the checkpoint the slot goes back to could be pushed out by the
        one `Scheduler._install` keeps there when `--ctx-checkpoints` are all taken)."""
        if self.reuse_points is None or num_used is None:
            return self
        points = tuple(p for p in self.reuse_points if p <= num_used)
        return self if points == self.reuse_points else replace(self, reuse_points=points)

    def usable(self, prefix: int, num_prompt_tokens: int) -> int:
        """The shared `prefix`, or for an entry with reuse points the most tokens a prompt of
        `num_prompt_tokens` can keep (a reuse point, below the prompt's last token, which is
        always read again)."""
        if self.reuse_points is None:
            return prefix
        limit = max(0, min(prefix, num_prompt_tokens - 1))
        return max((p for p in self.reuse_points if p <= limit), default=0)

    def covers(self, tokens: Sequence[int], reuse_points: tuple[int, ...] | None) -> bool:
        """Whether this entry restores everything an entry of `tokens` would: they are a
        prefix of its tokens, and it can go back to each of their reuse points."""
        if common_prefix_len(self.token_array, tokens) != len(tokens):
            return False
        if self.reuse_points is None:
            return True
        points = set(self.reuse_points)
        return reuse_points is not None and all(p in points for p in reuse_points)


class ConversationCache:
    """Parked KVs by key, in least- to most-recently-used order, using at most `budget_bytes`.

    Prefix rule (keep the longer): the K/V cells of a token prefix depend only on that prefix,
    so an entry whose tokens are a prefix of another entry's adds nothing. Parking tokens that
    extend an entry replaces it; parking tokens that an entry already extends (or equals) stores
    nothing new, refreshes that entry and returns its key. A hybrid model's entry restores only
    at its reuse points, so it covers another only when it has all of that one's points too.
    """

    def __init__(self, budget_mib: float, disk=None):
        """`disk`: a ConversationDisk (its keys from `new_key`) that takes the entries evicted
        from RAM, or a callable that builds one from `new_key`; None: evicted ones are lost."""
        if isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float)) \
                or not math.isfinite(budget_mib) or budget_mib < 0:
            raise ConfigError(f"--conversation-cache-mib {budget_mib!r} must be a number >= 0 "
                              "(0 turns parking off)")
        self.budget_bytes = int(budget_mib * 2**20)
        self._entries: OrderedDict[int, ParkedConversation] = OrderedDict()  # LRU first
        self._used_bytes = 0
        self._next_key = 1
        self.num_evicted = 0  # entries dropped to make room
        self.num_parked = 0  # entries stored
        self.num_taken = 0  # entries restored into a slot
        self.disk = disk(self.new_key) if callable(disk) else disk
        # an entry evicted to the disk tier waits for a writer that is behind (a stop) rather
        # than being dropped (serving: the engine thread must not wait for the disk)
        self.evictions_wait = False

    def new_key(self) -> int:
        key = self._next_key
        self._next_key += 1
        return key

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        """Keys from least to most recently used (the eviction order)."""
        return list(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries or (self.disk is not None and key in self.disk)

    def get(self, key: int) -> ParkedConversation:
        return self._entries[key]

    def park(self, tokens: Sequence[int], kv_arrays: Any, nbytes: int,
             reuse_points: Sequence[int] | None = None, landing: Any = None) -> int | None:
        """Keep the KV of `tokens`; return its key, or None when it cannot be kept (no tokens,
        or larger than the whole budget). Evicts least recently used entries to make room.
        `reuse_points`: the lengths it can be restored at (None: any). `landing`: the copies
        into `kv_arrays` may still run until its wait() returns."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes = {nbytes} must be >= 0")
        array = np.asarray(tokens, dtype=np.int64)
        tokens = tuple(array.tolist())  # (fast for long ones)
        if not tokens:
            return None
        points = None if reuse_points is None else tuple(sorted({int(p) for p in reuse_points}))
        for key, entry in self._entries.items():
            if entry.covers(array, points):
                self._entries.move_to_end(key)  # already covered: refresh, store nothing
                return key
        if nbytes > self.budget_bytes:
            return None
        new = ParkedConversation(self.new_key(), tokens, kv_arrays, nbytes, points, landing)
        for key in [k for k, e in self._entries.items()
                    if new.covers(e.token_array, e.reuse_points)]:
            self._drop(key)  # the new entry extends it
        self._entries[new.key] = new
        self._used_bytes += nbytes
        self.num_parked += 1
        while self._used_bytes > self.budget_bytes:
            evicted = self._drop(next(iter(self._entries)))
            self.num_evicted += 1
            log.info("parked entry %d (%d tokens) evicted, the least recently used, to make "
                     "room for entry %d within %.1f MiB%s", evicted.key, evicted.num_tokens,
                     new.key, self.budget_bytes / 2**20,
                     "" if self.disk is None else "; offered to the conversation files")
            if self.disk is not None:
                evicted.wait_landed()  # the writer thread reads its arrays
                self.disk.offer(evicted, wait=self.evictions_wait)
        return new.key

    def best_match(self, prompt_tokens: Sequence[int]) -> tuple[int | None, int]:
        """(key, length) of the entry sharing the longest prefix with the prompt (a hybrid
        model's entry: the most it lets the prompt keep, see `usable`); (None, 0) when none
        lets it keep a token. Ties go to the most recently used entry. Does not change
        recency."""
        best_key, best_len = None, 0
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        for key, entry in reversed(self._entries.items()):
            length = entry.usable(common_prefix_len(entry.token_array, prompt), len(prompt))
            if length > best_len:
                best_key, best_len = key, length
        if self.disk is not None:
            key, length = self.disk.best_match(prompt)
            if length > best_len:  # (a tie stays in RAM: no file to read)
                best_key, best_len = key, length
        return best_key, best_len

    def take(self, key: int, num_used: int | None = None) -> ParkedConversation | None:
        """Return a parked entry whose KV goes back into a slot that keeps `num_used` of its
        tokens (None: all). It leaves the cache only when the slot keeps all of it: an entry
        lending a prefix (another conversation's system prompt) stays parked, else its own
        next turn would find it gone. An entry on disk is read (its file stays until a file
        of the conversation's continuation replaces it); None when that file cannot be read
        any more, or left the disk tier since `best_match` (its writer thread frees room once
        a write's size is known; logged)."""
        if self.disk is not None and key not in self._entries:
            entry = self.disk.take(key, num_used)
            self.num_taken += entry is not None
            return None if entry is None else entry.kept(num_used)
        if key not in self._entries:
            raise KeyError(f"no parked conversation with key {key} (evicted or already taken); "
                           "call best_match() again")
        entry = self._entries[key]
        if num_used is None or num_used >= entry.num_tokens:
            self._drop(key)
        else:
            log.info("parked entry %d lends its first %d of %d tokens; it stays parked", key,
                     num_used, entry.num_tokens)
        self.num_taken += 1
        return entry.kept(num_used)

    def discard(self, key: int) -> None:
        """Forget entry `key` (in RAM, or on disk with its file): its KV turned out unfit."""
        if key in self._entries:
            self._drop(key)
        elif self.disk is not None:
            self.disk.discard(key)

    def clear(self) -> None:
        """Forget every entry, the disk tier's files too."""
        self._entries.clear()
        self._used_bytes = 0
        if self.disk is not None:
            self.disk.clear()

    def save_to_disk(self) -> None:
        """Write every entry to the disk tier (least recently used first, so the files keep
        the order) and wait for the writes: a graceful stop."""
        if self.disk is None:
            return
        for entry in list(self._entries.values()):
            entry.wait_landed()
            self.disk.offer(entry, wait=True)
        self.disk.close()

    def _drop(self, key: int) -> ParkedConversation:
        entry = self._entries.pop(key)
        self._used_bytes -= entry.nbytes
        return entry
