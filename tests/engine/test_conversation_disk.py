"""The conversation cache's disk tier: entries evicted from RAM are written to files, matched
and read back exactly; the prefix rule, the folder's budget, a restart's index, and files
that went bad."""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time

import numpy as np
import pytest

from strata.engine import conversation_disk
from strata.engine.conversation_disk import ConversationDisk
from strata.engine.conversations import ConversationCache, ParkedConversation
from strata.engine.kv_file import SUFFIX, write_kv_file
from strata.errors import ConfigError

MIB = 2**20


def kv(tokens, fill=None):
    """A (keys, values, state) value of `tokens` whose cells say which token they hold."""
    n = len(tokens)
    k = np.broadcast_to(np.asarray(tokens, np.float32)[None, None, :, None], (2, 1, n, 4))
    k = np.ascontiguousarray(k if fill is None else k * 0 + fill)
    return k, -k, None


def make_disk(folder, mib=64.0, model="m", fmt="f", keys=None):
    keys = keys if keys is not None else itertools.count(1000)
    return ConversationDisk(folder, mib, model, fmt, lambda: next(keys))


def cache_over(folder, ram_bytes, **kw):
    return ConversationCache(ram_bytes / MIB, disk=lambda new_key: ConversationDisk(
        folder, kw.get("mib", 64.0), kw.get("model", "m"), kw.get("fmt", "f"), new_key))


def files(folder):
    return sorted(p.name for p in folder.glob(f"*{SUFFIX}"))


def hold_writes(monkeypatch, started: threading.Event | None = None) -> threading.Event:
    """The writer thread waits for the returned event before each write (`started` is set
    when one begins)."""
    release = threading.Event()
    real = conversation_disk.write_kv_file

    def held(*args, **kw):
        if started is not None:
            started.set()
        assert release.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(conversation_disk, "write_kv_file", held)
    return release


def test_an_entry_evicted_from_ram_is_written_and_restored_exactly(tmp_path):
    cache = cache_over(tmp_path, 1000)
    a, b = [1, 2, 3, 4], [9, 8, 7]
    cache.park(a, kv(a), 600)
    cache.park(b, kv(b), 600)  # evicts a from RAM: a goes to a file
    cache.disk.flush()
    assert cache.num_entries == 1 and cache.disk.num_entries == 1 and len(files(tmp_path)) == 1
    key, length = cache.best_match(a + [5, 6])
    assert length == 4 and key in cache.disk and key in cache
    entry = cache.take(key)
    assert entry.tokens == tuple(a) and entry.nbytes == 600 and entry.reuse_points is None
    for got, want in zip(entry.kv_arrays, kv(a)):
        assert (got is None and want is None) or np.array_equal(got, want)
    assert cache.num_taken == 1 and cache.disk.num_read == 1 and cache.disk.num_written == 1
    # the file stays: it is still a valid prefix of the conversation
    assert cache.disk.num_entries == 1 and len(files(tmp_path)) == 1


def test_ram_wins_a_tie_and_the_longer_match_wins_otherwise(tmp_path):
    cache = cache_over(tmp_path, 10_000)
    disk = cache.disk
    disk.offer(ParkedConversation(0, (1, 2, 3, 4, 5), kv([1, 2, 3, 4, 5]), 100))
    disk.flush()
    ram_key = cache.park([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]), 100)
    assert cache.best_match([1, 2, 3, 4, 5, 6]) == (ram_key, 5)
    cache.take(ram_key)
    cache.park([1, 2, 3], kv([1, 2, 3]), 100)
    key, length = cache.best_match([1, 2, 3, 4, 5, 6])
    assert length == 5 and key in disk


def test_the_prefix_rule_holds_on_disk(tmp_path):
    disk = make_disk(tmp_path)
    short, long = (1, 2, 3), (1, 2, 3, 4, 5)
    assert disk.offer(ParkedConversation(0, short, kv(short), 50))
    disk.flush()
    first = files(tmp_path)
    assert disk.offer(ParkedConversation(0, long, kv(long), 80))  # extends it: replaces it
    disk.flush()
    assert disk.num_entries == 1 and files(tmp_path) != first and len(files(tmp_path)) == 1
    assert not disk.offer(ParkedConversation(0, short, kv(short), 50))  # covered: no file
    assert not disk.offer(ParkedConversation(0, long, kv(long), 80))
    disk.flush()
    assert disk.num_written == 2 and len(files(tmp_path)) == 1
    # a hybrid entry restores only at its points: one without that point does not cover it
    hybrid = make_disk(tmp_path / "hybrid")
    assert hybrid.offer(ParkedConversation(0, long, kv(long), 80, reuse_points=(2, 5)))
    assert hybrid.offer(ParkedConversation(0, short, kv(short), 50, reuse_points=(3,)))
    assert not hybrid.offer(ParkedConversation(0, short[:2], kv(short[:2]), 50,
                                               reuse_points=(2,)))
    hybrid.flush()
    assert hybrid.num_entries == 2


