"""Winnow reads (docs/reads.md, "Winnow"): Winnow-trained Gemma 4 checkpoints.

Like next-token reads, each question is one read of the reply's first token,
every read sharing the prefix up to the end of the state (evaluated once). What
differs: the prompt is Winnow's fixed turn serialization, never the chat
template; every question's candidates are labelled A, B, C... (a noul's
candidates are yes and no, in the order the read lists them);
`decision_temperature` divides the candidates' log-probabilities before their
softmax; `decision_state_format: json` writes the state in one canonical JSON
serialization. Request-side chat overrides (`chat_template_kwargs`,
`instructions`) are refused with 400: the serialization is fixed.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import numpy as np

from ..decisions.labels import LETTERS, check_label_tokens
from ..decisions.literal import literal
from ..decisions.types import Decision, Question, SlotRead, Thought
from ..errors import InvalidRequest
from .context import log_softmax
from .model import LoadedModel
from .nexttoken import NextTokenReader

MAX_QUESTIONS = 64
MAX_OPTIONS = 26
TURN_OPEN = "<|turn>"
TURN_CLOSE = "<turn|>"
INSTRUCTION = "Answer with the label of one candidate."


def canonical_json(value: Any) -> str:
    """Winnow's canonical state: sorted keys, no whitespace, non-ASCII kept,
    numbers as Python's json writes them (1 stays 1, 1.0 stays 1.0)."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False)


def parse_json_state(state: str) -> str:
    """The canonical text of a JSON state; InvalidRequest (400) when it is not JSON."""
    try:
        value = json.loads(state, parse_constant=_no_constant)
        return canonical_json(value)
    except (ValueError, RecursionError) as err:
        raise InvalidRequest(
            f"decision_state_format is json but the state is not valid JSON ({err})", param="state"
        ) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def winnow_labels(q: Question) -> tuple[str, ...]:
    return tuple(LETTERS[: len(q.options)])


def temper(logprobs: list[float], temperature: float) -> list[float]:
    """Candidate log-probabilities divided by `temperature`, shifted so that they
    keep their total full-vocabulary mass: a softmax over them is the tempered
    softmax, and label_mass is unchanged."""
    if temperature == 1.0:
        return list(logprobs)
    scaled = [lp / temperature for lp in logprobs]
    return [s - _lse(scaled) + _lse(logprobs) for s in scaled]


def _lse(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(math.fsum(math.exp(x - m) for x in xs))


def serialize(state_text: str, q: Question, answered=()) -> str:
    """Winnow's user turn content for one question (labels already Winnow's)."""
    lines = ["State:", state_text, ""]
    if answered:
        lines.append("Earlier answers:")
        for a in answered:
            lines.append(f"- {a.question.id}: {a.question.options[a.option]}")
        lines.append("")
    lines.append("Question: " + (q.instructions.strip() or q.id))
    lines.append("Candidates:")
    for label, name, desc in zip(q.labels, q.options, q.descriptions):
        lines.append(f"{label}. {name}" + (f": {desc}" if desc else ""))
    lines.append(INSTRUCTION)
    return "\n".join(lines)


def render(state_text: str, q: Question, answered=()) -> str:
    """The whole prompt text (specials parsed at tokenization; BOS added by the model's flag)."""
    # The content is caller text: tokenized as plain text (decisions/literal.py),
    # so a state holding "<turn|>" cannot close the turn.
    return f"{TURN_OPEN}user\n{literal(serialize(state_text, q, answered))}{TURN_CLOSE}\n{TURN_OPEN}model\n"


class WinnowReader(NextTokenReader):
    strategy = "winnow"
    # Winnow's serialization is text: images get 400 (media.no_projector), even with an mmproj.
    loads_projector = False

    def __init__(self, lm: LoadedModel, settings: dict[str, Any], parallel: int = 16):
        super().__init__(lm, settings, parallel)
        self.temperature = float(settings["decision_temperature"])
        self.state_format = settings["decision_state_format"]
        self.can_think = False
        self._states: dict[str, str] = {}
        # question id -> per read, option name -> full-vocabulary probability
        self._full: dict[str, list[dict[str, float]]] = {}

    def reset(self) -> None:
        super().reset()
        self._states = {}
        self._full = {}

    # -- admission ---------------------------------------------------------
    def check(self, decision: Decision) -> None:
        for name in ("chat_template_kwargs", "instructions"):
            if getattr(decision, name) is not None:
                raise InvalidRequest(
                    f"{name} is not accepted by the winnow read strategy: Winnow checkpoints use a fixed "
                    "turn serialization (docs/reads.md)",
                    param=name,
                )
        if len(decision.questions) > MAX_QUESTIONS:
            raise InvalidRequest(
                f"the winnow read strategy reads at most {MAX_QUESTIONS} questions, got {len(decision.questions)}",
                param="questions",
            )
        for q in decision.questions:
            if len(q.options) > MAX_OPTIONS:
                raise InvalidRequest(f"question '{q.id}': at most {MAX_OPTIONS} options", param=f"questions.{q.id}")
        self.state_text(decision.state)  # 400 on invalid JSON, before any read
        check_label_tokens([self._relabel(q) for q in decision.questions], self.label_token)
        super().check(decision)

    def state_text(self, state: str) -> str:
        if self.state_format != "json":
            return state
        if state not in self._states:
            self._states[state] = parse_json_state(state)
        return self._states[state]

    # -- prompts -----------------------------------------------------------
    def _relabel(self, q: Question) -> Question:
        return replace(q, labels=winnow_labels(q))

    def _render(self, instructions, state, q, answered, user_kwargs, thought: Thought | None,  # noqa: ARG002
                media: bool = False) -> str:
        q = self._relabel(q)
        return render(self.state_text(state), q, answered)

    def _slot(self, p, row: np.ndarray) -> SlotRead:
        lp = log_softmax(row)
        q = p.question
        ids = [self.label_token(lab) for lab in winnow_labels(q)]
        raw = [float(lp[i]) for i in ids]
        self._full.setdefault(q.id, []).append({name: math.exp(v) for name, v in zip(q.options, raw)})
        return SlotRead(tuple(temper(raw, self.temperature)), int(np.argmax(row)) in set(ids))

    def full_confidence(self, qid: str, option: str) -> float | None:
        """The winning option's original full-vocabulary probability, averaged
        over this decision's reads of the question."""
        reads = self._full.get(qid)
        if not reads:
            return None
        return math.fsum(r.get(option, 0.0) for r in reads) / len(reads)

    def diagnostics(self) -> dict:
        """`diagnostics.winnow` of the decision just answered: the temperature and,
        per question, each option's full-vocabulary probability averaged over its reads."""
        full = {}
        for qid, reads in self._full.items():
            names = list(reads[0])
            full[qid] = {n: math.fsum(r[n] for r in reads) / len(reads) for n in names}
        return {"winnow": {"decision_temperature": self.temperature, "state_format": self.state_format,
                           "full_probabilities": full}}

    def finish_answers(self, answers: dict) -> dict:
        """Set each answer's `confidence` to its winning label's full-vocabulary
        probability (the seed's Winnow contract). Needs a call from the decision
        core after the answers are built (see the module's report)."""
        for qid, a in answers.items():
            if not a:
                continue
            if a["type"] == "choice":
                win = a["choice"]
            elif a["type"] == "noul":
                win = "yes" if a["noul"] >= 0.5 else "no"
            else:
                probs = a["probabilities"]
                win = a["legend"][max(probs, key=probs.get)]
            c = self.full_confidence(qid, win)
            if c is not None:
                a["confidence"] = c
        return answers
