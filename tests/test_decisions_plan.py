"""Stages, ask, skipping and chunks (SPEC 4.4), through decide() with the fake reader."""

from __future__ import annotations

import pytest

from gmlx.errors import ValidationError
from fake_reader import FakeReader, ticket_body
from gmlx.decisions.plan import asked_questions, make_plan, skip_reason, stages_of
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import admit, decide
from gmlx.decisions.types import DecisionSettings

SETTINGS = DecisionSettings()


def run(body, reader, settings=SETTINGS):
    decision = parse_decision(body, settings)
    return decide(decision, reader, settings, "m"), decision


def ids(questions):
    return [q.id for q in questions]


def test_ticket_has_two_stages():
    d = parse_decision(ticket_body(), SETTINGS)
    plan = make_plan(d, SETTINGS)
    assert [ids(s) for s in plan.stages] == [["urgent", "team", "severity"], ["refund"]]
    assert plan.chunk_prompt == "full"


def test_stage_after_everything_it_depends_on_declaration_order_within():
    body = ticket_body(
        questions={
            "c": {"type": "noul", "depends_on": ["b"]},
            "a": {"type": "noul"},
            "b": {"type": "noul", "depends_on": ["a"]},
            "d": {"type": "noul"},
            "e": {"type": "noul", "depends_on": ["a", "c"]},
            "f": {"type": "noul", "depends_on": ["a"]},
        }
    )
    stages = stages_of(parse_decision(body, SETTINGS).questions)
    assert [ids(s) for s in stages] == [["a", "d"], ["b", "f"], ["c"], ["e"]]


def test_refund_skipped_when_team_is_not_billing():
    reader = FakeReader(forced={"team": [0.1, 0.8, 0.1]})
    response, _ = run(ticket_body(), reader)
    assert response["answers"]["refund"] is None
    assert list(response["answers"]) == ["urgent", "team", "severity", "refund"]
    assert response["diagnostics"]["skipped"] == {"refund": {"because": "team", "was": "infra", "wanted": ["billing"]}}
    assert response["diagnostics"]["chunks"] == [[["urgent", "team", "severity"]], []]
    assert all("refund" not in ids(r.questions) for r in reader.reads)
    assert response["diagnostics"]["conditioning"] is None


def test_refund_read_in_second_stage_when_team_is_billing():
    reader = FakeReader(forced={"team": [0.7, 0.2, 0.1]})
    response, decision = run(ticket_body(samples=1), reader)
    assert response["answers"]["refund"]["type"] == "noul"
    assert response["diagnostics"]["skipped"] == {}
    assert response["diagnostics"]["chunks"] == [[["urgent", "team", "severity"]], [["refund"]]]
    last = reader.reads[-1]
    assert ids(last.questions) == ["refund"]
    # The second stage sees every earlier answer, team's as its top option.
    seen = {a.question.id: a.question.options[a.option] for a in last.answered}
    assert seen["team"] == "billing" and set(seen) == {"urgent", "team", "severity"}
    # A next-token read states earlier answers in its prompt; it prefills nothing.
    assert response["diagnostics"]["conditioning"] == "prompt"
    assert len(reader.reads) == 2


def test_skipped_omitted_with_setting_but_still_listed():
    settings = DecisionSettings(skipped="omit")
    response, _ = run(ticket_body(), FakeReader(forced={"team": [0.1, 0.1, 0.8]}), settings)
    assert list(response["answers"]) == ["urgent", "team", "severity"]
    assert response["diagnostics"]["skipped"]["refund"]["was"] == "product"


def test_question_depending_on_skipped_is_skipped():
    body = ticket_body()
    body["questions"]["amount"] = {"type": "score", "criteria": ["small", "large"], "depends_on": ["refund"]}
    body["questions"]["why"] = {"type": "noul", "ask_if": {"amount": ["large"]}}
    response, _ = run(body, FakeReader(forced={"team": [0.1, 0.8, 0.1]}))
    skipped = response["diagnostics"]["skipped"]
    assert skipped["amount"] == {"because": "refund", "was": None, "wanted": None}
    assert skipped["why"] == {"because": "amount", "was": None, "wanted": ["large"]}
    assert response["answers"]["amount"] is None and response["answers"]["why"] is None
    assert response["diagnostics"]["stages"] == [["urgent", "team", "severity"], ["refund"], ["amount"], ["why"]]
    assert response["diagnostics"]["chunks"] == [[["urgent", "team", "severity"]], [], [], []]


