"""Batch invariance and balanced orders through the real llama.cpp, for canvas
reads (tiny LLaDA) and end to end on the embedded model: a read's numbers never
depend on what was read before it or beside it (SPEC 4.5), compared bitwise."""

from __future__ import annotations


import pytest

from gmlx.config import LOAD_DEFAULTS
from fake_reader import ticket_body
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import decide
from gmlx.decisions.types import DecisionSettings
from gmlx.engine import open_reader
from gmlx.engine.model import load_model

SETTINGS = DecisionSettings()


def _settings(**over):
    s = dict(LOAD_DEFAULTS, n_gpu_layers=0, n_ctx=2048, n_threads=1)
    s.update(over)
    return s


class Recording:
    """Wraps a reader and keeps every Read it was handed with its result."""

    def __init__(self, reader):
        self._reader = reader
        self.log = []

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def read(self, read):
        result = self._reader.read(read)
        self.log.append((read, result))
        return result


@pytest.fixture(scope="module")
def canvas_pair(tiny_llada):
    lm = load_model("tiny-llada", tiny_llada, _settings())
    a, b = open_reader(lm, _settings()), open_reader(lm, _settings())
    yield a, b
    a.close()
    b.close()
    lm.close()


def test_canvas_sample_read_alone_is_bitwise_the_same(canvas_pair):
    """Every read of a 4-sample canvas decision, replayed alone on a fresh
    reader, gives the same bits: nothing of the earlier samples leaks in."""
    used, fresh = canvas_pair
    rec = Recording(used)
    decide(parse_decision({"state": "other text first", "questions": ticket_body()["questions"]}, SETTINGS), used, SETTINGS, "m")
    decide(parse_decision(ticket_body(samples=4), SETTINGS), rec, SETTINGS, "m")
    assert len(rec.log) >= 4
    for read, result in rec.log:
        again = fresh.read(read)
        assert {q: s.logprobs for q, s in again.slots.items()} == {q: s.logprobs for q, s in result.slots.items()}


def test_canvas_template_lists_rotated_options(canvas_pair):
    """Canvas samples permute the question block like next-token reads: the
    choice's listing rotates, the noul and score flip every other sample."""
    reader, _ = canvas_pair
    rec = Recording(reader)
    decide(parse_decision(ticket_body(samples=3), SETTINGS), rec, SETTINGS, "m")
    first = [r for r, _ in rec.log if r.sample in (0, 1, 2) and any(q.id == "team" for q in r.questions)]
    teams = [next(q for q in r.questions if q.id == "team") for r in first]
    assert [t.options[0] for t in teams] != ["billing"] * len(teams)
    assert sorted(t.options[0] for t in teams) == ["billing", "infra", "product"]
    urgent = [next(q for q in r.questions if q.id == "urgent").labels for r in first]
    assert urgent[:2] == [("yes", "no"), ("no", "yes")]


def test_decision_answers_do_not_depend_on_other_questions(gemma_path):
    """The embedded model, end to end with balanced samples: a choice asked
    alone and asked with three other questions answers the same bits."""
    lm = load_model("gemma", gemma_path, _settings(n_ctx=4096, n_threads=None))
    reader = open_reader(lm, _settings(n_ctx=4096, n_threads=None))
    try:
        body = ticket_body(samples=3)
        body["questions"].pop("refund")
        team = {"team": body["questions"]["team"]}
        together = decide(parse_decision(body, SETTINGS), reader, SETTINGS, "m")
        alone = decide(parse_decision({**body, "questions": team}, SETTINGS), reader, SETTINGS, "m")
        assert alone["answers"]["team"] == together["answers"]["team"]
        assert together["diagnostics"]["questions"]["team"]["reads"] == 3
        again = decide(parse_decision(body, SETTINGS), reader, SETTINGS, "m")
        assert again["answers"] == together["answers"]
    finally:
        reader.close()
        lm.close()


def test_flash_attention_auto_is_off_for_invariant_reads(gemma_path):
    """flash_attn defaults to auto (llama.cpp's default); batch-invariant reads
    resolve auto to off because flash attention tiles queries by count."""
    from gmlx.engine.nexttoken import NextTokenReader

    assert LOAD_DEFAULTS["flash_attn"] == "auto"
    lm = load_model("gemma-fa", gemma_path, _settings(n_ctx=1024, n_threads=None))
    try:
        for over, want in [({}, False), ({"batch_invariant": False}, "auto"), ({"flash_attn": True}, True)]:
            r = NextTokenReader(lm, _settings(n_ctx=1024, n_threads=None, **over))
            try:
                assert r._flash_attn(_settings(**over)) == want
            finally:
                r.close()
    finally:
        lm.close()
