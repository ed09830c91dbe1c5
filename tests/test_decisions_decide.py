"""decide(): samples, thinking, answer shapes, usage and determinism."""

from __future__ import annotations

import copy
import math

import pytest

from gmlx.errors import Cancelled, ValidationError
from gmlx.decisions import stats
from fake_reader import FakeReader, ticket_body
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import admit, decide
from gmlx.decisions.orders import option_order
from gmlx.decisions.seeds import sample_seed, thought_seed
from gmlx.decisions.types import DecisionSettings

SETTINGS = DecisionSettings()
ONE = {"urgent": {"type": "noul"}}


def run(body, reader, settings=SETTINGS, **kw):
    decision = parse_decision(body, settings)
    return decide(decision, reader, settings, "model-x", **kw)


def entropy_of(probs):
    """The entropy the pipeline sees for a forced distribution."""
    return stats.entropy(stats.label_probs([math.log(p) for p in probs]))


# -- response shape -----------------------------------------------------------


def test_response_envelope():
    response = run(ticket_body(), FakeReader(forced={"team": [0.8, 0.1, 0.1]}))
    assert response["object"] == "structured_decision"
    assert response["id"].startswith("decision-") and len(response["id"]) == len("decision-") + 32
    assert isinstance(response["created"], int) and response["created"] > 1_700_000_000
    assert response["model"] == "model-x"
    assert list(response["answers"]) == ["urgent", "team", "severity", "refund"]
    assert all(isinstance(v, int) for v in response["usage"].values())
    diag = response["diagnostics"]
    assert diag["strategy"] == "next-token" and diag["steps"] == 1 and diag["thought"] is None
    assert diag["stages"] == [["urgent", "team", "severity"], ["refund"]]
    assert set(diag["timing"]) >= {"total_ms", "reads", "queue_ms"} and diag["timing"]["queue_ms"] == 0
    assert "think_auto" not in diag


def test_answer_shapes_and_score_expected_index():
    forced = {"urgent": [0.25, 0.75], "team": [0.8, 0.15, 0.05], "severity": [0.1, 0.3, 0.6]}
    answers = run(ticket_body(samples=1), FakeReader(forced=forced))["answers"]
    assert answers["urgent"] == {
        "type": "noul", "noul": pytest.approx(0.25), "probabilities": {"yes": pytest.approx(0.25), "no": pytest.approx(0.75)},
        "confidence": pytest.approx(0.75),
    }  # fmt: skip
    team = answers["team"]
    assert team["choice"] == "billing" and team["confidence"] == pytest.approx(0.8)
    assert list(team["probabilities"]) == ["billing", "infra", "product"]
    severity = answers["severity"]
    assert severity["type"] == "score"
    assert severity["score"] == pytest.approx(1.5)
    assert severity["legend"] == {"0": "low", "1": "medium", "2": "high"}
    assert severity["probabilities"] == pytest.approx({"0": 0.1, "1": 0.3, "2": 0.6})
    assert severity["confidence"] == pytest.approx(0.6)
    assert answers["refund"]["type"] == "noul"


def test_typesafe_confidence():
    settings = DecisionSettings(confidence="typesafe")
    forced = {"urgent": [0.25, 0.75], "team": [0.8, 0.2, 0.0], "severity": [0.1, 0.3, 0.6]}
    body = ticket_body(samples=1)
    body["questions"]["team"]["criteria"] = {"billing": None, "infra": None}
    forced["team"] = [0.8, 0.2]
    answers = run(body, FakeReader(forced=forced), settings)["answers"]
    assert answers["team"]["confidence"] == pytest.approx(0.6)
    assert answers["severity"]["confidence"] == pytest.approx(0.25)
    assert answers["urgent"]["confidence"] == pytest.approx(0.75)


@pytest.mark.parametrize("strategy", ["next-token", "canvas"])
def test_probabilities_sum_to_one(strategy):
    body = ticket_body(samples=5, seed=7)
    body["questions"]["many"] = {"type": "choice", "criteria": {f"o{i}": None for i in range(26)}}
    response = run(body, FakeReader(strategy))
    for answer in response["answers"].values():
        if answer is not None:
            assert abs(math.fsum(answer["probabilities"].values()) - 1.0) < 1e-9


