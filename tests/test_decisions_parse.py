"""parse_decision: every rule and limit of SPEC 4.1-4.3, table-driven."""

from __future__ import annotations

import json

import pytest

from gmlx.errors import InvalidRequest, ValidationError
from fake_reader import ticket_body
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.types import DecisionSettings

SETTINGS = DecisionSettings()
DROP = object()


def top(**fields):
    """Mutator setting (or, with DROP, removing) top-level fields."""

    def mutate(body):
        for k, v in fields.items():
            if v is DROP:
                body.pop(k, None)
            else:
                body[k] = v

    return mutate


def q(qid, **fields):
    """Mutator setting (or removing) fields of one question."""

    def mutate(body):
        spec = body["questions"].setdefault(qid, {})
        for k, v in fields.items():
            if v is DROP:
                spec.pop(k, None)
            else:
                spec[k] = v

    return mutate


def questions(mapping):
    return top(questions=mapping)


def nouls(n):
    return {f"q{i}": {"type": "noul"} for i in range(n)}


def choice(n):
    return {f"o{i}": None for i in range(n)}


def levels(n):
    return [f"l{i}" for i in range(n)]


# (mutator, exception, param, words the message must contain)
INVALID = [
    # state and questions
    pytest.param(top(state=DROP), ValidationError, "state", ["state", "required"], id="state-missing"),
    pytest.param(top(questions=DROP), ValidationError, "questions", ["questions", "non-empty"], id="questions-missing"),
    pytest.param(questions({}), ValidationError, "questions", ["questions", "non-empty"], id="questions-empty"),
    pytest.param(questions([{"type": "noul"}]), ValidationError, "questions", ["questions", "object"], id="questions-list"),
    pytest.param(questions(nouls(65)), ValidationError, "questions", ["65", "64"], id="65-questions"),
    # ids
    pytest.param(questions({"": {"type": "noul"}}), ValidationError, "questions", ["ids", "non-empty"], id="id-empty"),
    pytest.param(questions({"a:b": {"type": "noul"}}), ValidationError, "questions.a:b", ["a:b", "':'"], id="id-colon"),
    pytest.param(questions({"a\nb": {"type": "noul"}}), ValidationError, "questions.a\nb", ["a\\nb", "newline"], id="id-newline"),
    # question fields
    pytest.param(q("urgent", color="red"), ValidationError, "questions.urgent.color", ["urgent", "color", "unknown"], id="q-unknown-field"),
    pytest.param(questions({"x": "noul"}), ValidationError, "questions.x", ["'x'", "object"], id="q-not-object"),
    pytest.param(q("urgent", type=DROP), ValidationError, "questions.urgent.type", ["urgent", "type"], id="type-missing"),
    pytest.param(q("urgent", type=None), ValidationError, "questions.urgent.type", ["urgent", "type"], id="type-null"),
    pytest.param(q("urgent", type="bool"), ValidationError, "questions.urgent.type", ["urgent", "noul", "'bool'"], id="type-unknown"),
    pytest.param(q("urgent", type=1), ValidationError, "questions.urgent.type", ["urgent", "type"], id="type-int"),
    pytest.param(q("urgent", instructions=5), ValidationError, "questions.urgent.instructions", ["urgent", "instructions", "string"], id="instructions-int"),
    pytest.param(q("urgent", instructions=["x"]), ValidationError, "questions.urgent.instructions", ["urgent", "instructions"], id="instructions-list"),
    pytest.param(q("urgent", alone="yes"), ValidationError, "questions.urgent.alone", ["urgent", "alone", "true or false"], id="alone-str"),
    pytest.param(q("urgent", alone=1), ValidationError, "questions.urgent.alone", ["urgent", "alone"], id="alone-int"),
    # alternatives
    pytest.param(q("team", criteria=choice(1)), ValidationError, "questions.team.criteria", ["team", "2 to 26", "got 1"], id="choice-1"),
    pytest.param(q("team", criteria=choice(27)), ValidationError, "questions.team.criteria", ["team", "2 to 26", "got 27"], id="choice-27"),
    pytest.param(q("severity", criteria=levels(1)), ValidationError, "questions.severity.criteria", ["severity", "2 to 26", "got 1"], id="score-1"),
    pytest.param(q("severity", criteria=levels(27)), ValidationError, "questions.severity.criteria", ["severity", "2 to 26", "got 27"], id="score-27"),
    pytest.param(q("severity", criteria=["low", "high", "low"]), ValidationError, "questions.severity.criteria", ["severity", "'low'", "twice"], id="score-duplicate"),
    pytest.param(q("team", criteria=DROP), ValidationError, "questions.team.criteria", ["team", "criteria"], id="choice-no-criteria"),
    pytest.param(q("team", criteria=None), ValidationError, "questions.team.criteria", ["team", "criteria"], id="choice-null-criteria"),
    pytest.param(q("severity", criteria=None), ValidationError, "questions.severity.criteria", ["severity", "criteria"], id="score-null-criteria"),
    pytest.param(q("team", criteria=["a", "b"]), ValidationError, "questions.team.criteria", ["team", "object"], id="choice-criteria-list"),
    pytest.param(q("severity", criteria={"a": None, "b": None}), ValidationError, "questions.severity.criteria", ["severity", "list"], id="score-criteria-object"),
    pytest.param(q("team", criteria={"": "x", "b": None}), ValidationError, "questions.team.criteria", ["team", "non-empty"], id="choice-empty-name"),
    pytest.param(q("team", criteria={"a": 3, "b": None}), ValidationError, "questions.team.criteria.a", ["team", "'a'", "string or null"], id="choice-desc-int"),
    pytest.param(q("severity", criteria=["low", 2]), ValidationError, "questions.severity.criteria", ["severity", "level names"], id="score-level-int"),
    pytest.param(q("severity", criteria=["low", ""]), ValidationError, "questions.severity.criteria", ["severity", "non-empty"], id="score-level-empty"),
    pytest.param(q("urgent", criteria={"maybe": "x"}), ValidationError, "questions.urgent.criteria.maybe", ["urgent", "maybe"], id="noul-criteria-key"),
    pytest.param(q("urgent", criteria=["yes", "no"]), ValidationError, "questions.urgent.criteria", ["urgent", "noul criteria"], id="noul-criteria-list"),
    pytest.param(q("urgent", criteria={"true": 5}), ValidationError, "questions.urgent.criteria.true", ["urgent", "'true'", "string or null"], id="noul-criteria-int"),
    # references
    pytest.param(q("refund", depends_on="team"), ValidationError, "questions.refund.depends_on", ["refund", "depends_on", "list"], id="depends-str"),
    pytest.param(q("refund", depends_on=[3]), ValidationError, "questions.refund.depends_on", ["refund", "depends_on"], id="depends-int-item"),
    pytest.param(q("refund", depends_on=["nobody"]), ValidationError, "questions.refund.depends_on", ["refund", "unknown", "'nobody'"], id="depends-unknown"),
    pytest.param(q("urgent", depends_on=["urgent"]), ValidationError, "questions.urgent.depends_on", ["urgent", "itself"], id="depends-self"),
    pytest.param(q("refund", ask_if={"nobody": ["yes"]}), ValidationError, "questions.refund.ask_if", ["refund", "unknown", "'nobody'"], id="ask_if-unknown-question"),
    pytest.param(q("refund", ask_if={"team": ["sales"]}), ValidationError, "questions.refund.ask_if.team", ["refund", "'sales'", "billing, infra, product"], id="ask_if-unknown-option"),
    pytest.param(q("refund", ask_if={"urgent": ["true"]}), ValidationError, "questions.refund.ask_if.urgent", ["refund", "'true'", "yes, no"], id="ask_if-noul-not-yes-no"),
    pytest.param(q("refund", ask_if={"severity": ["1"]}), ValidationError, "questions.refund.ask_if.severity", ["refund", "'1'", "low, medium, high"], id="ask_if-score-label-not-name"),
    pytest.param(q("refund", ask_if={"refund": ["yes"]}), ValidationError, "questions.refund.ask_if", ["refund", "itself"], id="ask_if-self"),
    pytest.param(q("refund", ask_if=["team"]), ValidationError, "questions.refund.ask_if", ["refund", "ask_if", "object"], id="ask_if-list"),
    pytest.param(q("refund", ask_if={"team": "billing"}), ValidationError, "questions.refund.ask_if.team", ["refund", "'team'", "list"], id="ask_if-str-answers"),
    pytest.param(q("refund", ask_if={"team": []}), ValidationError, "questions.refund.ask_if.team", ["refund", "non-empty"], id="ask_if-empty-answers"),
    pytest.param(q("refund", ask_if={"team": [1]}), ValidationError, "questions.refund.ask_if.team", ["refund", "answer names"], id="ask_if-int-answer"),
    pytest.param(
        questions({"a": {"type": "noul", "depends_on": ["b"]}, "b": {"type": "noul", "depends_on": ["a"]}}),
        ValidationError, "questions.a.depends_on", ["'a' -> 'b' -> 'a'", "cycle"], id="cycle-2",
    ),
    pytest.param(
        questions({
            "a": {"type": "noul", "depends_on": ["b"]},
            "b": {"type": "noul", "ask_if": {"c": ["yes"]}},
            "c": {"type": "noul", "depends_on": ["a"]},
        }),
        ValidationError, "questions.a.depends_on", ["'a' -> 'b' -> 'c' -> 'a'", "cycle"], id="cycle-3-through-ask_if",
    ),
    # ask
    pytest.param(top(ask=["nobody"]), ValidationError, "ask", ["ask", "'nobody'"], id="ask-unknown"),
    pytest.param(top(ask=["refund"]), ValidationError, "ask", ["'refund'", "'team'", "depends on"], id="ask-without-dependency"),
    pytest.param(top(ask=[]), ValidationError, "ask", ["ask", "non-empty"], id="ask-empty"),
    pytest.param(top(ask="team"), ValidationError, "ask", ["ask", "list"], id="ask-str"),
    pytest.param(top(ask=[1]), ValidationError, "ask", ["ask", "strings"], id="ask-int-item"),
    # numbers and enums
    pytest.param(top(seed="42"), ValidationError, "seed", ["seed", "integer"], id="seed-str"),
    pytest.param(top(seed=True), ValidationError, "seed", ["seed", "integer", "boolean"], id="seed-bool"),
    pytest.param(top(seed=1.5), ValidationError, "seed", ["seed", "integer"], id="seed-float"),
    pytest.param(top(samples=0), ValidationError, "samples", ["samples", ">= 1"], id="samples-0"),
    pytest.param(top(samples=-2), ValidationError, "samples", ["samples", ">= 1"], id="samples-negative"),
    pytest.param(top(samples="many"), ValidationError, "samples", ["samples", "'many'"], id="samples-str"),
    pytest.param(top(samples=True), ValidationError, "samples", ["samples", "boolean"], id="samples-bool"),
    pytest.param(top(samples=2.5), ValidationError, "samples", ["samples"], id="samples-float"),
    pytest.param(top(auto_max=0), ValidationError, "auto_max", ["auto_max", ">= 1"], id="auto_max-0"),
    pytest.param(top(auto_max="4"), ValidationError, "auto_max", ["auto_max", "integer"], id="auto_max-str"),
    pytest.param(top(auto_max=True), ValidationError, "auto_max", ["auto_max", "integer"], id="auto_max-bool"),
    pytest.param(top(auto_threshold=-0.1), ValidationError, "auto_threshold", ["auto_threshold", ">= 0"], id="auto_threshold-negative"),
    pytest.param(top(auto_threshold="low"), ValidationError, "auto_threshold", ["auto_threshold"], id="auto_threshold-str"),
    pytest.param(top(auto_threshold=True), ValidationError, "auto_threshold", ["auto_threshold", "boolean"], id="auto_threshold-bool"),
    pytest.param(top(steps="2"), ValidationError, "steps", ["steps", "integer"], id="steps-str"),
    pytest.param(top(steps=True), ValidationError, "steps", ["steps", "integer"], id="steps-bool"),
    pytest.param(top(steps=1.5), ValidationError, "steps", ["steps", "integer"], id="steps-float"),
    pytest.param(top(think=-1), ValidationError, "think", ["think", "0..4096"], id="think-negative"),
    pytest.param(top(think=4097), ValidationError, "think", ["think", "0..4096"], id="think-4097"),
    pytest.param(top(think="sometimes"), ValidationError, "think", ["think", "'sometimes'"], id="think-str"),
    pytest.param(top(think=True), ValidationError, "think", ["think", "boolean"], id="think-bool"),
    pytest.param(top(think="Auto"), ValidationError, "think", ["think", "'Auto'"], id="think-Auto"),
    pytest.param(top(think="auto", think_threshold=0), ValidationError, "think_threshold", ["think_threshold", "(0, 1]"], id="think_threshold-0"),
    pytest.param(top(think="auto", think_threshold=1.0001), ValidationError, "think_threshold", ["think_threshold", "(0, 1]"], id="think_threshold-1.0001"),
    pytest.param(top(think="auto", think_threshold=-0.5), ValidationError, "think_threshold", ["think_threshold"], id="think_threshold-negative"),
    pytest.param(top(think="auto", think_threshold="high"), ValidationError, "think_threshold", ["think_threshold"], id="think_threshold-str"),
    pytest.param(top(think="auto", think_threshold=True), ValidationError, "think_threshold", ["think_threshold", "boolean"], id="think_threshold-bool"),
    pytest.param(top(think="auto", think_budget=0), ValidationError, "think_budget", ["think_budget", "1..4096"], id="think_budget-0"),
    pytest.param(top(think="auto", think_budget=4097), ValidationError, "think_budget", ["think_budget", "1..4096"], id="think_budget-4097"),
    pytest.param(top(think_budget="64"), ValidationError, "think_budget", ["think_budget", "integer"], id="think_budget-str"),
    pytest.param(top(think_budget=True), ValidationError, "think_budget", ["think_budget", "integer"], id="think_budget-bool"),
    pytest.param(top(chunk_rows=7), ValidationError, "chunk_rows", ["chunk_rows", ">= 8", "7"], id="chunk_rows-7"),
    pytest.param(top(chunk_rows="64"), ValidationError, "chunk_rows", ["chunk_rows", "integer"], id="chunk_rows-str"),
    pytest.param(top(chunk_rows=True), ValidationError, "chunk_rows", ["chunk_rows", "integer"], id="chunk_rows-bool"),
    pytest.param(top(chunk_prompt="full"), ValidationError, "chunk_prompt", ["chunk_prompt", "'full'"], id="chunk_prompt-full"),
    pytest.param(top(chunk_prompt="mine"), ValidationError, "chunk_prompt", ["chunk_prompt", "'mine'"], id="chunk_prompt-bad"),
    pytest.param(top(chunk_prompt=1), ValidationError, "chunk_prompt", ["chunk_prompt"], id="chunk_prompt-int"),
    pytest.param(top(sequential="yes"), ValidationError, "sequential", ["sequential", "true or false"], id="sequential-str"),
    pytest.param(top(sequential=1), ValidationError, "sequential", ["sequential", "true or false"], id="sequential-int"),
    pytest.param(top(chat_template_kwargs=["x"]), ValidationError, "chat_template_kwargs", ["chat_template_kwargs", "object"], id="kwargs-list"),
    pytest.param(top(cache_salt=5), ValidationError, "cache_salt", ["cache_salt", "string"], id="cache_salt-int"),
    pytest.param(top(model=5), ValidationError, "model", ["model", "string"], id="model-int"),
    pytest.param(top(profile=["fast"]), ValidationError, "profile", ["profile", "string"], id="profile-list"),
    pytest.param(top(instructions={"a": 1}), ValidationError, "instructions", ["instructions", "string"], id="instructions-object"),
    # images: 400, not 422
    pytest.param(top(images=["data:image/png;base64,AAAA"]), InvalidRequest, "images", ["images"], id="images-list"),
    pytest.param(top(images="data:image/png;base64,AAAA"), InvalidRequest, "images", ["images"], id="images-str"),
]


