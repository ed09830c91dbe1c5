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
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import llama_cpp
import numpy as np

from ..decisions import canvas_text as text
from ..decisions.plan import asked_questions, check_rows, stages_of, template_too_long
from ..decisions.types import Answered, Decision, Question, Read, ReadResult, SlotRead, Thought
from ..errors import InvalidRequest, ServerError, ValidationError
from . import denoise
from .context import Context, Entry
from .model import LoadedModel

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


@dataclass
class _Job:
    """One read in flight: its prompt, canvas and denoise state."""

    read: Read
    prompt: list[int]
    template: Template
    canvas: list[int]
    rng: np.random.Generator
    steps: int
    step: int = 0
    held: int = 0
    prev_argmax: list[int] | None = None
    result: ReadResult | None = None
    trace: list[list[int]] = field(default_factory=list)  # the canvas of every forward
    t0: float = 0.0

    sc: tuple[np.ndarray, float] | None = None  # DiffusionGemma: last forward's canvas rows, 1 / its t

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.canvas)


def diffusion_set_sc(lm: LoadedModel):
    """llama.cpp's `llama_diffusion_set_sc(model, sc_logits, use_sc, temp_inv, enabled)`
    (PR #24423) from the loaded libllama, declared with ctypes; None when the
    model is not DiffusionGemma or the library lacks the function."""
    if lm.architecture != "diffusion-gemma":
        return None
    lib = getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None)
    fn = getattr(lib, "llama_diffusion_set_sc", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_float, ctypes.c_float, ctypes.c_bool]
    fn.restype = None
    return fn


