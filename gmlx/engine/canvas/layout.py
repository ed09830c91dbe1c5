"""Canvas layout: the read's prompt tokens, the answer template and the slots its labels take."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from ...decisions import canvas_text as text
from ...decisions.plan import template_too_long
from ...decisions.types import Question, Read, Thought
from ...errors import ValidationError

log = logging.getLogger("gmlx.engine")


ALIGN = 16  # canvas widths and the batch offset of every sequence


def ceil_to(n: int, k: int = ALIGN) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class Slot:
    question: Question
    pos: int  # index in the canvas
    label_ids: tuple[int, ...]  # the question's label tokens, in option order


@dataclass(frozen=True)
class Template:
    tokens: tuple[int, ...]  # answer tokens then the end-of-turn token (the template's rows)
    slots: tuple[Slot, ...]
    width: int  # canvas positions of the forward: the template, then padding
    compact: bool

    @property
    def rows(self) -> int:
        return len(self.tokens)


class LayoutMixin:
    """CanvasReader's layout: prompt and answer-template tokens (gmlx.engine.canvas)."""

    def _builtin_format(self) -> str:
        """A turn format for a GGUF without a chat template (tiny test models,
        some diffusion conversions): Gemma's turns when the vocabulary has its
        markers, ChatML's when it has those, else plain text."""
        tid = self.lm.token_id
        if tid("<start_of_turn>") is not None and tid("<end_of_turn>") is not None:
            return "gemma"
        if tid("<|im_start|>") is not None and tid("<|im_end|>") is not None:
            return "chatml"
        return "plain"

    def _total_for(self, read: Read) -> int:
        if read.total:
            return read.total
        seen = {q.id for q in read.listed} | {q.id for q in read.questions} | {a.question.id for a in read.answered}
        return len(seen)

    def _encode(self, answer: str) -> list[int]:
        return self.lm.tokenize(answer, add_special=False, parse_special=False)

    def _slots(self, questions: Sequence[Question], is_compact: bool, continued: bool) -> tuple[list[int], list[Slot]]:
        """The template tokens (first labels written) and each question's slot.
        Raises 422 naming the question and label when a label does not change
        exactly one token at one position shared by all the question's labels,
        or two labels are the same token."""
        key = (tuple((q.id, q.labels) for q in questions), is_compact, continued)
        with self._cache_lock:  # admission checks run on other threads than reads
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        items = [(q.id, q.labels[0]) for q in questions]
        base = self._encode(text.answer_text(items, is_compact, continued))
        slots: list[Slot] = []
        for qi, q in enumerate(questions):
            variants = [base]
            for label in q.labels[1:]:
                changed = list(items)
                changed[qi] = (q.id, label)
                variants.append(self._encode(text.answer_text(changed, is_compact, continued)))
            pos: int | None = None
            bad: list[int] = []
            for li, toks in enumerate(variants[1:], start=1):
                diff = [j for j, (a, b) in enumerate(zip(toks, base)) if a != b] if len(toks) == len(base) else None
                if diff == []:
                    raise ValidationError(
                        f"question '{q.id}': labels '{q.labels[0]}' and '{q.labels[li]}' are the same token "
                        "for this model",
                        param=f"questions.{q.id}",
                    )
                if diff is None or len(diff) != 1 or (pos is not None and diff[0] != pos):
                    bad.append(li)
                elif pos is None:
                    pos = diff[0]
            if bad or pos is None:
                culprits = [q.labels[i] for i in _odd_ones(variants)]
                what = (
                    f"label '{culprits[0]}' is not a single token"
                    if len(culprits) == 1
                    else "labels " + ", ".join(f"'{c}'" for c in culprits) + " are not single tokens"
                )
                raise ValidationError(
                    f"question '{q.id}': {what} at one shared position of the answer template for this model"
                    + (" (with more than ten questions the template writes each label right after its id: "
                       "numbered ids such as q1 are the safe choice)" if is_compact else ""),
                    param=f"questions.{q.id}",
                )
            ids = tuple(v[pos] for v in variants)
            seen: dict[int, str] = {}
            for tok, label in zip(ids, q.labels):
                if tok in seen:
                    raise ValidationError(
                        f"question '{q.id}': labels '{seen[tok]}' and '{label}' are the same token for this model",
                        param=f"questions.{q.id}",
                    )
                seen[tok] = label
            slots.append(Slot(q, pos, ids))
        out = (base, slots)
        with self._cache_lock:
            self._cache[key] = out
            if len(self._cache) > 256:
                self._cache.popitem(last=False)
        return out

    def _width(self, rows: int) -> int:
        if rows > self.canvas:  # checked at admission; a guard for direct reads
            raise template_too_long(rows, self.canvas)
        return self.fixed_width or min(self.canvas, ceil_to(rows))

    def template(self, questions: Sequence[Question], total: int, continued: bool = False) -> Template:
        is_compact = text.compact(total)
        tokens, slots = self._slots(questions, is_compact, continued)
        rows = tuple(tokens) + (self.eot,)
        return Template(tokens=rows, slots=tuple(slots), width=self._width(len(rows)), compact=is_compact)

    def _turn(self, system: str, user: str) -> str:
        if self.template_fmt is not None:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            return self.template_fmt.render(msgs, True)
        return text.turn_prompt(self.turn_format, system, user)

    def _reply_prefix(self, rendered: str, thought: Thought | None) -> str:
        """DiffusionGemma-style models answer after their thought block: the
        read's thought, or the empty block (unless the template wrote one)."""
        if self.tags is None:
            return ""
        if thought is None and rendered.rstrip().endswith(self.tags[2]):
            return ""
        return text.thought_block(self.tags, thought.text if thought else None)

    def _prompt_tokens(self, instructions, listed, state, is_compact, answered, thought) -> list[int]:
        system = text.system_text(listed, is_compact, instructions)
        rendered = self._turn(system, state)
        prompt = rendered + self._reply_prefix(rendered, thought) + text.prefill_text(answered, is_compact)
        return self.lm.encode_prompt(prompt)

    def layout(self, read: Read) -> tuple[list[int], Template]:
        """The prompt tokens and the canvas template of a read."""
        total = self._total_for(read)
        is_compact = text.compact(total)
        thought = read.thought if self.can_think else None
        prompt = self._prompt_tokens(read.instructions, read.listed, read.state, is_compact, read.answered, thought)
        template = self.template(read.questions, total, continued=bool(read.answered))
        return prompt, template


def _differ_once(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The one position where two token lists differ (-1: equal), or None."""
    if len(a) != len(b):
        return None
    diff = [j for j, (x, y) in enumerate(zip(a, b)) if x != y]
    if not diff:
        return -1
    return diff[0] if len(diff) == 1 else None


def _odd_ones(variants: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the label variants to blame when a question's labels do not
    each change one shared token: those agreeing with the fewest others (two
    variants agree when they differ at most at one position); all of them
    when every label agrees with as many as every other."""
    n = len(variants)
    agree = [0] * n
    for i in range(n):
        for j in range(i + 1, n):
            if _differ_once(variants[i], variants[j]) is not None:
                agree[i] += 1
                agree[j] += 1
    low, high = min(agree), max(agree)
    if low == high:
        return list(range(n))
    return [i for i in range(n) if agree[i] == low]
