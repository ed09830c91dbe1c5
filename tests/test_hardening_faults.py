"""Faults under a real `gmlx serve`: bad model files, engine failures, client
disconnects, SIGTERM. Every fault is real (files on disk, model weights, a
configured chat template), none is mocked or switched on by a test hook.

One server for the module (preloaded, so bad files fail at the start of
serving): a tiny Qwen3 as the fallback, and beside it
- truncated / garbage / dupvocab / badtemplate: files or configs that cannot be
  served (a GGUF cut in half, random bytes, a vocabulary with a duplicate token
  on which llama.cpp itself aborts, a chat template that raises);
- nan: weights that make every logit NaN;
- faulty: a chat template that raises in the second read of a FAULT decision
  (admission and the first read pass), an exception inside the worker;
- doomed, inplace, renamed, nommap: copies whose files are deleted or
  rewritten under the running server.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402
from server_harness import assert_error, noul_body, start  # noqa: E402

from gmlx.config import parse_config  # noqa: E402
from gmlx.decisions.parse import parse_decision  # noqa: E402
from gmlx.decisions.orders import option_order  # noqa: E402
from gmlx.decisions.seeds import sample_seed  # noqa: E402
from gmlx.decisions.types import DecisionSettings  # noqa: E402

OPTIONS = ["o1", "o2", "o3", "o4", "o5"]
# A ChatML template that raises when a FAULT prompt lists its options in any
# order but the request's, which only a choice's second sample does (SPEC 4.5).
FAULTY_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if 'FAULT' in message['content'] and 'B. ' in message['content'] and 'A. o1' not in message['content'] -%}"
    "{{ raise_exception('fault injected by the faulty chat template') }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def dupvocab_qwen3(path: Path) -> Path:
    """A tiny Qwen3 whose last token repeats the one before it: llama.cpp
    GGML_ASSERTs (and aborts its process) reading such a vocabulary."""
    vocab = tiny_gguf.tiny_vocab()
    tokens = list(vocab.tokens)
    tokens[-1] = tokens[-2]
    return tiny_gguf.build_qwen3(path, vocab=dataclasses.replace(vocab, tokens=tuple(tokens)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    tiny = tiny_gguf.build_qwen3(d / "tiny.gguf")
    data = tiny.read_bytes()
    for name in ("doomed", "inplace", "renamed", "nommap"):
        shutil.copy(tiny, d / f"{name}.gguf")
    (d / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (d / "garbage.gguf").write_bytes(bytes(range(256)) * 64)
    dupvocab_qwen3(d / "dupvocab.gguf")
    tiny_gguf.build_qwen3(d / "nan.gguf", norm_jitter=float("nan"))
    models = {
        "tiny": {"path": str(tiny), "n_ctx": 2048},
        "faulty": {"path": str(tiny), "n_ctx": 512, "chat_template": FAULTY_TEMPLATE},
        "badtemplate": {"path": str(tiny), "chat_template": "{{ raise_exception('this template is broken') }}"},
        "nan": {"path": str(d / "nan.gguf"), "n_ctx": 512},
        "nommap": {"path": str(d / "nommap.gguf"), "n_ctx": 512, "use_mmap": False},
    }
    for name in ("doomed", "inplace", "renamed", "truncated", "garbage", "dupvocab"):
        models[name] = {"path": str(d / f"{name}.gguf"), "n_ctx": 512}
    config = {"models": models, "server": {"systemone": {"model": "tiny"}, "max_queue": 4}}
    parse_config(config)  # the test's own config must be valid
    s = start(d, config, preload=True)
    s.dir = d
    yield s
    s.stop()


def slot(server, model: str) -> dict:
    return server.health()["models"][model]["slots"]["default"]


def decide(server, model: str, path: str = "/v1/systemone", **top) -> httpx.Response:
    body = noul_body(model=model, **top) if path != "/v1/decisions" else {
        "model": model, "input": "The customer says: hello!",
        "questions": [{"type": "predicate", "instructions": "Is the customer happy?"}],
    }
    return httpx.post(server.url + path, json=body, timeout=120)


def ok(r: httpx.Response, model: str) -> dict:
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model
    return body


# -- bad files at the start of serving ------------------------------------------------------

@pytest.mark.parametrize(("model", "words"), [
    ("truncated", "truncated: the header promises tensor data"),  # refused before llama.cpp maps it
    ("garbage", "not a readable GGUF"),
    ("dupvocab", "GGML_ASSERT"),
    ("badtemplate", "does not render"),
])
def test_a_bad_model_fails_its_load_with_a_clear_error_and_the_server_serves(server, model, words):
    # Preloaded at start: the failure is already on /health, the process alive.
    s = slot(server, model)
    assert s["state"] == "failed", s
    assert s["error"]["type"] == "server_error" and model in s["error"]["message"]
    assert words in s["error"]["message"], s["error"]
    for path in ("/v1/systemone", "/v1/decisions"):
        err = assert_error(decide(server, model, path), 500, "server_error", "model")
        assert words in err["message"], err
    assert server.proc.poll() is None
    ok(decide(server, "tiny"), "tiny")
    assert slot(server, "tiny")["state"] == "ready"


def test_the_vocabulary_probe_is_what_saves_the_server(server):
    # Without the child-process probe, loading dupvocab aborts the process that loads it.
    code = ("import sys; from gmlx.engine.model import load_model; from gmlx.config import LOAD_DEFAULTS; "
            "load_model('x', sys.argv[1], dict(LOAD_DEFAULTS))")
    r = subprocess.run([sys.executable, "-c", code, str(server.dir / "dupvocab.gguf")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stderr[-2000:])
    assert "GGML_ASSERT" in r.stderr


# -- files that change under the running server --------------------------------------------

def test_model_file_deleted_after_start_is_404_on_both_routes_while_others_serve(server):
    for path in ("/v1/systemone", "/v1/decisions"):
        ok(decide(server, "doomed", path), "doomed")
    (server.dir / "doomed.gguf").rename(server.dir / "doomed.gguf.away")
    try:
        for path in ("/v1/systemone", "/v1/decisions"):
            assert_error(decide(server, "doomed", path), 404, "model_file_missing", "model")
            ok(decide(server, "tiny", path), "tiny")
        health = server.health()["models"]["doomed"]
        assert health["file_present"] is False
    finally:
        (server.dir / "doomed.gguf.away").rename(server.dir / "doomed.gguf")
    # The file is back: the loaded model answers again.
    ok(decide(server, "doomed"), "doomed")
    assert server.health()["models"]["doomed"]["file_present"] is True


def test_file_rewritten_under_a_loaded_model(server):
    before = {m: ok(decide(server, m), m)["answers"] for m in ("inplace", "renamed", "nommap")}
    # Overwritten in place (same size, all bits set: every weight NaN), while
    # llama.cpp maps it: the next decision reads NaN logits -> 500, not NaN answers.
    p = server.dir / "inplace.gguf"
    size = p.stat().st_size
    with open(p, "r+b") as fh:
        fh.write(b"\xff" * size)
    err = assert_error(decide(server, "inplace"), 500, "server_error")
    assert "non-finite" in err["message"], err
    # Replaced by a new file (rename): the old mapping stays valid and keeps serving.
    tmp = server.dir / "renamed.tmp"
    tmp.write_bytes(b"\x00" * 1000)
    os.replace(tmp, server.dir / "renamed.gguf")
    assert ok(decide(server, "renamed"), "renamed")["answers"] == before["renamed"]
    # use_mmap: false reads the weights into memory: truncating the file changes nothing.
    with open(server.dir / "nommap.gguf", "r+b") as fh:
        fh.truncate(1000)
    assert ok(decide(server, "nommap"), "nommap")["answers"] == before["nommap"]
    assert server.proc.poll() is None
    ok(decide(server, "tiny"), "tiny")


# -- engine failures -------------------------------------------------------------------------

def fault_body(samples: int) -> dict:
    """A FAULT decision whose second sample lists the options out of request order."""
    body = {"model": "faulty", "state": "FAULT in the billing system",
            "questions": {"pick": {"type": "choice", "instructions": "Which one?",
                                   "criteria": {o: None for o in OPTIONS}}},
            "samples": samples}
    q = parse_decision(body, DecisionSettings()).questions[0]
    body["seed"] = next(s for s in range(100) if option_order(q, 1, sample_seed(s, 0, 0, 1))[0] != 0)
    return body


def test_an_exception_inside_a_read_is_a_500_and_the_same_worker_serves_the_next(server):
    before = slot(server, "faulty")["queue"]
    r = httpx.post(server.url + "/v1/systemone", json=fault_body(samples=2), timeout=60)
    err = assert_error(r, 500, "server_error", "model")
    assert "engine failed" in err["message"] and "fault injected" in err["message"], err
    queue = slot(server, "faulty")["queue"]
    assert queue["failed"] == before["failed"] + 1
    assert queue["running"] is False and queue["waiting"] == 0
    # The same worker answers the next decisions: one read of the FAULT state, and a plain one.
    ok(httpx.post(server.url + "/v1/systemone", json=fault_body(samples=1), timeout=60), "faulty")
    ok(decide(server, "faulty"), "faulty")
    after = slot(server, "faulty")["queue"]
    assert after["served"] == queue["served"] + 2 and after["failed"] == queue["failed"]
    assert server.proc.poll() is None


def test_nan_logits_are_a_500_and_the_server_keeps_serving(server):
    for path in ("/v1/systemone", "/v1/decisions"):
        err = assert_error(decide(server, "nan", path), 500, "server_error")
        assert "non-finite" in err["message"], err
        ok(decide(server, "tiny", path), "tiny")
    queue = slot(server, "nan")["queue"]
    assert queue["failed"] >= 2 and queue["running"] is False


# -- client disconnects ----------------------------------------------------------------------

def long_openai_body() -> dict:
    """64 choices of 26 values on /v1/decisions: "auto" samples -> four reads of ~2 s."""
    choices = [{"value": f"value {chr(65 + i)}", "description": f"option {i}"} for i in range(26)]
    return {"model": "tiny", "input": "A long ticket about many things.",
            "questions": [{"type": "choice", "instructions": f"Aspect {i}?", "choices": choices} for i in range(64)]}


def test_client_disconnects_free_the_worker(server):
    before = slot(server, "tiny")["queue"]
    disconnects = server.health()["requests"]["disconnects"]
    errors: list[BaseException] = []

    def go(body, path, timeout):
        try:
            httpx.post(server.url + path, json=body, timeout=timeout)
        except httpx.ReadTimeout:
            pass
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    t0 = time.monotonic()
    running = threading.Thread(target=go, args=(long_openai_body(), "/v1/decisions", 1.5))
    running.start()
    while not slot(server, "tiny")["queue"]["running"]:
        assert time.monotonic() - t0 < 10
        time.sleep(0.02)
    # A second decision waits behind it, and its client gives up while it waits.
    queued = threading.Thread(target=go, args=(noul_body(), "/v1/systemone", 0.5))
    queued.start()
    queued.join()
    running.join()
    assert not errors, errors
    r = httpx.post(server.url + "/v1/systemone", json=noul_body(), timeout=60)
    body = ok(r, "tiny")
    elapsed = time.monotonic() - t0
    # Left alone, the long decision holds the worker for about four reads (8+ s);
    # cancelled, it stops at its next read.
    queue_ms = body["diagnostics"]["timing"]["queue_ms"]
    assert queue_ms < 4000, body["diagnostics"]["timing"]
    assert elapsed < 7, elapsed
    queue = slot(server, "tiny")["queue"]
    assert queue["cancelled"] == before["cancelled"] + 2, queue
    assert queue["running"] is False and queue["waiting"] == 0
    assert server.health()["requests"]["disconnects"] == disconnects + 2


# -- SIGTERM ----------------------------------------------------------------------------------

@pytest.fixture
def own_server(tmp_path):
    tiny = tiny_gguf.build_qwen3(tmp_path / "tiny.gguf")
    s = start(tmp_path, {"models": {"tiny": {"path": str(tiny), "n_ctx": 2048}}, "server": {"max_queue": 4}},
              preload=True)
    yield s
    s.stop()


def test_sigterm_finishes_the_running_decision_refuses_the_queued_one_and_exits_0(own_server):
    s = own_server
    results: dict[str, httpx.Response | BaseException] = {}

    def go(name, path, body):
        try:
            results[name] = httpx.post(s.url + path, json=body, timeout=60)
        except BaseException as err:  # noqa: BLE001
            results[name] = err

    long = {"state": "A long ticket.", "samples": 2, "questions": {
        f"q{i}": {"type": "choice", "instructions": f"Aspect {i}?",
                  "criteria": {f"v{chr(65 + j)}": None for j in range(26)}} for i in range(64)}}
    running = threading.Thread(target=go, args=("running", "/v1/systemone", long))
    running.start()
    deadline = time.monotonic() + 20
    while not s.health()["models"]["tiny"]["slots"]["default"]["queue"]["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    queued = threading.Thread(target=go, args=("queued", "/v1/decisions", {
        "input": "hello", "questions": [{"type": "predicate", "instructions": "Happy?"}]}))
    queued.start()
    while s.health()["models"]["tiny"]["slots"]["default"]["queue"]["waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    queued.join(30)
    running.join(60)
    # The queued decision: a clean 503 in the envelope, with Retry-After.
    assert isinstance(results["queued"], httpx.Response), results["queued"]
    err = assert_error(results["queued"], 503, "overloaded")
    assert "shutting down" in err["message"]
    assert 1 <= int(results["queued"].headers["Retry-After"]) <= 5
    # The running one: answered in full, no reset connection.
    assert isinstance(results["running"], httpx.Response), results["running"]
    ok(results["running"], "tiny")
    assert len(results["running"].json()["answers"]) == 64
    # A graceful stop exits 0 (uvicorn would re-raise SIGTERM: status -15).
    assert s.proc.wait(30) == 0, s.log()[-3000:]
    assert time.monotonic() - t0 < 30
    assert "Application shutdown complete" in s.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health", timeout=2)


def test_sigterm_on_an_idle_server_exits_0_at_once(own_server):
    t0 = time.monotonic()
    own_server.proc.send_signal(signal.SIGTERM)
    assert own_server.proc.wait(15) == 0, own_server.log()[-3000:]
    assert time.monotonic() - t0 < 5
