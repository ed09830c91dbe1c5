"""Shared-prefix next-token reads for hybrid / recurrent models (qwen35,
qwen35moe, lfm2): their memory holds a recurrent state per sequence that
cannot drop part of a sequence (llama.cpp's recurrent seq_rm refuses a
partial range), so the cached prefix is never trimmed: it is kept whole,
copied to sequence 1 for each prompt's tail, and sequence 1 is removed whole
after each read. A prefix that changes clears the cache and is evaluated again.

Every prompt's tail is evaluated after a copy of exactly the prefix it would
have alone, so results equal evaluating each full prompt on its own (to float
tolerance; tests/test_engine_liquid.py checks it on a tiny lfm2, and
tests/test_server_strategies.py on a tiny qwen35).

Where the prefix ends does not depend on the questions read beside a prompt:
it is the end of the state (the common prefix of the read's prompt written for
two probe questions), so a question's numbers are the same bits in any company
(batch invariance), and a later decision over the same state (and images)
finds the same prefix whole on sequence 0.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .context import Entry
from .nexttoken import NextTokenReader, _common_prefix


class HybridPrefixMixin:
    """Replaces NextTokenReader._evaluate for recurrent memories."""

    def read(self, read):
        self._state_end = self._end_of_state(read)
        return super().read(read)  # type: ignore[misc]

    def _end_of_state(self, read) -> int:
        """Tokens of the read's prompts up to the end of the state: the common
        prefix of its prompt for two probe questions (cached per decision)."""
        key = (read.state, tuple(im.key for im in read.images), read.instructions, read.thought,
               repr(read.chat_template_kwargs))
        ends = self.__dict__.setdefault("_state_ends", {})
        if key not in ends:
            media = self._media_for(read.images)
            probes = [self._encode(self._render(read.instructions, read.state, replace(read.questions[0], instructions=t),
                                                (), read.chat_template_kwargs, read.thought, media=media is not None),
                                   media)
                      for t in ("A", "B")]
            ends[key] = _common_prefix(probes, min(len(p) for p in probes))
        return ends[key]

    def _evaluate(self, prompts_tokens: list[list[int]]) -> list[np.ndarray]:  # type: ignore[override]
        shortest = min(len(t) for t in prompts_tokens)
        # Every tail keeps at least its last token, and no image is cut in two.
        lcp = _common_prefix(prompts_tokens, shortest - 1)
        lcp = self._layout.snap(min(lcp, getattr(self, "_state_end", lcp)))
        prefix = list(prompts_tokens[0][:lcp])
        cached = getattr(self, "_cached", [])
        salt = getattr(self, "_salt", None)  # a prefix is reused only under its own cache_salt
        if cached != prefix or getattr(self, "_hybrid_salt", None) != salt:
            self.ctx.clear()
            self._cached = []
            if prefix:
                self._run(self._entries(prefix, 0, 0))
            self._cached = prefix
            self._hybrid_salt = salt
        elif self._first_hold:
            self._reused += len(prefix)  # kept whole from the decision before
        self._first_hold = False
        rows: list[np.ndarray] = []
        for tokens in prompts_tokens:
            if lcp:
                self.ctx.seq_cp(0, 1, -1, -1)
            out = self._run(self._entries(tokens, lcp, 1, True))
            rows.append(out[len(tokens) - lcp - 1])
            self.ctx.seq_rm(1, -1, -1)
        return rows

    def _run(self, entries: list[Entry]) -> dict[int, np.ndarray]:
        """Decode in plain slices of at most the context's batch (llama.cpp aborts on more)."""
        return self._decode_run(entries, borrow=False)

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
        self._state_ends = {}
        # Sequences 1.. never outlive a read here; sequence 0 holds a whole prefix or nothing.
        for seq in range(1, self.ctx.n_seq_max):
            self.ctx.seq_rm(seq, -1, -1)


class HybridNextTokenReader(HybridPrefixMixin, NextTokenReader):
    """Next-token reads (SPEC 4.7) on qwen35 / qwen35moe / lfm2: the chat
    template with thinking off unless chat_template_kwargs turns it on."""

    def think(self, decision, budget, seed):  # type: ignore[override]
        # NextTokenReader.think decodes on sequence 0 from a cleared cache and
        # clears it afterwards: safe on a recurrent memory as it is.
        return super().think(decision, budget, seed)
