"""In-process tests of the server's pieces with no model: the worker queue
(back-pressure, cancellation, timeout, engine failures, shutdown), bounded
body decoding, and model/profile resolution."""

from __future__ import annotations

import gzip
import threading
import time

import pytest
import zstandard

from gmlx.config import parse_config
from fake_reader import FakeReader
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.types import DecisionSettings
from gmlx.errors import (
    Cancelled,
    InvalidRequest,
    ModelNotFound,
    NoModelSpecified,
    Overloaded,
    RequestTooLarge,
    ServerError,
    Timeout,
    UnknownProfile,
    UnsupportedMediaType,
)
from gmlx.server import body as bodies
from gmlx.server.models import ModelManager
from gmlx.server.worker import Worker

SETTINGS = DecisionSettings()


def decision(n: int = 1, samples: int = 1):
    qs = {f"q{i}": {"type": "noul", "instructions": f"question {i}?"} for i in range(n)}
    return parse_decision({"state": "s", "questions": qs, "samples": samples}, SETTINGS)


class SlowReader(FakeReader):
    """A fake reader whose reads take `delay` seconds and can be made to fail."""

    def __init__(self, delay: float = 0.0, fail: Exception | None = None):
        super().__init__()
        self.delay = delay
        self.fail = fail
        self.gate = threading.Event()
        self.gate.set()

    def read(self, read):
        self.gate.wait(10)
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return super().read(read)


def make_worker(reader, max_queue=2, timeout_s=60.0) -> Worker:
    w = Worker("fake", "fake", lambda: (None, reader), SETTINGS, max_queue=max_queue, timeout_s=timeout_s)
    w.start().result(5)
    return w


def test_worker_answers_and_reports_queue_wait():
    w = make_worker(SlowReader())
    body = w.submit(decision()).future.result(5)
    assert body["model"] == "fake" and body["answers"]["q0"]["type"] == "noul"
    assert 0 <= body["diagnostics"]["timing"]["queue_ms"] < 1000
    w.stop()
    assert w.join(5)