def test_top_labels_as_written():
    forced = {"urgent": [0.2, 0.8], "team": [0.1, 0.7, 0.2], "severity": [0.1, 0.2, 0.7]}
    response = run(ticket_body(samples=1), FakeReader(forced=forced))
    tops = response["diagnostics"]["samples"]["tops"]
    assert len(tops) == 1 and len(tops[0]) == 1  # one chunk (refund skipped), one sample
    first = tops[0][0]
    assert first["urgent"]["label"] == "no" and first["urgent"]["p"] == pytest.approx(0.8)
    assert first["team"]["label"] == "B"
    assert first["severity"]["label"] == "3"  # level counted from 1
    assert first["severity"]["entropy"] == pytest.approx(entropy_of([0.1, 0.2, 0.7]))


# -- samples ------------------------------------------------------------------


def test_auto_sampling_triggers_strictly_above_threshold():
    probs = [0.7, 0.3]
    h = entropy_of(probs)
    at = run(ticket_body(questions=ONE, auto_threshold=h), FakeReader(forced={"urgent": probs}))
    assert at["diagnostics"]["timing"]["reads"] == 1
    assert at["diagnostics"]["samples"]["n"] == 1 and at["diagnostics"]["samples"]["policy"] == "auto"
    below = math.nextafter(h, 0.0)  # the entropy is now just above the threshold
    above = run(ticket_body(questions=ONE, auto_threshold=below), FakeReader(forced={"urgent": probs}))
    # A noul has two distinct orders (yes first, no first): 4 samples are 2 reads.
    assert above["diagnostics"]["timing"]["reads"] == 2
    assert above["diagnostics"]["samples"]["n"] == 2 and above["diagnostics"]["samples"]["policy"] == "auto-extended"
    assert above["diagnostics"]["questions"]["urgent"]["reads"] == 2
    # auto_max bounds the extension (a choice of 8 options has 8 distinct orders); auto_max 1 never extends.
    eight = {"pick": {"type": "choice", "criteria": {f"o{i}": None for i in range(8)}}}
    flat = {"pick": [1 / 8] * 8}
    six = run(ticket_body(questions=eight, auto_threshold=0.1, auto_max=6), FakeReader(forced=flat))
    assert six["diagnostics"]["timing"]["reads"] == 6
    one = run(ticket_body(questions=ONE, auto_threshold=0, auto_max=1), FakeReader(forced={"urgent": probs}))
    assert one["diagnostics"]["timing"]["reads"] == 1


def test_auto_extension_looks_at_every_label_position():
    forced = {"urgent": [0.999, 0.001], "team": [0.4, 0.3, 0.3], "severity": [0.98, 0.01, 0.01]}
    body = ticket_body(auto_threshold=0.5)
    del body["questions"]["refund"]
    reader = FakeReader(forced=forced)
    response = run(body, reader)
    # urgent and severity have 2 orders each: samples 2 and 3 read only team
    # (6 orders: 3 rotations, then the reversed order's).
    assert [r.sample for r in reader.reads] == [0, 1, 2, 3]
    assert [[q.id for q in r.questions] for r in reader.reads] == [["urgent", "team", "severity"]] * 2 + [["team"]] * 2
    assert response["diagnostics"]["samples"]["n"] == 4
    reads = {qid: d["reads"] for qid, d in response["diagnostics"]["questions"].items()}
    assert reads == {"urgent": 2, "team": 4, "severity": 2}
    forced["team"] = [0.98, 0.01, 0.01]
    assert run(body, FakeReader(forced=forced))["diagnostics"]["timing"]["reads"] == 1


def test_auto_max_lowered_to_max_samples():
    settings = DecisionSettings(max_samples=2)
    response = run(ticket_body(questions=ONE, auto_threshold=0, auto_max=10), FakeReader(forced={"urgent": [0.6, 0.4]}), settings)
    assert response["diagnostics"]["timing"]["reads"] == 2


def test_fixed_samples_average_stderr_agreement():
    reader = FakeReader(forced={"urgent": [[0.9, 0.1], [0.3, 0.7]]})
    response = run(ticket_body(questions=ONE, samples=2), reader)
    assert response["answers"]["urgent"]["noul"] == pytest.approx(0.6)
    q = response["diagnostics"]["questions"]["urgent"]
    assert q["stderr"] == pytest.approx(0.3)
    assert q["agreement"] == 0.5
    assert q["entropy"] == pytest.approx(stats.entropy([0.6, 0.4]))
    assert q["label_mass"] == pytest.approx(1.0) and q["argmax_is_label"] is True
    assert response["diagnostics"]["samples"]["policy"] == "fixed"
    assert [t["urgent"]["label"] for t in response["diagnostics"]["samples"]["tops"]] == ["yes", "no"]


def test_single_sample_has_no_stderr():
    q = run(ticket_body(questions=ONE, samples=1), FakeReader())["diagnostics"]["questions"]["urgent"]
    assert "stderr" not in q and "agreement" not in q
    assert 0.0 < q["label_mass"] < 1.0  # the hashed fake leaves mass on other tokens