@pytest.mark.parametrize("mutate, error, param, words", INVALID)
def test_invalid_requests(mutate, error, param, words):
    body = ticket_body()
    mutate(body)
    with pytest.raises(error) as caught:
        parse_decision(body, SETTINGS)
    exc = caught.value
    assert type(exc) is error
    assert exc.param == param
    for word in words:
        assert word in exc.message, (word, exc.message)
    assert exc.status == (400 if error is InvalidRequest else 422)


def test_body_not_an_object_is_400():
    with pytest.raises(InvalidRequest):
        parse_decision(["state"], SETTINGS)


def test_validation_error_body_shape():
    body = ticket_body(chunk_rows=7)
    with pytest.raises(ValidationError) as caught:
        parse_decision(body, SETTINGS)
    err = caught.value.body()["error"]
    assert err["type"] == "validation_error" and err["code"] == 422 and err["param"] == "chunk_rows"


# -- what is accepted --------------------------------------------------------


def parse(**top_level):
    return parse_decision(ticket_body(**top_level), SETTINGS)


def test_defaults():
    d = parse()
    assert (d.seed, d.samples, d.auto_max, d.auto_threshold, d.steps) == (42, "auto", 4, 0.1, 1)
    assert (d.think, d.think_threshold, d.think_budget) == (0, 0.8, 64)
    assert (d.ask, d.chunk_rows, d.chunk_prompt, d.sequential) == (None, None, "own", False)
    assert (d.model, d.profile, d.instructions, d.chat_template_kwargs, d.cache_salt) == (None,) * 5
    assert d.ignored == [] and d.given == frozenset()
    assert [q.id for q in d.questions] == ["urgent", "team", "severity", "refund"]


