"""The engine thread: the only thread that touches the model. Request threads queue jobs and
read each job's events; the thread submits new jobs to the engine and steps it (one window over
every running request) while any runs; a job's cancel flag is checked between windows."""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from strata.backends.select import release_thread_gpu
from strata.errors import RequestError, StrataError
from strata.server.api_error import ApiError
from strata.server.metrics import ServerMetrics

log = logging.getLogger("strata.server")


@dataclass
class JobEnd:
    """The last item of a job's event queue."""
    error: ApiError | None = None
    is_cancelled: bool = False
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    decode_tokens_per_s: float = 0.0


@dataclass
class Job:
    request_id: str
    prompt_tokens: list[int]
    params: object  # strata.engine.sampling.SamplingParams
    events: queue.Queue | ChoiceQueue = field(default_factory=queue.Queue)  # the worker puts
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    stop_reason: str | None = None  # why the server cancelled it itself (None: the client left)
    # prompt tokens reused from a cached conversation: set by the engine thread before the
    # job's first event (Anthropic's message_start reports them)
    num_cached_tokens: int | None = None


@dataclass
class EngineCall:
    """`fn(engine)` run on the engine thread between windows (a slot's file saved or
    restored); its result or exception comes back through `done`."""
    fn: Callable
    done: Future = field(default_factory=Future)


@dataclass
class _Running:
    """A job the engine runs: its handle and the JobEnd being filled in."""
    job: Job
    handle: object  # strata.engine.scheduler.RequestHandle
    end: JobEnd = field(default_factory=JobEnd)
    last_event_s: float = 0.0
    is_finish_sent: bool = False


