"""The scheduler: N slots (one KV each), a FIFO queue of requests, and `step()`, which runs one
window holding every decoding slot's next token and, as the read-interleave plan says, one
prompt chunk. Placement reuses the longest cached prefix; displaced KVs are parked in host RAM
(what a slot's cells hold, placed, installed, parked or saved: slot_cells.py's SlotCells).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import partial

import numpy as np

from strata.backends.window import Window
from strata.engine.conversation_disk import ConversationDisk, DiskSettings, kv_format
from strata.engine.conversations import ConversationCache
from strata.engine.drafts import DraftSettings, NgramDrafter
from strata.engine.generate import GenerationEvent, GenerationStats, TokenDecoder
from strata.engine.interleave import (BadReadPlan, HalfRateInterleave, PendingRead,
                                      WindowTiming, check_read_plan)
from strata.engine.kv import KVCache
from strata.engine.logprobs import token_logprob
from strata.engine.sampling import SamplingParams
from strata.engine.slot_cells import SlotCells
from strata.engine.slots import SlotTable
from strata.errors import RequestError
from strata.experts.kv_grow import KVLender
from strata.hookspecs import WindowStats

log = logging.getLogger("strata.engine")

STATE_QUEUED, STATE_READING, STATE_DECODING, STATE_DONE = "queued", "reading", "decoding", "done"

# Prompt rows per window for a request that asks for its prompt's logprobs: each row's logits
# come back ([rows, vocab] floats: 78 MB at 128 rows of a 151,936-token vocabulary)
PROMPT_LOGPROBS_CHUNK = 128


class RequestHandle:
    """One submitted request as its submitter sees it: events to take (GenerationEvents; the
    last has the finish reason), an error if it failed, and `cancel()` (any thread)."""

    def __init__(self, request_id: int, prompt_tokens: list[int], params: SamplingParams,
                 name: str | None = None):
        self.request_id = request_id
        # what log lines call it: the submitter's id (the server's), so that its lines and the
        # engine's name one request alike
        self.name = name or str(request_id)
        self.prompt_tokens = prompt_tokens
        self.params = params
        self.stats = GenerationStats(num_prompt_tokens=len(prompt_tokens))
        self.state = STATE_QUEUED
        self.slot_index: int | None = None
        self.file_key: int | None = None  # the conversation file it waits for (scheduler)
        self.error: BaseException | None = None
        self._events: deque[GenerationEvent] = deque()
        self._is_cancel_asked = threading.Event()

    def cancel(self) -> None:
        """Ask to stop; the scheduler frees the slot at its next step (the KV stays cached)."""
        self._is_cancel_asked.set()

    @property
    def is_cancel_asked(self) -> bool:
        return self._is_cancel_asked.is_set()

    @property
    def is_finished(self) -> bool:
        return self.state == STATE_DONE

    def pop_events(self) -> list[GenerationEvent]:
        """The events produced since the last call, oldest first."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out


@dataclass
class _Active:
    """A request placed in a slot: reading its prompt, then decoding."""

    handle: RequestHandle
    slot_index: int
    decoder: TokenDecoder
    num_read_tokens: int  # prompt tokens in the slot's KV (reused ones included)
    started_at: float
    next_token: int | None = None  # decoding: the token the next window reads back
    drafter: NgramDrafter | None = None  # --spec-type: guesses of the tokens after next_token
    is_started: bool = False  # reading: its first chunk was planned
    arrival: int = 0  # order of placement: reads go first come first served
    # params.prompt_logprobs: those of the prompt tokens read so far (after the first)
    prompt_logprobs: list | None = None


@dataclass(frozen=True)
class SlotState:
    """One slot at one moment, for monitoring (GET /slots). The request fields are None / 0
    while the slot is idle."""

    index: int
    num_tokens: int  # tokens the slot's KV cells hold (an idle slot keeps its last ones)
    request_id: int | None = None  # the request in the slot (None: idle)
    params: SamplingParams | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused (a kept, copied or restored prefix)
    num_read_tokens: int = 0  # prompt tokens in the KV so far, the reused ones included
    num_generated_tokens: int = 0

    @property
    def is_busy(self) -> bool:
        return self.request_id is not None


@dataclass
class _Flight:
    """A pipelined decode window in flight: its slot group (lane), the forwarder's ticket, the
    window with its runs and kinds, when it was started."""

    group: int
    ticket: object
    window: Window
    runs: list
    kinds: list
    started_at: float


