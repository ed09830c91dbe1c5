"""`gmlx systemone --batch requests.jsonl --out answers.jsonl`: many decisions in one run.

Input: one request body (SPEC 4.1) per line. A line's `id` (a string or an
integer) names it in the output; without one its line number (from 1) does. The
`id` is taken off the body before it is answered. Blank lines are skipped.

Output: one JSON line per input line, in the order they finish:

    {"id": "t1", "line": 1, "response": {...SPEC 4.8 body...}}
    {"id": 2, "line": 2, "error": {"message": ..., "type": ..., "param": ..., "code": 422}}

A line that is not a JSON object, repeats an earlier id, or fails (any SPEC 5
error) gets an `error` line, is reported on stderr, and the run goes on; the
exit status is 1 when any line failed.

Resume: when `--out` already exists, ids with a `response` there are skipped.
Failed lines and a broken last line (a run killed mid-write) are dropped from
the file first (rewritten whole, then replaced), and those ids are answered
again; new lines are appended. Every output line is written in one write and
flushed, so an interrupted run leaves only whole lines.

Two engines answer the lines:
- offline (`--model`, `--config`): the model is loaded once, and one reader
  (its llama.cpp context, cached prompt parts, calibration priors) serves every
  line, one at a time, on this thread;
- a server (`--url`, `--concurrency N`): N requests in flight on one HTTP
  client; a 503 is retried after its Retry-After (at most `--retries` times),
  as is a connection error.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .errors import GmlxError, InvalidRequest, ServerError

# Longest wait a Retry-After may ask for before a 503 is retried.
MAX_RETRY_AFTER_S = 30.0


@dataclass
class Line:
    number: int  # from 1
    id: Any  # str | int
    body: dict[str, Any] | None
    error: dict[str, Any] | None = None  # the error object of a line that cannot be asked


@dataclass
class Summary:
    lines: int = 0  # input lines (not blank)
    already: int = 0  # answered in an earlier run, skipped
    answered: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0  # answering, after the model load
    load_seconds: float = 0.0
    retries: int = 0
    interrupted: bool = False
    failures: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.answered / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "lines": self.lines, "already_answered": self.already, "answered": self.answered,
            "failed": self.failed, "seconds": round(self.seconds, 3), "load_seconds": round(self.load_seconds, 3),
            "decisions_per_s": round(self.rate, 3), "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "retries": self.retries, "interrupted": self.interrupted,
        }

    def text(self) -> str:
        parts = [f"{self.lines} lines", f"{self.answered} answered", f"{self.failed} failed"]
        if self.already:
            parts.append(f"{self.already} already answered")
        parts.append(f"{self.rate:.2f} decisions/s over {self.seconds:.1f} s")
        if self.load_seconds:
            parts.append(f"model load {self.load_seconds:.1f} s")
        parts.append(f"tokens: {self.input_tokens} in, {self.output_tokens} out")
        if self.retries:
            parts.append(f"{self.retries} retries")
        return "gmlx: " + ", ".join(parts) + (" (interrupted)" if self.interrupted else "")


def _err(kind: type[GmlxError], message: str, param: str | None = None) -> dict[str, Any]:
    return kind(message, param).body()["error"]


def read_lines(path: str, seed: int | None = None) -> Iterator[Line]:
    """The input lines; a line that cannot be asked carries its error instead of a body."""
    seen: set = set()
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as err:
                yield Line(number, number, None, _err(InvalidRequest, f"line {number}: not valid JSON ({err.msg} at column {err.colno})"))
                continue
            if not isinstance(body, dict):
                yield Line(number, number, None, _err(InvalidRequest, f"line {number}: the request must be a JSON object"))
                continue
            rid = body.pop("id", number)
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                yield Line(number, number, None, _err(InvalidRequest, f"line {number}: id must be a string or an integer", "id"))
                continue
            key = _key(rid)
            if key in seen:
                yield Line(number, rid, None, _err(InvalidRequest, f"line {number}: id {rid!r} repeats an earlier line", "id"))
                continue
            seen.add(key)
            if seed is not None:
                body["seed"] = seed
            yield Line(number, rid, body)


def _key(rid: Any) -> str:
    # Ids compare as JSON: "7" and 7 are different ids.
    return json.dumps(rid)


def answered_ids(out: Path) -> set[str]:
    """Ids answered in `out`, after dropping its failed and broken lines (resume)."""
    if not out.exists():
        return set()
    keep: list[str] = []
    done: set[str] = set()
    dropped = 0
    with open(out, encoding="utf-8", errors="replace") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
                ok = raw.endswith("\n") and isinstance(rec, dict) and "id" in rec and "response" in rec
            except json.JSONDecodeError:
                ok = False
            if ok and _key(rec["id"]) not in done:
                done.add(_key(rec["id"]))
                keep.append(raw)
            elif raw.strip():
                dropped += 1
    if dropped:
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    return done


class Writer:
    """Whole JSON lines, flushed one by one (the engine may run on other threads)."""

    def __init__(self, f: TextIO):
        self.f = f
        self.lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        text = json.dumps(record, ensure_ascii=False) + "\n"
        with self.lock:
            self.f.write(text)
            self.f.flush()


# -- engines ----------------------------------------------------------------------

Answer = Callable[[dict[str, Any]], dict[str, Any]]  # body -> {"response": ...} | {"error": ...}


class OfflineEngine:
    """One model load and one reader for every line (the CLI's offline path)."""

    def __init__(self, model: str, config_path: str | None):
        from .systemone import open_offline

        t0 = time.perf_counter()
        self.model_id, self.reader, self.settings = open_offline(model, config_path)
        self.load_seconds = time.perf_counter() - t0

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        from .decisions.parse import parse_decision
        from .decisions.decide import admit, decide

        try:
            decision = parse_decision(body, self.settings)
            admit(decision, self.reader, self.settings)
            return {"response": decide(decision, self.reader, self.settings, self.model_id)}
        except GmlxError as err:
            return {"error": err.body()["error"]}
        except Exception as err:  # noqa: BLE001 - the server's 500: this line fails, the run goes on
            return {"error": _err(ServerError, f"the decision failed: {type(err).__name__}: {err}")}

    def close(self) -> None:
        close = getattr(self.reader, "close", None)
        if close is not None:
            close()


class ServerEngine:
    """POST each line to a server; 503 and connection errors are retried, bounded."""

    def __init__(self, url: str, api_key: str | None, retries: int = 5, timeout: float = 600.0,
                 concurrency: int = 4, sleep: Callable[[float], None] = time.sleep, transport=None):
        import httpx

        self.url = url.rstrip("/") + "/v1/systemone"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.client = httpx.Client(headers=headers, timeout=timeout, limits=limits, transport=transport)
        self.retries = retries
        self.sleep = sleep
        self.load_seconds = 0.0
        self.retried = 0
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        attempt = 0
        while True:
            try:
                r = self.client.post(self.url, json=body)
            except httpx.TransportError as err:
                if attempt < self.retries:
                    attempt += 1
                    self._count()
                    self.sleep(min(2.0 ** attempt * 0.25, MAX_RETRY_AFTER_S))
                    continue
                return {"error": {"message": f"no answer from {self.url}: {err}", "type": "connection_error",
                                  "param": None, "code": 0}}
            if r.status_code == 503 and attempt < self.retries:
                attempt += 1
                self._count()
                self.sleep(_retry_after(r.headers.get("retry-after"), attempt))
                continue
            if r.status_code == 200:
                try:
                    return {"response": r.json()}
                except ValueError:
                    return {"error": _err(ServerError, "the server's answer is not JSON")}
            try:
                error = r.json()["error"]
                if not isinstance(error, dict):
                    raise TypeError
            except Exception:  # noqa: BLE001 - not the SPEC envelope (a proxy's page)
                error = {"message": r.text.strip()[:300] or r.reason_phrase, "type": "http_error", "param": None,
                         "code": r.status_code}
            return {"error": error}

    def _count(self) -> None:
        with self._lock:
            self.retried += 1

    def close(self) -> None:
        self.client.close()


def _retry_after(value: str | None, attempt: int) -> float:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        seconds = None
    if seconds is None or seconds < 0:
        seconds = min(2.0 ** attempt * 0.25, MAX_RETRY_AFTER_S)
    return min(seconds, MAX_RETRY_AFTER_S)


# -- progress ---------------------------------------------------------------------


class Progress:
    """A rich progress bar (rate, ETA) on a terminal; plain lines every `every` s otherwise."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, every: float = 10.0, tty: bool | None = None):
        self.total, self.stream, self.every = total, stream, every
        self.done = self.failed = 0
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if tty if tty is not None else stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, ProgressColumn
            from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.text import Text

            class Rate(ProgressColumn):
                def render(self, task) -> Text:  # noqa: ANN001
                    speed = task.finished_speed or task.speed
                    return Text(f"{speed:.2f} dec/s" if speed else "- dec/s")

            self.bar = RichProgress(
                TextColumn("decisions"), BarColumn(), MofNCompleteColumn(), Rate(),
                TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=Console(file=stream), transient=False,
            )
            self.task = self.bar.add_task("bulk", total=total, failed=0)
            self.bar.start()

    def advance(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        if self.bar is not None:
            self.bar.update(self.task, advance=1, failed=self.failed)
            return
        now = time.monotonic()
        if now - self.last >= self.every and self.done < self.total:
            self.last = now
            rate = self.done / (now - self.t0) if now > self.t0 else 0.0
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            self.stream.write(f"gmlx: {self.done}/{self.total} lines, {self.failed} failed, "
                              f"{rate:.2f} decisions/s, ETA {eta:.0f} s\n")
            self.stream.flush()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# -- the run ----------------------------------------------------------------------


def run_batch(
    requests: str,
    out: str,
    engine: Answer,
    concurrency: int = 1,
    seed: int | None = None,
    stderr: TextIO = sys.stderr,
    progress: bool = True,
    load_seconds: float = 0.0,
) -> Summary:
    """Answer every line of `requests` not yet answered in `out`, appending to it."""
    out_path = Path(out)
    done = answered_ids(out_path)
    lines = list(read_lines(requests, seed))
    summary = Summary(lines=len(lines), load_seconds=load_seconds)
    todo = []
    for line in lines:
        if line.body is not None and _key(line.id) in done:
            summary.already += 1
        else:
            todo.append(line)
    bar = Progress(len(todo), stderr) if progress else None
    t0 = time.perf_counter()

    def finish(line: Line, result: dict[str, Any], w: Writer) -> None:
        record: dict[str, Any] = {"id": line.id, "line": line.number}
        record.update(result)
        w.write(record)
        if "response" in result:
            summary.answered += 1
            usage = result["response"].get("usage") or {}
            summary.input_tokens += int(usage.get("input_tokens") or 0)
            summary.output_tokens += int(usage.get("output_tokens") or 0)
        else:
            summary.failed += 1
            err = result.get("error") or {}
            msg = f"line {line.number} (id {line.id!r}): {err.get('code')} {err.get('type')}: {err.get('message')}"
            summary.failures.append(msg)
            stderr.write(f"gmlx: {msg}\n")
            stderr.flush()
        if bar is not None:
            bar.advance("response" not in result)

    with open(out_path, "a", encoding="utf-8") as f:
        w = Writer(f)
        try:
            if concurrency <= 1:
                for line in todo:
                    finish(line, {"error": line.error} if line.body is None else engine(line.body), w)
            else:
                _run_concurrent(todo, engine, concurrency, lambda ln, res: finish(ln, res, w))
        except KeyboardInterrupt:
            summary.interrupted = True
        finally:
            summary.seconds = time.perf_counter() - t0
            if bar is not None:
                bar.stop()
            summary.retries = getattr(engine, "retried", 0)
    return summary


def _run_concurrent(todo: list[Line], engine: Answer, n: int, finish: Callable[[Line, dict], None]) -> None:
    """At most `n` lines in flight; results written on this thread as they finish."""
    pending: dict[Future, Line] = {}
    it = iter(todo)
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="gmlx-bulk") as pool:
        try:
            while True:
                while len(pending) < n:
                    line = next(it, None)
                    if line is None:
                        break
                    if line.body is None:
                        finish(line, {"error": line.error})
                        continue
                    pending[pool.submit(engine, line.body)] = line
                if not pending:
                    return
                ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in ready:
                    line = pending.pop(fut)
                    try:
                        result = fut.result()
                    except Exception as err:  # noqa: BLE001 - an engine bug fails the line, not the run
                        result = {"error": _err(ServerError, f"{type(err).__name__}: {err}")}
                    finish(line, result)
        except KeyboardInterrupt:
            for fut in pending:
                fut.cancel()
            raise