class EngineWorker:
    """Owns the engine. `engine_source` is an engine, or a callable that builds one (called on
    the engine thread, so /health can say "loading" meanwhile)."""

    def __init__(self, engine_source, metrics: ServerMetrics):
        self._source = engine_source
        self._metrics = metrics
        self._jobs: queue.Queue = queue.Queue()
        self.engine = None
        self.state = "loading"
        self.error_message = ""
        self.is_closing = False  # the engine thread has begun closing the engine
        # stop() was called: jobs and calls are refused (under the lock: none is queued
        # after the engine thread's last look at its queue)
        self.is_stopping = False
        self._queue_lock = threading.Lock()
        self._is_loaded = threading.Event()
        self._thread = threading.Thread(target=self._engine_thread, name="strata-engine",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_loaded(self, timeout_s: float | None = None) -> bool:
        return self._is_loaded.wait(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops after the current window, however long it takes (then the engine closes);
        running and queued jobs end with a 503 (shutting_down; cancelled, those whose client
        left) and later ones get it at once. A model still loading is waited for `timeout_s`."""
        with self._queue_lock:
            if not self.is_stopping:
                self.is_stopping = True
                self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive() and self.state == "ok":
            # A loaded engine is in a window (it cannot be cut) or closing: it ends, then
            # writes its conversations to --conversation-cache-dir and the rest of its
            # --dump-routing trace, which a process ending now would lose. `timeout_s` bounds
            # only a wait for a model still loading.
            log.info("waiting for the engine's window to end and the engine to close (its "
                     "conversation files written)")
            self._thread.join()

    def call(self, fn: Callable, timeout_s: float | None = 600.0):
        """Run `fn(engine)` on the engine thread between two windows and return its result
        (its exception is raised here)."""
        call = EngineCall(fn)
        self._put(call)
        return call.done.result(timeout_s)

    def submit(self, job: Job) -> None:
        self._put(job)
        self._metrics.queued.inc()  # the engine thread sets the exact figure at its next step

    def _put(self, job: Job | EngineCall) -> None:
        with self._queue_lock:
            if self.state != "ok" or self.is_stopping:
                raise self.unavailable()
            self._jobs.put(job)

    def unavailable(self) -> ApiError:
        if self.is_stopping:
            return _shutting_down()
        if self.state == "loading":
            return ApiError(503, "The model is still loading; retry in a few seconds.",
                            code="model_loading")
        return ApiError(503, f"The model failed to load: {self.error_message}. Fix it and "
                        "restart the server.", code="model_load_failed")

    # ---- the engine thread --------------------------------------------------------------
    def _load(self) -> bool:
        try:
            self.engine = self._source() if callable(self._source) else self._source
        except Exception as exc:  # noqa: BLE001 - any load failure is reported on /health
            if isinstance(exc, StrataError):  # says what to fix: no traceback
                log.error("loading the model failed: %s", exc)
            else:
                log.exception("loading the model failed")
            self.error_message = str(exc) or type(exc).__name__
            self.state = "error"
            return False
        finally:
            self._is_loaded.set()
        self.state = "ok"
        return True

    def _engine_thread(self) -> None:
        try:
            self._run()
        finally:  # the engine, and a GPU's context, were this thread's
            release_thread_gpu()

    def _run(self) -> None:
        is_ok = self._load()
        running: list[_Running] = []
        while self._take_new(running, is_ok):
            if running:
                self._step(running)
        for run in running:
            run.handle.cancel()
            if run.job.cancel.is_set():
                run.end.is_cancelled = True  # the client left: nobody reads the error
            else:  # never a finish reason: the answer was cut, not finished
                run.end.error = _shutting_down()
            self._count_tokens(run)
            run.job.events.put(run.end)
        # Answer whatever is still queued so no request thread waits forever.
        for job in self._take_jobs(block=False):
            if isinstance(job, EngineCall):
                job.done.set_exception(_shutting_down())
            elif job is not None:
                job.events.put(JobEnd(error=_shutting_down()))
        for gauge in (self._metrics.queued, self._metrics.running, self._metrics.reading):
            gauge.set(0)  # every job has its answer
        close = getattr(self.engine, "close", None)
        if close is not None:
            self.is_closing = True
            # The worker owns the engine: its expert tier stops copying and writes the rest of
            # its --dump-routing trace.
            close()

    # The loop's steps are methods of their own so that no local of the engine thread holds
    # the last request (its prompt, handle and events) while the thread waits for the next.
    def _take_new(self, running: list[_Running], is_ok: bool) -> bool:
        """Start the jobs and run the calls queued now (waiting for one when nothing runs);
        False once stop() was called."""
        for job in self._take_jobs(block=not running):
            if job is None:
                return False
            if isinstance(job, EngineCall):
                self._run_call(job)
                continue
            self._start(job, is_ok, running)
        return True

    def _step(self, running: list[_Running]) -> None:
        """One window over the running jobs (their cancels first); the jobs that ended leave
        `running`."""
        for run in running:
            if run.job.cancel.is_set():
                run.handle.cancel()
        try:
            self.engine.step()
        except Exception:  # noqa: BLE001 - the engine thread must survive any request
            log.exception("a window failed in the engine; ending its %d requests: %s",
                          len(running), ", ".join(run.job.request_id for run in running))
            for run in running:
                run.handle.cancel()
                run.end.error = ApiError(500, "The engine failed on this request; the "
                                         "server log has the details.", code="engine_error")
                self._count_tokens(run)
                run.job.events.put(run.end)
            running.clear()
            self.engine.scheduler.drop_cancelled()
        running[:] = [run for run in running if not self._forward_events(run)]
        self._update_gauges()

    def _take_jobs(self, block: bool):
        """The jobs queued now (waiting for the first one when `block`)."""
        try:
            job = self._jobs.get(block=block)
        except queue.Empty:
            return
        while True:
            yield job
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _run_call(self, call: EngineCall) -> None:
        try:
            call.done.set_result(call.fn(self.engine))
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the thread goes on
            call.done.set_exception(exc)

    def _start(self, job: Job, is_ok: bool, running: list[_Running]) -> None:
        """Submit a newly taken job to the engine (or answer it at once)."""
        if not is_ok or job.cancel.is_set():
            job.events.put(JobEnd(error=None if is_ok else self.unavailable(),
                                  is_cancelled=job.cancel.is_set()))
        else:
            try:
                running.append(_Running(job, self.engine.submit(job.prompt_tokens, job.params,
                                                                job.request_id)))
            except RequestError as exc:
                job.events.put(JobEnd(error=ApiError(400, str(exc), code="invalid_request")))
            except Exception:  # noqa: BLE001 - the engine thread must survive any request
                log.exception("request %s: submitting it to the engine failed; it ends with "
                              "a 500", job.request_id)
                job.events.put(JobEnd(error=ApiError(
                    500, "The engine failed on this request; the server log has the details.",
                    code="engine_error")))
        self._update_gauges()

    def _update_gauges(self) -> None:
        engine = self.engine if self.state == "ok" else None
        num_queued = self._jobs.qsize() + (engine.num_queued if engine is not None else 0)
        self._metrics.queued.set(num_queued)
        self._metrics.running.set(engine.num_running if engine is not None else 0)
        self._metrics.reading.set(engine.num_reading if engine is not None else 0)

    def _forward_events(self, run: _Running) -> bool:
        """Move the handle's new events to the job's queue; True when the job ended."""
        job, end = run.job, run.end
        for event in run.handle.pop_events():
            now = time.perf_counter()
            if end.ttft_s is None:
                end.ttft_s = now - job.queued_at
                job.num_cached_tokens = run.handle.stats.num_cached_tokens
                self._metrics.ttft.observe(end.ttft_s)
            else:
                self._metrics.token_latency.observe(now - run.last_event_s)
            run.last_event_s = now
            run.is_finish_sent = event.finish_reason is not None
            end.num_generated_tokens += 1
            job.events.put(event)
        if not run.handle.is_finished:
            return False
        stats = run.handle.stats
        end.num_cached_tokens = stats.num_cached_tokens
        end.decode_tokens_per_s = stats.decode_tokens_per_s
        error = run.handle.error
        if isinstance(error, RequestError):
            end.error = ApiError(400, str(error), code="invalid_request")
        elif error is not None:
            log.error("request %s failed in the engine", job.request_id,
                      exc_info=(type(error), error, error.__traceback__))
            end.error = ApiError(500, "The engine failed on this request; the server log has "
                                 "the details.", code="engine_error")
        elif not run.is_finish_sent:
            end.is_cancelled = True
            log.info("request %s: cancelled after %d generated tokens (%s)", job.request_id,
                     end.num_generated_tokens, job.stop_reason or "the client went away")
        self._count_tokens(run)
        job.events.put(end)
        return True

    def _count_tokens(self, run: _Running) -> None:
        """Add an ended job's tokens to the counters (finished, failed or cut by a stop: the
        engine read and generated them all the same)."""
        stats = run.handle.stats
        self._metrics.prompt_tokens.inc(len(run.job.prompt_tokens))
        self._metrics.cached_tokens.inc(stats.num_cached_tokens)
        self._metrics.generated_tokens.inc(run.end.num_generated_tokens)
        self._metrics.draft_tokens.inc(stats.num_draft_tokens)
        self._metrics.draft_tokens_accepted.inc(stats.num_accepted_draft_tokens)


def _shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; retry the request when it is back.",
                    code="shutting_down")


class ChoiceQueue:
    """A job's event queue that tags each item with its choice's index into a queue shared by
    the choices of one request (`n` > 1): `iterate_jobs` reads them in arrival order."""

    def __init__(self, shared: queue.Queue, index: int):
        self.shared, self.index = shared, index

    def put(self, item) -> None:
        self.shared.put((self.index, item))


# How often a request thread waiting for its job's next event asks whether its client left (a
# look at waitress's flag, no socket call): a client that hangs up stops its generation this soon
# after, not one keep-alive period (5 s by default) later.
DISCONNECT_POLL_S = 0.1


class _EventWait:
    """Takes the next item of a request's event queue: None once `keepalive_s` passed without
    one (a keep-alive is due). While it waits, and between items at most every
    DISCONNECT_POLL_S, it asks `is_disconnected()`; the first time that is true it calls
    `on_gone()` (which cancels the request's jobs) and goes on waiting for their ends."""

    def __init__(self, keepalive_s: float, is_disconnected: Callable[[], bool] | None,
                 on_gone: Callable[[], None]):
        self.keepalive_s, self.is_disconnected, self.on_gone = keepalive_s, is_disconnected, on_gone
        self.poll_s = keepalive_s
        if is_disconnected is not None:
            self.poll_s = min(keepalive_s, DISCONNECT_POLL_S)
        self.next_check_s = time.monotonic() + self.poll_s
        self.is_gone = False

    def get(self, events: queue.Queue):
        deadline = time.monotonic() + self.keepalive_s
        while True:
            self._check()
            left_s = max(0.0, deadline - time.monotonic())
            try:
                return events.get(timeout=min(left_s, self.poll_s))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return None

    def _check(self) -> None:
        if self.is_gone or self.is_disconnected is None or time.monotonic() < self.next_check_s:
            return
        self.next_check_s = time.monotonic() + self.poll_s
        if self.is_disconnected():
            self.is_gone = True
            self.on_gone()


def iterate_job(job: Job, poll_s: float, is_disconnected: Callable[[], bool] | None = None):
    """Yields the job's GenerationEvents, None after each `poll_s` without one (a chance to send
    a keep-alive), and finally its JobEnd. Closing this generator early cancels the job, and so
    does `is_disconnected()` turning true (checked about every DISCONNECT_POLL_S)."""
    wait = _EventWait(poll_s, is_disconnected, job.cancel.set)
    try:
        while True:
            item = wait.get(job.events)
            yield item
            if isinstance(item, JobEnd):
                return
    finally:
        # Harmless once the job has ended; stops the generation when the reader went away.
        job.cancel.set()


def iterate_jobs(jobs: list[Job], shared: queue.Queue, poll_s: float,
                 is_disconnected: Callable[[], bool] | None = None):
    """`iterate_job` for the choices of one request, whose events are ChoiceQueues on `shared`:
    yields (choice index, item) in arrival order, None for a keep-alive, until every job's
    JobEnd came. Closing it early, or the client going away, cancels every job."""
    def cancel_all() -> None:
        for job in jobs:
            job.cancel.set()

    wait = _EventWait(poll_s, is_disconnected, cancel_all)
    num_left = len(jobs)
    try:
        while num_left:
            got = wait.get(shared)
            if got is None:
                yield None
                continue
            yield got
            num_left -= isinstance(got[1], JobEnd)
    finally:
        cancel_all()