class Scheduler(SlotCells):
    """Owns the slots of one model. Not thread-safe: one thread calls submit/step; only
    `RequestHandle.cancel` may come from another thread.

    Pipelined decode (a layer split with --batch-groups N > 1): slot i belongs to group i % N;
    while every running request decodes, each group's window is started as soon as its last
    one finished, so group A's rows run on stage 2 while group B's run on stage 1, and each
    step finishes the oldest window in flight. A prompt to read, a request to place or a
    cancel drains the windows in flight first; then windows hold every slot again."""

    def __init__(self, model, tokenizer, n_ctx: int, num_slots: int, choosers,
                 conversation_cache_mib: float = 2048, expert_tier=None, kv_dtype=None,
                 drafts: DraftSettings | None = None, ctx_checkpoints: int | None = None,
                 conversation_files: DiskSettings | None = None):
        self.model = model
        # --spec-type: decode runs carry draft tokens (strata.engine.drafts)
        self.drafts = drafts if drafts is not None else DraftSettings()
        hybrid = bool(model.spec.recurrent_layers)
        if hybrid and self.drafts.is_on:
            # a rejected draft would have to take the recurrent state back one row
            log.warning("drafts off (--spec-type %s asked): %s's recurrent layers cannot take "
                        "back the rows of rejected drafts", self.drafts.spec_type, model.spec.arch)
            self.drafts = DraftSettings()
        # Runs each forward pass through the expert cache (strata.engine.expert_tier); None
        # reads the experts straight from the model's mapping.
        self.expert_tier = expert_tier
        self.tokenizer = tokenizer
        self.n_ctx = int(n_ctx)
        self.choosers = choosers
        self.table = SlotTable(num_slots)
        # KV cells of `kv_dtype` (None: the model's default type); with --kv-grow each slot
        # starts with a base and borrows expert-cache slots for more (experts/kv_grow.py)
        kv_args = {} if kv_dtype is None else {"dtype": kv_dtype}
        if hybrid and ctx_checkpoints is not None:
            kv_args["max_checkpoints"] = ctx_checkpoints
        self.kv_lender = (KVLender.build(expert_tier, choosers.kv_grow, model, self.n_ctx,
                                         kv_dtype) if expert_tier is not None else None)
        num_cells = self.kv_lender.base_cells if self.kv_lender is not None else self.n_ctx
        self.kvs: list[KVCache] = [model.new_kv(num_cells, **kv_args) for _ in range(num_slots)]
        # --conversation-cache-dir: conversations evicted from RAM (and all, at a graceful
        # stop) go to files a later server of this model and KV format restores from
        disk = None
        if conversation_files is not None:
            files = conversation_files
            disk = partial(ConversationDisk, files.folder, files.budget_mib, files.model,
                           kv_format(self.kvs[0]))
        self.conversations = ConversationCache(conversation_cache_mib, disk=disk)
        self._queue: deque[RequestHandle] = deque()
        self._active: dict[int, _Active] = {}  # by slot index
        self._ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._window_index = 0
        self._decode_windows_left = 0  # decode-only windows still due before the next chunk
        self._decode_window_s: float | None = None
        self._num_bad_read_plans = 0  # faulty answers of a read-interleave plugin
        self._prompt_s_per_token: float | None = None
        self.last_slot_index = 0
        # pipelined decode: the model's slot groups and what starts / finishes their windows
        # (the split's tier, else the split model itself)
        self._forwarder = expert_tier if expert_tier is not None else model
        self._num_groups = int(getattr(model, "batch_groups", 1) or 1)
        if not callable(getattr(self._forwarder, "start_window", None)):
            self._num_groups = 1
        self._in_flight: deque[_Flight] = deque()
        self._next_group = 0
        if self._num_groups > 1 and not getattr(self._forwarder, "pipelines", True):
            log.info("batch groups: %d, but decode windows run one at a time: a stage's tier "
                     "keeps one window at a time (free admission, or a CPU pool: --pcie-frac "
                     "< 1)", self._num_groups)
            self._num_groups = 1

    # ---- what the engine and the server see -----------------------------------------------
    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_reading(self) -> int:
        return sum(1 for a in self._active.values() if a.handle.state == STATE_READING)

    @property
    def num_running(self) -> int:
        """Requests in a slot (reading or decoding)."""
        return len(self._active)

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._active)

    def slot_states(self) -> list[SlotState]:
        """Every slot's state, safe to call from another thread while this one steps: it reads
        copies of the containers (each copied in one step under the GIL), never iterates the
        live ones. Figures of a slot may lag each other by the window that is running."""
        active = dict(self._active)
        states = []
        for index in range(self.table.num_slots):
            num_tokens = len(self.table.tokens(index))
            run = active.get(index)
            if run is None:
                states.append(SlotState(index, num_tokens))
                continue
            handle = run.handle
            states.append(SlotState(index, num_tokens, handle.request_id, handle.params,
                                    len(handle.prompt_tokens), handle.stats.num_cached_tokens,
                                    run.num_read_tokens, handle.stats.num_generated_tokens))
        return states

    def check_prompt(self, prompt_tokens) -> list[int]:
        """The prompt as a list of ints; RequestError when it cannot be run."""
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token")
        if len(prompt) > self.n_ctx:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or raise the context size (n_ctx / --ctx-size)")
        vocab = min(self.tokenizer.vocab_size, self.model.spec.vocab)
        ids = np.asarray(prompt, dtype=np.int64)  # (one pass in numpy: prompts run long)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            raise RequestError(f"prompt token id {prompt[bad[0]]} is outside the vocabulary "
                               f"[0, {vocab})")
        return prompt

    def check_request(self, prompt_tokens, params: SamplingParams) -> list[int]:
        """check_prompt, and the token ids the parameters name (logit_bias, a grammar's token
        items) in the vocabulary."""
        prompt = self.check_prompt(prompt_tokens)
        vocab = min(self.tokenizer.vocab_size, self.model.spec.vocab)
        outside = [t for t in params.logit_bias if t >= vocab]
        if outside:
            raise RequestError(f"logit_bias names the token id {outside[0]}, outside the "
                               f"vocabulary [0, {vocab})")
        if params.grammar is not None:  # its token items in this vocabulary (GrammarError)
            from strata.engine.gbnf import compiled_grammar

            compiled_grammar(params.grammar).bound(self.tokenizer)
        return prompt

    def submit(self, prompt_tokens, params: SamplingParams,
               name: str | None = None) -> RequestHandle:
        """Place a request in an idle slot, or queue it (FIFO) until a slot frees up; `step()`
        runs it. `name`: what the log lines call it (default: its number)."""
        handle = RequestHandle(next(self._ids), self.check_request(prompt_tokens, params),
                               params, name)
        self._queue.append(handle)
        self._place_queued()
        if handle.state == STATE_QUEUED and not self.table.has_idle():
            log.info("request %s waits: all %d slots are busy (%d queued)", handle.name,
                     self.table.num_slots, len(self._queue))
        return handle

    def _place_queued(self) -> None:
        """Give idle slots to queued requests, first come first served. A request whose
        longest prefix is in a conversation file stays queued while the file is read on a
        thread; the requests behind it go on being placed and run."""
        waiting = []
        while self._queue and self.table.has_idle():
            handle = self._queue.popleft()
            if self._waits_for_file(handle):
                waiting.append(handle)
                continue
            try:
                self._place(handle)
            except RequestError as exc:  # the request's own (a prompt KV grow cannot hold)
                log.info("request %s: not placed: %s", handle.name, exc)
                self._end(handle, exc)
            except Exception as exc:  # noqa: BLE001 - e.g. a faulty slot-picker plugin
                log.exception("request %s: not placed (%s: %s); it ends with that error",
                              handle.name, type(exc).__name__, exc)
                self._end(handle, exc)
        self._queue.extendleft(reversed(waiting))
        disk = self.conversations.disk
        if disk is not None:
            disk.keep_loads({handle.file_key for handle in self._queue})

    def _waits_for_file(self, handle: RequestHandle) -> bool:
        """Whether `handle`'s best parked prefix is a conversation file still being read (the
        read is started here)."""
        disk = self.conversations.disk
        handle.file_key = None
        if disk is None:
            return False
        key, length = self.conversations.best_match(handle.prompt_tokens)
        if key is None or key not in disk:
            return False
        handle.file_key = key
        if not disk.is_loading(key) and not disk.prefetch(key):
            log.info("request %s waits for its conversation file (%d of its %d prompt tokens "
                     "there); the other slots run meanwhile", handle.name, length,
                     len(handle.prompt_tokens))
        return not disk.prefetch(key)

    def drop_cancelled(self) -> None:
        """End the requests whose cancel was asked: queued ones leave the queue, placed ones
        free their slot (their KV cells stay for reuse)."""
        if self._in_flight and any(a.handle.is_cancel_asked for a in self._active.values()):
            self.drain()  # a cancelled slot's window may be in flight
        for handle in [h for h in self._queue if h.is_cancel_asked]:
            self._queue.remove(handle)
            self._end(handle, None)
        for active in [a for a in self._active.values() if a.handle.is_cancel_asked]:
            # the server's line says why (its own stop or the client leaving)
            log.debug("request %s: cancelled in slot %d after %d generated tokens",
                      active.handle.name, active.slot_index,
                      active.handle.stats.num_generated_tokens)
            self._release(active, None)

    def reset(self) -> None:
        """Forget every idle slot's KV and every parked conversation."""
        for view in self.table.views():
            if not view.is_busy:
                self.table.clear(view.index)
                self.kvs[view.index].clear()
        self.conversations.clear()

    def save_conversations(self) -> None:
        """A graceful stop with conversation files: park every slot's KV, then write every
        parked conversation to its file and wait for the writes."""
        if self.conversations.disk is None:
            return
        self.drain()
        self.conversations.evictions_wait = True  # nothing is dropped for a writer behind
        for view in self.table.views():
            if self.table.tokens(view.index):
                self._park(view.index)
        disk = self.conversations.disk
        log.info("writing the parked conversations to %s (%d in RAM, %.2f GiB)", disk.folder,
                 self.conversations.num_entries, self.conversations.used_bytes / 2**30)
        self.conversations.save_to_disk()
        log.info("conversation files: %d in %s (%.2f GiB)", disk.num_entries, disk.folder,
                 disk.used_bytes / 2**30)

    def step(self) -> bool:
        """Place queued requests, then run one window (pipelined: start the idle groups' decode
        windows and finish the oldest in flight). False when there was nothing to run."""
        if self._pipelines_now():
            self._pipelined_step()
            return True
        if self._in_flight:
            log.debug("pipelined decode drained: a prompt to read, a request to place or a "
                      "cancel (%d windows in flight)", len(self._in_flight))
        self.drain()
        self.drop_cancelled()
        self._place_queued()
        if not self._active:
            # nothing runs: wait for the conversation files queued requests need
            disk = self.conversations.disk
            if disk is not None and disk.wait_loads():
                self._place_queued()
            if not self._active:
                return False
        runs, modes, kinds = self._plan_window()
        window = Window.build(runs, logits=modes)
        t0 = time.perf_counter()
        try:
            # [N, V]; a CUDA model leaves them on the device for the samplers
            if self.expert_tier is None:
                logits = getattr(self.model, "forward_window_lazy", self.model.forward_window)(
                    window)
            else:
                logits = self.expert_tier.forward_window(window, lazy=True)
        except BaseException as exc:
            self._fail_window(kinds, exc)
            return True
        self._after_window(window, runs, kinds, logits, time.perf_counter() - t0)
        return True

    # ---- pipelined decode ---------------------------------------------------------------
    def _decoding_groups(self) -> dict[int, list[_Active]]:
        """Slot group -> its decoding requests (slot order); groups without any left out."""
        groups: dict[int, list[_Active]] = {}
        for active in sorted(self._active.values(), key=lambda a: a.slot_index):
            if active.handle.state == STATE_DECODING:
                groups.setdefault(active.slot_index % self._num_groups, []).append(active)
        return groups

    def _pipelines_now(self) -> bool:
        """Pipelined decode this step: groups > 1, the forwarder able to keep several windows
        in flight now (SplitTier.pipelines), every running request decoding and none to
        cancel, no queued request that a free slot could take, and at least two groups with
        decoding slots (else the windows in flight drain and whole windows follow)."""
        if self._num_groups < 2 or not getattr(self._forwarder, "pipelines", True):
            return False
        if (self._queue and self.table.has_idle()) or any(
                h.is_cancel_asked for h in self._queue):
            return False
        if any(a.handle.state != STATE_DECODING or a.handle.is_cancel_asked
               for a in self._active.values()):
            return False
        return len(self._decoding_groups()) >= 2

    def _pipelined_step(self) -> None:
        groups = self._decoding_groups()
        busy = {flight.group for flight in self._in_flight}
        for g in sorted(groups, key=lambda g: (g - self._next_group) % self._num_groups):
            if g not in busy:
                self._start_group(g, groups[g])
        self._next_group = (self._next_group + 1) % self._num_groups
        if self._in_flight:
            self._finish_flight(self._in_flight.popleft())

    def _start_group(self, group: int, actives: list[_Active]) -> None:
        runs, modes = zip(*(self._decode_run(a) for a in actives))
        kinds = [(a.slot_index, "decode") for a in actives]
        window = Window.build(runs, logits=modes)
        t0 = time.perf_counter()
        try:
            ticket = self._forwarder.start_window(window, group, "lazy")
        except BaseException as exc:
            self._fail_window(kinds, exc)
            return
        self._in_flight.append(_Flight(group, ticket, window, runs, kinds, t0))

    def _finish_flight(self, flight: _Flight) -> None:
        try:
            logits = self._forwarder.finish_window(flight.ticket)
        except BaseException as exc:
            self._fail_window(flight.kinds, exc)
            return
        self._after_window(flight.window, flight.runs, flight.kinds, logits,
                           time.perf_counter() - flight.started_at)

    def drain(self) -> None:
        """Finish every pipelined window in flight, oldest first."""
        while self._in_flight:
            self._finish_flight(self._in_flight.popleft())

    def _fail_window(self, kinds, exc: BaseException) -> None:
        """A failed pass commits nothing: fail every request in it rather than retry."""
        for slot_index, _ in kinds:
            if slot_index in self._active:
                self._release(self._active[slot_index], exc)
        if not isinstance(exc, Exception):
            raise exc

    def _after_window(self, window: Window, runs, kinds, logits, seconds: float) -> None:
        """A finished window: timings, each run's tokens and events, the window's stats."""
        num_decode_rows = sum(len(runs[run][1]) for run, (_, kind) in enumerate(kinds)
                              if kind == "decode")  # a decode token and its drafts
        num_prompt_rows = window.num_rows - num_decode_rows
        self._measure(num_decode_rows, num_prompt_rows, seconds)
        for run, (slot_index, kind) in enumerate(kinds):
            active = self._active[slot_index]
            try:
                if kind == "prompt":
                    self._after_chunk(active, runs[run][1], window.logits_of(logits, run))
                else:
                    self._after_decode(active, runs[run][1], window.logits_of(logits, run),
                                       seconds)
            except Exception as exc:  # noqa: BLE001 - one request's failure ends only it
                self._release(active, exc)
        self._window_index += 1
        self._place_queued()  # slots freed by this window go to waiting requests now
        if num_prompt_rows and num_decode_rows:
            self._replan_after_chunk()
        tier = self.expert_tier.last_window if self.expert_tier is not None else None
        self.choosers.window_done(WindowStats(
            self._window_index, num_decode_rows, num_prompt_rows, seconds,
            *((tier.num_hits, tier.num_misses, tier.num_swaps, tier.wait_s) if tier else ())))

    # ---- placement (the slot cells' part: slot_cells.py) ----------------------------------
    def _place(self, handle: RequestHandle) -> None:
        """Put `handle` in a slot. Whatever fails on the way (an exception out of here ends
        the request) leaves no slot busy without a request, no cells the slot's tokens do not
        describe, and the parked conversation it was to restore parked still, where the slot
        had not changed yet."""
        prompt = handle.prompt_tokens
        started_at = time.perf_counter()
        wants_logprobs = handle.params.prompt_logprobs is not None
        # the request's own parts first: nothing to undo when one of them fails
        decoder = TokenDecoder(self.tokenizer, handle.params, prompt, handle.stats)
        drafter = self.drafts.drafter(prompt)
        placement, restored = self._placement(prompt, reuses=not wants_logprobs)
        index, kv = placement.slot_index, self.kvs[placement.slot_index]
        is_changing = False
        try:
            num_slot_tokens, note = kv.num_tokens, ""
            if placement.is_parking_needed:
                self._park(index)
            is_changing = True
            if restored is not None:  # only the cells the request keeps are copied
                n = self._install(index, restored, placement.num_reused_tokens)
                how = (f"restored a parked conversation of {n} tokens" if n == restored.num_tokens
                       else f"restored the first {n} of a parked conversation's "
                       f"{restored.num_tokens} tokens")
            elif placement.source_slot is not None:
                source, n = self.kvs[placement.source_slot], placement.num_reused_tokens
                kv.copy_prefix(source, n)
                self.table.replace_tokens(index, self.table.tokens(placement.source_slot)[:n])
                how = (f"copied the first {n} cells of "
                       f"{'busy' if placement.source_slot in self._active else 'idle'} slot "
                       f"{placement.source_slot}'s KV")
            elif placement.num_reused_tokens > 0:
                how = "kept its KV"
                num_lost = num_slot_tokens - placement.num_reused_tokens
                if num_lost > 0 and not placement.is_parking_needed:
                    note = (f"; the {num_lost} tokens after them dropped, not parked (a park "
                            f"copies all {num_slot_tokens}: worth it from "
                            f"{kv.min_copy_gain:.0%} of them)")
            elif num_slot_tokens == 0:
                how = "rebuilt"
            else:  # the picker's choice among slots none of which shares a prefix (a park,
                # when there was one, has its own line above)
                how = f"rebuilt: no cached prefix; its {num_slot_tokens} earlier tokens replaced"
            self.table.acquire(index, placement.num_reused_tokens)
            kv.truncate(placement.num_reused_tokens)
            self._active[index] = _Active(handle, index, decoder, placement.num_reused_tokens,
                                          started_at, arrival=next(self._arrivals),
                                          drafter=drafter,
                                          prompt_logprobs=[] if wants_logprobs else None)
            self._checkpoint_if_due(self._active[index])
        except BaseException:
            self._unplace(index, restored if not is_changing else None, is_changing)
            raise
        handle.state, handle.slot_index = STATE_READING, index
        handle.stats.num_cached_tokens = placement.num_reused_tokens
        self.last_slot_index = index
        log.info("request %s: slot %d %s (%d tokens reused)%s", handle.name, index, how,
                 placement.num_reused_tokens, note)

    # ---- the window -----------------------------------------------------------------------
    def _plan_window(self):
        """(runs, logits modes, (slot, "decode"|"prompt") per run) of the next window."""
        runs, modes, kinds = [], [], []
        decoding = [a for a in self._active.values() if a.handle.state == STATE_DECODING]
        for active in sorted(decoding, key=lambda a: a.slot_index):
            run, mode = self._decode_run(active)
            runs.append(run)
            modes.append(mode)
            kinds.append((active.slot_index, "decode"))
        reading = self._ready_reads(bool(decoding))
        if reading and (not decoding or self._decode_windows_left <= 0):
            plan = self._read_plan(reading, len(decoding))
            active = self._active[plan.slot_index]
            prompt = active.handle.prompt_tokens
            num_left = len(prompt) - active.num_read_tokens
            if decoding and not active.is_started and plan.chunk_tokens < num_left:
                # A read of several chunks owes the decoding slots their windows before its
                # first chunk too: over the whole read they then keep the planned share (after
                # its last chunk nothing is owed).
                active.is_started = True
                self._decode_windows_left = max(plan.num_decode_windows_after - 1, 0)
                return runs, modes, kinds
            active.is_started = True
            num_tokens = plan.chunk_tokens
            if active.prompt_logprobs is not None:  # every row's logits: chunks kept small
                num_tokens = min(num_tokens, PROMPT_LOGPROBS_CHUNK)
            if (num_tokens == num_left > 1 and self.kvs[plan.slot_index].state is not None
                    and self.kvs[plan.slot_index].state.max_checkpoints > 0):
                num_tokens -= 1  # the last token alone next: a checkpoint comes before it
            chunk = prompt[active.num_read_tokens:active.num_read_tokens + num_tokens]
            runs.append((self.kvs[plan.slot_index], chunk))
            modes.append("all" if active.prompt_logprobs is not None else
                         "last" if num_tokens == num_left else "none")
            kinds.append((plan.slot_index, "prompt"))
            self._decode_windows_left = plan.num_decode_windows_after
        elif reading:
            self._decode_windows_left -= 1
        return runs, modes, kinds

    def _ready_reads(self, others_run: bool) -> list[_Active]:
        """The requests reading their prompts (arrival order) whose slots' cells are in place.
        A slot whose parked or restored cells are still crossing PCIe (a device KV's queued
        copies) sits out while `others_run`; else the engine waits for its copies."""
        reading = sorted((a for a in self._active.values() if a.handle.state == STATE_READING),
                         key=lambda a: a.arrival)
        ready = [a for a in reading if not self.kvs[a.slot_index].copies_pending()]
        if reading and not ready and not others_run:
            t0 = time.perf_counter()
            self.kvs[reading[0].slot_index].settle()
            log.info("slot %d: waited %.0f ms for its KV copies (no other slot had work)",
                     reading[0].slot_index, (time.perf_counter() - t0) * 1e3)
            ready = [a for a in reading if not self.kvs[a.slot_index].copies_pending()]
        elif len(ready) < len(reading):
            log.debug("slots %s sit out this window: their KV copies are still running",
                      [a.slot_index for a in reading if a not in ready])
        return ready

    def _read_plan(self, reading: list[_Active], num_decoding: int):
        """Ask the read-interleave policy about the reads in progress (arrival order)."""
        pending = [PendingRead(a.slot_index, len(a.handle.prompt_tokens) - a.num_read_tokens,
                               a.num_read_tokens) for a in reading]
        timing = None
        if self._decode_window_s is not None and self._prompt_s_per_token is not None:
            timing = WindowTiming(self._decode_window_s, self._prompt_s_per_token)
        policy = self.choosers.read_interleave
        fallback = self.choosers.fallback_read_interleave or HalfRateInterleave()
        if policy is fallback:
            return check_read_plan(policy.plan(pending, num_decoding, timing), pending)
        try:
            plan = check_read_plan(policy.plan(pending, num_decoding, timing), pending)
        except Exception as exc:  # noqa: BLE001 - a faulty plugin: the built-in plans instead
            problem = str(exc) if isinstance(exc, BadReadPlan) else \
                f"raised {type(exc).__name__}: {exc}"
            level = logging.WARNING if not self._num_bad_read_plans else logging.DEBUG
            self._num_bad_read_plans += 1
            log.log(level, "read-interleave policy %r (plugin %r) %s; the built-in %r plans "
                    "instead (later faulty plans are logged at DEBUG): fix or uninstall the "
                    "plugin", getattr(policy, "name", type(policy).__name__),
                    self.choosers.sources.get("strata_read_interleave"), problem,
                    fallback.name)
            plan = fallback.plan(pending, num_decoding, timing)
        log.debug("read plan: slot %d, %d tokens, then %d decode windows (%s)",
                  plan.slot_index, plan.chunk_tokens, plan.num_decode_windows_after, timing)
        return plan

    def _replan_after_chunk(self) -> None:
        """The chunk just read (with slots decoding) has a measured cost now: the decode windows
        owed to those slots follow from it, not from the estimate made before it (a chunk costs
        more than the one before it, as attention spans grow)."""
        reading = sorted((a for a in self._active.values() if a.handle.state == STATE_READING),
                         key=lambda a: a.arrival)
        num_decoding = sum(1 for a in self._active.values() if a.handle.state == STATE_DECODING)
        if reading and num_decoding:
            plan = self._read_plan(reading, num_decoding)
            self._decode_windows_left = plan.num_decode_windows_after

    def _measure(self, num_decode_rows: int, num_prompt_rows: int, seconds: float) -> None:
        if num_prompt_rows == 0:
            self._decode_window_s = seconds
        else:
            # The whole window, decode rows riding along included: overestimating the chunk's
            # cost only gives the decoding slots more windows.
            self._prompt_s_per_token = seconds / num_prompt_rows

    def _decode_run(self, active: _Active):
        """((kv, tokens), logits mode) of a decoding slot's run: the token to read back, then
        the drafter's guesses of the tokens after it (every row's logits), as many as the KV's
        cells and max_tokens leave room for."""
        kv, stats = self.kvs[active.slot_index], active.handle.stats
        tokens = [active.next_token]
        if active.drafter is not None:
            room = min(kv.capacity - kv.num_tokens,
                       active.handle.params.max_tokens - stats.num_generated_tokens) - 1
            tokens += active.drafter.propose(room)
        return (kv, tokens), ("all" if len(tokens) > 1 else "last")

    def _after_chunk(self, active: _Active, tokens: list[int], logits: np.ndarray) -> None:
        """A prompt chunk was read; after the last one, the first token."""
        handle, stats = active.handle, active.handle.stats
        if active.prompt_logprobs is not None:
            self._score_prompt(active, logits)
        self.table.extend(active.slot_index, tokens)
        active.num_read_tokens += len(tokens)
        self._checkpoint_if_due(active)
        total = len(handle.prompt_tokens)
        num_to_read = total - stats.num_cached_tokens
        if active.num_read_tokens < total:
            num_read = active.num_read_tokens - stats.num_cached_tokens
            # a long prompt's progress at INFO once a quarter, not once a chunk (hundreds)
            quarter = 4 * num_read // num_to_read
            is_new_quarter = quarter > 4 * (num_read - len(tokens)) // num_to_read
            log.log(logging.INFO if is_new_quarter else logging.DEBUG,
                    "request %s: reading the prompt: %d of %d tokens", handle.name, num_read,
                    num_to_read)
            return
        stats.prompt_seconds = time.perf_counter() - active.started_at
        log.info("request %s: prompt %d tokens = %d reused + %d read in %.0f ms",
                 handle.name, total, stats.num_cached_tokens, num_to_read,
                 stats.prompt_seconds * 1e3)
        handle.state = STATE_DECODING
        event = self._next_event(active, logits[-1], self.kvs[active.slot_index].num_tokens)
        if active.prompt_logprobs is not None:
            event.prompt_logprobs = tuple(active.prompt_logprobs)
        self._after_events(active, [event])

    def _score_prompt(self, active: _Active, logits) -> None:
        """A chunk's rows [n, V] (all of them): each row's logits give the log probability of
        the prompt token after it (the chunk's last row: of the next chunk's first token, or
        of none after the prompt's last)."""
        prompt, start = active.handle.prompt_tokens, active.num_read_tokens
        num_top = active.handle.params.prompt_logprobs
        for i in range(min(len(logits), len(prompt) - start - 1)):
            # a CUDA model's rows stay on the device: each is reduced there (logprobs.py)
            active.prompt_logprobs.append(token_logprob(logits[i], prompt[start + i + 1],
                                                        num_top, self.tokenizer.vocab_size))

    def _after_decode(self, active: _Active, tokens: list[int], logits: np.ndarray,
                      seconds: float) -> None:
        """A decode run: tokens[0] read back, tokens[1:] its drafts. Row i's logits give the
        token after tokens[i]; it is sampled as without drafts (the same sampler, in order), and
        the next row counts only while that token equals the row's draft. The rows after the
        first miss leave the KV: the sequence is exactly what decoding one token per window
        would have made."""
        stats, kv = active.handle.stats, self.kvs[active.slot_index]
        stats.decode_seconds += seconds
        stats.num_decode_forwards += 1
        start = kv.num_tokens - len(tokens)  # the window committed every row
        events = []
        for i in range(len(tokens)):
            event = self._next_event(active, logits[i], start + i + 1)
            events.append(event)
            if (event.finish_reason is not None or i + 1 == len(tokens)
                    or event.token_id != tokens[i + 1]):
                break
        kept = len(events)  # rows whose token is part of the sequence
        if kept < len(tokens):
            kv.truncate(start + kept)
        if active.drafter is not None:
            active.drafter.observe(len(tokens) - 1, kept - 1)
        stats.num_draft_tokens += len(tokens) - 1
        stats.num_accepted_draft_tokens += kept - 1
        self.table.extend(active.slot_index, tokens[:kept])
        self._after_events(active, events)

    def _next_event(self, active: _Active, row, num_cells: int):
        """Sample the token after the sequence's first `num_cells` tokens from `row` [V]."""
        kv, handle = self.kvs[active.slot_index], active.handle
        if (self.kv_lender is not None and num_cells >= kv.capacity
                and handle.stats.num_generated_tokens + 1 < handle.params.max_tokens):
            self.kv_lender.grow(active.slot_index, kv, num_cells + 1)  # refused: "length"
        event = active.decoder.next_event(row, has_room=num_cells < kv.capacity)
        handle._events.append(event)
        return event

    def _after_events(self, active: _Active, events: list) -> None:
        """The run's new tokens: finish the request, or keep the last one to read back."""
        if active.drafter is not None:
            active.drafter.extend([e.token_id for e in events])
        last = events[-1]
        if last.finish_reason is None:
            active.next_token = last.token_id
            return
        stats = active.handle.stats
        if stats.num_draft_tokens:
            log.info("request %s: drafts: %d of %d accepted (%.0f%%), %d tokens in %d decode "
                     "windows", active.handle.name, stats.num_accepted_draft_tokens,
                     stats.num_draft_tokens,
                     100 * stats.num_accepted_draft_tokens / stats.num_draft_tokens,
                     stats.num_decode_tokens, stats.num_decode_forwards)
        self._release(active, None)

    def _release(self, active: _Active, error: BaseException | None) -> None:
        """End `active`'s request (`error`: it failed) and make its slot idle, whatever fails
        on the way; a second call for the same request does nothing."""
        index = active.slot_index
        if self._active.get(index) is not active:
            return  # released already (it failed inside its release)
        del self._active[index]
        try:
            if error is not None:
                # Cells of an unfinished pass cannot be trusted: the slot starts clean.
                self.kvs[index].truncate(0)
                self.table.clear(index)
            if self.kv_lender is not None and self.kv_lender.is_lending(index):
                # KV grow: park the whole conversation first (as the conversation cache rules
                # allow), then keep the base cells and return the lent expert slots
                if error is None:
                    self._park(index)
                keep = self.kv_lender.trim(index, self.kvs[index])
                self.table.replace_tokens(index, self.table.tokens(index)[:keep])
        except Exception as exc:  # noqa: BLE001 - the slot must come back all the same
            log.exception("slot %d: releasing request %s failed (%s: %s); the slot's cells "
                          "are dropped", index, active.handle.name,
                          type(exc).__name__, exc)
            self.table.clear(index)  # (the next request truncates the cells to none)
        finally:
            self.table.release(index)
            self._end(active.handle, error)

    def _end(self, handle: RequestHandle, error: BaseException | None) -> None:
        handle.state, handle.error = STATE_DONE, error
        self.choosers.request_done(handle.stats)
