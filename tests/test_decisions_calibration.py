"""Contextual calibration (calibrate: "content_free") on the fake reader:
the math against a hand computation, the prior cache, both strategies."""

from __future__ import annotations

import pytest

from gmlx.decisions.calibration import CONTENT_FREE_STATES, PriorCache, calibrated
from fake_reader import FakeReader, ticket_body
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import decide
from gmlx.decisions.types import DecisionSettings
from gmlx.errors import ValidationError

SETTINGS = DecisionSettings()
PICK = {"pick": {"type": "choice", "criteria": {"red": None, "green": None, "blue": None}}}


def run(body, reader):
    return decide(parse_decision(body, SETTINGS), reader, SETTINGS, "m")


def _state_dependent(real, prior):
    """A forced reader: `prior` for content-free states, `real` otherwise."""
    return lambda read: prior if read.state in CONTENT_FREE_STATES else real


def test_calibration_divides_by_the_prior_by_hand():
    real, prior = [0.5, 0.3, 0.2], [0.6, 0.3, 0.1]
    reader = FakeReader(forced={"pick": _state_dependent(real, prior)})
    resp = run({"state": "a ticket", "questions": PICK, "samples": 1, "calibrate": "content_free"}, reader)
    w = [0.5 / 0.6, 0.3 / 0.3, 0.2 / 0.1]
    expected = [x / sum(w) for x in w]
    got = list(resp["answers"]["pick"]["probabilities"].values())
    assert got == pytest.approx(expected, abs=1e-12)
    assert resp["answers"]["pick"]["choice"] == "blue"  # the raw argmax (red) was the model's bias
    cal = resp["diagnostics"]["questions"]["pick"]["calibration"]
    assert cal["prior"] == pytest.approx({"red": 0.6, "green": 0.3, "blue": 0.1})
    assert cal["uncalibrated"] == pytest.approx({"red": 0.5, "green": 0.3, "blue": 0.2})
    assert cal["cached"] is False
    # One real read plus one per content-free state.
    assert [r.state for r in reader.reads] == ["a ticket", *CONTENT_FREE_STATES]
    assert resp["usage"]["prior_reads"] == len(CONTENT_FREE_STATES)


def test_second_decision_reuses_the_prior():
    reader = FakeReader(forced={"pick": _state_dependent([0.5, 0.3, 0.2], [0.6, 0.3, 0.1])})
    body = {"state": "one", "questions": PICK, "samples": 3, "calibrate": "content_free"}
    first = run(body, reader)
    n_first = len(reader.reads)
    second = run({**body, "state": "another ticket"}, reader)
    # Three rotations -> 3 real reads; priors: 3 states x 3 orders, only the first time.
    assert n_first == 3 + 3 * len(CONTENT_FREE_STATES)
    assert len(reader.reads) - n_first == 3
    assert first["usage"]["prior_reads"] == 3 * len(CONTENT_FREE_STATES)
    assert second["usage"]["prior_reads"] == 0
    assert second["diagnostics"]["questions"]["pick"]["calibration"]["cached"] is True
    assert second["diagnostics"]["timing"]["prior_reads"] == 0


def test_prior_depends_on_the_question_set():
    reader = FakeReader()
    run({"state": "x", "questions": PICK, "samples": 1, "calibrate": "content_free"}, reader)
    other = {"pick": {"type": "choice", "criteria": {"red": None, "green": None, "teal": None}}}
    resp = run({"state": "x", "questions": other, "samples": 1, "calibrate": "content_free"}, reader)
    assert resp["usage"]["prior_reads"] == len(CONTENT_FREE_STATES)


def test_a_uniform_prior_changes_nothing():
    reader = FakeReader(forced={"pick": _state_dependent([0.5, 0.3, 0.2], [1 / 3] * 3)})
    resp = run({"state": "s", "questions": PICK, "samples": 1, "calibrate": "content_free"}, reader)
    assert list(resp["answers"]["pick"]["probabilities"].values()) == pytest.approx([0.5, 0.3, 0.2], abs=1e-12)


@pytest.mark.parametrize("strategy", ["next-token", "canvas"])
def test_calibrate_none_is_the_raw_read_and_deterministic(strategy):
    body = ticket_body(samples=2)
    a = run({**body, "calibrate": "none"}, FakeReader(strategy))
    b = run(body, FakeReader(strategy))
    assert a["answers"] == b["answers"]
    assert "prior_reads" not in a["usage"] and a["diagnostics"]["calibrate"] == "none"
    c = run({**body, "calibrate": "content_free"}, FakeReader(strategy))
    d = run({**body, "calibrate": "content_free"}, FakeReader(strategy))
    assert c["answers"] == d["answers"] and c["answers"] != a["answers"]
    for ans in c["answers"].values():
        if ans is not None:
            assert sum(ans["probabilities"].values()) == pytest.approx(1.0, abs=1e-12)


def test_model_default_applies_when_the_request_is_silent():
    reader = FakeReader()
    reader.calibrate = "content_free"
    resp = run({"state": "s", "questions": PICK, "samples": 1}, reader)
    assert resp["diagnostics"]["calibrate"] == "content_free"
    off = run({"state": "s", "questions": PICK, "samples": 1, "calibrate": "none"}, reader)
    assert off["diagnostics"]["calibrate"] == "none"


@pytest.mark.parametrize("bad", ["yes", 1, True, ["none"]])
def test_bad_calibrate_is_422(bad):
    with pytest.raises(ValidationError) as err:
        parse_decision({"state": "s", "questions": PICK, "calibrate": bad}, SETTINGS)
    assert err.value.param == "calibrate"


def test_calibrated_math_edge_cases():
    assert calibrated([0.2, 0.8], [0.0, 1.0]) == [0.0, 1.0]
    assert calibrated([0.5, 0.5], [0.0, 0.0]) == [0.5, 0.5]  # nothing to divide by: unchanged
    cache = PriorCache(max_entries=2)
    cache.put("a", [1.0]); cache.put("b", [2.0]); cache.get("a"); cache.put("c", [3.0])
    assert cache.get("b") is None and cache.get("a") == (1.0,) and len(cache) == 2


def test_the_decisions_images_reach_its_reads_but_not_the_content_free_ones():
    # Images are content: a content-free read must not see them, every real read must.
    reader = FakeReader()
    d = parse_decision({"state": "a ticket", "questions": PICK, "samples": 2, "calibrate": "content_free"}, SETTINGS)
    d.images = ("image-1", "image-2")
    decide(d, reader, SETTINGS, "m")
    real = [r for r in reader.reads if r.state == "a ticket"]
    free = [r for r in reader.reads if r.state in CONTENT_FREE_STATES]
    assert len(real) == 2 and len(free) == 2 * len(CONTENT_FREE_STATES)
    assert all(r.images == ("image-1", "image-2") for r in real)
    assert all(r.images == () for r in free)
