"""Liquid d1 reads on a tiny random lfm2 GGUF, and next-token reads on a tiny
qwen35: both are hybrid (recurrent + attention) memories, whose shared-prefix
reads must equal each prompt evaluated alone (engine/hybrid.py). Golden token
ids, indented JSON and null states, single-letter labels, determinism."""

from __future__ import annotations

import pytest
from tiny_gguf_more import build_lfm2, build_qwen35

from gmlx.config import LOAD_DEFAULTS
from gmlx.decisions.literal import CLOSE, OPEN
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import admit, decide
from gmlx.decisions.types import DecisionSettings, Read
from gmlx.engine import open_reader
from gmlx.engine.context import Entry, log_softmax
from gmlx.engine.liquid import liquid_labels, liquid_state
from gmlx.engine.model import load_model

SETTINGS = DecisionSettings()
STATE = "I was charged twice for my March invoice. Please refund the duplicate charge."
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "charges", "infra": None}},
    "sev": {"type": "score", "instructions": "How bad?", "criteria": ["low", "medium", "high"]},
}


def _settings(**over):
    return {**LOAD_DEFAULTS, "n_gpu_layers": 0, "n_ctx": 2048, "n_threads": 1, **over}


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    p = build_lfm2(tmp_path_factory.mktemp("liquid") / "lfm2.gguf")
    lm = load_model("lfm2", p, _settings(read_strategy="liquid"))
    r = open_reader(lm, _settings(read_strategy="liquid"))
    yield r
    r.close()
    lm.close()


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    p = build_qwen35(tmp_path_factory.mktemp("q35") / "qwen35.gguf")
    lm = load_model("q35", p, _settings())
    r = open_reader(lm, _settings())
    yield r
    r.close()
    lm.close()


def _decision(body):
    return parse_decision(body, SETTINGS)


def _read(d) -> Read:
    return Read(state=d.state, instructions=d.instructions, questions=d.questions, listed=d.questions,
                answered=(), sample=0, seed=0, chat_template_kwargs=d.chat_template_kwargs)


def _plain(text: str) -> str:
    return text.replace(OPEN, "").replace(CLOSE, "")


def _alone(reader, tokens, labels):
    """Reference: the whole prompt from an empty cache, one decode per n_batch slice."""
    reader.clear_cache()
    entries = [Entry(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)]
    rows = {}
    step = reader.ctx.max_tokens
    for s in range(0, len(entries), step):
        rows.update({s + i: r for i, r in reader.ctx.decode(entries[s:s + step]).items()})
    lp = log_softmax(rows[len(tokens) - 1])
    reader.clear_cache()
    return [float(lp[reader.label_token(lab)]) for lab in labels]


# -- Liquid ---------------------------------------------------------------------

def test_liquid_strategy(lfm2):
    assert lfm2.strategy == "liquid" and type(lfm2).__name__ == "LiquidReader"
    assert lfm2.lm.strategy == "liquid"


def test_liquid_golden_token_ids(lfm2):
    d = _decision({"state": "ok", "questions": {"u": {"type": "noul", "instructions": "good?"}}})
    toks = lfm2._prompt(_read(d), d.questions[0]).tokens
    assert lfm2.lm.decode(toks, special=True) == (
        "<|startoftext|><|im_start|>user\nok\n\ngood?\nAnswer with yes or no only.<|im_end|>\n<|im_start|>assistant\n")
    assert toks == LIQUID_GOLDEN


LIQUID_GOLDEN = [829, 6, 503, 20, 825, 20, 20, 817, 327, 20, 551, 572, 458, 624, 460, 586, 293, 7, 20, 6, 514, 20]


def test_liquid_json_state_is_indented(lfm2):
    d = _decision({"state": {"order": 7, "items": ["a", "b"]}, "questions": QUESTIONS})
    text = _plain(lfm2._render(None, d.state, d.questions[0], (), None, None))
    assert '<|im_start|>user\n{\n  "order": 7,\n  "items": [\n    "a",\n    "b"\n  ]\n}\n\nIs it urgent?' in text
    assert liquid_state('[1, 2]') == "[\n  1,\n  2\n]"
    assert liquid_state("plain text") == "plain text"
    assert liquid_state("{not json") == "{not json"