def test_skip_reason_unit():
    d = parse_decision(ticket_body(), SETTINGS)
    refund = d.question("refund")
    assert skip_reason(refund, {"team": "billing"}, set()) is None
    assert skip_reason(refund, {"team": "infra"}, set()) == {"because": "team", "was": "infra", "wanted": ["billing"]}
    assert skip_reason(refund, {}, {"team"}) == {"because": "team", "was": None, "wanted": ["billing"]}


def test_ask_filters_answers():
    reader = FakeReader()
    response, _ = run(ticket_body(ask=["severity", "urgent"]), reader)
    assert list(response["answers"]) == ["urgent", "severity"]
    assert response["diagnostics"]["stages"] == [["urgent", "severity"]]
    assert all(set(ids(r.questions)) == {"urgent", "severity"} for r in reader.reads)
    assert set(response["diagnostics"]["questions"]) == {"urgent", "severity"}


def test_asked_questions_keep_request_order():
    d = parse_decision(ticket_body(ask=["refund", "team"]), SETTINGS)
    assert ids(asked_questions(d)) == ["team", "refund"]


# -- chunks (canvas) ----------------------------------------------------------

SIX = {f"q{i}": {"type": "noul"} for i in range(1, 7)}  # 5 template rows each with the fake


def canvas_run(chunk_rows=None, alone=(), **top):
    qs = {k: dict(v) for k, v in SIX.items()}
    for qid in alone:
        qs[qid]["alone"] = True
    body = ticket_body(questions=qs, samples=1, **top)
    if chunk_rows is not None:
        body["chunk_rows"] = chunk_rows
    reader = FakeReader("canvas")
    response, _ = run(body, reader)
    return response, reader


def test_whole_stage_fits_default_canvas():
    response, reader = canvas_run()
    assert response["diagnostics"]["chunks"] == [[["q1", "q2", "q3", "q4", "q5", "q6"]]]
    assert len(reader.reads) == 1


@pytest.mark.parametrize(
    "rows, expected",
    [
        (10, [["q1", "q2"], ["q3", "q4"], ["q5", "q6"]]),
        (14, [["q1", "q2"], ["q3", "q4"], ["q5", "q6"]]),
        (15, [["q1", "q2", "q3"], ["q4", "q5", "q6"]]),
        (29, [["q1", "q2", "q3", "q4", "q5"], ["q6"]]),
        (30, [["q1", "q2", "q3", "q4", "q5", "q6"]]),
    ],
)
def test_fewest_in_order_chunks(rows, expected):
    response, reader = canvas_run(rows)
    assert response["diagnostics"]["chunks"] == [expected]
    assert [ids(r.questions) for r in reader.reads] == expected
    # Each chunk gets its own seed; with several chunks samples become per-chunk lists.
    assert len({r.seed for r in reader.reads}) == len(expected)
    if len(expected) > 1:
        assert response["diagnostics"]["samples"]["n"] == [1] * len(expected)


def test_alone_question_gets_own_chunk():
    response, _ = canvas_run(alone=("q3",))
    assert response["diagnostics"]["chunks"] == [[["q1", "q2"], ["q3"], ["q4", "q5", "q6"]]]
    response, _ = canvas_run(15, alone=("q1",))
    assert response["diagnostics"]["chunks"] == [[["q1"], ["q2", "q3", "q4"], ["q5", "q6"]]]


def test_question_over_chunk_rows_but_within_canvas_read_alone():
    qs = {"a": {"type": "noul"}, "long_question_id": {"type": "noul"}, "b": {"type": "noul"}}
    response, _ = run(ticket_body(questions=qs, chunk_rows=8), FakeReader("canvas"))
    assert response["diagnostics"]["chunks"] == [[["a"], ["long_question_id"], ["b"]]]


