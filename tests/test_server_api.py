"""The HTTP server against a real `gmlx serve` process, embedded Gemma model.

One server for the module (fallback model `gemma`, no API key, max_queue 1,
a 64 KiB body limit) with extra models for the error paths: a missing file,
a model with no read strategy (501), a corrupt GGUF (500), a second copy of
Gemma to catch a load in progress (503 model_loading), and a tiny Qwen3 copy
that is deleted after it loads (404 model_file_missing while others serve).
"""

from __future__ import annotations

import gzip
import math
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402
from server_harness import assert_error, dumps, long_body, noul_body, start  # noqa: E402

from fake_reader import ticket_body  # noqa: E402

LIMIT = 65536


def build_plain_llama(path: Path) -> Path:
    """A tiny llama-architecture GGUF: no chat template in the file and no
    built-in one for the architecture, so no read strategy (SPEC 3: 501)."""
    return tiny_gguf.build_gguf(path, "llama")


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    d = tmp_path_factory.mktemp("server_api")
    plain = build_plain_llama(d / "plain-llama.gguf")
    doomed = tiny_gguf.build_qwen3(d / "doomed-qwen3.gguf")
    broken = d / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    config = {
        "models": {
            "gemma": {"path": str(gemma_path), "n_ctx": 1024, "profiles": ["small"]},
            "ghost": {"path": str(d / "missing.gguf")},
            "plain": {"path": str(plain), "n_ctx": 256},
            "broken": {"path": str(broken)},
            "doomed": {"path": str(doomed), "n_ctx": 512},
            "second": {"path": str(gemma_path), "n_ctx": 512},
        },
        "aliases": {"jev": "gemma"},
        "profiles": {"small": {"n_ctx": 256}, "other": {"n_ctx": 512}},
        "server": {"systemone": {"model": "gemma"}, "max_queue": 1, "max_body_bytes": LIMIT},
    }
    s = start(d, config)
    # Load the fallback model once so timings below measure decisions, not the load.
    r = s.post(noul_body())
    assert r.status_code == 200, r.text
    yield s
    s.stop()


def check_decision(r: httpx.Response, model: str = "gemma") -> dict:
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "structured_decision"
    assert body["model"] == model
    assert re.fullmatch(r"decision-[0-9a-f]+", body["id"])
    assert r.headers["x-request-id"] == body["id"]
    assert r.headers["x-typesafe-request-id"] == body["id"]
    assert all(isinstance(v, int) for v in body["usage"].values())
    for a in body["answers"].values():
        if a is None:
            continue
        assert a["type"] in ("noul", "choice", "score")
        if "probabilities" in a:
            assert math.isclose(sum(a["probabilities"].values()), 1.0, abs_tol=1e-6)
    return body


# -- decisions ----------------------------------------------------------------------

def test_ticket_on_both_routes_gives_the_same_answers(server):
    a = check_decision(server.post(ticket_body(seed=7), path="/v1/systemone"))
    b = check_decision(server.post(ticket_body(seed=7), path="/systemone"))
    assert list(a["answers"]) == ["urgent", "team", "severity", "refund"]
    assert a["answers"] == b["answers"]
    assert a["answers"]["team"]["choice"] in ("billing", "infra", "product")
    assert set(a["answers"]["severity"]["legend"]) == {"0", "1", "2"}
    assert 0.0 <= a["answers"]["urgent"]["noul"] <= 1.0
    assert a["id"] != b["id"]
    assert a["diagnostics"]["strategy"] == "next-token"
    assert a["diagnostics"]["timing"]["reads"] >= 1
    # One log line per decision, naming the model and the top picks.
    server.log_line(rf"decision {a['id']} model=gemma urgent=\S+ team=\w+\(\S+\) .*queue_ms=")


def test_trace_context_is_logged_with_the_decision(server):
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    r = server.post(noul_body(), headers={"traceparent": tp, "tracestate": "vendor=abc,other=1"})
    body = check_decision(r)
    line = server.log_line(f"decision {body['id']} ")
    assert f"traceparent={tp}" in line and "tracestate=vendor=abc,other=1" in line
    # Without the headers the line carries none.
    plain = check_decision(server.post(noul_body()))
    line = server.log_line(f"decision {plain['id']} ")
    assert "traceparent" not in line


@pytest.mark.parametrize("name", ["jev-latest", "typesafe/jev-1.13", None, "jev", "gemma"])
def test_model_names_fall_back_to_the_systemone_model(server, name):
    body = noul_body() if name is None else noul_body(model=name)
    assert check_decision(server.post(body))["model"] == "gemma"