def test_worker_back_pressure_and_retry_after():
    reader = SlowReader()
    reader.gate.clear()  # reads block until released
    w = make_worker(reader, max_queue=2)
    running = w.submit(decision())
    deadline = time.monotonic() + 5
    while not w.snapshot()["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    queued = [w.submit(decision()), w.submit(decision())]
    with pytest.raises(Overloaded) as info:
        w.submit(decision())
    assert info.value.status == 503 and 1 <= info.value.retry_after <= 5
    assert w.snapshot()["waiting"] == 2 and w.counts["overloaded"] == 1
    reader.gate.set()
    for job in [running, *queued]:
        assert job.future.result(5)["answers"]
    w.stop()
    assert w.join(5)


def _retry_after(w) -> int:
    with w._cond:
        return w._retry_after_locked()


def test_retry_after_grows_with_service_time_and_is_capped():
    w = make_worker(SlowReader())
    w._service_s.extend([1.6] * 4)
    assert _retry_after(w) == 2
    w._service_s.extend([30.0] * 16)
    assert _retry_after(w) == 5
    w._service_s.clear()
    w._service_s.extend([0.01] * 4)
    assert _retry_after(w) == 1
    w.stop()


def test_max_queue_zero_takes_only_an_idle_worker():
    reader = SlowReader()
    reader.gate.clear()
    w = make_worker(reader, max_queue=0)
    first = w.submit(decision())
    with pytest.raises(Overloaded):
        w.submit(decision())
    reader.gate.set()
    first.future.result(5)
    w.stop()


def test_cancel_queued_and_running():
    reader = SlowReader()
    reader.gate.clear()
    w = make_worker(reader, max_queue=4)
    running = w.submit(decision(n=3, samples=4))
    while not w.snapshot()["running"]:
        time.sleep(0.01)
    queued = w.submit(decision())
    w.cancel(queued)
    with pytest.raises(Cancelled):
        queued.future.result(1)
    assert w.snapshot()["waiting"] == 0
    w.cancel(running)
    reader.gate.set()
    with pytest.raises(Cancelled):
        running.future.result(5)
    # Stopped at its next read: one read of its many ran.
    assert len(reader.reads) <= 2
    assert w.submit(decision()).future.result(5)["answers"]
    assert w.counts["cancelled"] == 2
    w.stop()


def test_timeout_counts_from_leaving_the_queue():
    reader = SlowReader(delay=0.05)
    reader.gate.clear()
    w = make_worker(reader, max_queue=4, timeout_s=0.2)
    first = w.submit(decision())
    second = w.submit(decision())
    time.sleep(0.4)  # the first holds the worker past the timeout; the second waits
    reader.gate.set()
    with pytest.raises(Timeout) as info:
        first.future.result(5)
    assert info.value.status == 504
    # The second waited longer than the timeout in the queue, and that does not count.
    body = second.future.result(5)
    assert body["diagnostics"]["timing"]["queue_ms"] >= 300
    # A decision of many reads (8 distinct orders of an 8-option choice) is
    # stopped at a read past the deadline.
    many = parse_decision({"state": "s", "samples": 8, "questions": {
        "pick": {"type": "choice", "criteria": {f"o{i}": None for i in range(8)}}}}, SETTINGS)
    with pytest.raises(Timeout):
        w.submit(many).future.result(5)
    assert len(reader.reads) < 2 + 8
    w.stop()


def test_engine_failure_is_a_500_and_the_worker_keeps_serving():
    reader = SlowReader(fail=RuntimeError("llama_decode returned -1"))
    w = make_worker(reader)
    with pytest.raises(ServerError) as info:
        w.submit(decision()).future.result(5)
    assert info.value.status == 500 and "llama_decode" in info.value.message
    reader.fail = None
    assert w.submit(decision()).future.result(5)["answers"]
    w.stop()


def test_stop_answers_queued_decisions_503_and_lets_the_running_one_finish():
    reader = SlowReader()
    reader.gate.clear()
    w = make_worker(reader, max_queue=4)
    running = w.submit(decision())
    while not w.snapshot()["running"]:
        time.sleep(0.01)
    queued = w.submit(decision())
    w.stop()
    with pytest.raises(Overloaded):
        queued.future.result(1)
    with pytest.raises(Overloaded):
        w.submit(decision())
    reader.gate.set()
    assert running.future.result(5)["answers"]
    assert w.join(5)


def test_load_failure_is_reported_through_the_load_future():
    def load():
        raise RuntimeError("no such architecture")

    w = Worker("bad", "bad", load, SETTINGS, max_queue=1, timeout_s=1)
    with pytest.raises(RuntimeError):
        w.start().result(5)
    assert w.join(5)


# -- bodies ----------------------------------------------------------------------------

def test_encodings():
    assert bodies.encodings_of(None) == []
    assert bodies.encodings_of("identity") == []
    assert bodies.encodings_of("GZIP") == ["gzip"]
    assert bodies.encodings_of("gzip, zstd") == ["gzip", "zstd"]
    for bad in ("br", "deflate", "gzip, br"):
        with pytest.raises(UnsupportedMediaType):
            bodies.encodings_of(bad)


def test_bounded_decompression():
    data = b'{"state": "x"}'
    assert bodies.decode(zstandard.ZstdCompressor().compress(data), ["zstd"], 100) == data
    assert bodies.decode(gzip.compress(data), ["gzip"], 100) == data
    # Applied gzip first, then zstd: undone in reverse.
    both = zstandard.ZstdCompressor().compress(gzip.compress(data))
    assert bodies.decode(both, ["gzip", "zstd"], 100) == data
    assert bodies.decode(gzip.compress(b"ab") + gzip.compress(b"cd"), ["gzip"], 100) == b"abcd"
    bomb = b"\x00" * (256 << 20)
    for coding, packed in (("zstd", zstandard.ZstdCompressor().compress(bomb)), ("gzip", gzip.compress(bomb, 1))):
        t0 = time.monotonic()
        with pytest.raises(RequestTooLarge):
            bodies.decode(packed, [coding], 1 << 20)
        assert time.monotonic() - t0 < 2
    exact = b"x" * 1000
    assert bodies.decode(gzip.compress(exact), ["gzip"], 1000) == exact
    with pytest.raises(RequestTooLarge):
        bodies.decode(gzip.compress(exact + b"x"), ["gzip"], 1000)
    for coding, junk in (("zstd", b"junk"), ("gzip", b"junk"), ("gzip", gzip.compress(data)[:-6])):
        with pytest.raises(InvalidRequest):
            bodies.decode(junk, [coding], 100)


def test_json_object_only():
    assert bodies.parse_json_object(b'{"a": 1}') == {"a": 1}
    assert bodies.parse_json_object(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}
    for bad in (b"", b"  ", b"[]", b"1", b"{", b"\xff", b"[" * 100000):
        with pytest.raises(InvalidRequest):
            bodies.parse_json_object(bad)


# -- resolution ------------------------------------------------------------------------

def manager(data) -> ModelManager:
    return ModelManager(parse_config(data))


def test_resolution_with_a_fallback():
    m = manager({
        "models": {"big": {"path": "/x/big.gguf"}, "small": {"path": "/x/small.gguf", "profiles": ["fast"]}},
        "aliases": {"jev-latest": "big"},
        "profiles": {"fast": {"n_ctx": 512}, "slow": {"n_ctx": 8192}},
        "server": {"systemone": {"model": "small"}},
    })
    assert m.resolve("big") == "big"
    assert m.resolve("jev-latest") == "big"
    assert m.resolve(None) == "small"
    assert m.resolve("typesafe/jev-1.13") == "small"
    assert m.resolve("/x/big.gguf") == "small"  # never a path
    assert m.profile_for("small", "fast") == "fast"
    assert m.profile_for("small", None) is None
    with pytest.raises(UnknownProfile):
        m.profile_for("small", "slow")  # configured, but small lists only fast
    with pytest.raises(UnknownProfile):
        m.profile_for("big", "nope")
    assert m.profile_for("big", "slow") == "slow"  # big lists no profiles: any configured one


def test_resolution_without_a_fallback():
    m = manager({"models": {"a": {"path": "/x/a.gguf"}, "b": {"path": "/x/b.gguf"}}})
    assert m.resolve("a") == "a"
    with pytest.raises(NoModelSpecified):
        m.resolve(None)
    with pytest.raises(ModelNotFound):
        m.resolve("jev-latest")
    only = manager({"models": {"a": {"path": "/x/a.gguf"}}})
    assert only.resolve(None) == "a" and only.resolve("zzz") == "a"
    defaults = manager({"models": {"a": {"path": "/x/a.gguf"}, "b": {"path": "/x/b.gguf", "profiles": ["p"]}},
                        "profiles": {"p": {"n_ctx": 128}, "q": {"n_ctx": 256}},
                        "server": {"defaults": {"model": "b", "profile": "q"}}})
    assert defaults.resolve(None) == "b"
    # The default profile applies where the model allows it.
    assert defaults.profile_for("a", None) == "q"
    assert defaults.profile_for("b", None) is None


# -- envelope for FastAPI's own errors and anything unexpected -----------------------

def test_validation_errors_and_unexpected_exceptions_use_the_envelope():
    from fastapi.testclient import TestClient

    from gmlx.server.app import create_app

    app = create_app(parse_config({"models": {"a": {"path": "/nowhere/a.gguf"}}}))

    @app.get("/probe")
    async def probe(n: int) -> dict:
        return {"n": n}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("kaboom")

    with TestClient(app) as client:
        assert client.get("/probe?n=3").json() == {"n": 3}
        r = client.get("/probe?n=three")
        assert r.status_code == 422
        assert r.json()["error"]["type"] == "validation_error" and r.json()["error"]["code"] == 422
        assert r.headers["x-request-id"]
        r = client.get("/boom")
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert "kaboom" not in r.text
        assert r.headers["x-request-id"] == r.headers["x-typesafe-request-id"]
        # The app keeps serving, and a missing model file is a 404.
        r = client.post("/v1/systemone", json={"state": "s", "questions": {"q": {"type": "noul"}}})
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_file_missing"
