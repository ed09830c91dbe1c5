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

from pathlib import Path

from ..decisions import prompts
from ..decisions.labels import check_label_tokens
from ..decisions.literal import literal
from ..decisions.types import Decision, Question, Thought
from ..errors import ModelLoadError
from .hybrid import HybridPrefixMixin
from .media import ImageRegistry, Projector, no_projector, shrink
from .model import LoadedModel
from .nexttoken import NextTokenReader

BOS = "<|startoftext|>"
IMAGE = "<image>"


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


def user_content(state: str, q: Question, answered=(), images: int = 0) -> str:
    text = liquid_state(state)
    suffix = prompts.question_suffix(q, range(len(q.options)), answered)
    head = IMAGE * images  # the projector's markers stay control text
    if text is None:
        return head + literal(suffix)
    return head + literal(text + "\n\n" + suffix)


def head_text(instructions: str | None) -> str:
    """Everything before the images: BOS, the system turn, the user turn's opening."""
    out = BOS
    if instructions:
        out += f"<|im_start|>system\n{literal(instructions)}<|im_end|>\n"
    return out + "<|im_start|>user\n"


def render(instructions: str | None, state: str, q: Question, answered=(), images: int = 0) -> str:
    out = BOS
    if instructions:
        out += f"<|im_start|>system\n{literal(instructions)}<|im_end|>\n"
    out += f"<|im_start|>user\n{user_content(state, q, answered, images)}<|im_end|>\n<|im_start|>assistant\n"
    return out


class LiquidReader(HybridPrefixMixin, NextTokenReader):
    strategy = "liquid"

    def __init__(self, lm: LoadedModel, settings: dict[str, Any], parallel: int = 16):
        super().__init__(lm, settings, parallel)
        self.can_think = False
        self.projector = None
        self.reads_images = False
        self._registry = ImageRegistry()
        self._images: tuple = ()  # images of the read being evaluated
        self._image_chunks: dict = {}  # id of an image -> (chunks handle, chunk pointers, positions, tokens)
        mmproj = settings.get("mmproj")
        if mmproj:
            path = Path(mmproj).expanduser()
            if not path.is_absolute():
                path = Path(lm.path).parent / path
            if not path.is_file():
                raise ModelLoadError(f"model {lm.model_id!r}: mmproj {path} is missing")
            try:
                self.projector = Projector(lm, path, settings.get("n_threads"))
            except ValueError as err:
                raise ModelLoadError(f"model {lm.model_id!r}: {err}") from None
            self.reads_images = True

    def check(self, decision: Decision) -> None:
        images = getattr(decision, "images", ())
        if images:
            if self.projector is None:
                raise no_projector(self.lm.model_id, self.strategy)
            shrunk = tuple(shrink(im) for im in images)
            self._registry.put(decision.state, shrunk)
            positions = 0
            for im in shrunk:  # admission runs beside the worker: its own chunks, freed at once
                handle, _, pos, _ = self.projector.chunks(im)
                self.projector.mt.mtmd_input_chunks_free(handle)
                positions += pos
            if positions + self.largest_prompt(decision) > self.ctx.n_ctx:
                raise self._too_long(f"the images take {positions} positions and the prompt")
        if decision.chat_template_kwargs is not None and "chat_template_kwargs" not in decision.ignored:
            decision.ignored.append("chat_template_kwargs")  # fixed prompt: logged and ignored
        check_label_tokens([replace(q, labels=liquid_labels(q)) for q in decision.questions], self.label_token)
        super().check(decision)

    def _render(self, instructions, state, q, answered, user_kwargs, thought: Thought | None) -> str:  # noqa: ARG002
        q = replace(q, labels=liquid_labels(q))
        self._head = head_text(instructions)
        return render(instructions, state, q, answered)

    # -- images ------------------------------------------------------------
    def _chunks_of(self, image):
        key = id(image)
        if key not in self._image_chunks:
            self._image_chunks[key] = (image, *self.projector.chunks(image))
        return self._image_chunks[key][1:]

    def reset(self) -> None:
        super().reset()
        for _, handle, *_rest in self._image_chunks.values():
            self.projector.mt.mtmd_input_chunks_free(handle)
        self._image_chunks = {}

    def read(self, read):
        self._images = self._registry.get(read.state) if self.projector is not None else ()
        try:
            result = super().read(read)
        finally:
            images, self._images = self._images, ()
        if images:
            extra = sum(self._chunks_of(im)[3] for im in images)
            result = replace(result, prompt_tokens=result.prompt_tokens + extra)
        return result

    def _evaluate(self, prompts_tokens):
        if not self._images:
            return super()._evaluate(prompts_tokens)
        return self._evaluate_with_images(prompts_tokens)

    def _evaluate_with_images(self, prompts_tokens):
        """[head tokens | image chunks | state and question]: the head and the
        images are the start of the shared prefix, evaluated once on sequence 0;
        the text after them continues at the positions the images leave."""
        from .context import Entry

        head = self.lm.encode_prompt(self._head_text())
        n_head = len(head)
        assert all(t[:n_head] == head for t in prompts_tokens), "the head is not a token prefix"
        rests = [t[n_head:] for t in prompts_tokens]
        shortest = min(len(r) for r in rests)
        lcp = 0
        while lcp < shortest - 1 and all(r[lcp] == rests[0][lcp] for r in rests[1:]):
            lcp += 1
        key = ("images", tuple(id(im) for im in self._images), tuple(head), tuple(rests[0][:lcp]),
               getattr(self, "_salt", None))
        if getattr(self, "_media_key", None) != key or not self._cached:
            self.ctx.clear()
            self._cached = []
            self._run([Entry(t, j, 0) for j, t in enumerate(head)])
            pos = n_head
            for im in self._images:
                for chunk in self._chunks_of(im)[1]:
                    pos = self.projector.eval_into(self.ctx, chunk, pos, 0)
            self._media_pos = pos
            self._run([Entry(t, pos + j, 0) for j, t in enumerate(rests[0][:lcp])])
            self._media_key = key
            # Sequence 0 now holds something no text-only prompt starts with.
            self._cached = [-1]
        start = self._media_pos + lcp
        rows = []
        for r in rests:
            tail = r[lcp:]
            self.ctx.seq_cp(0, 1, -1, -1)
            out = self._run([Entry(t, start + j, 1, j == len(tail) - 1) for j, t in enumerate(tail)])
            rows.append(out[len(tail) - 1])
            self.ctx.seq_rm(1, -1, -1)
        return rows

    def _head_text(self) -> str:
        return getattr(self, "_head", None) or head_text(None)

    def close(self) -> None:
        self.reset()
        if self.projector is not None:
            self.projector.close()
        super().close()

    def _slot(self, p, row):
        return super()._slot(replace(p, question=replace(p.question, labels=liquid_labels(p.question))), row)
