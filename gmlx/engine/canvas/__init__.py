"""Canvas reads for diffusion models: DiffusionGemma, LLaDA, Dream (SPEC 4.7).

A read is one forward over [prompt | canvas] with the model's non-causal
attention (llama.cpp runs these architectures through its encoder path: one
llama_decode, no KV cache, logits for every position):

    prompt  system: the questions with their labelled answers (canvas_text)
            user:   the state
            reply:  [thought block] [earlier answer lines]
    canvas  the answer template (`id: label` lines, or `idLABEL` items above
            ten questions), the end-of-turn token, then padding

Each question's label position (its *slot*) holds a random token drawn from
the sample's seed; the logits row of the slot (row p - 1 on models with
`diffusion.shift_logits`, such as Dream) gives the log-probabilities of the
question's labels over the full vocabulary. Every other canvas position is
pinned to its template token.

Slots are found by tokenizing the template once per label: each label of a
question must change exactly one token, at one position shared by all its
labels, with distinct token ids; otherwise the request is refused (422).

Canvas width: the smallest multiple of 16 that holds the template and its
end-of-turn token, at most the served canvas (the constructor's `canvas`,
capped by the GGUF's `diffusion.canvas_length`).

DiffusionGemma (llama.cpp PR #24423, checked against its graph): one
llama_decode over [prompt | canvas] where the canvas is the last
`diffusion.canvas_length` tokens of the *whole batch* (no batch larger than
that: all of it is canvas). The prompt is embedded and attended causally, the
canvas is embedded through the self-conditioning block and attends to
everything; the attention mask ignores sequence ids. So a DiffusionGemma
forward carries exactly one read, no filler, its canvas padded to
`canvas_length`, and its logits are read unshifted (row p predicts position
p). Self-conditioning, as llama.cpp's own driver (examples/diffusion,
`diffusion_generate_entropy_bound`) does it: `llama_diffusion_set_sc` enables
the graph between model load and context creation; every forward then gets
the previous step's raw canvas logits at 1 / (previous temperature), gated
off (use 0, a zero buffer) on the first step. A library without the function
runs with self-conditioning off, and the reader says so (`diagnostics()`).

Random tokens: the seed's generator (numpy PCG64) draws, slot by slot in
template order, uniformly among the question's label ids when the read is
`constrained` (the default), else uniformly over the whole vocabulary, as
llama.cpp's DiffusionGemma sampler initializes its canvas.

`steps > 1` runs the entropy-bound denoise loop of denoise.py over the slots
only (constrained: sampling and argmax among the label ids), template
positions pinned, and reports the temperature-1 distribution of its last
forward. A thought (`think`) is written with the same sampler over whole open
canvases, one after the other, until the close tag or the budget.

Several reads (samples) can share one llama_decode as separate sequences
(`read_many`). Every sequence of a forward starts at a batch offset that is a
multiple of 16, and the batch is filled up to a multiple of 16 with a filler
sequence; on one CPU that made a sequence's numbers bit-identical whatever else
shared its decode, on others (AVX-512/AMX machines) they still move by ~2e-6,
so decisions never pack: batch invariance needs one read per forward. Packing
does not pay on the CPU anyway:
llama.cpp's encoder path attends over the whole batch (other sequences are
masked, not skipped), so k packed reads cost about k times the attention of
k separate ones; the decision core reads one sample per call.

The template's layout (lines up to ten questions, compact above) depends on
how many questions the decision answers: `Read.total`, the same count the
core passed to `template_rows` when it planned the chunks.

The reader is split along its jobs: `layout.py` (prompt tokens, the answer
template, slots), `batching.py` (jobs, forwards, self-conditioning inputs),
`driving.py` (one forward or the denoise loop, label log-probabilities),
`thoughts.py` (writing a thought); this module keeps the protocol (check,
read, template_rows) and the reader's state.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from ...decisions import canvas_text as text
from ...decisions.plan import asked_questions, check_rows, stages_of
from ...decisions.types import Answered, Decision, Question, Read, ReadResult
from ...errors import InvalidRequest, ServerError
from .. import denoise
from ..context import Context
from ..model import LoadedModel

from .batching import BatchingMixin, diffusion_set_sc  # noqa: F401 - looked up here (tests replace it)
from .driving import DrivingMixin
from .layout import ALIGN, LayoutMixin, Slot, ceil_to
from .thoughts import ThoughtsMixin

log = logging.getLogger("gmlx.engine")


class CanvasReader(LayoutMixin, BatchingMixin, DrivingMixin, ThoughtsMixin):
    strategy = "canvas"

    def __init__(
        self,
        lm: LoadedModel,
        settings: dict[str, Any],
        *,
        canvas: int = 64,
        parallel: int = 8,
        schedule: denoise.Schedule | None = None,
        self_conditioning: bool = True,
    ):
        self.lm = lm
        self.dg = lm.architecture == "diffusion-gemma"
        if self.dg and not lm.canvas_length:
            raise ServerError(f"model {lm.model_id!r}: a diffusion-gemma GGUF without diffusion.canvas_length")
        n_ctx = int(settings["n_ctx"])
        # No KV cache: a forward is one ubatch, so n_batch = n_ubatch = the largest
        # forward: n_ctx, or less when the config sets n_ubatch (llama.cpp's compute
        # buffer holds n_ubatch rows of logits: n_ubatch x n_vocab floats).
        ubatch = min(n_ctx, int(settings.get("n_ubatch") or n_ctx))
        # DiffusionGemma's graph takes the batch's last canvas_length tokens as the
        # canvas whatever the sequences: one read per forward.
        self.parallel = 1 if self.dg else max(1, int(parallel))
        # Self-conditioning: enabled on the model before its context exists (the
        # context reserves its compute buffer for the graph it will run).
        self._sc_fn = diffusion_set_sc(lm)
        self._set_sc = self._sc_fn if self_conditioning else None
        self.self_conditioning = self._set_sc is not None
        if self.dg and self._set_sc is None:
            why = "turned off" if not self_conditioning else "this llama.cpp has no llama_diffusion_set_sc"
            self.sc_note: str | None = f"off ({why})"
        else:
            self.sc_note = "on" if self.dg else None
        self._sc_zero: np.ndarray | None = None
        if self._set_sc is not None:
            self._sc_zero = np.zeros((lm.canvas_length, lm.n_vocab), dtype=np.float32)
        self._sc_call(None)
        # Each sequence may be followed by a filler sequence (alignment), hence 2x.
        self.ctx = Context(
            lm,
            n_ctx=n_ctx,
            n_batch=ubatch,
            n_ubatch=ubatch,
            n_seq_max=min(2 * self.parallel, 256),
            n_threads=settings.get("n_threads"),
            flash_attn=settings["flash_attn"],
        )
        # Tokens one forward may take (llama.cpp aborts the process above n_ubatch).
        self.limit = min(self.ctx.n_ctx, self.ctx.max_tokens) // ALIGN * ALIGN
        self.n_vocab = lm.n_vocab
        self.shift = 1 if lm.shift_logits else 0
        # The served canvas, and the width of every forward's canvas on
        # DiffusionGemma (its graph takes the last canvas_length tokens as the canvas).
        self.canvas = min(int(canvas), lm.canvas_length) if lm.canvas_length else int(canvas)
        if self.canvas < ALIGN:
            raise ValueError(f"canvas {canvas}: at least {ALIGN} rows")
        self.fixed_width = lm.canvas_length if (lm.canvas_length and lm.architecture == "diffusion-gemma") else None
        # PR #24423 also exports prompt-cache phases (`llama_diffusion_set_phase`:
        # prefill the prompt once, then decode only the canvas). They match the unified
        # forward only to float round-off, so reads keep the unified forward (the
        # same numbers whichever way a read is split into steps) and do not use them.
        self.schedule = schedule or denoise.Schedule.from_meta(lm.meta)

        self.template_fmt = lm.chat_template
        self.turn_format = None if self.template_fmt else self._builtin_format()
        sp = lm.special
        end = text.TURN_END.get(self.turn_format or "", None)
        end_id = lm.token_id(end) if end else None
        self.eot = next(t for t in (end_id, sp.eot, sp.eos, 0) if t is not None)
        self.pad = next(t for t in (sp.pad, sp.eos, self.eot) if t is not None)
        self.filler = self.pad
        self.tags, self.close_id = self._thought_tags()
        self.can_think = self.tags is not None
        self.eog = {t for t in (sp.eos, sp.eot, self.eot) if t is not None}

        log.info(
            "canvas reader for %s: canvas %d%s, forwards up to %d tokens, %s turns, end of turn %d, "
            "thought %s, shift_logits %s, schedule %s",
            lm.model_id, self.canvas, f" (padded to {self.fixed_width})" if self.fixed_width else "", self.limit,
            self.turn_format or "chat-template", self.eot, self.tags[0] if self.tags else "none", lm.shift_logits,
            self.schedule,
        )
        self._cache: OrderedDict[tuple, tuple[list[int], list[Slot]]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.last_trace: list[list[list[int]]] = []  # per read of the last read_many: canvases fed
        self.forwards = 0  # llama_decode calls made (tests, bench)
        self.sc_forwards = 0  # of them, DiffusionGemma forwards fed the previous step's logits

    def diagnostics(self) -> dict[str, Any]:
        """Facts about how this reader runs, for a decision's diagnostics:
        DiffusionGemma's self-conditioning ("on", or "off (why)")."""
        return {"self_conditioning": self.sc_note} if self.dg else {}

    def template_rows(self, questions: tuple[Question, ...], total: int) -> int:
        """Canvas rows the answer template of `questions` takes in a decision of
        `total` questions: its tokens plus the end-of-turn token (with the
        compact template, the larger of the opening and continued forms)."""
        is_compact = text.compact(total)
        items = [(q.id, q.labels[0]) for q in questions]
        rows = len(self._encode(text.answer_text(items, is_compact)))
        if is_compact:
            rows = max(rows, len(self._encode(text.answer_text(items, is_compact, continued=True))))
        return rows + 1

    def check(self, decision: Decision) -> None:
        asked = asked_questions(decision)
        total = len(asked)
        is_compact = text.compact(total)
        # 422: every label one token at its slot (the whole template, both forms).
        self._slots(asked, is_compact, False)
        if is_compact:
            self._slots(asked, is_compact, True)
        # 422: a question whose own template does not fit the served canvas.
        check_rows(decision, self, self.canvas)
        # 400: the largest forward the decision can build must fit one ubatch.
        need, prompt = self.largest_forward(decision)
        if self.dg and self.fixed_width and self.fixed_width >= self.limit:
            raise InvalidRequest(
                f"this model's canvas (diffusion.canvas_length {self.fixed_width}) plus a prompt does not fit "
                f"one forward of {self.limit} tokens (n_ubatch / n_ctx); serve it with a larger n_ubatch and n_ctx",
                param="model",
            )
        if need > self.limit:
            raise InvalidRequest(
                f"the decision's largest read needs {need} tokens (a prompt of {prompt} plus its canvas) "
                f"but the context holds {self.limit}; shorten the state or serve the model with a larger n_ctx",
                param="state",
            )

    def largest_forward(self, decision: Decision) -> tuple[int, int]:
        """(tokens of the largest forward, tokens of its prompt), an upper bound:
        every question listed, the earlier answers the last read can see, a
        thought at full budget, the widest canvas."""
        asked = asked_questions(decision)
        total = len(asked)
        is_compact = text.compact(total)
        if decision.sequential:
            earlier = asked[:-1]
        else:
            earlier = tuple(q for stage in stages_of(asked)[:-1] for q in stage)
        answered = tuple(Answered(q, 0) for q in earlier)
        think = decision.think_budget if decision.think == "auto" else int(decision.think or 0)
        think = think if self.can_think else 0
        prompt = len(self._prompt_tokens(decision.instructions, asked, decision.state, is_compact, answered, None))
        prompt += think
        rows = self.template_rows(asked, total)
        width = self.fixed_width or min(self.canvas, ceil_to(rows))
        if think:
            width = max(width, self._thought_width())
        return self._need(prompt, width), prompt

    def _need(self, prompt: int, width: int) -> int:
        """Batch tokens of a forward: DiffusionGemma's exactly (no filler),
        others' rounded up to the alignment."""
        return prompt + width if self.dg else ceil_to(prompt + width)

    def read(self, read: Read) -> ReadResult:
        return self.read_many([read])[0]

    def read_many(self, reads: Sequence[Read]) -> list[ReadResult]:
        """Several reads, packed as separate sequences into as few forwards as
        fit (at most `parallel` each); the numbers are those of reading each
        alone. Denoise loops advance together, a read leaving when it is done."""
        jobs = [self._job(r) for r in reads]
        active = list(jobs)
        while active:
            for group in self._groups(active):
                starts = self._forward([j.prompt + j.canvas for j in group], sc=group[0].sc if self.dg else None)
                for job, start in zip(group, starts):
                    self._advance(job, start)
            active = [j for j in active if j.result is None]
        self.last_trace = [j.trace for j in jobs]
        return [j.result for j in jobs]  # type: ignore[misc]

    # -- layout ----------------------------------------------------------------

    def close(self) -> None:
        self.ctx.close()
