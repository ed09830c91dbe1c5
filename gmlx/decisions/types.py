"""The validated decision and the read protocol: the seam between the decision
core (pure Python) and the read engines (llama.cpp).

Data flows one way: request body -> `Decision` (parse.py) -> plan (plan.py)
-> `Read`s handed to a `Reader` (read.py) -> `ReadResult`s -> answers
(aggregate.py) -> response body (respond.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Union

QuestionType = Literal["noul", "choice", "score"]
Strategy = Literal["next-token", "canvas"]


@dataclass(frozen=True)
class Question:
    id: str
    type: QuestionType
    instructions: str
    # noul: ("yes", "no"); choice: option names; score: level names, in request order.
    options: tuple[str, ...]
    # One per option: the criteria text (noul: the "true"/"false" descriptions), or None.
    descriptions: tuple[str | None, ...]
    # SPEC 4.3: noul yes/no, choice A.., score 1..9 (or A.. above nine levels).
    labels: tuple[str, ...]
    # Ids whose answers this question's read sees; includes the keys of ask_if.
    depends_on: tuple[str, ...] = ()
    # id -> answer names (option names of that question) for which this one is asked.
    ask_if: dict[str, tuple[str, ...]] = field(default_factory=dict)
    alone: bool = False
    # As a read lists it (decisions/orders.py): listed option k is request
    # option order[k]. Empty: the request order.
    order: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecisionSettings:
    """Server settings that shape a decision (config `server.systemone`)."""

    max_questions: int = 64
    max_samples: int = 32
    # The request's auto_max when it sends none (server.systemone.auto_max).
    auto_max: int = 4
    think: int | str = 0
    think_threshold: float = 0.8
    think_budget: int = 64
    confidence: Literal["probability", "typesafe"] = "probability"
    skipped: Literal["null", "omit"] = "null"
    canvas: int = 64
    constrained: bool = True


@dataclass
class Decision:
    """A request body after validation (SPEC 4.1), defaults applied."""

    state: str
    questions: tuple[Question, ...]
    model: str | None = None
    profile: str | None = None
    instructions: str | None = None
    seed: int = 42
    samples: Union[int, Literal["auto"]] = "auto"
    # The server's settings are these fields' defaults (parse.py applies them).
    auto_max: int = DecisionSettings.auto_max
    auto_threshold: float = 0.1
    steps: int = 1
    think: Union[int, Literal["auto"]] = DecisionSettings.think
    think_threshold: float = DecisionSettings.think_threshold
    think_budget: int = DecisionSettings.think_budget
    ask: tuple[str, ...] | None = None
    chunk_rows: int | None = None
    chunk_prompt: Literal["own", "shared"] = "own"
    sequential: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    # "none" | "content_free"; None: the model's or profile's default.
    calibrate: str | None = None
    # Decoded images (parse.py), replaced at admission by the reader's prepared
    # form (engine/media.py: shrunk, keyed by their pixels).
    images: tuple = ()
    # Fields present in the body that the server parses but will not use, or does
    # not know: logged once as "ignoring unsupported parameter(s): ...".
    ignored: list[str] = field(default_factory=list)
    # Which optional fields the body actually set (for the per-strategy warning).
    given: frozenset[str] = frozenset()

    def question(self, qid: str) -> Question:
        for q in self.questions:
            if q.id == qid:
                return q
        raise KeyError(qid)


@dataclass(frozen=True)
class Answered:
    """An earlier answer a later read is conditioned on."""

    question: Question
    option: int  # index into question.options


@dataclass(frozen=True)
class Thought:
    text: str
    tokens: int
    closed: bool
    ms: float


@dataclass(frozen=True)
class Read:
    """One read: a forward (or a set of next-token reads sharing a prefix)
    that yields a distribution over the labels of each question in `questions`."""

    state: str
    instructions: str | None
    questions: tuple[Question, ...]  # answered by this read, in template order
    listed: tuple[Question, ...]  # questions the prompt lists (canvas system prompt)
    answered: tuple[Answered, ...]  # earlier answers the prompt states
    sample: int  # 0-based sample index within its chunk
    seed: int  # this sample's seed, derived from the request seed and the chunk
    # Questions the decision answers: the canvas template's layout (lines up to
    # ten, compact above) depends on it. 0 = unknown: the read's own questions.
    total: int = 0
    steps: int = 1
    thought: Thought | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    constrained: bool = True
    # The decision's images, as the reader's admission prepared them (the
    # engine's ReadImage: picture and content key); a content-free read has none.
    images: tuple = ()


@dataclass(frozen=True)
class SlotRead:
    """One question's result in one read."""

    # Log-probabilities of the question's label tokens over the full vocabulary,
    # in the question's option order (request order), whatever order the read used.
    logprobs: tuple[float, ...]
    argmax_is_label: bool


@dataclass(frozen=True)
class ReadResult:
    slots: dict[str, SlotRead]
    prompt_tokens: int  # tokens of the longest prompt this read ran on
    output_tokens: int  # canvas: template tokens; next-token: one per question read
    ms: float = 0.0
    # Tokens llama.cpp actually evaluated for this read (prefix reuse excluded);
    # None: the reader does not say.
    evaluated_tokens: int | None = None
    # Prompt tokens taken from an earlier decision's prefix (the cross-request cache).
    cached_tokens: int = 0


class Reader(Protocol):
    """What a read engine offers the decision core. Implementations live in
    gmlx.engine (llama.cpp) and tests/fake_reader.py (tests)."""

    strategy: Strategy
    # Whether `think` can do anything on this model (else it is ignored with a warning).
    can_think: bool

    def check(self, decision: Decision) -> None:
        """Admission checks before queueing: every label one token (422
        ValidationError naming question and label), templates within the canvas
        (422), the largest prompt within the context (400 InvalidRequest)."""

    def template_rows(self, questions: tuple[Question, ...], total: int) -> int:
        """Canvas: tokens the answer template of `questions` takes when the
        decision has `total` questions (line format up to ten, compact above).
        Next-token readers return 0 (no chunking)."""

    def think(self, decision: Decision, budget: int, seed: int) -> Thought:
        """Write one thought of at most `budget` tokens for the decision."""

    def read(self, read: Read) -> ReadResult:
        """Run one read. Raises nothing for bad input (checked in `check`)."""

    # Optional: `reset()` is called at the start of every decision when the
    # reader has it (a next-token reader drops its cached prefix there).


# Called before every read; raises gmlx.errors.Cancelled or Timeout to stop.
Checkpoint = Callable[[], None]
