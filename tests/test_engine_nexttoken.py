"""Next-token reads through the real llama.cpp: the embedded Gemma 3 GGUF and a
tiny f32 Qwen3 GGUF built at test time."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from gmlx.config import LOAD_DEFAULTS
from fake_reader import ticket_body
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import admit, decide
from gmlx.decisions.orders import option_order
from gmlx.decisions.seeds import sample_seed
from gmlx.decisions.types import DecisionSettings, Read
from gmlx.engine.context import Entry, log_softmax
from gmlx.engine.model import load_model
from gmlx.engine.nexttoken import NextTokenReader
from gmlx.errors import InvalidRequest, ValidationError

SETTINGS = DecisionSettings()

LONG_STATE = (
    "Customer ticket #4411. I was charged twice for my March invoice, once on the 3rd and again on the 5th. "
    "The duplicate charge pushed my account into overdraft and my bank added a fee. I have attached the "
    "statement lines. Please refund the duplicate charge and the overdraft fee, and confirm by email. "
    "This is the second time this year that a charge has been duplicated; in January support fixed it "
    "within a day. I would like to know why it keeps happening and whether my card details are safe."
)


def _settings(**over):
    s = dict(LOAD_DEFAULTS)
    s.update(n_gpu_layers=0, n_ctx=4096)
    s.update(over)
    return s


def _many_questions(n: int) -> dict:
    kinds = [
        {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        {"type": "choice", "instructions": "Which team handles it?",
         "criteria": {"billing": "charges", "infra": "outages", "product": "features", "legal": None}},
        {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]},
        {"type": "noul", "instructions": "Is the card compromised?", "criteria": {"true": "fraud is likely"}},
    ]
    return {f"q{i}": copy.deepcopy(kinds[i % len(kinds)]) for i in range(n)}


@pytest.fixture(scope="module")
def gemma(gemma_path):
    lm = load_model("gemma", gemma_path, _settings())
    reader = NextTokenReader(lm, _settings())
    yield reader
    reader.close()
    lm.close()


@pytest.fixture(scope="module")
def qwen(tiny_qwen3):
    lm = load_model("qwen", tiny_qwen3, _settings())
    reader = NextTokenReader(lm, _settings())
    yield reader
    reader.close()
    lm.close()


def _decision(body):
    return parse_decision(body, SETTINGS)


def _read(decision, sample=0, seed=7, thought=None) -> Read:
    return Read(
        state=decision.state, instructions=decision.instructions, questions=decision.questions,
        listed=decision.questions, answered=(), sample=sample, seed=seed, thought=thought,
    )


def naive_logprobs(reader: NextTokenReader, read: Read) -> dict[str, list[float]]:
    """Reference: every question's full prompt evaluated alone from an empty
    cache, in one pass (n_batch slices), labels in the order the question lists them."""
    out = {}
    for q in read.questions:
        p = reader._prompt(read, q)
        reader.clear_cache()
        toks = p.tokens
        entries = [Entry(t, i, 0, i == len(toks) - 1) for i, t in enumerate(toks)]
        rows = {}
        for start in range(0, len(entries), reader.ctx.n_batch):
            rows.update({start + i: r for i, r in reader.ctx.decode(entries[start:start + reader.ctx.n_batch]).items()})
        lp = log_softmax(rows[len(toks) - 1])
        out[q.id] = [float(lp[reader.label_token(label)]) for label in q.labels]
    reader.clear_cache()
    return out


def shared_logprobs(reader: NextTokenReader, read: Read) -> dict[str, list[float]]:
    reader.reset()
    result = reader.read(read)
    return {qid: list(s.logprobs) for qid, s in result.slots.items()}


def _distinct_questions(n: int) -> dict:
    """n questions whose prompts all differ (no read is a repeat of another)."""
    qs = _many_questions(n)
    for i, (qid, q) in enumerate(qs.items()):
        q["instructions"] = f"{q['instructions']} (check {i})"
    return qs


# -- batch invariance (SPEC 4.5): bitwise, on any CPU -------------------------------

@pytest.mark.parametrize("fixture", ["gemma", "qwen"])
def test_question_numbers_do_not_depend_on_company(request, fixture):
    """A question's label logprobs are the same bits asked alone, at any position
    of a 16-question request, and in its naive full-prompt evaluation."""
    reader = request.getfixturevalue(fixture)
    d = _decision({"state": LONG_STATE, "questions": _distinct_questions(16), "samples": 1})
    read = _read(d)
    ref = naive_logprobs(reader, read)
    together = shared_logprobs(reader, read)
    backwards = shared_logprobs(reader, dataclasses.replace(read, questions=tuple(reversed(d.questions))))
    assert together == ref
    assert backwards == ref
    for q in d.questions[::5]:
        alone = shared_logprobs(reader, dataclasses.replace(read, questions=(q,), listed=(q,)))
        assert alone == {q.id: ref[q.id]}


def test_numbers_do_not_depend_on_company_through_decide(gemma):
    """End to end: a noul asked alone answers the same bits as inside 16 questions,
    and as one of the samples of a request with other questions."""
    qs = _distinct_questions(16)
    alone = decide(_decision({"state": LONG_STATE, "questions": {"q4": qs["q4"]}, "samples": 1}), gemma, SETTINGS, "m")
    many = decide(_decision({"state": LONG_STATE, "questions": qs, "samples": 1}), gemma, SETTINGS, "m")
    assert alone["answers"]["q4"] == many["answers"]["q4"]
    two = decide(_decision({"state": LONG_STATE, "questions": {"q1": qs["q1"], "q4": qs["q4"]}, "samples": 2}), gemma, SETTINGS, "m")
    four = decide(_decision({"state": LONG_STATE, "questions": {"q4": qs["q4"]}, "samples": 2}), gemma, SETTINGS, "m")
    assert two["answers"]["q4"] == four["answers"]["q4"]


def test_batched_path_is_opt_in_and_not_invariant(gemma_path):
    """`batch_invariant: false` batches suffixes: same argmax on this request,
    but not the same bits as the naive read (which is why it is not the default)."""
    lm = load_model("gemma-batched", gemma_path, _settings())
    r = NextTokenReader(lm, _settings(batch_invariant=False))
    try:
        assert not r.batch_invariant
        d = _decision({"state": LONG_STATE, "questions": _distinct_questions(8), "samples": 1})
        read = _read(d)
        ref = naive_logprobs(r, read)
        got = shared_logprobs(r, read)
        assert got.keys() == ref.keys()
        assert got != ref
    finally:
        r.close()
        lm.close()


def test_listed_question_reads_its_labels_in_listed_order(qwen):
    """The engine reads a question as listed; the permuted listing's logprobs are
    those of its own prompt (the core maps them back to option names)."""
    from gmlx.decisions.orders import listed

    d = _decision({"state": "My card was charged twice.", "questions": _many_questions(4), "samples": 1})
    choice = d.question("q1")
    order = option_order(choice, 1, 12345)
    assert order != list(range(len(choice.options)))  # the test needs a real permutation
    moved = listed(choice, order)
    read = dataclasses.replace(_read(d), questions=(moved,), listed=(moved,))
    ref = naive_logprobs(qwen, read)
    got = shared_logprobs(qwen, read)
    assert got == ref
    first = shared_logprobs(qwen, dataclasses.replace(read, questions=(choice,), listed=(choice,)))
    assert first["q1"] != got["q1"]


def test_small_batch_splits_and_agrees(tiny_qwen3):
    """n_batch smaller than a prompt: the work is split, never handed to llama.cpp whole."""
    lm = load_model("qwen-small-batch", tiny_qwen3, _settings())
    small = NextTokenReader(lm, _settings(n_batch=32, n_ubatch=32), parallel=3)
    big = NextTokenReader(lm, _settings(n_batch=2048))
    try:
        d = _decision({"state": LONG_STATE, "questions": _many_questions(7), "samples": 1})
        read = _read(d)
        a, b = shared_logprobs(small, read), shared_logprobs(big, read)
        # n_batch splits the prefix differently; every slice holds >= MIN_PIECE tokens.
        assert a == b
    finally:
        small.close()
        big.close()
        lm.close()


def test_context_cells_split_groups(tiny_qwen3):
    """Suffixes that do not all fit the KV cells next to the prefix run in groups."""
    lm = load_model("qwen-small-ctx", tiny_qwen3, _settings())
    r = NextTokenReader(lm, _settings(n_ctx=512))
    try:
        d = _decision({"state": "Short state.", "questions": _many_questions(16), "samples": 1})
        read = _read(d)
        ref = naive_logprobs(r, read)
        got = shared_logprobs(r, read)
        assert got == ref
    finally:
        r.close()
        lm.close()


# -- decisions end to end ---------------------------------------------------------

def _numbers(resp):
    # cached_tokens says how much an earlier decision had evaluated: not a number of this one.
    usage = {k: v for k, v in resp["usage"].items() if k != "cached_tokens"}
    return resp["answers"], usage, resp["diagnostics"]["questions"]


@pytest.mark.parametrize("fixture", ["gemma", "qwen"])
def test_ticket_is_deterministic(request, fixture):
    reader = request.getfixturevalue(fixture)
    a = decide(_decision(ticket_body()), reader, SETTINGS, "m")
    b = decide(_decision(ticket_body()), reader, SETTINGS, "m")
    assert _numbers(a) == _numbers(b)
    assert list(a["answers"]) == ["urgent", "team", "severity", "refund"]
    for ans in a["answers"].values():
        if ans is not None:
            assert abs(sum(ans["probabilities"].values()) - 1) < 1e-9
    assert a["diagnostics"]["strategy"] == "next-token"
    assert a["usage"]["input_tokens"] > 40


def test_decision_does_not_depend_on_previous_one(qwen):
    """A decision in between (different state) must not change the numbers."""
    first = decide(_decision(ticket_body()), qwen, SETTINGS, "m")
    decide(_decision({"state": LONG_STATE, "questions": _many_questions(6)}), qwen, SETTINGS, "m")
    again = decide(_decision(ticket_body()), qwen, SETTINGS, "m")
    assert _numbers(first) == _numbers(again)


def test_seed_changes_choice_samples_only(qwen):
    body = {"state": "My card was charged twice.", "questions": _many_questions(4), "samples": 2}
    seeds = [s for s in range(1, 40) if option_order(_decision(body).question("q1"), 1, sample_seed(s, 0, 0, 0))[0] == 1]
    other = next(s for s in range(1, 40) if s not in seeds)
    a = decide(_decision({**body, "seed": seeds[0]}), qwen, SETTINGS, "m")
    b = decide(_decision({**body, "seed": other}), qwen, SETTINGS, "m")
    # A choice's second sample starts from a seeded rotation; nouls and scores alternate, unseeded.
    assert a["answers"]["q1"]["probabilities"] != b["answers"]["q1"]["probabilities"]
    assert a["answers"]["q0"] == b["answers"]["q0"]
    assert a["answers"]["q2"] == b["answers"]["q2"]


def test_labels_are_single_tokens_on_gemma(gemma):
    for label in ["yes", "no", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"123456789"]:
        tid = gemma.label_token(label)
        assert tid is not None, label
        assert gemma.lm.decode([tid]) == label


def test_label_not_one_token_is_422(tiny_gguf_dir):
    import tiny_gguf

    import dataclasses

    vocab = tiny_gguf.tiny_vocab()
    # Rename the whole-word "yes" pieces: "yes" then tokenizes into several pieces.
    gone = {"yes".encode(), "\u2581yes".encode()}
    tokens = tuple(b"<gone%d>" % i if t in gone else t for i, t in enumerate(vocab.tokens))
    vocab = dataclasses.replace(vocab, tokens=tokens)
    path = tiny_gguf.build_qwen3(tiny_gguf_dir / "qwen3-no-yes.gguf", vocab=vocab)
    lm = load_model("noyes", path, _settings())
    r = NextTokenReader(lm, _settings())
    try:
        assert r.label_token("yes") is None
        d = _decision(ticket_body())
        with pytest.raises(ValidationError) as err:
            r.check(d)
        assert "urgent" in err.value.message and "yes" in err.value.message
        # A decision with no noul passes the same check, and so does one whose
        # noul is never asked (`ask` leaves it out): only what may be asked is checked.
        r.check(_decision({"state": "x", "questions": {"t": ticket_body()["questions"]["team"]}}))
        r.check(_decision({**ticket_body(), "ask": ["team"]}))
    finally:
        r.close()
        lm.close()


def test_prompt_larger_than_context_is_400_not_a_crash(tiny_qwen3):
    lm = load_model("qwen-tiny-ctx", tiny_qwen3, _settings())
    r = NextTokenReader(lm, _settings(n_ctx=256))
    try:
        d = _decision({"state": LONG_STATE * 4, "questions": _many_questions(2)})
        with pytest.raises(InvalidRequest) as err:
            r.check(d)
        assert "256" in err.value.message
        ok = _decision({"state": "short", "questions": _many_questions(2)})
        r.check(ok)
        assert decide(ok, r, SETTINGS, "m")["answers"]["q0"]["type"] == "noul"
    finally:
        r.close()
        lm.close()


# -- thinking ------------------------------------------------------------------------

def test_thinking_writes_a_closed_block_then_reads(qwen):
    assert qwen.can_think
    d = _decision({**ticket_body(), "think": 12, "samples": 1})
    admit(d, qwen, SETTINGS)
    resp = decide(d, qwen, SETTINGS, "m")
    thought = resp["diagnostics"]["thought"]
    assert thought is not None and 1 <= thought["tokens"] <= 12
    # One output token per next-token read (refund may be skipped), plus the thought.
    reads = sum(1 for a in resp["answers"].values() if a is not None)
    assert resp["usage"]["output_tokens"] == reads + thought["tokens"]
    # The reads saw the thought, closed: their prompts carry <think>text</think>.
    from gmlx.decisions.types import Thought

    read = _read(d, thought=Thought(thought["text"], thought["tokens"], thought["closed"], 0.0))
    text = qwen.lm.decode(qwen._prompt(read, d.questions[0]).tokens, special=True)
    assert text.rstrip().endswith("</think>")
    assert "<think>\n" + thought["text"].strip() in text
    # Same seed, same thought and numbers.
    again = decide(_decision({**ticket_body(), "think": 12, "samples": 1}), qwen, SETTINGS, "m")
    assert again["diagnostics"]["thought"]["text"] == thought["text"]
    assert _numbers(again) == _numbers(resp)


def test_model_without_thinking_ignores_think(gemma):
    assert not gemma.can_think
    d = _decision({**ticket_body(), "think": 8, "samples": 1})
    admit(d, gemma, SETTINGS)
    assert "think" in d.ignored
    resp = decide(d, gemma, SETTINGS, "m")
    assert resp["diagnostics"]["thought"] is None


def test_repeated_prompts_are_read_once_per_decision(qwen, monkeypatch):
    """A sample whose order repeats an earlier one is not read again and does not
    count: nouls and scores have two orders, this 4-option choice eight."""
    evaluated = []
    real = qwen._evaluate
    monkeypatch.setattr(qwen, "_evaluate", lambda toks: evaluated.append(len(toks)) or real(toks))
    qs = _many_questions(4)  # noul, choice (4 options), score, noul
    resp = decide(_decision({"state": "My card was charged twice.", "questions": qs, "samples": 9}), qwen, SETTINGS, "m")
    # Samples 0 and 1 read all four (the noul and score flip), 2..7 only the
    # choice, and sample 8 repeats sample 0 for every question: no read.
    assert evaluated == [4, 4, 1, 1, 1, 1, 1, 1]
    assert resp["diagnostics"]["samples"]["n"] == 8
    reads = {qid: d["reads"] for qid, d in resp["diagnostics"]["questions"].items()}
    assert reads == {"q0": 2, "q1": 8, "q2": 2, "q3": 2}
    # One output token per distinct read, and usage counts what was evaluated.
    assert resp["usage"]["output_tokens"] == 14
    assert resp["diagnostics"]["evaluated_tokens"] > 0


BOUND_TEXTS = [
    "", "a", " leading space", "trailing  ", "\n\n\n", "Café crème ☕ — naïve 你好 🙂🙂",
    "<start_of_turn>user\nhi<end_of_turn>\n", "<|im_start|>assistant\n", "x" * 500, "\x00\x01 bytes \ufffd",
]


@pytest.mark.parametrize("which", ["gemma", "qwen"])
def test_byte_bound_holds_for_every_prompt(request, which):
    # Admission skips tokenizing when this bound fits: it must never undercount.
    reader = request.getfixturevalue(which)
    from gmlx.decisions.literal import literal

    for a in BOUND_TEXTS:
        for b in BOUND_TEXTS[:4]:
            for text in (a + b, literal(a) + b, a + literal(b), literal(a + b)):
                assert len(reader.lm.encode_prompt(text)) <= reader.lm.max_prompt_tokens(text), repr(text)
    body = ticket_body()
    d = _decision(body)
    exact = reader.largest_prompt(d)
    # English runs about 4-5 bytes a token: the bound is loose, never below.
    assert exact <= reader.largest_prompt(d, size=reader.lm.max_prompt_tokens) < 6 * exact


def test_admission_of_a_small_decision_tokenizes_nothing(gemma, monkeypatch):
    d = _decision(ticket_body())
    admit(d, gemma)  # label tokens are looked up (and cached) once
    calls = []
    real = gemma.lm.tokenize
    monkeypatch.setattr(gemma.lm, "tokenize", lambda *a, **k: calls.append(a) or real(*a, **k))
    admit(_decision(ticket_body()), gemma)
    assert calls == []
    # A state that may not fit is still measured exactly, and refused.
    with pytest.raises(InvalidRequest, match="context holds"):
        admit(_decision(ticket_body(state="word " * 5000)), gemma)
    assert calls