@pytest.mark.parametrize("state", ["", "null", "  ", None])
def test_liquid_null_state_leaves_the_question_alone(lfm2, state):
    d = _decision({"state": state, "questions": QUESTIONS})
    text = _plain(lfm2._render(None, d.state, d.questions[0], (), None, None))
    assert text == ("<|startoftext|><|im_start|>user\nIs it urgent?\nAnswer with yes or no only.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    admit(d, lfm2, SETTINGS)
    out = decide(d, lfm2, SETTINGS, "lfm2")
    assert set(out["answers"]) == {"urgent", "team", "sev"}


def test_liquid_single_letter_labels(lfm2):
    q = {"type": "choice", "instructions": "Pick.", "criteria": {"C": "third", "A": "first", "B": None}}
    d = _decision({"state": "s", "questions": {"p": q}})
    assert liquid_labels(d.questions[0]) == ("C", "A", "B")
    text = _plain(lfm2._render(None, "s", d.questions[0], (), None, None))
    assert "C. C: third\nA. A: first\nB. B\n" in text
    # mixed names keep the SPEC labels
    d2 = _decision({"state": "s", "questions": {"p": {"type": "choice", "criteria": {"A": None, "bb": None}}}})
    assert liquid_labels(d2.questions[0]) == ("A", "B")
    out = decide(d, lfm2, SETTINGS, "lfm2")
    assert set(out["answers"]["p"]["probabilities"]) == {"C", "A", "B"}
    # the read's label tokens are the option letters themselves
    lfm2.reset()
    slots = lfm2.read(_read(d)).slots
    toks = lfm2._prompt(_read(d), d.questions[0]).tokens
    assert list(slots["p"].logprobs) == pytest.approx(_alone(lfm2, toks, ["C", "A", "B"]), abs=2e-3)


def test_liquid_instructions_are_a_system_turn(lfm2):
    d = _decision({"state": "s", "questions": QUESTIONS, "instructions": "Be careful."})
    text = _plain(lfm2._render(d.instructions, "s", d.questions[0], (), None, None))
    assert text.startswith("<|startoftext|><|im_start|>system\nBe careful.<|im_end|>\n<|im_start|>user\ns\n\n")


def test_liquid_chat_template_kwargs_are_ignored_with_the_warning(lfm2):
    d = _decision({"state": "s", "questions": QUESTIONS, "chat_template_kwargs": {"enable_thinking": True}})
    admit(d, lfm2, SETTINGS)
    assert "chat_template_kwargs" in d.ignored


def test_liquid_shared_prefix_equals_alone(lfm2):
    d = _decision({"state": STATE * 3, "questions": QUESTIONS})
    lfm2.reset()
    shared = lfm2.read(_read(d)).slots
    for q in d.questions:
        toks = lfm2._prompt(_read(d), q).tokens
        assert list(shared[q.id].logprobs) == pytest.approx(_alone(lfm2, toks, liquid_labels(q)), abs=2e-3)


def test_liquid_deterministic(lfm2):
    body = {"state": STATE, "questions": QUESTIONS, "samples": 2}
    a = decide(_decision(body), lfm2, SETTINGS, "lfm2")
    b = decide(_decision(body), lfm2, SETTINGS, "lfm2")
    assert a["answers"] == b["answers"] and a["diagnostics"]["strategy"] == "liquid"


# -- Qwen3.5 next-token ------------------------------------------------------------

def test_qwen35_is_next_token_on_the_hybrid_reader(qwen35):
    assert qwen35.lm.architecture == "qwen35" and qwen35.strategy == "next-token"
    assert type(qwen35).__name__ == "HybridNextTokenReader"


def test_qwen35_golden_token_ids_thinking_off(qwen35):
    d = _decision({"state": "ok", "questions": {"u": {"type": "noul", "instructions": "good?"}}})
    toks = qwen35._prompt(_read(d), d.questions[0]).tokens
    text = qwen35.lm.decode(toks, special=True)
    assert text.startswith("<|im_start|>user\nok\n\ngood?\nAnswer with yes or no only.<|im_end|>\n<|im_start|>assistant\n")
    assert text.endswith("<think>\n\n</think>\n\n")  # enable_thinking false: an empty, closed block
    on = _decision({"state": "ok", "questions": {"u": {"type": "noul", "instructions": "good?"}},
                    "chat_template_kwargs": {"enable_thinking": True}})
    text_on = qwen35.lm.decode(qwen35._prompt(_read(on), on.questions[0]).tokens, special=True)
    assert not text_on.endswith("</think>\n\n") and text_on.endswith("<|im_start|>assistant\n")
    assert toks == QWEN35_GOLDEN


QWEN35_GOLDEN = [6, 503, 20, 825, 20, 20, 817, 327, 20, 551, 572, 458, 624, 460, 586, 293, 7, 20, 6, 514, 20,
                 8, 20, 20, 9, 20, 20]


def test_qwen35_shared_prefix_equals_alone(qwen35):
    d = _decision({"state": STATE * 3, "questions": QUESTIONS})
    qwen35.reset()
    shared = qwen35.read(_read(d)).slots
    for q in d.questions:
        toks = qwen35._prompt(_read(d), q).tokens
        assert list(shared[q.id].logprobs) == pytest.approx(_alone(qwen35, toks, q.labels), abs=2e-3)


def test_qwen35_deterministic_and_prefix_reused_across_decisions(qwen35):
    body = {"state": STATE, "questions": QUESTIONS, "samples": 3}
    a = decide(_decision(body), qwen35, SETTINGS, "q35")
    b = decide(_decision(body), qwen35, SETTINGS, "q35")
    assert a["answers"] == b["answers"]
    c = decide(_decision({**body, "cache_salt": "other"}), qwen35, SETTINGS, "q35")
    assert c["answers"] == a["answers"]