def test_seeds_differ_per_sample_and_chunk():
    reader = FakeReader("canvas", forced={"team": [0.9, 0.05, 0.05]})
    response = run(ticket_body(samples=3, chunk_rows=16), reader)  # rows: urgent 9, team 7, severity 11
    assert response["diagnostics"]["chunks"] == [[["urgent", "team"], ["severity"]], [["refund"]]]
    groups = [(s, c, k) for s, c in [(0, 0), (0, 1), (1, 0)] for k in range(3)]
    assert [r.seed for r in reader.reads] == [sample_seed(42, s, c, k) for s, c, k in groups]
    assert len({r.seed for r in reader.reads}) == 9
    assert [r.sample for r in reader.reads] == [0, 1, 2] * 3


def test_canvas_samples_differ_through_their_seeds():
    response = run(ticket_body(questions=ONE, samples=3), FakeReader("canvas"))
    ps = [t["urgent"]["p"] for t in response["diagnostics"]["samples"]["tops"]]
    assert len(set(ps)) == 3


# -- next-token option order ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["next-token", "canvas"])
def test_position_bias_cancels_over_n_rotations(strategy):
    """A reader that always favours the first listed option gives uniform
    probabilities over n samples: each option is listed first exactly once."""
    body = ticket_body(questions={"pick": {"type": "choice", "criteria": {f"o{i}": None for i in range(5)}}}, samples=5)
    logits = [4.0, 1.0, 0.0, -1.0, -2.0]  # by listed position
    reader = FakeReader(strategy, position_logits={"pick": logits})
    response = run(body, reader)
    pick = parse_decision(body, SETTINGS).question("pick")
    position_probs = stats.label_probs(logits)  # softmax by listed position
    orders = [list(r.questions[0].order) or [0, 1, 2, 3, 4] for r in reader.reads]
    assert len(orders) == 5
    assert orders[0] == [0, 1, 2, 3, 4]
    assert sorted(o[0] for o in orders[:5]) == [0, 1, 2, 3, 4]  # every option first once
    assert all(o == orders[0][k:] + orders[0][:k] for o in orders for k in [o[0]])  # rotations
    tops = response["diagnostics"]["samples"]["tops"]
    for order, top in zip(orders, tops):
        assert top["pick"]["label"] == pick.labels[order[0]]
        assert top["pick"]["p"] == pytest.approx(position_probs[0])
    got = list(response["answers"]["pick"]["probabilities"].values())
    assert got == pytest.approx([0.2] * 5, abs=1e-12)


def test_two_n_samples_read_what_a_reversed_request_reads():
    """Samples n..2n-1 list the reversed order's rotations, so 2n samples give the
    same numbers whichever way round the options were sent; 2n+1 repeats sample 0."""
    names = ["red", "green", "blue", "grey"]
    fwd = {"pick": {"type": "choice", "criteria": {k: None for k in names}}}
    rev = {"pick": {"type": "choice", "criteria": {k: None for k in reversed(names)}}}
    a = run(ticket_body(questions=fwd, samples=9), FakeReader())
    b = run(ticket_body(questions=rev, samples=9), FakeReader())
    assert a["diagnostics"]["questions"]["pick"]["reads"] == 8
    pa, pb = a["answers"]["pick"]["probabilities"], b["answers"]["pick"]["probabilities"]
    assert pa == pytest.approx(pb, abs=1e-12)


def test_permuted_prompt_lists_options_in_that_order():
    body = ticket_body(questions={"pick": {"type": "choice", "criteria": {"red": None, "green": None, "blue": None, "grey": None}}}, samples=4)
    reader = FakeReader("next-token")
    run(body, reader)
    pick = parse_decision(body, SETTINGS).question("pick")
    assert len(reader.reads) == 4
    for read in reader.reads:
        order = list(read.questions[0].order) or [0, 1, 2, 3]
        assert order == option_order(pick, read.sample, sample_seed(42, 0, 0, 0))
        text = reader.prompt_text(read, read.questions[0], range(4))
        listed = [line.split(". ", 1)[1] for line in text.splitlines() if line[:2] in ("A.", "B.", "C.", "D.")]
        assert listed == [pick.options[i] for i in order]


# -- thinking -----------------------------------------------------------------


