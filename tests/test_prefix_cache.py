"""The cross-request prefix cache of next-token readers: a decision whose
prompts start like an earlier one's evaluates only the rest, with the same
bits as an uncached evaluation; cache_salt partitions it; usage says how many
tokens came from it."""

from __future__ import annotations

import pytest

from gmlx.config import LOAD_DEFAULTS
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import decide
from gmlx.decisions.types import DecisionSettings
from gmlx.engine.model import load_model
from gmlx.engine.nexttoken import NextTokenReader

SETTINGS = DecisionSettings()
STATE_1 = ("Ticket 1: I was charged twice for my March invoice, once on the 3rd and again on the 5th. "
           "The duplicate pushed my account into overdraft and my bank added a fee. Please refund both. ") * 3
STATE_2 = ("Ticket 2: the export page spins forever in Firefox and Chrome; our accountant needs the CSV "
           "files by Friday for the quarterly filing, so this is getting urgent. ") * 3
SET_A = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
         "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "infra": None, "product": None}}}
SET_B = {"urgent": {"type": "noul", "instructions": "Is it urgent?"},
         "tone": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "furious"]}}


def _settings(**over):
    return dict(LOAD_DEFAULTS, n_gpu_layers=0, n_ctx=4096, **over)


@pytest.fixture(scope="module")
def readers(gemma_path):
    lm = load_model("gemma-cache", gemma_path, _settings())
    cached = NextTokenReader(lm, _settings())
    cold = NextTokenReader(lm, _settings(prefix_cache_mib=0))
    yield cached, cold
    cached.close()
    cold.close()
    lm.close()


def run(reader, state, questions, **extra):
    body = {"state": state, "questions": questions, "samples": 2, **extra}
    return decide(parse_decision(body, SETTINGS), reader, SETTINGS, "m")


def test_second_question_set_reuses_the_state_and_answers_the_same(readers):
    cached, cold = readers
    cached.clear_cache()
    first = run(cached, STATE_1, SET_A)
    second = run(cached, STATE_1, SET_B)
    reference = run(cold, STATE_1, SET_B)
    assert second["answers"] == reference["answers"]
    assert second["diagnostics"]["questions"] == reference["diagnostics"]["questions"]
    # Most of the prompt (template header and the state) came from the first decision.
    assert second["usage"]["cached_tokens"] > 0.8 * len(cached.lm.encode(STATE_1))
    assert reference["usage"]["cached_tokens"] == 0
    assert second["diagnostics"]["evaluated_tokens"] < reference["diagnostics"]["evaluated_tokens"] / 2
    assert first["usage"]["cached_tokens"] < 10  # at most the template's opening tokens


def test_saved_prefix_comes_back_from_host_memory(readers):
    cached, cold = readers
    cached.clear_cache()
    run(cached, STATE_1, SET_A)
    run(cached, STATE_2, SET_A)  # STATE_1's prefix leaves the KV for host memory
    assert cached.prefix_cache_bytes > 0
    back = run(cached, STATE_1, SET_B)
    assert back["usage"]["cached_tokens"] > 0.8 * len(cached.lm.encode(STATE_1))
    assert back["answers"] == run(cold, STATE_1, SET_B)["answers"]


def test_cache_salt_partitions_the_cache(readers):
    cached, cold = readers
    cached.clear_cache()
    run(cached, STATE_1, SET_A, cache_salt="tenant-a")
    other = run(cached, STATE_1, SET_B, cache_salt="tenant-b")
    none = run(cached, STATE_1, SET_B)
    assert other["usage"]["cached_tokens"] == 0  # written under tenant-a: never reused by tenant-b
    assert none["usage"]["cached_tokens"] == 0  # nor without a salt
    again = run(cached, STATE_1, SET_B, cache_salt="tenant-a")
    assert again["usage"]["cached_tokens"] > 0.8 * len(cached.lm.encode(STATE_1))
    ref = run(cold, STATE_1, SET_B)["answers"]
    assert other["answers"] == none["answers"] == again["answers"] == ref


def test_memory_stays_within_the_limit(gemma_path):
    lm = load_model("gemma-small-cache", gemma_path, _settings())
    r = NextTokenReader(lm, _settings(prefix_cache_mib=4))
    try:
        for i in range(8):
            run(r, f"Ticket {i}. " + STATE_2, SET_A)
        # Each prefix is ~1.5-3 MB of KV state: the oldest were dropped to stay within 4 MiB.
        assert 0 < r.prefix_cache_bytes <= 4 * 2**20
        assert 1 <= len(r._saved) < 7
    finally:
        r.close()
        lm.close()


# -- through a real server: cache_salt (/v1/systemone), prompt_cache_key (/v1/decisions)

@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    from server_harness import start

    d = tmp_path_factory.mktemp("server_cache")
    s = start(d, {"models": {"gemma": {"path": str(gemma_path), "n_ctx": 2048}},
                  "server": {"systemone": {"model": "gemma"}}})
    yield s
    s.stop()


def test_cache_salt_on_the_systemone_route(server):
    def post(questions, salt=None):
        body = {"state": STATE_2, "questions": questions, "samples": 1}
        if salt is not None:
            body["cache_salt"] = salt
        r = server.post(body)
        assert r.status_code == 200, r.text
        return r.json()

    post(SET_A, "x")
    other = post(SET_B, "y")
    warm = post(SET_B, "x")
    assert other["usage"]["cached_tokens"] == 0
    assert warm["usage"]["cached_tokens"] > 50
    assert warm["answers"] == other["answers"]


def test_prompt_cache_key_on_the_openai_route(server):
    import httpx

    def post(key):
        body = {"model": "gemma", "input": STATE_1, "prompt_cache_key": key,
                "questions": [{"type": "predicate", "name": "refund", "instructions": "Does the customer ask for a refund?"}]}
        r = httpx.post(server.url + "/v1/decisions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    first = post("k1")
    again = post("k1")
    other = post("k2")
    assert first["usage"]["input_tokens_details"]["cached_tokens"] < 10
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 50
    assert other["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert again["answers"] == first["answers"] == other["answers"]


def test_prefix_past_the_sliding_window_is_not_restored_from_host_memory(readers):
    """llama.cpp saves only a sliding-window layer's window and restores it from
    cell 0, which rounds differently: such a prefix is reused only while it is
    resident, and the numbers stay those of a cold evaluation."""
    cached, cold = readers
    assert cached._swa == 512  # Gemma 3's sliding window
    long_state = STATE_1 * 6
    assert len(cached.lm.encode(long_state)) > 600
    cached.clear_cache()
    run(cached, long_state, SET_A)
    resident = run(cached, long_state, SET_B)
    assert resident["usage"]["cached_tokens"] > 600
    run(cached, STATE_2 * 6, SET_A)  # pushes the long prefix out of the KV
    back = run(cached, long_state, SET_B)
    assert back["usage"]["cached_tokens"] < 20
    assert back["answers"] == resident["answers"] == run(cold, long_state, SET_B)["answers"]