class CanvasReader:
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
        n_ctx = int(settings.get("n_ctx") or 8192)
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
            flash_attn=settings.get("flash_attn", "auto"),
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

    def _sc_call(self, sc: tuple[np.ndarray, float] | None) -> None:
        """Set the self-conditioning input of the next forward: `sc` = (the
        previous forward's canvas rows, 1 / its temperature), or None (first
        step: a zero buffer, gated off, as llama.cpp's driver does)."""
        if self._set_sc is None:
            if self._sc_fn is not None:  # turned off: the model may carry another reader's setting
                self._sc_fn(self.lm.model, None, 0.0, 1.0, False)
            return
        if sc is None:
            # The first step: llama.cpp's driver runs the graph with the gate at 0,
            # which adds exactly 0 to the canvas embeddings; leaving the block out
            # gives the same numbers (tested bitwise) without its cost (a softmax
            # over canvas x vocabulary and a vocabulary-wide matmul).
            self._sc_live = self._sc_zero
            self._set_sc(self.lm.model, self._sc_zero.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 0.0, 1.0, False)
            return
        buf, tinv = sc
        assert buf.flags.c_contiguous and buf.dtype == np.float32 and buf.shape == self._sc_zero.shape
        self._sc_live = buf  # llama.cpp reads it during the next llama_decode
        self._set_sc(self.lm.model, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1.0, tinv, True)

    # -- model facts ---------------------------------------------------------
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

    def _thought_tags(self) -> tuple[tuple[str, str, str] | None, int | None]:
        """The first thought channel whose open and close tags are single tokens
        of this vocabulary (DiffusionGemma's <|channel>thought .. <channel|>,
        or <think> .. </think>); none -> the model cannot think."""
        for tags in text.THOUGHT_TAGS:
            open_id, close_id = self.lm.token_id(tags[0]), self.lm.token_id(tags[2])
            if open_id is not None and close_id is not None and open_id != close_id:
                return tags, close_id
        return None, None

    # -- protocol --------------------------------------------------------------
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

    def _draw(self, rng: np.random.Generator, slot: Slot, constrained: bool) -> int:
        if constrained:
            return slot.label_ids[int(rng.integers(len(slot.label_ids)))]
        return int(rng.integers(self.n_vocab))

    def _job(self, read: Read) -> _Job:
        t0 = time.perf_counter()
        prompt, template = self.layout(read)
        need = self._need(len(prompt), template.width)
        if need > self.limit:
            raise InvalidRequest(
                f"the read needs {need} tokens but the context holds {self.limit}; "
                "shorten the state or serve the model with a larger n_ctx",
                param="state",
            )
        canvas = list(template.tokens) + [self.pad] * (template.width - template.rows)
        rng = np.random.default_rng(read.seed)
        for slot in template.slots:
            canvas[slot.pos] = self._draw(rng, slot, read.constrained)
        return _Job(read, prompt, template, canvas, rng, steps=max(1, int(read.steps)), t0=t0)

    # -- forwards ----------------------------------------------------------------
    def _groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        groups: list[list[_Job]] = []
        current: list[_Job] = []
        used = 0
        for job in jobs:
            size = ceil_to(job.length)
            if current and (len(current) == self.parallel or used + size > self.limit):
                groups.append(current)
                current, used = [], 0
            current.append(job)
            used += size
        if current:
            groups.append(current)
        return groups

    def _forward(self, seqs: Sequence[Sequence[int]], sc: tuple[np.ndarray, float] | None = None) -> list[int]:
        """One llama_decode over `seqs`, each its own sequence starting at a
        batch offset that is a multiple of ALIGN, a filler sequence after any
        that does not end on one. Returns each sequence's first batch index;
        rows stay readable (`_rows`) until the next forward.

        DiffusionGemma: exactly one sequence, no filler (its canvas is the
        batch's last canvas_length tokens),
        `sc` its self-conditioning input (None: the first step)."""
        if self.dg:
            if len(seqs) != 1:
                raise ServerError(f"internal: a diffusion-gemma forward carries one read, not {len(seqs)}")
            toks = seqs[0]
            first = len(toks) - int(self.fixed_width or 0)
            if first < 1:
                raise ServerError("internal: a diffusion-gemma forward needs a prompt before its canvas")
            # No logits flags: llama.cpp's encoder path returns every row anyway
            # (flagged rows would also be copied out by Context.decode).
            entries = [Entry(int(t), j, 0) for j, t in enumerate(toks)]
            if len(entries) > self.limit:
                raise ServerError(f"internal: a forward of {len(entries)} tokens exceeds the context's {self.limit}")
            self._sc_call(sc)
            self.ctx.decode(entries)
            self.forwards += 1
            self.sc_forwards += sc is not None and self._set_sc is not None
            return [0]
        entries: list[Entry] = []
        starts: list[int] = []
        seq = 0
        for toks in seqs:
            starts.append(len(entries))
            entries.extend(Entry(int(t), j, seq) for j, t in enumerate(toks))
            seq += 1
            fill = (-len(entries)) % ALIGN
            if fill:
                entries.extend(Entry(self.filler, j, seq) for j in range(fill))
                seq += 1
        if len(entries) > self.limit:
            raise ServerError(f"internal: a forward of {len(entries)} tokens exceeds the context's {self.limit}")
        self.ctx.decode(entries)  # guarded: refuses more than n_ubatch tokens, bad sequence ids
        self.forwards += 1
        return starts

    def _row(self, start: int, prompt_len: int, pos: int) -> np.ndarray:
        """The logits row predicting canvas position `pos` (row p - 1 with shift_logits)."""
        return self.ctx.logits_rows(start + prompt_len + pos - self.shift, 1)[0]

    # -- reads -------------------------------------------------------------------
    def _advance(self, job: _Job, start: int) -> None:
        """Take one forward's rows for `job`: finish it (last step, or converged),
        or sample, accept and renoise its slots for the next forward."""
        job.trace.append(list(job.canvas))
        slots = job.template.slots
        rows = [self._row(start, len(job.prompt), s.pos) for s in slots]
        if job.step < job.steps - 1 and not self._denoise_step(job, rows):
            return
        # The last forward (step cap or converged): temperature-1 log-probabilities
        # of the labels over the full vocabulary.
        reads = {}
        for slot, row in zip(slots, rows):
            reads[slot.question.id] = SlotRead(
                logprobs=label_logprobs(row, slot.label_ids),
                argmax_is_label=int(np.argmax(row)) in set(slot.label_ids),
            )
        job.result = ReadResult(
            slots=reads,
            prompt_tokens=len(job.prompt),
            output_tokens=job.template.rows,
            ms=(time.perf_counter() - job.t0) * 1000.0,
        )

    def _denoise_step(self, job: _Job, rows: list[np.ndarray]) -> bool:
        """One step of the denoise loop on a read's slots. Returns True when the
        canvas has converged (stable argmax, low entropy): this forward is the
        last. Otherwise writes the next canvas: accepted slots hold their
        sample, the others a fresh random token; template positions never change."""
        read = job.read
        slots = job.template.slots
        t = self.schedule.temperature(job.step, job.steps)
        # Pre-drawn in slot order whatever is accepted: the seed fixes every choice.
        u = job.rng.random(len(slots))
        renoise = [self._draw(job.rng, s, read.constrained) for s in slots]
        entropy = np.empty(len(slots))
        argmax: list[int] = []
        sampled: list[int] = []
        for k, (slot, row) in enumerate(zip(slots, rows)):
            if read.constrained:
                ids = np.asarray(slot.label_ids)
                h, a, s = denoise.position_stats(row[ids], t, float(u[k]))
                a, s = int(ids[a]), int(ids[s])
            else:
                h, a, s = denoise.position_stats(row, t, float(u[k]))
            entropy[k] = h
            argmax.append(a)
            sampled.append(s)
        job.held = job.held + 1 if job.prev_argmax == argmax else 0
        job.prev_argmax = argmax
        if job.held >= self.schedule.stability and float(entropy.mean()) < self.schedule.confidence:
            return True
        accepted = denoise.accept(entropy, self.schedule.entropy_bound)
        for k, slot in enumerate(slots):
            job.canvas[slot.pos] = sampled[k] if accepted[k] else renoise[k]
        if self._set_sc is not None:
            job.sc = (self._canvas_rows(len(job.prompt), len(job.canvas)), 1.0 / t)
        job.step += 1
        return False

    def _canvas_rows(self, prompt_len: int, width: int) -> np.ndarray:
        """A copy of the last forward's canvas rows (DiffusionGemma: one read at batch 0)."""
        return np.ascontiguousarray(self.ctx.logits_rows(prompt_len, width), dtype=np.float32).copy()

    # -- thinking ----------------------------------------------------------------
    def _thought_width(self) -> int:
        return self.fixed_width or self.canvas

    def think(self, decision: Decision, budget: int, seed: int) -> Thought:
        """Write the model's thought with the denoise sampler, one open canvas
        after another, each seeing the ones before; cut at the close tag (or an
        end-of-generation token), at most `budget` tokens."""
        t0 = time.perf_counter()
        if self.tags is None or budget <= 0:
            return Thought(text="", tokens=0, closed=False, ms=0.0)
        asked = asked_questions(decision)
        system = text.system_text(asked, text.compact(len(asked)), decision.instructions)
        head = self.lm.encode_prompt(self._turn(system, decision.state) + text.thought_open(self.tags))
        width = self._thought_width()
        rng = np.random.default_rng(seed)
        out: list[int] = []
        closed = False
        while len(out) < budget:
            prefix = head + out
            if self._need(len(prefix), width) > self.limit:
                log.info("thought stopped at %d tokens: the context is full", len(out))
                break
            block = self._denoise_open(prefix, width, rng)
            cut, stop = len(block), False
            for i, tok in enumerate(block):
                if tok == self.close_id:
                    cut, stop, closed = i, True, True
                    break
                if tok in self.eog:
                    cut, stop = i, True
                    break
            keep = block[: min(cut, budget - len(out))]
            closed = closed and len(keep) == cut
            out.extend(keep)
            if stop:
                break
        return Thought(
            text=self.lm.decode(out), tokens=len(out), closed=closed, ms=(time.perf_counter() - t0) * 1000.0
        )

    def _denoise_open(self, prefix: list[int], width: int, rng: np.random.Generator) -> list[int]:
        """Denoise a canvas of `width` open positions after `prefix`; returns the
        argmax canvas of the last step (stable, or at the step cap)."""
        steps = self.schedule.max_steps
        canvas = rng.integers(self.n_vocab, size=width)
        prev: np.ndarray | None = None
        held = 0
        argmax = canvas
        sc: tuple[np.ndarray, float] | None = None
        for step in range(steps):
            start = self._forward([prefix + canvas.tolist()], sc=sc)[0]
            rows = self.ctx.logits_rows(start + len(prefix) - self.shift, width)
            t = self.schedule.temperature(step, steps)
            if self._set_sc is not None:
                sc = (np.array(rows, dtype=np.float32, copy=True, order="C"), 1.0 / t)
            u = rng.random(width)
            renoise = rng.integers(self.n_vocab, size=width)
            entropy, argmax, sampled = denoise.rows_stats(rows, t, u)
            accepted = denoise.accept(entropy, self.schedule.entropy_bound)
            canvas = np.where(accepted, sampled, renoise)
            held = held + 1 if prev is not None and np.array_equal(prev, argmax) else 0
            prev = argmax
            if held >= self.schedule.stability and float(entropy.mean()) < self.schedule.confidence:
                break
        return [int(t) for t in argmax]

    def close(self) -> None:
        self.ctx.close()


def label_logprobs(row: np.ndarray, ids: Sequence[int]) -> tuple[float, ...]:
    """log_softmax over the whole row, at `ids` only: row[i] - logsumexp(row),
    the exponentials in float32 and their sum in float64 (a 262k-entry row
    costs ~1 ms instead of materializing every log-probability)."""
    top = float(row.max())
    lse = top + float(np.log(np.exp(row - np.float32(top)).sum(dtype=np.float64)))
    return tuple(float(row[i]) - lse for i in ids)


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