def test_the_budget_deletes_the_least_recently_used_files(tmp_path):
    probe = make_disk(tmp_path / "probe")
    probe.offer(ParkedConversation(0, tuple(range(10)), kv(range(10)), 4000))
    probe.flush()
    size = probe.used_bytes  # one file of 10 tokens
    disk = make_disk(tmp_path, mib=3.5 * size / MIB)  # room for three
    names = []
    for i in range(3):
        tokens = tuple(range(10 * i, 10 * i + 10))
        disk.offer(ParkedConversation(0, tokens, kv(tokens), 4000))
        disk.flush()
        names.append(set(files(tmp_path)))
    keys = list(disk._entries)
    disk.take(keys[0])  # the first is used again: the second is now the oldest
    tokens = tuple(range(100, 110))
    disk.offer(ParkedConversation(0, tokens, kv(tokens), 4000))
    disk.flush()
    assert list(disk._entries)[:2] == [keys[2], keys[0]] and disk.num_evicted >= 1
    second = (names[1] - names[0]).pop()
    assert second not in files(tmp_path) and len(files(tmp_path)) == disk.num_entries
    assert disk.used_bytes <= disk.budget_bytes


def test_a_files_continuation_replaces_it_once_written(tmp_path):
    disk = make_disk(tmp_path)
    old = (1, 2, 3, 4, 5, 6)  # a turn and the reply's last tokens
    disk.offer(ParkedConversation(0, old, kv(old), 100))
    other = (9, 9, 9)
    disk.offer(ParkedConversation(0, other, kv(other), 100))
    disk.flush()
    next_turn = (1, 2, 3, 4, 5, 7, 8)  # shares 5: the client rewrote the reply's end
    disk.offer(ParkedConversation(0, next_turn[:6], kv(next_turn[:6]), 100))
    disk.flush()
    assert disk.num_entries == 3  # not restored from it: the old file stays
    key = next(e.key for e in disk._entries.values() if e.tokens == old)
    disk.take(key, num_used=5)
    disk.offer(ParkedConversation(0, next_turn, kv(next_turn), 100))
    disk.flush()
    assert sorted(e.tokens for e in disk._entries.values()) == [next_turn, other]
    assert len(files(tmp_path)) == 2
    # a hybrid continuation without a state at the kept length does not replace it
    hybrid = make_disk(tmp_path / "h")
    hybrid.offer(ParkedConversation(0, old, kv(old), 100, reuse_points=(5, 6)))
    hybrid.flush()
    hybrid.take(next(iter(hybrid._entries)), num_used=5)
    hybrid.offer(ParkedConversation(0, next_turn, kv(next_turn), 100, reuse_points=(3, 7)))
    hybrid.flush()
    assert hybrid.num_entries == 2
    hybrid.offer(ParkedConversation(0, next_turn + (1,), kv(next_turn + (1,)), 100,
                                    reuse_points=(5, 8)))
    hybrid.flush()
    assert sorted(e.tokens for e in hybrid._entries.values()) == [next_turn,
                                                                  next_turn + (1,)]


def test_an_entry_over_the_whole_budget_is_not_written(tmp_path, caplog):
    disk = make_disk(tmp_path, mib=0.001)
    with caplog.at_level(logging.INFO, "strata.engine"):
        assert not disk.offer(ParkedConversation(0, (1, 2), kv([1, 2]), 5000))
    assert "over the folder's budget" in caplog.text and files(tmp_path) == []


