"""`POST /v1/decisions` (SPEC 8): OpenAI's Decisions API on a real `gmlx serve`.

One server for the module: the embedded Gemma 3 270M (next-token, the
fallback), a tiny random LLaDA (canvas), a model whose file is missing, no API
key and `max_queue: 0` (a decision that finds its model busy gets 503 at
once). The official `openai` package (>= 3.26, `client.decisions.create`)
talks to it; raw httpx posts check the wire shapes and the 400 rules.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_harness import assert_error, long_body, start  # noqa: E402

from gmlx.decisions import prompts  # noqa: E402
from gmlx.decisions.openai import OpenAIRequestError, option_names, parse_openai  # noqa: E402
from gmlx.decisions.types import DecisionSettings  # noqa: E402
from gmlx.errors import ValidationError  # noqa: E402

openai = pytest.importorskip("openai")
if not hasattr(openai.OpenAI, "decisions"):  # pragma: no cover - guarded by the test extra
    pytest.skip("openai >= 3.26 (client.decisions) is needed", allow_module_level=True)

from openai.types.decision import Decision  # noqa: E402

STATE = "The package arrived with a broken screen and I want my money back."
PREDICATE = {"type": "predicate", "name": "damaged", "instructions": "Does the customer report a damaged item?"}
CHOICE = {
    "type": "choice",
    "instructions": "Should this be escalated? Pick the closest value.",
    "choices": [
        {"value": "returns", "description": "the returns desk handles it"},
        {"value": True},
        {"value": "true", "description": "the text 'true'"},
        {"value": False},
    ],
}
SCORE = {
    "type": "score",
    "name": "severity",
    "instructions": "How severe is the damage?",
    "levels": [{"label": "cosmetic"}, {"label": "broken"}, {"label": "unusable"}],
}
QUESTIONS = [PREDICATE, CHOICE, SCORE]
# The same decision in /v1/systemone's shape: question i is `q{i}`, a choice's
# options are named by their values (the colliding true / "true" marked).
SYSTEMONE = {
    "state": STATE,
    "questions": {
        "q0": {"type": "noul", "instructions": PREDICATE["instructions"]},
        "q1": {"type": "choice", "instructions": CHOICE["instructions"],
               "criteria": {"returns": "the returns desk handles it", "true (boolean)": None,
                            '"true" (text)': "the text 'true'", "false": None}},
        "q2": {"type": "score", "instructions": SCORE["instructions"], "criteria": ["cosmetic", "broken", "unusable"]},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path, tiny_llada):
    d = tmp_path_factory.mktemp("openai_decisions")
    config = {
        "models": {
            "gemma": {"path": str(gemma_path), "n_ctx": 2048},
            "llada": {"path": str(tiny_llada), "n_ctx": 2048, "n_threads": 1},
            "ghost": {"path": str(d / "missing.gguf")},
        },
        "server": {"systemone": {"model": "gemma"}, "max_queue": 0},
    }
    s = start(d, config)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0, timeout=120) as c:
        yield c


def post(server, body, **kw) -> httpx.Response:
    return server.post(body, path="/v1/decisions", **kw)


def check_typed(result: Decision, model: str = "gemma") -> None:
    """What every answered decision must satisfy, through the SDK's types."""
    assert isinstance(result, Decision)
    assert result.model == model
    for a in result.answers:
        if a.type == "predicate":
            assert 0.0 <= a.probability <= 1.0
        else:
            assert math.isclose(sum(p.probability for p in a.probabilities), 1.0, abs_tol=1e-6)
            assert 0.0 <= a.confidence <= 1.0
    u = result.usage
    for v in (u.input_tokens, u.output_tokens, u.total_tokens, u.input_tokens_details.cached_tokens,
              u.input_tokens_details.cache_write_tokens, u.output_tokens_details.reasoning_tokens):
        assert type(v) is int
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens > 0 and u.output_tokens > 0


# -- the openai client ------------------------------------------------------------


