"""Parked conversations on disk (`--conversation-cache-dir`): the tier below the host RAM's
conversation cache. A conversation the RAM cache evicts is written to a file (kv_file.py) by a
writer thread; at a graceful stop every slot's and every parked conversation is written too.
A server started on the same model and KV format finds the files again, so an agent's next
turn after a restart reads only its new tokens.

Files hold the prefix rule of the RAM cache (conversations.py): a file whose tokens are a
prefix of a newer entry's is deleted, an entry another file already covers is not written.
Least recently used files go first when the folder's budget is full. Files of other models or
KV formats in the folder are left alone. Files leave the index at once and are deleted by the
writer thread, in order with its writes: unlinking a file of gigabytes can take as long as the
writer's fsync beside it (0.25-0.3 s for a 0.4 GiB file on the H200 machine's disk, on the
engine thread while every slot waited, until session 57). A stop before the writer deleted a
file leaves it; the next start indexes it like any other (it is a valid conversation).
`clear` (Engine.reset) deletes at once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from strata.engine.conversations import ParkedConversation
from strata.engine.kv_file import SUFFIX, KVFileError, read_kv_file, read_kv_header, \
    write_kv_file
from strata.engine.slots import common_prefix_len
from strata.errors import ConfigError
from strata.sizes import size_text

log = logging.getLogger("strata.engine")

# The files may take at most this share of the disk space free (plus their own) at start.
DISK_SHARE = 0.5
# Evicted conversations waiting for the writer may hold this much RAM beyond the RAM cache's
# budget; past it a conversation evicted while serving is dropped, not queued (a stop waits).
PENDING_MAX_BYTES = 4 * 2**30
# A `.partial` file this old is a write that a killed server left behind.
STALE_PARTIAL_S = 3600.0


def model_fingerprint(gguf) -> str:
    """What ties a KV to the weights that computed it: the model's spec, every tensor's name,
    type, shape and offset, its first and last 4 KiB, and the file's size (a model with other
    weights in the same shape is told apart; cheap, no full read)."""
    h = hashlib.sha256(repr(gguf.spec).encode())
    for name in sorted(gguf.tensor_names):
        t = gguf.tensor(name)
        h.update(f"{name}|{t.qtype}|{tuple(t.shape)}|{t.offset_bytes};".encode())
        flat = t.raw.reshape(-1)
        h.update(flat[:4096].tobytes())
        h.update(flat[-4096:].tobytes())
    h.update(f"file_bytes={Path(gguf.path).stat().st_size}".encode())
    return h.hexdigest()


def kv_format(kv) -> str:
    """The shape of what a slot's KV exports and imports: files of another format (another
    backend, cell type or layer split) are not restored into it."""
    cells = np.dtype(getattr(kv, "host_dtype", kv.dtype))
    return (f"{type(kv).__name__};layers={kv.num_layers};kv_heads={kv.spec.n_kv_heads};"
            f"head_dim={kv.spec.head_dim};cells={cells.descr};"
            f"parts={len(getattr(kv, 'parts', ()))};state={kv.state is not None}")


@dataclass(frozen=True)
class DiskSettings:
    """Where the conversation files go and how much they may take, and the model's
    fingerprint (the engine's part; the scheduler adds the KV format)."""

    folder: Path
    budget_mib: float
    model: str


def resolve_disk_budget(folder: Path, asked_mib: float, own_bytes: int = 0) -> int:
    """`asked_mib` in bytes, at most DISK_SHARE of the folder's free space plus `own_bytes`
    (the files of ours it holds already)."""
    free = shutil.disk_usage(folder).free
    bound = int(DISK_SHARE * (free + own_bytes))
    budget = int(asked_mib * 2**20)
    if budget > bound:
        log.info("conversation files: up to %s in %s (asked %s; %.0f%% of the disk space "
                 "free)", size_text(bound), folder, size_text(budget), 100 * DISK_SHARE)
    return min(budget, bound)


@dataclass(frozen=True)
class _Delete:
    """A file for the writer thread to delete (its entry has left the index)."""
    path: Path


@dataclass
class DiskEntry:
    key: int
    tokens: tuple[int, ...]
    reuse_points: tuple[int, ...] | None
    path: Path
    nbytes: int  # the file's bytes (the KV's while it is being written)
    kv_nbytes: int  # the KV's bytes in RAM once read
    pending: ParkedConversation | None = None  # in RAM until the writer has written it
    is_dropped: bool = False
    # the most of its tokens a slot kept when it was restored, at least half of them (its
    # own next turn, not a system prompt lent to another): a file that continues them
    # replaces this one (its tail is a reply the next turn did not keep)
    num_used: int = 0

    def as_parked(self) -> ParkedConversation:
        """The entry's tokens, for the prefix rule (no KV)."""
        return ParkedConversation(self.key, self.tokens, None, self.kv_nbytes,
                                  self.reuse_points)


class ConversationDisk:
    """Conversation files in `folder` of one model and KV format, least recently used first,
    within `budget_bytes`. The engine thread offers, matches and takes; a writer thread writes.
    Every change of the index happens under one lock."""

    def __init__(self, folder: Path, budget_mib: float, model: str, kv_format: str,
                 new_key: Callable[[], int]):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"--conversation-cache-dir {str(self.folder)!r} cannot be "
                              f"written ({e.strerror or e}); give a folder this user may "
                              "write") from e
        self._meta = {"model": model, "kv_format": kv_format}
        self._new_key = new_key
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, DiskEntry] = OrderedDict()  # LRU first
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._room = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._loads: dict[int, Future] = {}  # reads started ahead of take(), by key
        self._loader: ThreadPoolExecutor | None = None
        self.num_written = self.num_read = self.num_evicted = self.num_failed = 0
        self.bytes_written = self.bytes_read = 0
        self._scan()
        self.budget_bytes = resolve_disk_budget(self.folder, budget_mib, self.used_bytes)
        with self._lock:
            self._evict_over_budget()
        if self._entries:
            log.info("conversation files: %d conversations (%s, %d tokens) of this model "
                     "found in %s", len(self._entries), size_text(self.used_bytes),
                     sum(len(e.tokens) for e in self._entries.values()), self.folder)

    # ---- the index --------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def _scan(self) -> None:
        """Index the files of this model and KV format, oldest use first."""
        found = []
        for path in self.folder.glob(f"*{SUFFIX}.partial"):
            try:
                if time.time() - path.stat().st_mtime > STALE_PARTIAL_S:
                    path.unlink()
            except OSError:
                pass
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                header = read_kv_header(path)
                if any(header.get(k) != v for k, v in self._meta.items()):
                    continue  # another model's or KV format's
                tokens = _read_tokens(path, header)
                found.append((path.stat().st_mtime, path, header, tokens))
            except (KVFileError, OSError) as e:
                log.warning("conversation files: skipping %s: %s", path, e)
        for _, path, header, tokens in sorted(found, key=lambda f: f[0]):
            points = header.get("reuse_points")
            entry = DiskEntry(self._new_key(), tokens,
                              None if points is None else tuple(points), path,
                              path.stat().st_size, int(header.get("kv_nbytes", 0)))
            self._entries[entry.key] = entry

    def best_match(self, prompt_tokens: Sequence[int]) -> tuple[int | None, int]:
        """(key, length) of the file sharing the longest prefix with the prompt, as
        ConversationCache.best_match; ties to the most recently used."""
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        best_key, best_len = None, 0
        with self._lock:
            entries = list(reversed(self._entries.values()))
        for entry in entries:
            parked = entry.as_parked()
            length = parked.usable(common_prefix_len(entry.tokens, prompt), len(prompt))
            if length > best_len:
                best_key, best_len = entry.key, length
        return best_key, best_len

    # ---- writing ----------------------------------------------------------------------
    def offer(self, parked: ParkedConversation, wait: bool = False) -> bool:
        """Queue `parked` for a file; False when it is not kept (a file covers it already, it
        is over the budget, or the writer is behind and `wait` is off)."""
        with self._lock:
            for entry in reversed(self._entries.values()):
                covers = entry.as_parked().covers(parked.tokens, parked.reuse_points)
                if covers and not entry.is_dropped:
                    self._touch(entry)
                    return False
            if parked.nbytes > self.budget_bytes:
                log.info("conversation files: a conversation of %d tokens (%s) is over the "
                         "folder's budget of %s; not written", parked.num_tokens,
                         size_text(parked.nbytes), size_text(self.budget_bytes))
                return False
            while self._pending_bytes and self._pending_bytes + parked.nbytes \
                    > PENDING_MAX_BYTES:
                if not wait:
                    log.info("conversation files: the writer is %s behind; a conversation "
                             "of %d tokens evicted from RAM is dropped",
                             size_text(self._pending_bytes), parked.num_tokens)
                    return False
                self._room.wait()
            name = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:12]}{SUFFIX}"
            entry = DiskEntry(self._new_key(), parked.tokens, parked.reuse_points,
                              self.folder / name, parked.nbytes, parked.nbytes, parked)
            for old in [e for e in self._entries.values()
                        if parked.covers(e.tokens, e.reuse_points) or _continues(parked, e)]:
                self._drop(old)  # the new file extends it, or what a slot kept of it
            self._entries[entry.key] = entry
            self._pending_bytes += parked.nbytes
            self._evict_over_budget(keep=entry.key)
            self._start_writer_locked()
        self._queue.put(entry)
        return True

    def _start_writer_locked(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop,
                                            name="strata-conversation-files", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            if isinstance(entry, _Delete):
                try:
                    entry.path.unlink(missing_ok=True)
                except OSError as e:
                    log.warning("conversation files: cannot delete %s (%s)", entry.path,
                                e.strerror or e)
                self._queue.task_done()
                continue
            parked, size, error = entry.pending, None, None
            try:
                if not entry.is_dropped:
                    started = time.perf_counter()
                    size = write_kv_file(entry.path, entry.tokens, parked.kv_arrays,
                                         {**self._meta, "reuse_points": entry.reuse_points,
                                          "kv_nbytes": parked.nbytes})
                    log.info("conversation files: wrote %d tokens (%s) to %s in %.2f s",
                             len(entry.tokens), size_text(size), entry.path.name,
                             time.perf_counter() - started)
            except Exception as e:  # noqa: BLE001 - a full or failing disk loses the file only
                error = e
            finally:
                with self._lock:
                    entry.pending = None
                    self._pending_bytes -= parked.nbytes
                    if size is not None:
                        entry.nbytes = size
                        self.num_written += 1
                        self.bytes_written += size
                    if error is not None:
                        self.num_failed += 1
                        log.warning("conversation files: writing %s failed (%s); the "
                                    "conversation is not kept on disk", entry.path, error)
                    if entry.is_dropped or error is not None:
                        self._drop(entry)  # (dropped while it was written: the file goes)
                    else:
                        self._evict_over_budget(keep=entry.key)  # its size is known now
                    self._room.notify_all()
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued file is written (and every dropped one deleted)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer (and the reader)."""
        if self._loader is not None:
            self._loads.clear()
            self._loader.shutdown(wait=True, cancel_futures=True)
            self._loader = None
        if self._writer is not None:
            self._queue.join()
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    # ---- reading ----------------------------------------------------------------------
    def take(self, key: int, num_used: int | None = None) -> ParkedConversation | None:
        """The conversation of `key` with its KV, read from its file (or from RAM while it
        is still queued), for a slot that keeps `num_used` of its tokens (None: all). The
        file stays until a file that continues those tokens is written (a crash meanwhile
        loses nothing). None when the file cannot be read any more (logged; dropped), or
        left the index meanwhile (the writer thread deleted it to make room; logged)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                load = self._loads.pop(key, None)
                if load is not None:
                    load.cancel()
                log.info("conversation files: entry %d was deleted to make room before it "
                         "was restored; the request is placed again without it", key)
                return None
            self._touch(entry)
            used = min(len(entry.tokens) if num_used is None else int(num_used),
                       len(entry.tokens))
            if 2 * used >= len(entry.tokens):
                # the conversation's own next turn (it keeps at least as much as it drops,
                # the slot picker's rule): a file that continues it replaces this one. Not
                # a prefix lent to another conversation: this one's own turn comes back.
                entry.num_used = max(entry.num_used, used)
            pending = entry.pending
        if pending is not None:
            return ParkedConversation(key, pending.tokens, pending.kv_arrays, pending.nbytes,
                                      pending.reuse_points)
        load = self._loads.pop(key, None)
        try:
            tokens, value = load.result() if load is not None else self._read(entry)
        except KVFileError as e:
            log.warning("conversation files: cannot restore a parked conversation: %s; dropped", e)
            with self._lock:
                self._drop(entry)
            return None
        self.num_read += 1
        self.bytes_read += entry.nbytes
        return ParkedConversation(key, tokens, value, entry.kv_nbytes or entry.nbytes,
                                  entry.reuse_points)

    def _read(self, entry: DiskEntry):
        """(tokens, KV value) of `entry`'s file, checked against the index."""
        started = time.perf_counter()
        header = read_kv_header(entry.path)
        if any(header.get(k) != v for k, v in self._meta.items()):
            raise KVFileError(f"{entry.path} now holds another model's KV")
        tokens, value = read_kv_file(entry.path, header)
        if tokens != entry.tokens:
            raise KVFileError(f"{entry.path} now holds other tokens")
        seconds = time.perf_counter() - started
        log.info("conversation files: read %d tokens (%s) from %s in %.2f s (%.2f GB/s)",
                 len(tokens), size_text(entry.nbytes), entry.path.name, seconds,
                 entry.nbytes / max(seconds, 1e-9) / 1e9)
        return tokens, value

    # ---- reading ahead: a request waits for its file while the other slots run ---------
    def prefetch(self, key: int) -> bool:
        """Start reading `key`'s file on a thread; True once `take(key)` will not wait for the
        disk (the KV is read, still in RAM, or the read failed)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pending is not None:
                return True
        load = self._loads.get(key)
        if load is None:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="strata-conversation-read")
            load = self._loads[key] = self._loader.submit(self._read, entry)
        return load.done()

    def is_loading(self, key: int) -> bool:
        return key in self._loads

    def keep_loads(self, keys) -> None:
        """Forget the reads started for other keys (their requests went elsewhere)."""
        for key in [k for k in self._loads if k not in keys]:
            self._loads.pop(key).cancel()

    def wait_loads(self) -> bool:
        """Wait for the reads started; False when none was."""
        loads = list(self._loads.values())
        for load in loads:
            load.exception()  # waits; take() reports a failure
        return bool(loads)

    def discard(self, key: int) -> None:
        """Drop `key`'s file (its KV does not fit the slots: damaged or edited)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._drop(entry)

    def clear(self) -> None:
        """Delete every file of this model and format (Engine.reset), here and now."""
        with self._lock:
            for entry in list(self._entries.values()):
                self._drop(entry, now=True)

    # ---- under the lock ---------------------------------------------------------------
    def _touch(self, entry: DiskEntry) -> None:
        self._entries.move_to_end(entry.key)
        if entry.pending is None:
            try:
                os.utime(entry.path)  # the order survives a restart
            except OSError:
                pass

    def _drop(self, entry: DiskEntry, now: bool = False) -> None:
        """Out of the index now; its file deleted by the writer, or here with `now` (one still
        being written: once written, when the writer drops it)."""
        self._entries.pop(entry.key, None)
        entry.is_dropped = True
        if entry.pending is not None:
            return
        if now:
            entry.path.unlink(missing_ok=True)
        else:
            self._start_writer_locked()
            self._queue.put(_Delete(entry.path))

    def _evict_over_budget(self, keep: int | None = None) -> None:
        while sum(e.nbytes for e in self._entries.values()) > self.budget_bytes:
            victim = next((e for e in self._entries.values() if e.key != keep), None)
            if victim is None:
                return
            log.info("conversation files: %s (%d tokens, %s) deleted to make room",
                     victim.path.name, len(victim.tokens), size_text(victim.nbytes))
            self._drop(victim)
            self.num_evicted += 1


def _continues(new: ParkedConversation, old: DiskEntry) -> bool:
    """Whether `new` restores all that a slot kept of `old` when `old` was last restored."""
    if old.num_used <= 0:
        return False
    shared = common_prefix_len(new.tokens, old.tokens)
    return new.usable(shared, len(old.tokens) + 1) >= old.num_used


def _read_tokens(path: Path, header: dict) -> tuple[int, ...]:
    """The tokens array alone (the first array of a file)."""
    spec = header["arrays"][0]
    with open(path, "rb") as f:
        f.seek(header["data_start"] + int(spec["offset"]))
        raw = f.read(int(spec["nbytes"]))
    if len(raw) != int(spec["nbytes"]):
        raise KVFileError(f"{path}: truncated in its tokens")
    return tuple(int(t) for t in np.frombuffer(raw, dtype=np.int32))