def test_server_defaults_for_think():
    settings = DecisionSettings(think="auto", think_threshold=0.6, think_budget=99)
    d = parse_decision(ticket_body(), settings)
    assert (d.think, d.think_threshold, d.think_budget) == ("auto", 0.6, 99)
    # The request still overrides them.
    d = parse_decision(ticket_body(think=5, think_threshold=0.5), settings)
    assert (d.think, d.think_threshold) == (5, 0.5)
    # Unused (think is not "auto"): a bad think_threshold is ignored with the warning, not refused.
    d = parse_decision(ticket_body(think=5, think_threshold="high"), settings)
    assert d.think_threshold == 0.6 and "think_threshold" in d.ignored
    assert d.ignored == ["think_threshold"]


def test_questions_parsed():
    d = parse()
    urgent, team, severity, refund = d.questions
    assert urgent.options == ("yes", "no") and urgent.labels == ("yes", "no")
    assert urgent.descriptions == (None, None) and urgent.instructions.startswith("Does the customer")
    assert team.options == ("billing", "infra", "product") and team.labels == ("A", "B", "C")
    assert team.descriptions == ("invoices, charges, refunds", "outages, errors, latency", "features, UI bugs")
    assert severity.options == ("low", "medium", "high") and severity.labels == ("1", "2", "3")
    assert refund.depends_on == ("team",) and refund.ask_if == {"team": ("billing",)}
    assert not any(x.alone for x in d.questions)