def test_sdk_predicate_choice_score(client):
    result = client.decisions.create(model="gemma", input=STATE, questions=QUESTIONS)
    check_typed(result)
    damaged, escalate, severity = result.answers
    assert [a.type for a in result.answers] == ["predicate", "choice", "score"]
    assert [a.name for a in result.answers] == ["damaged", None, "severity"]

    values = [p.value for p in escalate.probabilities]
    assert values == ["returns", True, "true", False]
    assert [type(v) for v in values] == [str, bool, str, bool]  # true and "true" stay apart
    assert any(escalate.choice == v and type(escalate.choice) is type(v) for v in values)
    top = max(escalate.probabilities, key=lambda p: p.probability)
    assert escalate.choice == top.value and type(escalate.choice) is type(top.value)
    assert escalate.confidence == pytest.approx(top.probability)

    assert [(p.value, p.label) for p in severity.probabilities] == [(0, "cosmetic"), (1, "broken"), (2, "unusable")]
    expected = sum(p.value * p.probability for p in severity.probabilities)
    assert severity.score == pytest.approx(expected, abs=1e-9)
    assert 0.0 <= severity.score <= 2.0
    assert severity.confidence == pytest.approx(max(p.probability for p in severity.probabilities))
    assert result.usage.output_tokens_details.reasoning_tokens == 0  # no thought on these reads


