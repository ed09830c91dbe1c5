"""Liquid d1 reads (docs/reads.md, "Liquid d1"): LFM2(-VL) checkpoints
post-trained to answer a decision as their reply's first token.

The prompt is Liquid's ChatML turn format (not the GGUF's template):
`<|startoftext|><|im_start|>system\n{instructions}<|im_end|>\n` (only with
instructions), `<|im_start|>user\n{images}{state}\n\n{question}<|im_end|>\n<|im_start|>assistant\n`.
A JSON object or array state is written as indented JSON (2 spaces, keys in
their order); an empty state, or JSON null, leaves the images (or the question
alone) as the prompt. A choice whose option names are all single letters is
labelled with those letters. Reads share the prefix up to the end of the state
on the hybrid memory of lfm2 (engine/hybrid.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from ..decisions import prompts
from ..decisions.labels import check_label_tokens
from ..decisions.literal import literal
from ..decisions.types import Decision, Question, Thought
from .hybrid import HybridPrefixMixin
from .media import MARKER, shrink
from .model import LoadedModel
from .nexttoken import NextTokenReader

BOS = "<|startoftext|>"


def liquid_state(state: str) -> str | None:
    """The state as d1 reads it: indented JSON for an object or array, None for
    an empty or null state, else the text as sent."""
    if state.strip() in ("", "null"):
        return None
    s = state.lstrip()
    if s[:1] in "{[":
        try:
            value = json.loads(state)
        except ValueError:
            return state
        if isinstance(value, (dict, list)):
            return json.dumps(value, ensure_ascii=False, indent=2)
    return state


def liquid_labels(q: Question) -> tuple[str, ...]:
    """A choice whose option names are all single letters is labelled with them."""
    if q.type == "choice" and all(len(o) == 1 and o.isalpha() for o in q.options) and len(set(q.options)) == len(q.options):
        return tuple(q.options)
    return q.labels


def user_content(state: str, q: Question, answered=(), media: bool = False) -> str:
    """The user turn: the images' place (MARKER, engine/media.py), the state, the question."""
    text = liquid_state(state)
    suffix = prompts.question_suffix(q, range(len(q.options)), answered)
    head = MARKER if media else ""
    if text is None:
        return head + literal(suffix)
    return head + literal(text + "\n\n" + suffix)


def render(instructions: str | None, state: str, q: Question, answered=(), media: bool = False) -> str:
    out = BOS
    if instructions:
        out += f"<|im_start|>system\n{literal(instructions)}<|im_end|>\n"
    out += f"<|im_start|>user\n{user_content(state, q, answered, media)}<|im_end|>\n<|im_start|>assistant\n"
    return out


class LiquidReader(HybridPrefixMixin, NextTokenReader):
    """Liquid's prompt on lfm2's hybrid memory; images (with `mmproj`) are
    read the next-token way (engine/nexttoken.py, engine/media.py), shrunk to
    fit 1024 x 1024 first."""

    strategy = "liquid"

    def __init__(self, lm: LoadedModel, settings: dict[str, Any], parallel: int = 16):
        super().__init__(lm, settings, parallel)
        self.can_think = False

    def prepare_image(self, image):
        return shrink(image)

    def check(self, decision: Decision) -> None:
        if decision.chat_template_kwargs is not None and "chat_template_kwargs" not in decision.ignored:
            decision.ignored.append("chat_template_kwargs")  # fixed prompt: logged and ignored
        check_label_tokens([replace(q, labels=liquid_labels(q)) for q in decision.questions], self.label_token)
        super().check(decision)

    def _render(self, instructions, state, q, answered, user_kwargs, thought: Thought | None,  # noqa: ARG002
                media: bool = False) -> str:
        return render(instructions, state, replace(q, labels=liquid_labels(q)), answered, media)

    def _slot(self, p, row):
        return super()._slot(replace(p, question=replace(p.question, labels=liquid_labels(p.question))), row)
