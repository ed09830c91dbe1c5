"""Which questions are read together, and in what order (SPEC 4.4).

Stages come from depends_on; a stage is split into chunks that fit the canvas
rows; ask_if decides, between stages, which questions are not read at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Mapping

from ..errors import ValidationError
from .types import Decision, DecisionSettings, Question, Reader


@dataclass(frozen=True)
class Plan:
    asked: tuple[Question, ...]  # questions answered, in request order
    stages: tuple[tuple[Question, ...], ...]
    chunk_prompt: str  # "own", "shared" or "full"
    rows_limit: int  # template rows one canvas read may take (chunk_rows)
    canvas: int  # served canvas rows: a longer single question is refused
    total: int  # question count the canvas template is laid out for

    def listed(self, chunk: tuple[Question, ...]) -> tuple[Question, ...]:
        """The questions a chunk's prompt lists."""
        return chunk if self.chunk_prompt == "own" else self.asked


def asked_questions(decision: Decision) -> tuple[Question, ...]:
    """Questions to answer, in request order (`ask` keeps every dependency)."""
    if decision.ask is None:
        return decision.questions
    wanted = set(decision.ask)
    return tuple(q for q in decision.questions if q.id in wanted)


def stages_of(questions: tuple[Question, ...]) -> tuple[tuple[Question, ...], ...]:
    """A question's stage is one past the latest stage it depends on."""
    level: dict[str, int] = {}
    by_id = {q.id: q for q in questions}

    def stage(q: Question) -> int:
        if q.id not in level:
            level[q.id] = 1 + max((stage(by_id[d]) for d in q.depends_on), default=-1)
        return level[q.id]

    count = 1 + max(stage(q) for q in questions)
    return tuple(tuple(q for q in questions if level[q.id] == s) for s in range(count))


def make_plan(decision: Decision, settings: DecisionSettings) -> Plan:
    asked = asked_questions(decision)
    stages = stages_of(asked)
    if len(stages) > 1 or decision.sequential:
        # Every read of a staged or sequential decision shares one full prompt.
        chunk_prompt = "full"
    else:
        chunk_prompt = decision.chunk_prompt
    limit = min(decision.chunk_rows or settings.canvas, settings.canvas)
    return Plan(
        asked=asked, stages=stages, chunk_prompt=chunk_prompt, rows_limit=limit, canvas=settings.canvas, total=len(asked)
    )


def template_too_long(rows: int, canvas: int, qid: str | None = None) -> ValidationError:
    """The one 422 for an answer template longer than the canvas."""
    if qid is None:
        return ValidationError(f"the answer template takes {rows} tokens, longer than the canvas ({canvas})")
    return ValidationError(
        f"question '{qid}': its answer template takes {rows} tokens, longer than the canvas ({canvas})",
        param=f"questions.{qid}",
    )


def check_rows(decision: Decision, reader: Reader, settings: DecisionSettings | int) -> None:
    """422 for a question whose own answer template is longer than the canvas
    (`settings` or a canvas width). The one admission check of template
    length: canvas readers call it from their own check too."""
    canvas = settings if isinstance(settings, int) else settings.canvas
    asked = asked_questions(decision)
    for q in asked:
        rows = reader.template_rows((q,), len(asked))
        if rows > canvas:
            raise template_too_long(rows, canvas, q.id)


def chunk_stage(plan: Plan, questions: tuple[Question, ...], reader: Reader) -> list[tuple[Question, ...]]:
    """Split the questions of a stage, in order, into the fewest chunks whose
    templates fit `plan.rows_limit`; an `alone` question gets its own chunk.

    Greedy filling is optimal here because a template's rows only grow as
    questions are added. A next-token reader (0 rows) reads a stage at once.
    """
    if not questions:
        return []
    if reader.template_rows(questions, plan.total) == 0:
        return [questions]
    chunks: list[tuple[Question, ...]] = []
    current: list[Question] = []
    for q in questions:
        own = reader.template_rows((q,), plan.total)
        if own > plan.canvas:  # admission (check_rows) refuses this first
            raise template_too_long(own, plan.canvas, q.id)
        # A question over chunk_rows but within the canvas is still read, alone.
        if q.alone or own > plan.rows_limit:
            if current:
                chunks.append(tuple(current))
                current = []
            chunks.append((q,))
            continue
        if current and reader.template_rows(tuple(current) + (q,), plan.total) > plan.rows_limit:
            chunks.append(tuple(current))
            current = []
        current.append(q)
    if current:
        chunks.append(tuple(current))
    return chunks


def skip_reason(question: Question, chosen: Mapping[str, str], skipped: Container[str]) -> dict | None:
    """Why `question` is not read, or None when it is.

    `chosen` maps answered ids to their top answer name; a question that
    depends on a skipped one is skipped too (its answer never existed).
    """
    for dep in question.depends_on:
        wanted = list(question.ask_if[dep]) if dep in question.ask_if else None
        if dep in skipped:
            return {"because": dep, "was": None, "wanted": wanted}
        if wanted is not None and chosen[dep] not in question.ask_if[dep]:
            return {"because": dep, "was": chosen[dep], "wanted": wanted}
    return None
