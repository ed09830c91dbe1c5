"""A deterministic Reader for tests: no model, numbers from hashes.

Label logits are hashed from the text the read would show the model (the
next-token prompt with its option order, or a canvas-like prompt with the
read's seed), so every setting that changes a prompt changes the numbers, and
the same read always gives the same numbers. Tests can also force a
question's label distribution (`forced`, `forced_thought`) or make logits
depend only on where an option is listed (`position_logits`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Mapping, Sequence, Union

from gmlx.errors import InvalidRequest
from gmlx.decisions import prompts
from gmlx.decisions.labels import check_label_tokens
from gmlx.decisions.plan import asked_questions
from gmlx.decisions.orders import order_of
from gmlx.decisions.types import Decision, Question, Read, ReadResult, SlotRead, Thought

# A forced distribution: label probabilities in request option order, one list
# per sample (the last repeats), or a function of the read.
Forced = Union[Sequence[float], Sequence[Sequence[float]], Callable[[Read], Sequence[float]]]


def _unit(text: str) -> float:
    """A number in [0, 1) fixed by `text`."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    return top + math.log(math.fsum(math.exp(v - top) for v in values))


class FakeReader:
    def __init__(
        self,
        strategy: str = "next-token",
        can_think: bool = True,
        *,
        forced: Mapping[str, Forced] | None = None,
        forced_thought: Mapping[str, Forced] | None = None,
        position_logits: Mapping[str, Sequence[float]] | None = None,
        row_cost: Callable[[Question], int] | None = None,
        canvas: int = 64,
        max_prompt_tokens: int | None = None,
        label_tokens: Mapping[str, int | None] | None = None,
        thought_tokens: int = 7,
    ):
        self.strategy = strategy
        self.can_think = can_think
        self.forced = dict(forced or {})
        self.forced_thought = dict(forced_thought or {})
        self.position_logits = dict(position_logits or {})
        # Rows of one template line: "id: L" plus a separator, say.
        self.row_cost = row_cost or (lambda q: 2 + len(q.id) + 1)
        self.canvas = canvas
        self.max_prompt_tokens = max_prompt_tokens
        self.label_tokens = dict(label_tokens or {})
        self.thought_tokens = thought_tokens
        self.reads: list[Read] = []
        self.thinks: list[tuple[int, int]] = []  # (budget, seed) of each thought

    @property
    def think_calls(self) -> int:
        return len(self.thinks)

    # -- Reader protocol -------------------------------------------------
    def check(self, decision: Decision) -> None:
        asked = asked_questions(decision)
        check_label_tokens(asked, self.label_token)
        if self.max_prompt_tokens is not None:
            longest = max(len(decision.state.split()) + 20 * len(asked), 0)
            if longest > self.max_prompt_tokens:
                raise InvalidRequest(f"the prompt ({longest} tokens) does not fit the context ({self.max_prompt_tokens})")

    def label_token(self, label: str) -> int | None:
        if label in self.label_tokens:
            return self.label_tokens[label]
        return int(_unit("token:" + label) * 2**31)

    def template_rows(self, questions: tuple[Question, ...], total: int) -> int:
        if self.strategy == "next-token":
            return 0
        return sum(self.row_cost(q) for q in questions)

    def think(self, decision: Decision, budget: int, seed: int) -> Thought:
        self.thinks.append((budget, seed))
        tokens = min(budget, self.thought_tokens)
        text = f"thought {seed} over {len(decision.questions)} questions"
        # The fake's thought is `thought_tokens` long: closed when the budget allows it.
        return Thought(text=text, tokens=tokens, closed=budget >= self.thought_tokens, ms=5.0)

    def read(self, read: Read) -> ReadResult:
        self.reads.append(read)
        slots: dict[str, SlotRead] = {}
        longest = 0
        for q in read.questions:
            # The core lists q in its sample's order already (q.order says which).
            order = list(range(len(q.options)))
            text = self.prompt_text(read, q, order)
            longest = max(longest, len(text.split()))
            slots[q.id] = self._slot(read, q, order, text)
        if self.strategy == "next-token":
            output = len(read.questions)
        else:
            output = self.template_rows(read.questions, len(read.listed))
        return ReadResult(slots=slots, prompt_tokens=longest, output_tokens=output, ms=1.0)

    # -- numbers ---------------------------------------------------------
    def prompt_text(self, read: Read, q: Question, order: Sequence[int]) -> str:
        """What the model would see for `q` in this read (thought included)."""
        if self.strategy == "next-token":
            msgs = prompts.messages(read.instructions, read.state, q, order, read.answered)
            parts = [m["content"] for m in msgs]
        else:
            listing = [f"{x.id}: " + prompts.question_block(x, range(len(x.options))) for x in read.listed]
            parts = [read.instructions or "", *listing, read.state, prompts.answered_block(read.answered)]
            # The random label tokens of a canvas read come from its seed.
            parts += [f"seed {read.seed}", f"slot {q.id}"]
        if read.thought is not None:
            parts.append(read.thought.text)
        return "\n".join(parts)

    def _slot(self, read: Read, q: Question, order: Sequence[int], text: str) -> SlotRead:
        table = self.forced_thought if read.thought is not None and q.id in self.forced_thought else self.forced
        listed_as = order_of(q)  # listed position -> request option
        if q.id in table:
            probs = _pick(table[q.id], read)  # request option order
            lps = tuple(math.log(probs[o]) if probs[o] > 0 else -math.inf for o in listed_as)
            return SlotRead(logprobs=lps, argmax_is_label=True)
        if q.id in self.position_logits:
            logits = list(self.position_logits[q.id])
            others: list[float] = []
        else:
            logits = [8.0 * _unit(f"{text}\x00{label}") - 4.0 for label in q.labels]
            others = [6.0 * _unit(f"{text}\x00other{i}") - 3.0 for i in range(2)]
        norm = _logsumexp(logits + others)
        argmax_is_label = not others or max(logits) >= max(others)
        # In listed order, as a read engine returns them.
        return SlotRead(logprobs=tuple(v - norm for v in logits), argmax_is_label=argmax_is_label)


def _pick(forced: Forced, read: Read) -> Sequence[float]:
    if callable(forced):
        return forced(read)
    if forced and isinstance(forced[0], (list, tuple)):
        return forced[min(read.sample, len(forced) - 1)]
    return forced  # type: ignore[return-value]


def ticket_body(**top_level) -> dict:
    """The support-ticket request used across tests: three first-stage
    questions and `refund`, asked only when team is billing (second stage)."""
    body = {
        "state": {"ticket": "I was charged twice for my March invoice. Please refund the duplicate charge."},
        "questions": {
            "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
            "team": {
                "type": "choice",
                "instructions": "Which team should handle the ticket?",
                "criteria": {
                    "billing": "invoices, charges, refunds",
                    "infra": "outages, errors, latency",
                    "product": "features, UI bugs",
                },
            },
            "severity": {
                "type": "score",
                "instructions": "How severe is the problem for the customer?",
                "criteria": ["low", "medium", "high"],
            },
            "refund": {
                "type": "noul",
                "instructions": "Does the customer ask for a refund?",
                "ask_if": {"team": ["billing"]},
            },
        },
    }
    body.update(top_level)
    return body