def test_think_budget_writes_one_thought_seen_by_every_read():
    reader = FakeReader(forced={"team": [0.9, 0.05, 0.05]})
    response = run(ticket_body(think=32, samples=2), reader)
    assert reader.thinks == [(32, thought_seed(42))]
    assert len(reader.reads) == 4 and all(r.thought is not None for r in reader.reads)
    thought = response["diagnostics"]["thought"]
    assert thought == {"tokens": 7, "closed": True, "ms": 5.0, "text": reader.reads[0].thought.text}
    reads_out = sum(len(r.questions) for r in reader.reads)
    assert response["usage"]["output_tokens"] == reads_out + 7


def test_think_ignored_when_the_model_cannot_think():
    reader = FakeReader(can_think=False)
    d = parse_decision(ticket_body(think=32), SETTINGS)
    admit(d, reader, SETTINGS)
    assert d.ignored == ["think"]
    response = decide(d, reader, SETTINGS, "m")
    assert reader.think_calls == 0 and response["diagnostics"]["thought"] is None
    assert response["diagnostics"]["ignored"] == ["think"]
    d = parse_decision(ticket_body(think="auto", think_budget=9), SETTINGS)
    response = decide(d, FakeReader(can_think=False), SETTINGS, "m")
    assert d.ignored == ["think", "think_budget"] and "think_auto" not in response["diagnostics"]


def test_think_auto_no_thought_when_sure():
    forced = {"urgent": [0.05, 0.95], "team": [0.9, 0.05, 0.05], "severity": [0.85, 0.1, 0.05], "refund": [0.99, 0.01]}
    reader = FakeReader(forced=forced)
    response = run(ticket_body(think="auto", samples=1), reader)
    assert reader.think_calls == 0
    auto = response["diagnostics"]["think_auto"]
    assert auto["thought"] is False and auto["unsure"] == []
    assert auto["threshold"] == 0.8 and auto["budget"] == 64
    assert auto["confidences"] == pytest.approx({"urgent": 0.95, "team": 0.9, "severity": 0.85, "refund": 0.99})
    assert auto["reads"] == 2 and response["diagnostics"]["timing"]["reads"] == 2


def test_think_auto_reruns_with_a_thought_when_unsure():
    forced = {"urgent": [0.6, 0.4], "team": [0.9, 0.05, 0.05], "severity": [0.85, 0.1, 0.05]}
    reader = FakeReader(forced=forced, forced_thought={"urgent": [0.97, 0.03]})
    response = run(ticket_body(think="auto", think_budget=16, samples=1), reader)
    assert reader.thinks == [(16, thought_seed(42))]
    auto = response["diagnostics"]["think_auto"]
    assert auto["thought"] is True and auto["unsure"] == ["urgent"]
    assert auto["confidences"]["urgent"] == pytest.approx(0.6)
    assert auto["reads"] == 2
    assert response["answers"]["urgent"]["noul"] == pytest.approx(0.97)  # from the second run
    assert [r.thought is not None for r in reader.reads] == [False, False, True, True]
    assert response["diagnostics"]["timing"]["reads"] == 4
    assert response["diagnostics"]["thought"]["tokens"] == 7


def test_think_auto_threshold_is_a_strict_floor():
    forced = {"urgent": [0.75, 0.25]}
    at = FakeReader(forced=forced)
    run(ticket_body(questions=ONE, think="auto", think_threshold=0.75, samples=1), at)
    assert at.think_calls == 0
    above = FakeReader(forced=forced)
    run(ticket_body(questions=ONE, think="auto", think_threshold=0.7500001, samples=1), above)
    assert above.think_calls == 1


def test_think_auto_from_server_default():
    settings = DecisionSettings(think="auto", think_threshold=0.99)
    reader = FakeReader(forced={"urgent": [0.9, 0.1]})
    response = run(ticket_body(questions=ONE, samples=1), reader, settings)
    assert reader.think_calls == 1
    assert response["diagnostics"]["think_auto"]["threshold"] == 0.99


def test_think_auto_uses_typesafe_confidence():
    settings = DecisionSettings(confidence="typesafe")
    forced = {"team": [0.85, 0.1, 0.05]}  # probability 0.85, typesafe 0.775
    body = ticket_body(questions={"team": ticket_body()["questions"]["team"]}, think="auto", samples=1)
    reader = FakeReader(forced=forced)
    response = run(body, reader, settings)
    assert reader.think_calls == 1
    assert response["diagnostics"]["think_auto"]["confidences"]["team"] == pytest.approx(0.775)


# -- usage, checkpoints, admission ------------------------------------------------


def test_usage():
    reader = FakeReader("canvas", forced={"team": [0.9, 0.05, 0.05]})
    response = run(ticket_body(samples=2), reader)
    results = [FakeReader("canvas", forced={"team": [0.9, 0.05, 0.05]}).read(r) for r in reader.reads]
    assert response["usage"]["input_tokens"] == max(r.prompt_tokens for r in results)
    assert response["usage"]["output_tokens"] == sum(r.output_tokens for r in results)
    assert response["diagnostics"]["prompt_tokens"] == response["usage"]["input_tokens"]