def test_a_restart_finds_this_models_files_in_their_order(tmp_path, caplog):
    disk = make_disk(tmp_path)
    for i, tokens in enumerate([(1, 2), (3, 4, 5), (6,)]):
        disk.offer(ParkedConversation(0, tokens, kv(tokens), 100, reuse_points=(len(tokens),)))
        disk.flush()
    for n, path in enumerate(sorted(tmp_path.glob(f"*{SUFFIX}"),
                                    key=lambda p: p.stat().st_mtime_ns)):
        os.utime(path, (1e9 + n, 1e9 + n))
    disk.take(list(disk._entries)[0])  # (1, 2) used last now
    make_disk(tmp_path, model="other").offer(ParkedConversation(0, (7,), kv([7]), 10))
    make_disk(tmp_path, fmt="other").offer(ParkedConversation(0, (8,), kv([8]), 10))
    (tmp_path / f"junk{SUFFIX}").write_bytes(b"not a conversation")
    time.sleep(0.2)
    with caplog.at_level(logging.INFO, "strata.engine"):
        again = make_disk(tmp_path)
    assert [e.tokens for e in again._entries.values()] == [(3, 4, 5), (6,), (1, 2)]
    assert [e.reuse_points for e in again._entries.values()] == [(3,), (1,), (2,)]
    assert "skipping" in caplog.text and "junk" in caplog.text
    assert "3 conversations" in caplog.text
    key, length = again.best_match([3, 4, 5, 9])
    assert length == 3
    assert again.take(key).tokens == (3, 4, 5)


def test_a_file_gone_bad_is_dropped_and_the_scheduler_places_again(tmp_path, caplog):
    cache = cache_over(tmp_path, 100)
    cache.park([1, 2, 3], kv([1, 2, 3]), 100)
    cache.park([4, 5, 6], kv([4, 5, 6]), 100)
    cache.disk.flush()
    path, = tmp_path.glob(f"*{SUFFIX}")
    path.write_bytes(path.read_bytes()[:-10])
    key, _ = cache.best_match([1, 2, 3])
    with caplog.at_level(logging.WARNING, "strata.engine"):
        assert cache.take(key) is None
    assert "cannot restore" in caplog.text and "truncated" in caplog.text
    assert key not in cache and cache.best_match([1, 2, 3]) == (None, 0)
    cache.disk.flush()  # (the writer thread deletes it)
    assert not path.exists()


def test_a_file_the_writer_deleted_after_the_match_is_placed_again(tmp_path, monkeypatch,
                                                                   caplog):
    """The writer thread frees room once a write's size is known, between the engine
    thread's best_match and its take: the matched file may be gone by then. The take gives
    None (the scheduler places again), not a KeyError that failed the request."""
    cache = cache_over(tmp_path, 100)
    disk = cache.disk
    disk.offer(ParkedConversation(0, (1, 2, 3), kv([1, 2, 3]), 100))
    disk.flush()
    disk.budget_bytes = disk.used_bytes + 150  # the file, and a write of 100 bytes of KV
    release = hold_writes(monkeypatch)
    disk.offer(ParkedConversation(0, (7, 8), kv([7, 8]), 100))  # its file is larger
    key, length = cache.best_match([1, 2, 3, 4])
    assert length == 3 and key in disk
    release.set()
    disk.flush()  # written: over the budget, the least recently used file goes
    assert key not in disk
    with caplog.at_level(logging.INFO, "strata.engine"):
        assert cache.take(key, 3) is None
    assert "placed again" in caplog.text
    assert cache.best_match([1, 2, 3, 4]) == (None, 0)


def test_files_are_deleted_by_the_writer_thread_after_the_writes_before_them(
        tmp_path, monkeypatch):
    deleted_in = []
    real_unlink = conversation_disk.Path.unlink

    def unlink(self, missing_ok=False):
        if self.name.endswith(SUFFIX):
            deleted_in.append((self.name, threading.current_thread().name))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(conversation_disk.Path, "unlink", unlink)
    disk = make_disk(tmp_path)
    disk.offer(ParkedConversation(0, (1, 2, 3), kv([1, 2, 3]), 100))
    disk.flush()
    first, = files(tmp_path)
    disk.budget_bytes = disk.used_bytes + 150  # the file and one entry of 100 queued
    started = threading.Event()
    release = hold_writes(monkeypatch, started)
    disk.offer(ParkedConversation(0, (7, 8), kv([7, 8]), 100))
    assert started.wait(10)  # the writer is busy with it
    # over the budget: the first file leaves the index at once; its deletion waits for the
    # writer (an unlink beside a write's fsync took 0.25-0.3 s on the engine thread)
    disk.offer(ParkedConversation(0, (4, 5, 6), kv([4, 5, 6]), 100))
    assert [e.tokens for e in disk._entries.values()] == [(7, 8), (4, 5, 6)]
    assert files(tmp_path) == [first] and deleted_in == []
    release.set()
    disk.flush()
    assert first not in files(tmp_path) and deleted_in[0][0] == first
    assert {thread for _, thread in deleted_in} == {"strata-conversation-files"}


