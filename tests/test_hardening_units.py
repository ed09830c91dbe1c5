"""In-process checks of the hardening fixes: the documented OpenAPI bodies,
admission (what the largest prompt is, chat_template_kwargs), non-finite
logits, llama.cpp's load mode, the vocabulary probe."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import llama_cpp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402

from gmlx.config import LOAD_DEFAULTS, parse_config  # noqa: E402
from fake_reader import FakeReader, ticket_body  # noqa: E402
from gmlx.decisions.parse import RESERVED_TEMPLATE_KWARGS, parse_decision  # noqa: E402
from gmlx.decisions.decide import admit, decide  # noqa: E402
from gmlx.decisions.types import DecisionSettings  # noqa: E402
from gmlx.engine.model import _set_load_mode, load_model, probe_vocab  # noqa: E402
from gmlx.engine.nexttoken import NextTokenReader  # noqa: E402
from gmlx.errors import InvalidRequest, ModelLoadError, ServerError, ValidationError  # noqa: E402

SETTINGS = DecisionSettings()
OPENAI_BODY = {
    "model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
    "questions": [
        {"type": "predicate", "name": "p", "instructions": "Happy?"},
        {"type": "choice", "instructions": "Which?", "choices": [{"value": "a"}, {"value": True, "description": None}]},
        {"type": "score", "instructions": [{"type": "input_text", "text": "How much?"}],
         "levels": [{"label": "low"}, {"label": "high", "description": "a lot"}]},
    ],
    "safety_identifier": "u1", "prompt_cache_options": {"mode": "implicit"},
}


# -- the OpenAPI bodies ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def openapi():
    from gmlx.server.app import create_app

    cfg = parse_config({"models": {"m": {"path": "/nowhere/m.gguf"}}, "profiles": {"fast": {"n_ctx": 256}},
                        "server": {"systemone": {"max_questions": 5}}})
    return create_app(cfg).openapi()


def validator(openapi, name):
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = {**openapi["components"]["schemas"][name], "components": openapi["components"]}
    return jsonschema_rs.validator_for(schema)


def test_decision_routes_document_their_bodies(openapi):
    for path, name in (("/v1/systemone", "SystemOneRequest"), ("/systemone", "SystemOneRequest"),
                       ("/v1/decisions", "DecisionsRequest")):
        op = openapi["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        responses = op["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "415", "422", "500", "501", "503", "504"}
        assert responses["422"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    request = openapi["components"]["schemas"]["SystemOneRequest"]
    assert request["properties"]["questions"]["maxProperties"] == 5  # from the config
    assert request["properties"]["profile"] == {"anyOf": [{"enum": ["fast"]}, {"type": "null"}]}


def test_the_schemas_accept_what_the_parsers_accept(openapi):
    s1 = validator(openapi, "SystemOneRequest")
    ticket = ticket_body(samples=1, think="auto", ask=["urgent"], unknown_client_field=[1])
    assert s1.is_valid(ticket)
    parse_decision(ticket, SETTINGS)
    for bad in ({"state": "x"}, {"questions": {"a": {"type": "noul"}}},
                {"state": "x", "questions": {"a": {"type": "maybe"}}},
                {"state": "x", "questions": {"a": {"type": "choice", "criteria": {"only": None}}}},
                {"state": "x", "questions": {"a": {"type": "noul", "colour": "red"}}},
                {"state": "x", "questions": {f"q{i}": {"type": "noul"} for i in range(6)}},
                {"state": "x", "questions": {"a": {"type": "noul"}}, "samples": 0},
                {"state": "x", "questions": {"a": {"type": "noul"}}, "profile": "slow"},
                {"state": "x", "questions": {"a": {"type": "noul"}}, "images": ["aGk="]}):
        assert not s1.is_valid(bad), bad
    s8 = validator(openapi, "DecisionsRequest")
    assert s8.is_valid(OPENAI_BODY)
    for bad in ({"input": "x"}, {"input": "x", "questions": []}, {"input": "x", "questions": [], "tools": []},
                {"input": [{"role": "system", "content": "x"}], "questions": [{"type": "predicate", "instructions": "?"}]},
                {"input": "x", "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": 1}] * 2}]}):
        assert not s8.is_valid(bad), bad
    err = validator(openapi, "Error")
    assert err.is_valid({"error": {"message": "m", "type": "t", "param": None, "code": 400}})
    assert err.is_valid({"error": {"message": "m", "type": "t", "param": "x", "code": "invalid_value"}})
    assert not err.is_valid({"detail": "x"})


# -- admission -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", RESERVED_TEMPLATE_KWARGS)
def test_reserved_chat_template_kwargs_are_a_422(key):
    with pytest.raises(ValidationError) as err:
        parse_decision({"state": "x", "questions": {"a": {"type": "noul"}}, "chat_template_kwargs": {key: 1}}, SETTINGS)
    assert err.value.param == f"chat_template_kwargs.{key}"


@pytest.fixture(scope="module")
def qwen(tiny_qwen3):
    settings = {**LOAD_DEFAULTS, "n_gpu_layers": 0, "n_ctx": 1024}
    lm = load_model("qwen", tiny_qwen3, settings)
    reader = NextTokenReader(lm, settings)
    yield reader
    reader.close()
    lm.close()


def test_a_template_that_fails_with_the_callers_kwargs_is_a_422(qwen):
    d = parse_decision({"state": "x", "questions": {"a": {"type": "noul"}}, "chat_template_kwargs": {"tools": 5}},
                       SETTINGS)
    with pytest.raises(ValidationError) as err:
        admit(d, qwen, SETTINGS)
    assert err.value.param == "chat_template_kwargs" and "TypeError" in err.value.message


def test_the_largest_prompt_states_only_the_answers_a_question_depends_on(qwen):
    options = {f"option {c} with a long description": None for c in "ABCDEFGH"}
    questions = {f"q{i}": {"type": "choice", "instructions": f"Aspect {i}?", "criteria": dict(options)} for i in range(8)}
    alone = parse_decision({"state": "s", "questions": questions, "samples": 1}, SETTINGS)
    # The largest prompt of independent questions is the largest single one.
    single = max(qwen.largest_prompt(parse_decision({"state": "s", "questions": {k: v}}, SETTINGS))
                 for k, v in questions.items())
    assert qwen.largest_prompt(alone) == single
    # A dependency adds the answer it states.
    questions["q7"]["depends_on"] = ["q0", "q1"]
    dependent = parse_decision({"state": "s", "questions": questions, "samples": 1}, SETTINGS)
    assert qwen.largest_prompt(dependent) > single
    # Both fit a 1024-token context and run.
    admit(alone, qwen, SETTINGS)
    assert len(decide(alone, qwen, SETTINGS, "m")["answers"]) == 8


def test_a_state_that_alone_overflows_is_refused_after_one_tokenization(qwen):
    questions = {f"q{i}": {"type": "choice", "instructions": "?", "criteria": {"a": None, "b": None}} for i in range(64)}
    d = parse_decision({"state": "word " * 50_000, "questions": questions}, SETTINGS)
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest) as err:
        admit(d, qwen, SETTINGS)
    assert "the state alone is" in err.value.message and err.value.param == "state"
    assert time.perf_counter() - t0 < 2.0


def test_a_thought_prompt_that_overflows_is_refused_at_admission(qwen):
    # The thought prompt lists every question with its described options (~1700
    # tokens here); each read shows one question (~300). Admission used to
    # check only the reads, and the worker then refused the thought after queueing.
    assert qwen.can_think
    desc = "a description that is long enough to matter here"
    questions = {f"q{i}": {"type": "choice", "instructions": "Which?", "criteria": {f"o{j}": desc for j in range(4)}}
                 for i in range(10)}
    d = parse_decision({"state": "s", "questions": questions, "think": 100, "samples": 1}, SETTINGS)
    with pytest.raises(InvalidRequest) as err:
        admit(d, qwen, SETTINGS)
    assert err.value.param == "state" and "1024" in err.value.message
    one = parse_decision({"state": "s", "questions": {"q0": questions["q0"]}, "think": 100, "samples": 1}, SETTINGS)
    admit(one, qwen, SETTINGS)
    assert decide(one, qwen, SETTINGS, "m")["diagnostics"]["thought"] is not None


# -- non-finite logits -------------------------------------------------------------------------

@pytest.mark.parametrize("reader", [
    FakeReader(position_logits={"a": [math.nan, 0.0]}),  # NaN logits
    FakeReader(position_logits={"a": [math.inf, 1.0]}),  # an infinite logit
    FakeReader(forced={"a": [0.0, 0.0]}),  # no mass on any label: 0/0
], ids=["nan", "inf", "zero"])
def test_non_finite_label_probabilities_fail_the_decision(reader):
    d = parse_decision({"state": "x", "questions": {"a": {"type": "noul"}}, "samples": 1}, SETTINGS)
    with pytest.raises(ServerError) as err:
        decide(d, reader, SETTINGS, "m")
    assert "non-finite" in err.value.message


# -- loading ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("mmap", "mlock", "mode"), [
    (True, False, None),
    (False, False, llama_cpp.LLAMA_LOAD_MODE_NONE),
    (True, True, llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK),
    (False, True, llama_cpp.LLAMA_LOAD_MODE_MLOCK),
])
def test_use_mmap_and_use_mlock_reach_llama_cpp(mmap, mlock, mode):
    mp = llama_cpp.llama_model_default_params()
    default = getattr(mp, "load_mode", None)
    _set_load_mode(mp, mmap, mlock)
    fields = {name for name, *_ in type(mp)._fields_}
    if "load_mode" in fields:
        assert mp.load_mode == (default if mode is None else mode)
        assert "use_mmap" not in mp.__dict__  # no silent Python attribute
    else:  # an older binding: the booleans are the struct's own fields
        assert (mp.use_mmap, mp.use_mlock) == (mmap, mlock)


def test_use_mmap_false_reads_the_weights_into_memory(tmp_path):
    path = tiny_gguf.build_qwen3(tmp_path / "q.gguf")
    for mmap, mapped in ((True, True), (False, False)):
        lm = load_model("q", path, {**LOAD_DEFAULTS, "n_gpu_layers": 0, "use_mmap": mmap})
        try:
            maps = Path("/proc/self/maps").read_text()
            assert (str(path) in maps) == mapped, (mmap, [line for line in maps.splitlines() if "q.gguf" in line])
        finally:
            lm.close()


def test_the_vocabulary_probe(tmp_path):
    good = tiny_gguf.build_qwen3(tmp_path / "good.gguf")
    vocab = tiny_gguf.tiny_vocab()
    tokens = list(vocab.tokens)
    tokens[-1] = tokens[-2]
    bad = tiny_gguf.build_qwen3(tmp_path / "bad.gguf", vocab=dataclasses.replace(vocab, tokens=tuple(tokens)))
    assert probe_vocab(good) is None
    verdict = probe_vocab(bad)
    assert verdict is not None and "GGML_ASSERT" in verdict
    t0 = time.perf_counter()
    assert probe_vocab(bad) == verdict  # cached for this file version
    assert time.perf_counter() - t0 < 0.05
    with pytest.raises(ModelLoadError) as err:
        load_model("bad", bad, {**LOAD_DEFAULTS, "n_gpu_layers": 0}, isolate_vocab=True)
    assert "corrupted" in str(err.value) and "GGML_ASSERT" in str(err.value)


def test_a_chat_template_that_cannot_render_fails_the_load(tiny_qwen3):
    with pytest.raises(ModelLoadError) as err:
        load_model("q", tiny_qwen3, {**LOAD_DEFAULTS, "n_gpu_layers": 0,
                                     "chat_template": "{{ raise_exception('no') }}"})
    assert "does not render" in str(err.value)
