"""One worker thread per loaded (model, profile), owning its llama.cpp context.

A llama.cpp context is not thread-safe, so everything that touches it (load,
open the reader, every read) happens on the worker's own thread; the event
loop only hands it jobs and waits for their futures.

Queue rules (SPEC 6.3):
- an idle worker takes a decision at once; otherwise it waits in a bounded
  queue, and a decision that would make more than `max_queue` wait gets 503
  `overloaded` with a Retry-After (1..5 s) estimated from recent service times;
- `token_queue_timeout_s` counts from the moment a decision leaves the queue:
  the checkpoint before every read raises Timeout (504) past it, and a decision
  that finishes late is answered 504 too;
- a cancelled decision (its client went away) is dropped from the queue, or
  stops at its next read through the checkpoint raising Cancelled;
- any engine exception becomes 500 `server_error` for that decision only: the
  worker keeps serving the next one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..decisions.run import decide
from ..decisions.types import Decision, DecisionSettings
from ..errors import Cancelled, GmlxError, Overloaded, ServerError, Timeout

log = logging.getLogger("gmlx.server")

# Retry-After bounds (SPEC 6.1a: clients honour 1..5 seconds).
RETRY_MIN_S, RETRY_MAX_S = 1, 5


def _settle(fut: concurrent.futures.Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve a future unless someone cancelled it meanwhile."""
    if fut.done():
        return
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


@dataclass
class Job:
    decision: Decision
    submitted: float = field(default_factory=time.monotonic)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float | None = None  # when it left the queue
    finished: float | None = None

    @property
    def queue_ms(self) -> float:
        end = self.started if self.started is not None else time.monotonic()
        return (end - self.submitted) * 1000.0


class Worker:
    """Loads one (model, profile), then answers its decisions one at a time."""

    def __init__(
        self,
        name: str,
        model_id: str,
        load: Callable[[], tuple[Any, Any]],
        settings: DecisionSettings,
        max_queue: int,
        timeout_s: float,
    ):
        self.name = name
        self.model_id = model_id
        self._load = load  # runs on the worker thread: -> (loaded model, reader)
        self.settings = settings
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.loaded: concurrent.futures.Future = concurrent.futures.Future()
        self.lm = None
        self.reader = None
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._stopping = False
        self._service_s: collections.deque[float] = collections.deque(maxlen=16)
        self.counts = {"served": 0, "failed": 0, "cancelled": 0, "timeouts": 0, "overloaded": 0}
        self._thread = threading.Thread(target=self._main, name=f"gmlx-worker-{name}", daemon=True)

    # -- lifecycle (event loop side) ------------------------------------------
    def start(self) -> concurrent.futures.Future:
        """Start the thread; the returned future resolves when the model is
        loaded and the reader open (or holds the load's exception)."""
        self._thread.start()
        return self.loaded

    def stop(self, reason: str = "the server is shutting down") -> None:
        """Refuse new decisions, answer the queued ones 503, cancel nothing that runs."""
        with self._cond:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in dropped:
            job.cancelled.set()
            _settle(job.future, exc=Overloaded(reason, retry_after=RETRY_MIN_S))

    def cancel_running(self) -> None:
        with self._cond:
            if self._running is not None:
                self._running.cancelled.set()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- queue -----------------------------------------------------------------
    def submit(self, decision: Decision) -> Job:
        job = Job(decision)
        with self._cond:
            if self._stopping:
                raise Overloaded("the server is shutting down", retry_after=RETRY_MIN_S)
            busy = self._running is not None or bool(self._queue)
            if busy and len(self._queue) + 1 > self.max_queue:
                self.counts["overloaded"] += 1
                raise Overloaded(
                    f"model {self.model_id!r} is busy: {len(self._queue)} decision(s) waiting "
                    f"(server.max_queue is {self.max_queue}); retry later",
                    retry_after=self._retry_after_locked(),
                )
            self._queue.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop it at its next read if it runs."""
        with self._cond:
            if job.cancelled.is_set() or job.future.done():
                return
            job.cancelled.set()
            try:
                self._queue.remove(job)
                queued = True
            except ValueError:
                queued = False
            if queued:
                self.counts["cancelled"] += 1
        if queued:
            _settle(job.future, exc=Cancelled())

    def _retry_after_locked(self) -> int:
        # Every waiting decision plus the running one, at the recent mean service time.
        mean = sum(self._service_s) / len(self._service_s) if self._service_s else 1.0
        ahead = len(self._queue) + (1 if self._running is not None else 0)
        return int(min(RETRY_MAX_S, max(RETRY_MIN_S, math.ceil(mean * max(1, ahead)))))

    def retry_after(self) -> int:
        with self._cond:
            return self._retry_after_locked()

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return {
                "waiting": len(self._queue),
                "running": self._running is not None,
                "max_queue": self.max_queue,
                "mean_service_ms": round(1000 * sum(self._service_s) / len(self._service_s), 1)
                if self._service_s
                else None,
                **self.counts,
            }

    # -- worker thread ---------------------------------------------------------
    def _main(self) -> None:
        try:
            self.lm, self.reader = self._load()
        except BaseException as err:  # noqa: BLE001 - reported through the future
            _settle(self.loaded, exc=err)
            self._close()
            return
        _settle(self.loaded, result=self.lm)
        try:
            self._serve()
        finally:
            self._close()

    def _close(self) -> None:
        for obj in (self.reader, self.lm):
            close = getattr(obj, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - best effort at exit
                    log.debug("closing %s failed", self.name, exc_info=True)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return  # stopping, nothing left
                job = self._queue.popleft()
                job.started = time.monotonic()
                self._running = job
            try:
                self._run(job)
            finally:
                job.finished = time.monotonic()
                with self._cond:
                    self._running = None
                    self._service_s.append(job.finished - job.started)

    def _run(self, job: Job) -> None:
        deadline = job.started + self.timeout_s

        def checkpoint() -> None:
            if job.cancelled.is_set():
                raise Cancelled()
            if time.monotonic() > deadline:
                raise self.timeout_error()

        try:
            checkpoint()
            body = decide(job.decision, self.reader, self.settings, self.model_id, checkpoint)
            if time.monotonic() > deadline:
                raise self.timeout_error()
            body["diagnostics"]["timing"]["queue_ms"] = round(job.queue_ms, 3)
            self.counts["served"] += 1
            _settle(job.future, result=body)
        except Cancelled as err:
            self.counts["cancelled"] += 1
            _settle(job.future, exc=err)
        except Timeout as err:
            self.counts["timeouts"] += 1
            _settle(job.future, exc=err)
        except GmlxError as err:
            self.counts["failed"] += 1
            _settle(job.future, exc=err)
        except Exception as err:  # noqa: BLE001 - an engine failure must not stop the worker
            self.counts["failed"] += 1
            log.exception("decision on %s failed in the engine", self.name)
            _settle(job.future, exc=ServerError(
                f"the engine failed on model {self.model_id!r}: {type(err).__name__}: {err}", param="model"))

    def timeout_error(self) -> Timeout:
        return Timeout(
            f"the decision ran longer than server.token_queue_timeout_s ({self.timeout_s:g} s) after leaving the queue"
        )
