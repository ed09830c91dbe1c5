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
"""

from __future__ import annotations

import numpy as np

from .context import Entry
from .nexttoken import NextTokenReader, _common_prefix


class HybridPrefixMixin:
    """Replaces NextTokenReader._evaluate for recurrent memories."""

    def _evaluate(self, prompts_tokens: list[list[int]]) -> list[np.ndarray]:  # type: ignore[override]
        shortest = min(len(t) for t in prompts_tokens)
        lcp = _common_prefix(prompts_tokens, shortest - 1)  # every tail keeps at least its last token
        prefix = list(prompts_tokens[0][:lcp])
        cached = getattr(self, "_cached", [])
        salt = getattr(self, "_salt", None)  # a prefix is reused only under its own cache_salt
        if cached != prefix or getattr(self, "_hybrid_salt", None) != salt:
            self.ctx.clear()
            self._cached = []
            if prefix:
                self._run([Entry(t, j, 0) for j, t in enumerate(prefix)])
            self._cached = prefix
            self._hybrid_salt = salt
        rows: list[np.ndarray] = []
        for tokens in prompts_tokens:
            tail = tokens[lcp:]
            if lcp:
                self.ctx.seq_cp(0, 1, -1, -1)
            out = self._run([Entry(t, lcp + j, 1, j == len(tail) - 1) for j, t in enumerate(tail)])
            rows.append(out[len(tail) - 1])
            self.ctx.seq_rm(1, -1, -1)
        return rows

    def _run(self, entries: list[Entry]) -> dict[int, np.ndarray]:
        """Decode in slices of at most the context's batch (llama.cpp aborts on more)."""
        out: dict[int, np.ndarray] = {}
        self._evaluated = getattr(self, "_evaluated", 0) + len(entries)
        step = self.ctx.max_tokens
        for start in range(0, len(entries), step):
            for i, row in self.ctx.decode(entries[start:start + step]).items():
                out[start + i] = row
        return out

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
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