def test_take_while_the_write_is_queued_gives_the_arrays_in_ram(tmp_path, monkeypatch):
    release = hold_writes(monkeypatch)
    disk = make_disk(tmp_path)
    value = kv([1, 2, 3])
    disk.offer(ParkedConversation(0, (1, 2, 3), value, 100))
    key, _ = disk.best_match([1, 2, 3])
    entry = disk.take(key)
    assert entry.kv_arrays is value and disk.num_read == 0
    release.set()
    disk.flush()
    assert len(files(tmp_path)) == 1 and disk.num_written == 1


def test_a_failed_write_loses_that_file_only(tmp_path, monkeypatch, caplog):
    def full_disk(*args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conversation_disk, "write_kv_file", full_disk)
    disk = make_disk(tmp_path)
    with caplog.at_level(logging.WARNING, "strata.engine"):
        disk.offer(ParkedConversation(0, (1, 2), kv([1, 2]), 100))
        disk.flush()
    assert "No space left" in caplog.text and disk.num_failed == 1 and disk.num_entries == 0
    monkeypatch.undo()
    disk.offer(ParkedConversation(0, (1, 2), kv([1, 2]), 100))
    disk.flush()
    assert disk.num_entries == 1 and disk.num_written == 1


def test_a_dropped_entry_being_written_leaves_no_file(tmp_path, monkeypatch):
    started = threading.Event()
    release = hold_writes(monkeypatch, started)
    disk = make_disk(tmp_path)
    disk.offer(ParkedConversation(0, (1, 2), kv([1, 2]), 100))
    assert started.wait(10)
    disk.clear()  # while it is written
    release.set()
    disk.flush()
    assert files(tmp_path) == [] and disk.num_entries == 0


def test_the_writer_behind_drops_or_waits(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(conversation_disk, "PENDING_MAX_BYTES", 150)
    release = hold_writes(monkeypatch)
    disk = make_disk(tmp_path)
    assert disk.offer(ParkedConversation(0, (1,), kv([1]), 100))
    with caplog.at_level(logging.INFO, "strata.engine"):
        assert not disk.offer(ParkedConversation(0, (2,), kv([2]), 100))
    assert "behind" in caplog.text
    threading.Timer(0.2, release.set).start()
    assert disk.offer(ParkedConversation(0, (3,), kv([3]), 100), wait=True)
    disk.close()
    assert disk.num_written == 2 and len(files(tmp_path)) == 2


def test_save_to_disk_writes_every_ram_entry_and_clear_forgets_them(tmp_path):
    cache = cache_over(tmp_path, 10_000)
    for tokens in ([1, 2], [3, 4], [5, 6]):
        cache.park(tokens, kv(tokens), 100)
    cache.save_to_disk()
    assert len(files(tmp_path)) == 3
    again = cache_over(tmp_path, 10_000)
    assert again.best_match([3, 4, 9])[1] == 2
    again.clear()
    assert files(tmp_path) == [] and again.best_match([3, 4])[1] == 0


def test_a_folder_that_cannot_be_written_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--conversation-cache-dir"):
        make_disk(blocker / "sub")


def test_stale_partial_files_are_removed_and_fresh_ones_kept(tmp_path):
    stale, fresh = tmp_path / f"a{SUFFIX}.partial", tmp_path / f"b{SUFFIX}.partial"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (1e9, 1e9))
    make_disk(tmp_path)
    assert not stale.exists() and fresh.exists()


def test_files_written_by_hand_with_the_format_are_indexed(tmp_path):
    write_kv_file(tmp_path / f"x{SUFFIX}", [5, 6, 7], kv([5, 6, 7]),
                  {"model": "m", "kv_format": "f", "reuse_points": None, "kv_nbytes": 96})
    disk = make_disk(tmp_path)
    key, length = disk.best_match([5, 6, 7, 8])
    assert length == 3 and disk.take(key).nbytes == 96


def test_at_a_stop_evictions_wait_for_the_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(conversation_disk, "PENDING_MAX_BYTES", 150)
    real = conversation_disk.write_kv_file

    def slow_write(*args, **kw):
        time.sleep(0.1)
        return real(*args, **kw)

    monkeypatch.setattr(conversation_disk, "write_kv_file", slow_write)
    cache = cache_over(tmp_path, 100)
    cache.evictions_wait = True
    for tokens in ([1], [2], [3], [4]):
        cache.park(tokens, kv(tokens), 100)  # each evicts the one before, the writer behind
    cache.save_to_disk()
    assert cache.disk.num_written == 4 and len(files(tmp_path)) == 4