def test_checkpoint_before_every_read_and_thought():
    calls = []
    reader = FakeReader(forced={"team": [0.9, 0.05, 0.05]})
    run(ticket_body(samples=2, think=8), reader, checkpoint=lambda: calls.append(len(reader.reads)))
    assert calls == [0, 0, 1, 2, 3]  # the thought, then each of the four reads


def test_checkpoint_stops_the_decision():
    reader = FakeReader()

    def stop_after_two():
        if len(reader.reads) == 2:
            raise Cancelled()

    with pytest.raises(Cancelled):
        run(ticket_body(samples=4), reader, checkpoint=stop_after_two)
    assert len(reader.reads) == 2


def test_admit_runs_the_reader_check():
    d = parse_decision(ticket_body(), SETTINGS)
    with pytest.raises(ValidationError) as caught:
        admit(d, FakeReader(label_tokens={"C": None}), SETTINGS)
    assert "'team'" in caught.value.message and "'C'" in caught.value.message
    with pytest.raises(ValidationError) as caught:
        admit(d, FakeReader(label_tokens={"yes": 1, "no": 1}), SETTINGS)
    assert "'urgent'" in caught.value.message


def test_canvas_only_fields_ignored_on_next_token():
    body = ticket_body(steps=4, chunk_prompt="shared", sequential=True, seed=3, bogus=1)
    d = parse_decision(body, SETTINGS)
    admit(d, FakeReader("next-token"), SETTINGS)
    assert d.ignored == ["bogus", "steps", "chunk_prompt", "sequential"]
    d = parse_decision(body, SETTINGS)
    admit(d, FakeReader("canvas"), SETTINGS)
    assert d.ignored == ["bogus"]


# -- determinism --------------------------------------------------------------


def strip(response):
    out = copy.deepcopy(response)
    for key in ("id", "created"):
        out.pop(key)
    out["diagnostics"].pop("timing")
    out["diagnostics"].get("think_auto", {}).pop("ms", None)
    return out


@pytest.mark.parametrize("strategy", ["next-token", "canvas"])
def test_same_request_same_numbers(strategy):
    body = ticket_body(think="auto", think_threshold=0.95, chunk_rows=12)
    first = run(copy.deepcopy(body), FakeReader(strategy))
    second = run(copy.deepcopy(body), FakeReader(strategy))
    assert first["id"] != second["id"]
    assert strip(first) == strip(second)
    other = run(ticket_body(think="auto", think_threshold=0.95, chunk_rows=12, seed=43), FakeReader(strategy))
    assert strip(other)["answers"] != strip(first)["answers"]


# -- invariants over arbitrary label distributions -----------------------------

from hypothesis import given, settings as hsettings, strategies as st  # noqa: E402

weights = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)


def dist(n):
    return st.lists(st.lists(weights, min_size=n, max_size=n), min_size=1, max_size=4).map(
        lambda rows: [[w / sum(r) for w in r] for r in rows]
    )


@hsettings(max_examples=60, deadline=None)
@given(urgent=dist(2), team=dist(3), severity=dist(3), mode=st.sampled_from(["probability", "typesafe"]))
def test_answers_well_formed_for_any_distribution(urgent, team, severity, mode):
    settings = DecisionSettings(confidence=mode)
    n = max(len(urgent), len(team), len(severity))
    reader = FakeReader(forced={"urgent": urgent, "team": team, "severity": severity})
    response = run(ticket_body(samples=n), reader, settings)
    for qid, answer in response["answers"].items():
        if answer is None:
            assert response["diagnostics"]["skipped"][qid]["because"] == "team"
            continue
        probs = list(answer["probabilities"].values())
        assert abs(math.fsum(probs) - 1.0) < 1e-9
        assert 0.0 <= answer["confidence"] <= 1.0 + 1e-12
    sev = response["answers"]["severity"]
    assert 0.0 <= sev["score"] <= 2.0
    assert sev["score"] == pytest.approx(sum(i * p for i, p in enumerate(sev["probabilities"].values())))
    assert response["answers"]["urgent"]["noul"] == response["answers"]["urgent"]["probabilities"]["yes"]
    team_answer = response["answers"]["team"]
    assert team_answer["choice"] == max(team_answer["probabilities"], key=team_answer["probabilities"].get)
    assert (response["answers"]["refund"] is None) == (team_answer["choice"] != "billing")
