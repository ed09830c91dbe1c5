"""Prompt text for next-token reads (SPEC 4.7): pure text, no tokenizer.

A read's user message is the state, a blank line, the earlier answers (later
stages), then the question, its options with their labels and a one-line
instruction. Everything up to the end of the state is the same for every
question of a decision, which is what lets the engine evaluate it once.
"""

from __future__ import annotations

from typing import Sequence

from .types import Answered, Question

TYPE_INSTRUCTION = {
    "choice": "Answer with the letter of one option only.",
    "score": "Answer with the label of one level only.",
}


def type_instruction(question: Question) -> str:
    if question.type == "noul":
        # Names yes/no in the order the read lists them (no-first on odd samples).
        return f"Answer with {question.labels[0]} or {question.labels[1]} only."
    return TYPE_INSTRUCTION[question.type]


def option_lines(question: Question, order: Sequence[int]) -> list[str]:
    """The options as listed in `order` (indices into question.options); the
    k-th listed option gets the k-th label."""
    lines = []
    for label, index in zip(question.labels, order):
        name = question.options[index]
        desc = question.descriptions[index]
        if question.type == "noul":
            # yes/no are their own labels; only the criteria say what they mean.
            if desc:
                lines.append(f"{label}: {desc}")
        else:
            lines.append(f"{label}. {name}" + (f": {desc}" if desc else ""))
    return lines


def question_block(question: Question, order: Sequence[int]) -> str:
    parts = [question.instructions.strip() or f"Question {question.id}"]
    opts = option_lines(question, order)
    if opts:
        parts.append("\n".join(opts))
    parts.append(type_instruction(question))
    return "\n".join(parts)


def answered_block(answered: Sequence[Answered]) -> str:
    if not answered:
        return ""
    lines = ["Earlier answers:"]
    for a in answered:
        q = a.question
        text = q.instructions.strip() or q.id
        lines.append(f"- {q.id} ({text}): {q.options[a.option]}")
    return "\n".join(lines)


def user_message(state: str, question: Question, order: Sequence[int], answered: Sequence[Answered] = ()) -> str:
    """The state, a blank line, then what this question's read adds."""
    return state + "\n\n" + question_suffix(question, order, answered)


def question_suffix(question: Question, order: Sequence[int], answered: Sequence[Answered] = ()) -> str:
    earlier = answered_block(answered)
    block = question_block(question, order)
    return (earlier + "\n\n" + block) if earlier else block


def messages(
    instructions: str | None, state: str, question: Question, order: Sequence[int], answered: Sequence[Answered] = ()
) -> list[dict[str, str]]:
    msgs: list[dict[str, str]] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    msgs.append({"role": "user", "content": user_message(state, question, order, answered)})
    return msgs


def thought_messages(instructions: str | None, state: str, questions: Sequence[Question]) -> list[dict[str, str]]:
    """The prompt a thought is written for: the state and every question, so one
    thought serves all reads of the decision."""
    blocks = [question_block(q, range(len(q.options))) for q in questions]
    content = state + "\n\n" + "\n\n".join(blocks)
    msgs: list[dict[str, str]] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    msgs.append({"role": "user", "content": content})
    return msgs