def test_question_longer_than_canvas_is_422():
    long_id = "x" * 70  # 73 rows > 64
    body = ticket_body(questions={"a": {"type": "noul"}, long_id: {"type": "noul"}})
    d = parse_decision(body, SETTINGS)
    with pytest.raises(ValidationError) as caught:
        admit(d, FakeReader("canvas"), SETTINGS)
    assert caught.value.param == f"questions.{long_id}" and "73" in caught.value.message
    with pytest.raises(ValidationError) as caught:
        decide(d, FakeReader("canvas"), SETTINGS, "m")
    assert caught.value.param == f"questions.{long_id}"
    # A bigger canvas (served and held by the model) takes it.
    big = DecisionSettings(canvas=128)
    response = decide(parse_decision(body, big), FakeReader("canvas", canvas=128), big, "m")
    assert set(response["answers"]) == {"a", long_id}


def test_chunk_rows_above_canvas_capped():
    response, _ = canvas_run(10_000)
    assert response["diagnostics"]["chunks"] == [[["q1", "q2", "q3", "q4", "q5", "q6"]]]
    settings = DecisionSettings(canvas=16)
    body = ticket_body(questions=SIX, chunk_rows=1000, samples=1)
    response, _ = run(body, FakeReader("canvas"), settings)
    assert response["diagnostics"]["chunks"] == [[["q1", "q2", "q3"], ["q4", "q5", "q6"]]]


def test_reader_with_a_smaller_canvas_plans_for_its_own():
    """A model whose canvas_length is below the served canvas: chunks fit the model's."""
    body = ticket_body(questions=SIX, samples=1)
    response, reader = run(body, FakeReader("canvas", canvas=16), DecisionSettings(canvas=64))
    assert response["diagnostics"]["chunks"] == [[["q1", "q2", "q3"], ["q4", "q5", "q6"]]]
    # And a question too long for the model's canvas is refused at admission.
    long_body = ticket_body(questions={"a": {"type": "noul"}, "x" * 20: {"type": "noul"}})
    with pytest.raises(ValidationError):
        admit(parse_decision(long_body, SETTINGS), FakeReader("canvas", canvas=16), DecisionSettings(canvas=64))


def test_next_token_reads_a_stage_at_once():
    reader = FakeReader("next-token")
    body = ticket_body(questions=SIX, chunk_rows=8, samples=1)
    d = parse_decision(body, SETTINGS)
    admit(d, reader, SETTINGS)
    response = decide(d, reader, SETTINGS, "m")
    assert response["diagnostics"]["chunks"] == [[["q1", "q2", "q3", "q4", "q5", "q6"]]]
    assert d.ignored == ["chunk_rows"]
    assert response["diagnostics"]["ignored"] == ["chunk_rows"]


def test_chunk_prompt_own_lists_only_the_chunk():
    _, reader = canvas_run(10)
    assert [ids(r.listed) for r in reader.reads] == [["q1", "q2"], ["q3", "q4"], ["q5", "q6"]]


def test_chunk_prompt_shared_lists_everything():
    response, reader = canvas_run(10, chunk_prompt="shared")
    assert response["diagnostics"]["chunk_prompt"] == "shared"
    assert all(ids(r.listed) == list(SIX) for r in reader.reads)


def test_stages_make_chunk_prompt_full():
    reader = FakeReader("canvas", forced={"team": [0.9, 0.05, 0.05]})
    response, _ = run(ticket_body(chunk_prompt="own", chunk_rows=8, samples=1), reader)
    assert response["diagnostics"]["chunk_prompt"] == "full"
    assert all(ids(r.listed) == ["urgent", "team", "severity", "refund"] for r in reader.reads)
    assert response["diagnostics"]["chunks"] == [[["urgent"], ["team"], ["severity"]], [["refund"]]]


def test_sequential_chunks_see_earlier_answers():
    response, reader = canvas_run(10, sequential=True)
    assert response["diagnostics"]["chunk_prompt"] == "full"
    assert response["diagnostics"]["sequential"] is True
    assert [[a.question.id for a in r.answered] for r in reader.reads] == [[], ["q1", "q2"], ["q1", "q2", "q3", "q4"]]
    assert all(ids(r.listed) == list(SIX) for r in reader.reads)
    assert response["diagnostics"]["conditioning"] == "prefill"


def test_parallel_chunks_see_no_answers_of_their_stage():
    response, reader = canvas_run(10)
    assert all(r.answered == () for r in reader.reads)
    assert response["diagnostics"]["conditioning"] is None
    assert response["diagnostics"]["sequential"] is False
