"""Thoughts on a canvas model: the thought channel's tags and writing a thought with the denoise sampler."""

from __future__ import annotations

import logging
import time

import numpy as np

from ...decisions import canvas_text as text
from ...decisions.plan import asked_questions
from ...decisions.types import Decision, Thought
from .. import denoise

log = logging.getLogger("gmlx.engine")


class ThoughtsMixin:
    """CanvasReader's thoughts (gmlx.engine.canvas)."""

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