def test_model_field_is_never_a_path(server, gemma_path):
    # A path to a real GGUF is just an unknown name: the fallback answers.
    assert check_decision(server.post(noul_body(model=str(gemma_path))))["model"] == "gemma"


def test_unknown_fields_are_ignored_with_a_warning(server):
    check_decision(server.post(noul_body(extra_client_field={"x": 1}, steps=3)))
    assert "ignoring unsupported parameter(s): extra_client_field, steps" in server.log()


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_compressed_bodies(server, encoding):
    before = server.health()["requests"]["content_encoding"].get(encoding, 0)
    body = noul_body(seed=3)
    raw = dumps(body)
    packed = zstandard.ZstdCompressor().compress(raw) if encoding == "zstd" else gzip.compress(raw)
    r = server.post(content=packed, headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    plain = check_decision(server.post(body))
    assert check_decision(r)["answers"] == plain["answers"]
    assert server.health()["requests"]["content_encoding"][encoding] == before + 1


def test_any_bearer_token_is_accepted_without_a_key(server):
    headers = {"Authorization": "Bearer whatever-the-client-has"}
    check_decision(server.post(noul_body(), headers=headers))
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Basic Zm9vOmJhcg=="}).status_code == 200


# -- the error table ---------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"42", b"null", b"{", b"", b"\xff\xfe{}", b"[" * 50000])
def test_400_body_not_a_json_object(server, raw):
    assert_error(server.post(content=raw, headers={"Content-Type": "application/json"}), 400, "invalid_request_error")


def test_400_images(server):
    err = assert_error(server.post(noul_body(images=["aGVsbG8="])), 400, "invalid_request_error", "images")
    assert "image" in err["message"]
    # An empty list is harmless.
    check_decision(server.post(noul_body(images=[])))


def test_400_multipart(server):
    files = {"request": ("request.json", dumps(noul_body()), "application/json"),
             "asset-0": ("a.png", b"\x89PNG....", "image/png")}
    r = httpx.post(server.url + "/v1/systemone", files=files)
    assert_error(r, 400, "invalid_request_error", "images")


def test_400_prompt_longer_than_the_context(server):
    r = server.post(noul_body(profile="small", state="word " * 600))
    err = assert_error(r, 400, "invalid_request_error")
    assert "256" in err["message"]
    # The same decision with a short state fits the small context.
    check_decision(server.post(noul_body(profile="small")))


@pytest.mark.parametrize("profile", ["nope", "other"])
def test_400_unknown_profile(server, profile):
    # "nope" is not configured; "other" is, but gemma does not list it.
    assert_error(server.post(noul_body(profile=profile)), 400, "unknown_profile", "profile")


def test_404_model_file_missing(server):
    assert_error(server.post(noul_body(model="ghost")), 404, "model_file_missing", "model")
    health = server.health()["models"]["ghost"]
    assert health["state"] == "unloaded" and health["file_present"] is False


def test_404_when_a_loaded_models_file_is_deleted(server):
    assert check_decision(server.post(noul_body(model="doomed")), model="doomed")
    path = server.config_path.parent / "doomed-qwen3.gguf"
    path.unlink()
    assert_error(server.post(noul_body(model="doomed")), 404, "model_file_missing", "model")
    # The others keep serving.
    check_decision(server.post(noul_body()))
    assert server.health()["models"]["doomed"]["file_present"] is False


def test_413_body_too_large(server):
    big = noul_body(state="x" * (LIMIT + 10))
    assert_error(server.post(big), 413, "request_too_large")
    # Without Content-Length (chunked), the limit holds while reading.
    data = dumps(big)
    chunks = (data[i:i + 4096] for i in range(0, len(data), 4096))
    r = httpx.post(server.url + "/v1/systemone", content=chunks, headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "request_too_large")


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_413_after_decompression_bomb(server, encoding):
    # 64 MiB of JSON whitespace packed into a few KiB: refused once the output passes the limit.
    payload = b"{" + b" " * (64 << 20) + b"}"
    packed = zstandard.ZstdCompressor(level=3).compress(payload) if encoding == "zstd" else gzip.compress(payload, 9)
    assert len(packed) < LIMIT
    t0 = time.monotonic()
    r = server.post(content=packed, headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    assert_error(r, 413, "request_too_large")
    assert time.monotonic() - t0 < 5
    # Just under the limit after decompression is fine (and then fails as a decision, not a size).
    ok = dumps(noul_body(state="y" * (LIMIT // 2)))
    packed = zstandard.ZstdCompressor().compress(ok) if encoding == "zstd" else gzip.compress(ok)
    r = server.post(content=packed, headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    assert r.status_code in (200, 400), r.text


@pytest.mark.parametrize("encoding", ["br", "deflate", "compress"])
def test_415_unsupported_content_encoding(server, encoding):
    r = server.post(content=b"\x00\x01\x02", headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    assert_error(r, 415, "unsupported_media_type")


def test_400_corrupt_compressed_body(server):
    r = server.post(content=b"not zstd at all", headers={"Content-Encoding": "zstd"})
    assert_error(r, 400, "invalid_request_error")


@pytest.mark.parametrize("body", [
    {"state": "x", "questions": {"a": {"type": "maybe"}}},
    {"state": "x", "questions": {}},
    {"state": "x", "questions": {"a": {"type": "noul", "colour": "red"}}},
    {"state": "x", "questions": {"a": {"type": "choice", "criteria": {"only": None}}}},
    {"questions": {"a": {"type": "noul"}}},
    {"state": "x", "questions": {"a": {"type": "noul"}}, "samples": 0},
    {"state": "x", "questions": {"a": {"type": "noul"}}, "model": 5},
])
def test_422_validation(server, body):
    assert_error(server.post(body), 422, "validation_error")


def test_500_model_that_fails_to_load_and_the_server_keeps_serving(server):
    err = assert_error(server.post(noul_body(model="broken")), 500, "server_error", "model")
    assert "broken" in err["message"]
    assert server.health()["models"]["broken"]["state"] == "failed"
    # Asked again: the same failure, no new load; and the others keep serving.
    assert_error(server.post(noul_body(model="broken")), 500, "server_error")
    check_decision(server.post(noul_body()))


def test_501_model_without_a_read_strategy(server):
    err = assert_error(server.post(noul_body(model="plain")), 501, "not_implemented", "model")
    assert "llama" in err["message"]
    assert_error(server.post(noul_body(model="plain")), 501, "not_implemented")
    slot = server.health()["models"]["plain"]["slots"]["default"]
    assert slot["error"]["type"] == "not_implemented"
    assert slot["architecture"] == "llama" and slot["strategy"] is None


def test_503_model_loading_while_another_request_loads_it(server):
    # One request starts the load and waits for it; the others, arriving while
    # it loads, get 503 model_loading. Which one loads is up to the race.
    responses: list[httpx.Response] = []
    states: set[str] = set()

    def post():
        responses.append(server.post(noul_body(model="second")))

    def watch():
        # Until every request is back: the load may be this thread's or the main one's.
        while not finished.is_set():
            states.add(server.health()["models"]["second"]["state"])
            time.sleep(0.02)

    finished = threading.Event()

    assert server.health()["models"]["second"]["state"] == "unloaded"
    loader = threading.Thread(target=post)
    watcher = threading.Thread(target=watch)
    loader.start()
    watcher.start()
    try:
        while loader.is_alive():
            post()
            time.sleep(0.05)
    finally:
        loader.join()
        finished.set()
        watcher.join()
    statuses = [r.status_code for r in responses]
    assert 200 in statuses and 503 in statuses, statuses
    for r in responses:
        if r.status_code == 503:
            assert_error(r, 503, "model_loading", "model")
            assert 1 <= int(r.headers["Retry-After"]) <= 5
        else:
            check_decision(r, model="second")
    assert "loading" in states, states
    assert server.health()["models"]["second"]["state"] == "ready"


def test_503_overloaded_burst(server):
    n = 6
    results: list[httpx.Response] = [None] * n  # type: ignore[list-item]
    body = long_body(n=3, samples=2)
    barrier = threading.Barrier(n)

    def go(i):
        barrier.wait()
        results[i] = server.post(body)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) <= {200, 503}, statuses
    assert 200 in statuses and 503 in statuses, statuses
    for r in results:
        if r.status_code == 503:
            assert_error(r, 503, "overloaded")
            assert 1 <= int(r.headers["Retry-After"]) <= 5
        else:
            check_decision(r)
    assert server.health()["models"]["gemma"]["slots"]["default"]["queue"]["overloaded"] >= 1


def test_disconnect_frees_the_worker(server):
    before = server.health()["models"]["gemma"]["slots"]["default"]["queue"]["cancelled"]
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        server.post(long_body(n=8, samples=8), timeout=1.5)
    r = server.post(noul_body())
    elapsed = time.monotonic() - t0
    body = check_decision(r)
    # The long decision (about ten reads of eight questions) would hold the
    # worker for many seconds; cancelled, it stops at its next read.
    assert body["diagnostics"]["timing"]["queue_ms"] < 6000, body["diagnostics"]["timing"]
    assert elapsed < 10
    queue = server.health()["models"]["gemma"]["slots"]["default"]["queue"]
    assert queue["cancelled"] == before + 1
    assert queue["running"] is False and queue["waiting"] == 0


def test_no_input_produces_a_500(server):
    bodies = [
        {"state": {"deep": [[[[[]]]]]}, "questions": {"a": {"type": "noul", "instructions": None, "criteria": None}},
         "samples": 1},
        {"state": "x", "questions": [1, 2]},
        {"state": "x", "questions": {"a": None}},
        {"state": "x", "questions": {"": {"type": "noul"}}},
        {"state": "x", "questions": {"a": {"type": "score", "criteria": [1, 2]}}},
        {"state": "x", "questions": {"a": {"type": "noul"}}, "think": "sometimes"},
        {"state": "x", "questions": {"a": {"type": "noul"}}, "profile": ["a"]},
    ]
    for b in bodies:
        r = server.post(b)
        assert r.status_code < 500, (b, r.status_code, r.text)
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for raw in (b'{"state": NaN, "questions": {"a": {"type": "noul"}}}', b'{"a": 1e999999}', b"\x00" * 100,
                b'{"state": "x", "questions": {"a": {"type": "noul"}}, "seed": 1e400}',
                b'{"state": "x", "questions": {"a": {"type": "noul"}}, "samples": Infinity}'):
        r = server.post(content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (raw, r.text)


# -- other routes --------------------------------------------------------------------

def test_models_list_shapes(server):
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    names = ["gemma", "ghost", "plain", "broken", "doomed", "second", "jev"]
    assert [m["id"] for m in body["data"]] == names
    for m in body["data"]:
        assert m["object"] == "model" and m["owned_by"] == "gmlx"
    assert [m["name"] for m in body["models"]] == names
    for m in body["models"]:
        assert set(m) == {"name", "description", "release_date"}
        assert all(isinstance(v, str) and v for v in m.values()), m
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", m["release_date"])
    assert "alias of 'gemma'" in body["models"][-1]["description"]
    assert r.headers["x-request-id"] == r.headers["x-typesafe-request-id"]


def test_health(server):
    h = server.health()
    assert h["status"] == "ok"
    assert h["fallback_model"] == "gemma"
    gemma = h["models"]["gemma"]
    assert gemma["state"] == "ready" and gemma["aliases"] == ["jev"] and gemma["file_present"] is True
    slot = gemma["slots"]["default"]
    assert slot["strategy"] == "next-token" and slot["architecture"] == "gemma3"
    assert slot["queue"]["max_queue"] == 1 and slot["queue"]["served"] >= 1
    assert h["models"]["ghost"]["state"] == "unloaded"
    assert h["requests"]["by_status"]["200"] >= 1


def test_unknown_route_and_method_use_the_envelope(server):
    assert_error(httpx.get(server.url + "/v2/nothing"), 404, "invalid_request_error")
    r = httpx.get(server.url + "/v1/systemone")
    assert_error(r, 405, "invalid_request_error")
    assert r.headers["allow"] == "POST"


def test_openapi_schema(server):
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert {"/v1/systemone", "/systemone", "/v1/models", "/health"} <= set(paths)


def test_keep_alive(server):
    with httpx.Client(base_url=server.url) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
        r = client.post("/v1/systemone", json=noul_body())
        assert r.status_code == 200
        assert r.headers.get("connection", "keep-alive").lower() != "close"


# -- last: this one stops the module's server ----------------------------------------

def test_sigterm_finishes_the_running_decision_and_refuses_the_queued_one(server):
    results: dict[str, httpx.Response] = {}

    def go(name, body):
        results[name] = server.post(body)

    running = threading.Thread(target=go, args=("running", long_body(n=4, samples=3)))
    running.start()
    deadline = time.monotonic() + 30
    while not server.health()["models"]["gemma"]["slots"]["default"]["queue"]["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    queued = threading.Thread(target=go, args=("queued", noul_body()))
    queued.start()
    while server.health()["models"]["gemma"]["slots"]["default"]["queue"]["waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    queued.join(30)
    running.join(60)
    assert_error(results["queued"], 503, "overloaded")
    check_decision(results["running"])
    assert server.proc.wait(30) is not None
    assert "Application shutdown complete" in server.log()