def test_wire_shape_and_request_id(server):
    r = post(server, {"model": "gemma", "input": STATE, "questions": [PREDICATE]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"model", "answers", "usage"}
    (answer,) = body["answers"]
    assert answer == {"type": "predicate", "name": "damaged", "probability": answer["probability"]}
    assert type(answer["probability"]) is float
    assert set(body["usage"]) == {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
                                  "total_tokens"}
    # Earlier tests left this state's prefix in the model's cache: reused, and said so.
    details = body["usage"]["input_tokens_details"]
    assert set(details) == {"cached_tokens", "cache_write_tokens"} and details["cache_write_tokens"] == 0
    assert 0 < details["cached_tokens"] < body["usage"]["input_tokens"]
    assert r.headers["x-request-id"].startswith("decision-")
    server.log_line(f"decision {r.headers['x-request-id']} model=gemma")


def test_same_probabilities_as_systemone(server):
    a = post(server, {"model": "gemma", "input": STATE, "questions": QUESTIONS})
    b = server.post({**SYSTEMONE, "model": "gemma"})
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    ours, theirs = a.json()["answers"], b.json()["answers"]
    assert ours[0]["probability"] == pytest.approx(theirs["q0"]["noul"], abs=1e-12)
    assert [p["probability"] for p in ours[1]["probabilities"]] == pytest.approx(
        list(theirs["q1"]["probabilities"].values()), abs=1e-12)
    assert [p["probability"] for p in ours[2]["probabilities"]] == pytest.approx(
        list(theirs["q2"]["probabilities"].values()), abs=1e-12)
    assert ours[2]["score"] == pytest.approx(theirs["q2"]["score"], abs=1e-12)
    assert a.json()["usage"]["input_tokens"] == b.json()["usage"]["input_tokens"]
    assert a.json()["usage"]["output_tokens"] == b.json()["usage"]["output_tokens"]


def test_message_input_is_joined_like_text(client):
    # Messages join with a blank line, parts with a newline: the same state, the same numbers.
    text = client.decisions.create(model="gemma", input="Hello there.\nMy screen is broken.\n\nPlease help.",
                                   questions=[PREDICATE])
    messages = client.decisions.create(
        model="gemma",
        input=[
            {"role": "user", "type": "message",
             "content": [{"type": "input_text", "text": "Hello there."},
                         {"type": "input_text", "text": "My screen is broken."}]},
            {"role": "user", "content": "Please help."},
        ],
        questions=[{**PREDICATE, "instructions": [{"type": "input_text", "text": PREDICATE["instructions"]}]}],
    )
    assert messages.answers[0].probability == pytest.approx(text.answers[0].probability, abs=1e-12)
    other = client.decisions.create(model="gemma", input="Hello there. My screen is broken. Please help.",
                                    questions=[PREDICATE])
    assert other.usage.input_tokens != text.usage.input_tokens  # the joins are really there


def test_unknown_model_names_fall_back_and_missing_files_are_404(client, server):
    result = client.decisions.create(model="gpt-6-luna", input=STATE, questions=[PREDICATE])
    assert result.model == "gemma"
    # Errors past the route's own rules are the /v1/systemone ones (SPEC 5 envelope).
    assert_error(post(server, {"model": "ghost", "input": STATE, "questions": [PREDICATE]}),
                 404, "model_file_missing", "model")
    with pytest.raises(openai.NotFoundError):
        client.decisions.create(model="ghost", input=STATE, questions=[PREDICATE])


def test_safety_identifier_is_logged_and_cache_fields_accepted(client, server):
    ident = "user-" + "x" * 123
    assert len(ident) == 128
    result = client.decisions.create(
        model="gemma", input=STATE, questions=[PREDICATE], safety_identifier=ident,
        prompt_cache_key="tenant-7", prompt_cache_options={"mode": "implicit", "ttl": "30m"},
    )
    check_typed(result)
    server.log_line(re.escape(f"safety_identifier={ident!r}"))
    assert "accepted with no effect: prompt_cache_options" in server.log()


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_compressed_body_over_1_kib(server, encoding):
    before = server.health()["requests"]["content_encoding"].get(encoding, 0)
    body = {"model": "gemma", "input": "My invoice shows the same charge twice. " * 40, "questions": [PREDICATE]}
    raw = json.dumps(body).encode()
    assert len(raw) > 1024
    packed = gzip.compress(raw) if encoding == "gzip" else zstandard.ZstdCompressor().compress(raw)
    r = httpx.post(server.url + "/v1/decisions", content=packed, timeout=120,
                   headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["answers"][0]["name"] == "damaged"
    plain = post(server, body)
    assert r.json()["answers"] == plain.json()["answers"]
    assert server.health()["requests"]["content_encoding"][encoding] == before + 1


def test_unsupported_content_encoding_is_415(server):
    r = server.post(content=b"\x00\x01", path="/v1/decisions",
                    headers={"Content-Encoding": "br", "Content-Type": "application/json"})
    assert_error(r, 415, "unsupported_media_type")


def test_busy_model_answers_503_with_retry_after(server, client):
    done: dict = {}

    def long_decision():
        done["status"] = server.post(long_body(n=4, samples=4)).status_code

    t = threading.Thread(target=long_decision)
    t.start()
    deadline = time.monotonic() + 60
    while not server.health()["models"]["gemma"]["slots"]["default"]["queue"]["running"]:
        assert time.monotonic() < deadline and t.is_alive(), "the long decision never started"
        time.sleep(0.05)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.decisions.create(model="gemma", input=STATE, questions=[PREDICATE])
    finally:
        t.join()
    assert info.value.status_code == 503
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 5
    assert info.value.body["type"] == "overloaded"
    assert done["status"] == 200


# -- a canvas model answers the same API ------------------------------------------


def test_tiny_diffusion_model_answers(client, server):
    result = client.decisions.create(model="llada", input=STATE, questions=QUESTIONS)
    check_typed(result, model="llada")
    assert [a.type for a in result.answers] == ["predicate", "choice", "score"]
    assert [a.name for a in result.answers] == ["damaged", None, "severity"]
    assert [type(p.value) for p in result.answers[1].probabilities] == [str, bool, str, bool]
    slot = server.health()["models"]["llada"]["slots"]["default"]
    assert slot["strategy"] == "canvas"


# -- the route's own 400 rules ------------------------------------------------------


def _ok(**over) -> dict:
    body = {"model": "gemma", "input": STATE, "questions": [PREDICATE]}
    body.update(over)
    return body


def _choice(n: int, **over) -> dict:
    return {"type": "choice", "instructions": "Which?", "choices": [{"value": f"v{i}"} for i in range(n)], **over}


def _score(n: int) -> dict:
    return {"type": "score", "instructions": "How much?", "levels": [{"label": f"level {i}"} for i in range(n)]}


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
RULES = [
    ("system role", _ok(input=[{"role": "system", "content": "Be terse."}]), "input[0].role", "unsupported_role"),
    ("assistant role", _ok(input=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
     "input[1].role", "unsupported_role"),
    ("developer role", _ok(input=[{"role": "developer", "content": "x"}]), "input[0].role", "unsupported_role"),
    ("input_image part", _ok(input=[{"role": "user", "content": [{"type": "input_text", "text": "see"}, IMAGE]}]),
     "input[0].content[1].type", "unsupported_input_image"),
    ("input_image in a question",
     _ok(questions=[{**PREDICATE, "instructions": [{"type": "input_text", "text": "Is it?"}, IMAGE]}]),
     "questions[0].instructions[1].type", "unsupported_input_image"),
    ("input_json part", _ok(input=[{"role": "user", "content": [{"type": "input_json", "data": {"a": 1}}]}]),
     "input[0].content[0].type", "unsupported_content_type"),
    ("tools", _ok(tools=[{"type": "function", "name": "lookup"}]), "tools", "unsupported_parameter"),
    ("tool call item", _ok(input=[{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]),
     "input[0].type", "unsupported_input_item"),
    ("unknown field", _ok(temperature=0.2), "temperature", "unknown_parameter"),
    ("unknown question field", _ok(questions=[{**PREDICATE, "criteria": None}]), "questions[0].criteria",
     "unknown_parameter"),
    ("unknown part field", _ok(input=[{"role": "user", "content": [{"type": "input_text", "text": "a", "x": 1}]}]),
     "input[0].content[0].x", "unknown_parameter"),
    ("65 questions", _ok(questions=[PREDICATE] * 65), "questions", "too_many_questions"),
    ("empty questions", _ok(questions=[]), "questions", "empty_array"),
    ("27 choices", _ok(questions=[PREDICATE, _choice(27)]), "questions[1].choices", "too_many_choices"),
    ("1 choice", _ok(questions=[_choice(1)]), "questions[0].choices", "too_few_choices"),
    ("11 levels", _ok(questions=[_score(11)]), "questions[0].levels", "too_many_levels"),
    ("1 level", _ok(questions=[_score(1)]), "questions[0].levels", "too_few_levels"),
    ("duplicate values", _ok(questions=[{"type": "choice", "instructions": "Which?",
                                         "choices": [{"value": "a"}, {"value": True}, {"value": "a"}]}]),
     "questions[0].choices[2].value", "duplicate_value"),
    ("duplicate booleans", _ok(questions=[{"type": "choice", "instructions": "Which?",
                                           "choices": [{"value": False}, {"value": "false"}, {"value": False}]}]),
     "questions[0].choices[2].value", "duplicate_value"),
    ("number value", _ok(questions=[{"type": "choice", "instructions": "Which?",
                                     "choices": [{"value": 1}, {"value": 2}]}]),
     "questions[0].choices[0].value", "invalid_type"),
    ("safety_identifier of 129", _ok(safety_identifier="u" * 129), "safety_identifier", "string_above_max_length"),
    ("unknown question type", _ok(questions=[{"type": "noul", "instructions": "x"}]), "questions[0].type",
     "invalid_value"),
    ("missing instructions", _ok(questions=[{"type": "predicate"}]), "questions[0].instructions",
     "missing_required_parameter"),
    ("missing input", {"model": "gemma", "questions": [PREDICATE]}, "input", "missing_required_parameter"),
    ("empty input list", _ok(input=[]), "input", "empty_array"),
]


@pytest.mark.parametrize(("body", "param", "code"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_400_rules(server, body, param, code):
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code), err
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    assert r.headers.get("x-request-id")


def test_400_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.decisions.create(model="gemma", input=STATE, questions=[PREDICATE] * 65)
    assert info.value.code == "too_many_questions"
    assert info.value.param == "questions"
    assert "64" in info.value.message


# -- the mapping, without a server ----------------------------------------------------


SETTINGS = DecisionSettings()


def test_option_names_show_the_values():
    assert option_names(("returns", True, False)) == ("returns", "true", "false")
    # Only the colliding ones are marked; the empty string is marked too.
    assert option_names((True, "true", "x")) == ("true (boolean)", '"true" (text)', "x")
    assert option_names(("", "a")) == ('"" (text)', "a")
    # A string that spells a marked name: every value as JSON, still distinct.
    names = option_names(('"true" (text)', "true", True))
    assert len(set(names)) == 3 and names[2] == "true"


def test_choice_values_map_back_by_position():
    req = parse_openai(_ok(questions=[CHOICE]), SETTINGS)
    result = {"model": "m", "usage": {"input_tokens": 5, "output_tokens": 1}, "diagnostics": {"thought": None},
              "answers": {"q0": {"type": "choice", "choice": '"true" (text)', "confidence": 0.7,
                                 "probabilities": {"returns": 0.1, "true (boolean)": 0.15,
                                                   '"true" (text)': 0.7, "false": 0.05}}}}
    out = req.response(result)["answers"][0]
    assert out["choice"] == "true" and isinstance(out["choice"], str)
    assert [(p["value"], p["probability"]) for p in out["probabilities"]] == [
        ("returns", 0.1), (True, 0.15), ("true", 0.7), (False, 0.05)]
    assert [type(p["value"]) for p in out["probabilities"]] == [str, bool, str, bool]


def test_level_descriptions_reach_the_prompt():
    levels = [{"label": "low", "description": "barely noticeable"}, {"label": "high"}]
    req = parse_openai(_ok(questions=[{"type": "score", "instructions": "How bad?", "levels": levels}]), SETTINGS)
    q = req.decision(SETTINGS).questions[0]
    assert prompts.option_lines(q, range(2)) == ["1. low: barely noticeable", "2. high"]


def test_thinking_is_off_and_cache_key_is_the_salt():
    d = parse_openai(_ok(prompt_cache_key="k1"), SETTINGS).decision(DecisionSettings(think="auto"))
    assert d.think == 0
    assert d.cache_salt == "k1"
    assert d.ignored == []


def test_admission_errors_name_the_request_fields():
    req = parse_openai(_ok(questions=[PREDICATE, _choice(3)]), SETTINGS)
    err = req.error(ValidationError("question 'q1': label 'C' is not a single token for this model",
                                    param="questions.q1.criteria"))
    assert (err.param, err.message) == ("questions[1].choices",
                                        "questions[1]: label 'C' is not a single token for this model")
    assert err.status == 422
    assert req.error(ValidationError("x", param="model")).param == "model"


def test_parse_errors_are_400_with_string_codes():
    with pytest.raises(OpenAIRequestError) as info:
        parse_openai([1, 2], SETTINGS)
    assert info.value.status == 400 and info.value.body()["error"]["code"] == "invalid_type"
    # max_questions is the server's setting, not a constant.
    parse_openai(_ok(questions=[PREDICATE] * 3), DecisionSettings(max_questions=3))
    with pytest.raises(OpenAIRequestError, match="at most 2"):
        parse_openai(_ok(questions=[PREDICATE] * 3), DecisionSettings(max_questions=2))


def test_docs_example_runs(server):
    text = (Path(__file__).resolve().parent.parent / "docs" / "openai.md").read_text()
    code = re.findall(r"```python\n(.*?)\n```", text, re.S)[0]
    assert 'OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="anything")' in code
    scope: dict = {}
    exec(code.replace("http://127.0.0.1:8080/v1", server.url + "/v1"), scope)  # noqa: S102
    damaged, department, severity = scope["decision"].answers
    assert (damaged.name, department.name, severity.name) == ("damaged", "department", None)
    assert department.choice in ("returns", "billing", False)


def test_route_is_in_the_openapi_schema(server):
    assert "/v1/decisions" in httpx.get(server.url + "/openapi.json").json()["paths"]


def _json_values():
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
        ["", "user", "system", "input_text", "input_image", "predicate", "choice", "score", "true", "x"])
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "role", "content", "text", "value", "label", "choices", "levels", "name",
                         "instructions", "description", "x"]), inner, max_size=4), max_leaves=12)


def test_no_body_breaks_the_parser():
    """Whatever the JSON, the route's parser answers a request error or a
    decision, never an unexpected exception (which would be a 500)."""
    from hypothesis import given, settings as hsettings, strategies as st

    from gmlx.errors import GmlxError

    values = _json_values()
    bodies = st.fixed_dictionaries({"input": values, "questions": st.lists(values, max_size=3) | values},
                                   optional={"model": values, "safety_identifier": values,
                                             "prompt_cache_options": values})

    @hsettings(max_examples=300, deadline=None)
    @given(bodies)
    def check(body):
        try:
            parse_openai(body, SETTINGS).decision(SETTINGS)
        except GmlxError as err:
            assert err.status in (400, 422)

    check()
