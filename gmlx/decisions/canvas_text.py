"""Prompt and answer-template text for canvas reads (SPEC 4.7, "Canvas"): pure
text, no tokenizer.

A canvas read shows a diffusion model:

    system  the questions with their labelled answers (after `instructions`)
            and how to write the answers
    user    the state
    reply   [thought block] [earlier answer lines] | answer template, end of turn, padding

Everything left of `|` is the prompt; the canvas starts at the answer
template. The template writes every question of the read with a label:
`id: label` lines when the decision has at most ten questions, `idLABEL`
items separated by spaces above ten (COMPACT_ABOVE). The engine tokenizes the
template once per label variant to find the one token each label changes.

Earlier answers (later stages, sequential chunks) are the same lines or items
with the chosen labels, written into the reply before the canvas, so the model
reads them as the part of its answer already written. The line separator ends
the prefill ("...\\n" then "refund: ..."), while the compact separator opens the
canvas ("...q3B" then " q4A"): each side then tokenizes the way the joined text
would.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .literal import literal
from .types import Answered, Question

# More questions than this in a decision: the compact `idLABEL` template.
COMPACT_ABOVE = 10


def compact(total: int) -> bool:
    """Whether a decision with `total` questions uses the compact template."""
    return total > COMPACT_ABOVE


# -- system text ------------------------------------------------------------


def question_block(q: Question) -> str:
    """One question: its id and text, then each answer with its label."""
    lines = [f"{q.id}: {q.instructions.strip() or 'Question ' + q.id}"]
    if q.type == "noul":
        described = [(label, desc) for label, desc in zip(q.labels, q.descriptions) if desc]
        if described:
            lines += [f"  {label}: {desc}" for label, desc in described]
        else:
            lines.append(f"  {q.labels[0]} or {q.labels[1]}")
    else:
        for label, name, desc in zip(q.labels, q.options, q.descriptions):
            lines.append(f"  {label}. {name}" + (f": {desc}" if desc else ""))
    return "\n".join(lines)


def format_instruction(is_compact: bool) -> str:
    if is_compact:
        return (
            "Answer on one line: for every question, in the order above, write its id immediately "
            "followed by the label of your answer, with a space between questions (for example: q1A q2yes)."
        )
    return (
        "Answer with one line per question, in the order above: the question id, a colon, a space and "
        "the label of your answer (for example: q1: A). Use only the labels listed."
    )


def system_text(questions: Sequence[Question], is_compact: bool, instructions: str | None = None) -> str:
    """The system prompt of a canvas read listing `questions`."""
    parts: list[str] = []
    if instructions and instructions.strip():
        parts.append(instructions.strip())
    parts.append("Answer every question below about the state in the user's message.")
    parts += [question_block(q) for q in questions]
    parts.append(format_instruction(is_compact))
    return "\n\n".join(parts)


# -- answer template --------------------------------------------------------


def item(qid: str, label: str, is_compact: bool) -> str:
    """One question with a label, as the template writes it."""
    return f"{qid}{label}" if is_compact else f"{qid}: {label}"


def separator(is_compact: bool) -> str:
    return " " if is_compact else "\n"


def answer_text(items: Iterable[tuple[str, str]], is_compact: bool, continued: bool = False) -> str:
    """The answer template of (id, label) pairs. `continued`: earlier answers
    precede it in the reply (the compact template then opens with its space)."""
    sep = separator(is_compact)
    body = sep.join(item(qid, label, is_compact) for qid, label in items)
    return (sep + body) if (continued and is_compact) else body


def prefill_text(answered: Sequence[Answered], is_compact: bool) -> str:
    """Earlier answers as the template writes them, for the reply before the
    canvas ("" when there are none)."""
    if not answered:
        return ""
    items = [(a.question.id, a.question.labels[a.option]) for a in answered]
    body = separator(is_compact).join(item(qid, label, is_compact) for qid, label in items)
    return literal(body if is_compact else body + "\n")


# -- thought blocks -----------------------------------------------------------

# (open, close) text of the thought channels gmlx knows, each tag a single
# token in the vocabularies that have it: Gemma 4 / DiffusionGemma's channel,
# and the <think> block of Qwen3-style vocabularies.
THOUGHT_TAGS: tuple[tuple[str, str, str], ...] = (
    # (open tag, text right after the open tag, close tag)
    ("<|channel>", "thought\n", "<channel|>"),
    ("<think>", "\n", "</think>"),
)


def thought_open(tags: tuple[str, str, str]) -> str:
    """The reply's opening of a thought the model is about to write."""
    open_tag, lead, _close = tags
    return open_tag + lead


def thought_block(tags: tuple[str, str, str], text: str | None) -> str:
    """A closed thought block holding `text` (None or "" -> the empty block)."""
    open_tag, lead, close = tags
    # The thought is model text: plain text, only the tags are control tokens.
    body = literal((text or "").strip())
    if open_tag == "<think>":
        # Qwen3's own empty block is "<think>\n\n</think>\n\n".
        return f"{open_tag}\n{body}\n{close}\n\n" if body else f"{open_tag}\n\n{close}\n\n"
    return f"{open_tag}{lead}{body}{close}" if body else f"{open_tag}{lead}{close}"


# -- built-in turn formats (GGUFs without a chat template) --------------------

# One-turn prompts up to the start of the reply: "gemma" (system text folded
# into the user turn, as Gemma does), "chatml", or "plain" text for
# vocabularies with no turn markers.
TURNS = {
    "gemma": "<start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n<start_of_turn>model\n",
    "chatml": "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n",
    "plain": "{system}\n\nState:\n{user}\n\nAnswer:\n",
}
TURN_FORMATS = tuple(TURNS)


def turn_prompt(fmt: str, system: str, user: str) -> str:
    """A one-turn prompt in a built-in format (TURNS). The system text and the
    state are the caller's: plain text (literal.py)."""
    if fmt not in TURNS:
        raise ValueError(f"unknown turn format {fmt!r}")
    return TURNS[fmt].format(system=literal(system), user=literal(user.strip() if fmt == "gemma" else user))


# The token that ends the reply in each built-in format (None: the vocabulary's eos).
TURN_END = {"gemma": "<end_of_turn>", "chatml": "<|im_end|>", "plain": None}
