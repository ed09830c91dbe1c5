"""Driving a read to its answer: one forward (steps 1) or the entropy-bound denoise loop, and the slots' label log-probabilities."""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from ...decisions.types import ReadResult, SlotRead
from .. import denoise

from .batching import _Job

log = logging.getLogger("gmlx.engine")


class DrivingMixin:
    """CanvasReader's denoise driving (gmlx.engine.canvas)."""

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


def label_logprobs(row: np.ndarray, ids: Sequence[int]) -> tuple[float, ...]:
    """log_softmax over the whole row, at `ids` only: row[i] - logsumexp(row),
    the exponentials in float32 and their sum in float64 (a 262k-entry row
    costs ~1 ms instead of materializing every log-probability)."""
    top = float(row.max())
    lse = top + float(np.log(np.exp(row - np.float32(top)).sum(dtype=np.float64)))
    return tuple(float(row[i]) - lse for i in ids)