def test_ask_if_keys_join_depends_on_after_it():
    body = ticket_body()
    body["questions"]["refund"]["depends_on"] = ["severity", "severity"]
    refund = parse_decision(body, SETTINGS).question("refund")
    assert refund.depends_on == ("severity", "team")


def test_noul_criteria():
    body = ticket_body()
    body["questions"]["urgent"]["criteria"] = {"true": "blocking", "false": None}
    body["questions"]["refund"]["criteria"] = {"false": "no refund"}
    d = parse_decision(body, SETTINGS)
    assert d.question("urgent").descriptions == ("blocking", None)
    assert d.question("refund").descriptions == (None, "no refund")


@pytest.mark.parametrize("n", [64, 1])
def test_question_count_limits_accepted(n):
    d = parse_decision(ticket_body(questions=nouls(n)), SETTINGS)
    assert len(d.questions) == n


def test_max_questions_from_settings():
    with pytest.raises(ValidationError) as caught:
        parse_decision(ticket_body(questions=nouls(4)), DecisionSettings(max_questions=3))
    assert caught.value.param == "questions" and "at most 3" in caught.value.message


@pytest.mark.parametrize(
    "qtype, n, labels",
    [
        ("choice", 2, ("A", "B")),
        ("choice", 26, tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")),
        ("score", 2, ("1", "2")),
        ("score", 9, tuple("123456789")),
        ("score", 10, tuple("ABCDEFGHIJ")),
        ("score", 26, tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")),
    ],
)
def test_alternative_limits_and_labels(qtype, n, labels):
    criteria = choice(n) if qtype == "choice" else levels(n)
    d = parse_decision(ticket_body(questions={"x": {"type": qtype, "criteria": criteria}}), SETTINGS)
    assert d.questions[0].labels == labels
    assert len(d.questions[0].options) == n


@pytest.mark.parametrize("given, expected", [(0, 1), (-5, 1), (1, 1), (8, 8), (9, 8), (100, 8), (3.0, 3)])
def test_steps_clamped(given, expected):
    assert parse(steps=given).steps == expected


def test_samples_and_auto_max_lowered_to_max_samples():
    d = parse(samples=100, auto_max=100)
    assert (d.samples, d.auto_max) == (32, 32)
    d = parse_decision(ticket_body(samples=5, auto_max=7), DecisionSettings(max_samples=3))
    assert (d.samples, d.auto_max) == (3, 3)
    assert parse(samples=5).samples == 5
    assert parse(samples="auto").samples == "auto"


@pytest.mark.parametrize(
    "field, value",
    [("think", 0), ("think", 4096), ("think", "auto"), ("think_threshold", 1.0), ("think_threshold", 1e-9),
     ("think_budget", 1), ("think_budget", 4096), ("chunk_rows", 8), ("auto_threshold", 0),
     ("chunk_prompt", "shared"), ("seed", -3), ("seed", 7.0)],
)  # fmt: skip
def test_boundaries_accepted(field, value):
    d = parse(**{field: value})
    assert getattr(d, field) == value


def test_nulls_mean_absent():
    nulls = {k: None for k in (
        "model", "profile", "instructions", "seed", "samples", "auto_max", "auto_threshold", "steps", "think",
        "think_threshold", "think_budget", "ask", "chunk_rows", "chunk_prompt", "sequential",
        "chat_template_kwargs", "cache_salt", "images",
    )}  # fmt: skip
    body = ticket_body(**nulls)
    for spec in body["questions"].values():
        spec.update(instructions=None, depends_on=None, alone=None)
        spec.setdefault("criteria", None)
        spec.setdefault("ask_if", None)
    body["questions"]["team"]["criteria"]["product"] = None
    body["questions"]["refund"]["ask_if"] = None
    d = parse_decision(body, SETTINGS)
    plain = parse()
    for name in ("seed", "samples", "auto_max", "auto_threshold", "steps", "think", "think_threshold",
                 "think_budget", "ask", "chunk_rows", "chunk_prompt", "sequential", "model", "instructions"):  # fmt: skip
        assert getattr(d, name) == getattr(plain, name), name
    assert d.given == frozenset() and d.ignored == []
    assert all(x.instructions == "" and not x.alone for x in d.questions)
    assert d.question("urgent").descriptions == (None, None)
    assert d.question("team").descriptions[2] is None
    assert d.question("refund").depends_on == ()


def test_given_lists_fields_set():
    d = parse(seed=1, samples=None, chunk_rows=16, sequential=False)
    assert d.given == frozenset({"seed", "chunk_rows", "sequential"})


def test_unknown_top_level_fields_are_ignored_in_order():
    d = parse(temperature=0.2, extra={"x": 1}, seed=3, user="me")
    assert d.ignored == ["temperature", "extra", "user"]
    assert d.seed == 3


def test_think_fields_without_auto_are_ignored():
    assert parse(think_threshold=0.5, think_budget=10).ignored == ["think_threshold", "think_budget"]
    assert parse(think=16, think_budget=10).ignored == ["think_budget"]
    d = parse(think="auto", think_threshold=0.5, think_budget=10)
    assert d.ignored == [] and (d.think_threshold, d.think_budget) == (0.5, 10)


@pytest.mark.parametrize("images", [[], {}, ""])
def test_empty_images_accepted(images):
    assert parse(images=images).state.startswith("{")


def test_state_string_kept_as_is():
    assert parse(state="  Hello\n").state == "  Hello\n"


def test_state_json_keeps_characters():
    d = parse(state={"ticket": "Café crème ☕ — naïve", "n": [1, 2.5, None, True]})
    assert d.state == '{"ticket": "Café crème ☕ — naïve", "n": [1, 2.5, null, true]}'
    assert json.loads(d.state)["ticket"] == "Café crème ☕ — naïve"
    assert parse(state=0).state == "0"


def test_state_null_is_its_json_text_but_a_missing_state_is_refused():
    # null is a JSON value (SPEC 4.1: "string, or any JSON value"); only a body
    # without the key lacks a state.
    assert parse(state=None).state == "null"
    body = ticket_body()
    del body["state"]
    with pytest.raises(ValidationError, match="state is required"):
        parse_decision(body, DecisionSettings())


def test_ask_with_dependencies():
    d = parse(ask=["refund", "team", "refund"])
    assert d.ask == ("refund", "team")


def test_ask_transitive_dependency_required():
    body = ticket_body(
        questions={
            "a": {"type": "noul"},
            "b": {"type": "noul", "depends_on": ["a"]},
            "c": {"type": "noul", "ask_if": {"b": ["yes"]}},
        },
        ask=["c", "b"],
    )
    with pytest.raises(ValidationError) as caught:
        parse_decision(body, SETTINGS)
    assert caught.value.param == "ask" and "'a'" in caught.value.message
    body["ask"] = ["c", "b", "a"]
    assert parse_decision(body, SETTINGS).ask == ("c", "b", "a")


def test_choice_option_names_keep_request_order():
    body = ticket_body(questions={"x": {"type": "choice", "criteria": {"zeta": None, "alpha": "first letter"}}})
    x = parse_decision(body, SETTINGS).questions[0]
    assert x.options == ("zeta", "alpha") and x.descriptions == (None, "first letter")
