"""The engine thread: the only thread that touches the model. Request threads queue jobs and
read each job's events; a job's cancel flag is checked between tokens."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from strata.errors import RequestError
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
    events: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


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
        self._is_loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_loaded(self, timeout_s: float | None = None) -> bool:
        return self._is_loaded.wait(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops after the current job; queued jobs are answered as cancelled."""
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, job: Job) -> None:
        if self.state != "ok":
            raise self.unavailable()
        self._metrics.queued.inc()
        self._jobs.put(job)

    def unavailable(self) -> ApiError:
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
            log.exception("loading the model failed")
            self.error_message = str(exc) or type(exc).__name__
            self.state = "error"
            return False
        finally:
            self._is_loaded.set()
        self.state = "ok"
        return True

    def _run(self) -> None:
        is_ok = self._load()
        while True:
            job = self._jobs.get()
            if job is None:
                break
            self._metrics.queued.dec()
            if not is_ok or job.cancel.is_set():
                job.events.put(JobEnd(error=None if is_ok else self.unavailable(),
                                      is_cancelled=job.cancel.is_set()))
                continue
            self._metrics.running.inc()
            try:
                job.events.put(self._generate(job))
            finally:
                self._metrics.running.dec()
        # Answer whatever is still queued so no request thread waits forever.
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._metrics.queued.dec()
                job.events.put(JobEnd(error=ApiError(503, "The server is shutting down.",
                                                     code="shutting_down")))

    def _generate(self, job: Job) -> JobEnd:
        end = JobEnd()
        last_s = None
        events = None
        try:
            events = self.engine.generate(job.prompt_tokens, job.params)
            for event in events:
                now = time.perf_counter()
                if last_s is None:
                    end.ttft_s = now - job.queued_at
                    self._metrics.ttft.observe(end.ttft_s)
                else:
                    self._metrics.token_latency.observe(now - last_s)
                last_s = now
                end.num_generated_tokens += 1
                job.events.put(event)
                if event.finish_reason is not None:
                    stats = event.stats
                    if stats is not None:
                        end.num_cached_tokens = stats.num_cached_tokens
                        end.decode_tokens_per_s = stats.decode_tokens_per_s
                    break
                if job.cancel.is_set():
                    end.is_cancelled = True
                    log.info("request %s: cancelled after %d generated tokens (the client "
                             "went away)", job.request_id, end.num_generated_tokens)
                    break
        except RequestError as exc:
            end.error = ApiError(400, str(exc), code="invalid_request")
        except Exception:  # noqa: BLE001 - the engine thread must survive any request
            log.exception("request %s failed in the engine", job.request_id)
            end.error = ApiError(500, "The engine failed on this request; the server log has "
                                 "the details.", code="engine_error")
        finally:
            if events is not None and hasattr(events, "close"):
                events.close()
        self._metrics.prompt_tokens.inc(len(job.prompt_tokens))
        self._metrics.cached_tokens.inc(end.num_cached_tokens)
        self._metrics.generated_tokens.inc(end.num_generated_tokens)
        return end


def iterate_job(job: Job, poll_s: float, is_disconnected: Callable[[], bool] | None = None):
    """Yields the job's GenerationEvents, None after each `poll_s` without one (a chance to send
    a keep-alive), and finally its JobEnd. Closing this generator early cancels the job, and so
    does `is_disconnected()` turning true (checked about every `poll_s`)."""
    next_check_s = time.monotonic() + poll_s
    try:
        while True:
            if is_disconnected is not None and time.monotonic() >= next_check_s:
                next_check_s = time.monotonic() + poll_s
                if is_disconnected():
                    job.cancel.set()
            try:
                item = job.events.get(timeout=poll_s)
            except queue.Empty:
                yield None
                continue
            yield item
            if isinstance(item, JobEnd):
                return
    finally:
        # Harmless once the job has ended; stops the generation when the reader went away.
        job.cancel.set()
