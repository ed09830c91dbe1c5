"""Canvas forwards: the read's jobs, packing sequences into one llama_decode, self-conditioning inputs."""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import llama_cpp
import numpy as np

from ...decisions.types import Read, ReadResult
from ...errors import InvalidRequest, ServerError
from ..context import Entry
from ..model import LoadedModel

from .layout import ALIGN, Slot, Template, ceil_to

log = logging.getLogger("gmlx.engine")


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


class BatchingMixin:
    """CanvasReader's forwards (gmlx.engine.canvas)."""

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
