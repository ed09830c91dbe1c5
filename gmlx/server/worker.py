"""One worker per loaded (model, profile): `parallel` threads, each owning one
llama.cpp context (a reader) on the one loaded model.

A llama.cpp context is not thread-safe, so everything that touches a context
(open the reader, every read) happens on its own thread; the first thread
loads the model, the others open their readers on it. A decision runs entirely
on one reader. The event loop only hands jobs to the shared queue and waits
for their futures; back-pressure counts every context of the model.

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

from ..decisions.decide import decide
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


@dataclass(eq=False)  # hashed by identity: a set of running jobs
class Job:
    decision: Decision
    submitted: float = field(default_factory=time.monotonic)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float | None = None  # when it left the queue
    finished: float | None = None
    result: dict | None = None

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
        parallel: int = 1,
        open_more: Callable[[Any], Any] | None = None,
    ):
        self.name = name
        self.parallel = max(1, int(parallel)) if open_more is not None else 1
        self._open_more = open_more  # runs on each extra thread: loaded model -> reader
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
        self._running: set[Job] = set()
        self._idle = 0  # threads waiting for a job
        self.contexts = 0  # readers open and serving
        self._stopping = False
        self._draining = False  # stop taking new decisions, finish the queued ones
        self.on_done: Callable[[Job, str], None] | None = None  # metrics hook
        self._service_s: collections.deque[float] = collections.deque(maxlen=16)
        self.counts = {"served": 0, "failed": 0, "cancelled": 0, "timeouts": 0, "overloaded": 0}
        self._thread = threading.Thread(target=self._main, name=f"gmlx-worker-{name}", daemon=True)
        self._extra: list[threading.Thread] = []

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

    def drain(self) -> None:
        """Refuse new decisions (503), keep answering the queued and running ones
        (the threads keep the model until stop())."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._running

    def cancel_running(self) -> None:
        with self._cond:
            for job in self._running:
                job.cancelled.set()

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in [self._thread, *self._extra]:
            if t.is_alive():
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in [self._thread, *self._extra])

    # -- queue -----------------------------------------------------------------
    def submit(self, decision: Decision) -> Job:
        job = Job(decision)
        with self._cond:
            if self._stopping or self._draining:
                raise Overloaded("the server is shutting down", retry_after=RETRY_MIN_S)
            busy = len(self._running) + len(self._queue) >= max(1, self.contexts)
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
        ahead = len(self._queue) + len(self._running)
        rounds = math.ceil(max(1, ahead) / max(1, self.contexts or self.parallel))
        return int(min(RETRY_MAX_S, max(RETRY_MIN_S, math.ceil(mean * rounds))))

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return {
                "waiting": len(self._queue),
                "running": bool(self._running),
                "in_flight": len(self._running),
                "parallel": self.contexts or self.parallel,
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
            self._close(self.reader, self.lm)
            return
        # The other contexts: each opened on the thread that will use it.
        opened = [threading.Event() for _ in range(self.parallel - 1)]
        for i in range(1, self.parallel):
            t = threading.Thread(target=self._extra_main, args=(opened[i - 1], i),
                                 name=f"gmlx-worker-{self.name}-{i}", daemon=True)
            self._extra.append(t)
            t.start()
        for ev in opened:
            ev.wait()
        with self._cond:
            self.contexts += 1
        _settle(self.loaded, result=self.lm)
        try:
            self._serve(self.reader)
        finally:
            for t in self._extra:
                t.join()
            self._close(self.reader, self.lm)

    def _extra_main(self, opened: threading.Event, index: int) -> None:
        reader = None
        try:
            reader = self._open_more(self.lm)  # type: ignore[misc]
        except BaseException:  # noqa: BLE001 - fewer contexts, the model still serves
            log.exception("%s: context %d could not be opened; serving with fewer", self.name, index)
            opened.set()
            return
        with self._cond:
            self.contexts += 1
        opened.set()
        try:
            self._serve(reader)
        finally:
            self._close(reader)

    def _close(self, *objs) -> None:
        for obj in objs:
            close = getattr(obj, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - best effort at exit
                    log.debug("closing %s failed", self.name, exc_info=True)

    def _serve(self, reader) -> None:
        while True:
            with self._cond:
                self._idle += 1
                try:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                finally:
                    self._idle -= 1
                if not self._queue:
                    return  # stopping, nothing left
                job = self._queue.popleft()
                job.started = time.monotonic()
                self._running.add(job)
            try:
                self._run(job, reader)
            finally:
                job.finished = time.monotonic()
                with self._cond:
                    self._running.discard(job)
                    self._service_s.append(job.finished - job.started)

    def _done(self, job: Job, outcome: str) -> None:
        if self.on_done is not None:
            try:
                self.on_done(job, outcome)
            except Exception:  # noqa: BLE001 - metrics never fail a decision
                log.debug("metrics hook failed", exc_info=True)

    def _run(self, job: Job, reader=None) -> None:
        reader = self.reader if reader is None else reader
        deadline = job.started + self.timeout_s

        def checkpoint() -> None:
            if job.cancelled.is_set():
                raise Cancelled()
            if time.monotonic() > deadline:
                raise self.timeout_error()

        try:
            checkpoint()
            body = decide(job.decision, reader, self.settings, self.model_id, checkpoint)
            if time.monotonic() > deadline:
                raise self.timeout_error()
            body["diagnostics"]["timing"]["queue_ms"] = round(job.queue_ms, 3)
            job.result = body
            self._finish(job, "served", "served", result=body)
        except Cancelled as err:
            self._finish(job, "cancelled", "cancelled", exc=err)
        except Timeout as err:
            self._finish(job, "timeouts", "timeout", exc=err)
        except GmlxError as err:
            self._finish(job, "failed", "failed", exc=err)
        except Exception as err:  # noqa: BLE001 - an engine failure must not stop the worker
            log.exception("decision on %s failed in the engine", self.name)
            self._finish(job, "failed", "failed", exc=ServerError(
                f"the engine failed on model {self.model_id!r}: {type(err).__name__}: {err}", param="model"))

    def _finish(self, job, count: str, outcome: str, result=None, exc: BaseException | None = None) -> None:
        """Count the job, report its outcome, and settle its future."""
        self._count(count)
        self._done(job, outcome)
        _settle(job.future, result=result, exc=exc)

    def _count(self, key: str) -> None:
        with self._cond:
            self.counts[key] += 1

    def timeout_error(self) -> Timeout:
        return Timeout(
            f"the decision ran longer than server.token_queue_timeout_s ({self.timeout_s:g} s) after leaving the queue"
        )
