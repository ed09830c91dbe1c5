"""Next-token reads for autoregressive chat models (SPEC 4.7, "Next-token").

Each question's read is the first token of the model's reply to a prompt that
starts with the state. All prompts of a read share their leading tokens, so
that prefix is evaluated once on sequence 0 and each question's suffix is
evaluated on its own sequence after a metadata-only copy of the prefix
(unified KV cache), with logits asked only for the suffix's last token.
The prefix stays in the cache across the reads of one decision and is cleared
between decisions, so no decision's numbers depend on another's.

A model configured with `mmproj` reads a decision's images (engine/media.py):
they go at the start of the user turn, before the state, as placeholder tokens
in the prompt's token list; the image chunks are evaluated through libmtmd
where their placeholders are, once, inside the shared prefix, and every
question's tail reads after them. Placeholders are keyed by the pixels' hash,
so the prefix caches reuse an image prefix exactly when the pictures match.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from ..decisions import prompts
from ..decisions.labels import check_label_tokens
from ..decisions.literal import literal
from ..decisions.plan import asked_questions
from ..decisions.types import Decision, Question, Read, ReadResult, SlotRead, Thought
from ..errors import InvalidRequest, ValidationError
from .context import Context, Entry, log_softmax
from .media import MARKER, NO_IMAGES, Layout, MediaSet, attach, load_projector, no_projector, split_at_marker
from .model import LoadedModel

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# The fewest tokens one decode of a batch-invariant read holds: below 8 rows
# llama.cpp's CPU matmuls take another path and round differently (measured on
# this project's machines: a tail of 1-7 tokens moves label logprobs by up to
# 1.1 nats on the Q4 Gemma, 8 and more match a single-pass evaluation bit for bit).
# 16 leaves a margin for CPUs whose kernels switch later.
MIN_PIECE = 16


@dataclass
class _Prompt:
    question: Question
    tokens: list[int]


class NextTokenReader:
    strategy = "next-token"

    def __init__(self, lm: LoadedModel, settings: dict[str, Any], parallel: int = 16):
        self.lm = lm
        n_batch = int(settings["n_batch"])
        n_ubatch = int(settings.get("n_ubatch") or n_batch)
        self.parallel = max(1, parallel)
        self.batch_invariant = settings["batch_invariant"] is not False
        self.ctx = Context(
            lm,
            n_ctx=int(settings["n_ctx"]),
            n_batch=n_batch,
            n_ubatch=min(n_ubatch, n_batch),
            n_seq_max=self.parallel + 1,
            n_threads=settings.get("n_threads"),
            flash_attn=self._flash_attn(settings),
        )
        self.template = lm.chat_template
        self.think_open = lm.token_id(THINK_OPEN)
        self.think_close = lm.token_id(THINK_CLOSE)
        self.can_think = bool(
            self.template and self.template.has_thinking and self.think_open is not None and self.think_close is not None
        )
        self._cached: list[int] = []  # tokens held by sequence 0
        # Within a decision, a prompt read once is not read again (two questions
        # whose prompts come out the same; repeated sample orders never reach the
        # reader, decisions/sampling.py skips them). Only the slot result is kept:
        # a full logits row is 1 MB on a 262k vocabulary.
        self._slots: dict[tuple[int, ...], SlotRead] = {}
        self._label_ids: dict[str, int | None] = {}
        self._evaluated = 0  # tokens decoded so far (usage counts what was evaluated)
        # Cross-request prefix cache: sequence 0 keeps the last prefix between
        # decisions, and earlier prefixes wait in host memory (llama.cpp's
        # sequence state) up to prefix_cache_mib. A prefix is reused only under
        # the cache_salt it was written with (None is a salt of its own).
        self._cache_limit = int(settings["prefix_cache_mib"]) * 2**20
        self._salt: str | None = None  # the salt of the read being evaluated
        self._cached_salt: str | None = None  # the salt sequence 0's prefix was written under
        # (salt, tokens) -> (sequence state, end of its images)
        self._saved: OrderedDict[tuple, tuple[bytes, int]] = OrderedDict()
        self._saved_bytes = 0
        n_swa = getattr(llama_cpp, "llama_model_n_swa", None)
        self._swa = int(n_swa(lm.model)) if n_swa is not None else 0
        self._first_hold = True
        self._reused = 0  # tokens this decision took from an earlier one
        self._cached_media = 0  # end of the last image chunk in sequence 0's prefix (0: none)
        # Images (engine/media.py): the projector, the images of the decision
        # being read (its MediaSet, on the worker) and the read's Layout.
        self.projector = load_projector(lm, settings) if self.loads_projector else None
        self.reads_images = self.projector is not None
        self._media: MediaSet | None = None
        self._layout: Layout = NO_IMAGES

    # Whether this strategy reads images through a configured `mmproj`.
    loads_projector = True

    def _flash_attn(self, settings: dict[str, Any]) -> bool | str:
        """`auto` is llama.cpp's choice, except for batch-invariant reads: on
        CPU, flash attention tiles a decode's queries by how many there are, so
        a tail evaluated alone no longer rounds like the same tokens inside a
        longer prompt (measured: docs/reads.md). Explicit true/false is kept."""
        fa = settings["flash_attn"]
        if fa in ("auto", None) and self.batch_invariant:
            return False
        return fa

    # -- protocol ----------------------------------------------------------
    def reset(self) -> None:
        """Start of a decision. Only the prefix cache outlives a decision, and
        reusing it gives the same bits as evaluating again (docs/reads.md)."""
        self._slots = {}
        self._first_hold = True
        self._reused = 0
        self._drop_media()
        if not self._cache_limit:
            self._clear()
            return
        for seq in range(1, self.ctx.n_seq_max):
            self.ctx.seq_rm(seq, -1, -1)

    def _clear(self) -> None:
        self.ctx.clear()
        self._cached = []
        self._cached_media = 0

    def clear_cache(self) -> None:
        """Empty the KV cache and the saved prefixes (tests, benches)."""
        self._clear()
        self._saved.clear()
        self._saved_bytes = 0

    def template_rows(self, questions, total) -> int:  # noqa: ARG002 - no canvas
        return 0

    def label_token(self, label: str) -> int | None:
        """The token of `label` at the reply's first position (no leading space)."""
        if label not in self._label_ids:
            ids = self.lm.encode(label)
            self._label_ids[label] = ids[0] if len(ids) == 1 else None
        return self._label_ids[label]

    def check(self, decision: Decision) -> None:
        images = getattr(decision, "images", None)
        if not images:
            return self._check(decision, None)
        if self.projector is None:
            raise no_projector(self.lm.model_id, self.strategy)
        attach(decision, [self.prepare_image(im) for im in images])
        # Admission runs beside the worker: the images' chunks are its own, freed at once.
        media = MediaSet(self.projector, decision.images)
        try:
            media.check_fits(self.ctx.n_ubatch)
            self._check(decision, media)
        finally:
            media.close()

    def prepare_image(self, image):
        """An image as this strategy reads it (Liquid d1 shrinks it)."""
        return image

    def _check(self, decision: Decision, media: MediaSet | None) -> None:
        # Only what may be asked: a question outside `ask` is never read.
        check_label_tokens(asked_questions(decision), self.label_token)
        n_ctx = self.ctx.n_ctx
        # Admission runs on the server's request path: when even an upper bound
        # of every prompt's tokens (from its bytes, LoadedModel.max_prompt_tokens)
        # fits, nothing needs tokenizing (about 1 ms of each small decision).
        if media is None and self._largest(decision, None, self.lm.max_prompt_tokens) <= n_ctx:
            return
        # Every prompt holds the whole state: a state that alone overflows the
        # context is refused after one tokenization, not one per question.
        # (The margin covers tokens merging across the state's two edges.)
        state_tokens = len(self.lm.encode(decision.state))
        if state_tokens > n_ctx + 8:
            raise self._too_long(f"the state alone is {state_tokens} tokens")
        need = self._largest(decision, media)
        if need > n_ctx:
            extra = f" ({media.image_tokens} of them for the images)" if media is not None else ""
            raise self._too_long(f"the decision's largest prompt needs {need} tokens{extra}")

    def _too_long(self, what: str) -> InvalidRequest:
        return InvalidRequest(
            f"{what} but the context holds {self.ctx.n_ctx}; "
            "shorten the state or serve the model with a larger n_ctx",
            param="state",
        )

    def _largest(self, decision: Decision, media: MediaSet | None, size=None) -> int:
        try:
            return self.largest_prompt(decision, media, size)
        except Exception as err:  # noqa: BLE001
            # The chat template runs here with the caller's chat_template_kwargs
            # for the first time: a template they make fail is their request's fault.
            if decision.chat_template_kwargs:
                raise ValidationError(
                    f"the model's chat template fails with these chat_template_kwargs ({type(err).__name__}: {err})",
                    param="chat_template_kwargs",
                ) from None
            raise

    def largest_prompt(self, decision: Decision, media: MediaSet | None = None, size=None) -> int:
        """Tokens of the largest prompt any read can build: each question with
        the questions it depends on answered with their longest option (a read
        states only those, see _prompt), plus a thought at full budget; or the
        prompt the thought is written on, if that is longer. `size` counts a
        rendered prompt's tokens (default: tokenize it)."""
        from ..decisions.types import Answered

        count = size or (lambda text: len(self._encode(text, media)))

        think = decision.think_budget if decision.think == "auto" else int(decision.think or 0)
        think = think if self.can_think else 0
        by_id = {q.id: q for q in decision.questions}
        worst = 0
        for q in asked_questions(decision):
            answered = tuple(
                Answered(o, max(range(len(o.options)), key=lambda i, o=o: len(o.options[i])))
                for o in (by_id[d] for d in q.depends_on if d in by_id)
            )
            text = self._render(decision.instructions, decision.state, q, answered,
                                decision.chat_template_kwargs, None, media=media is not None)
            worst = max(worst, count(text))
        # +1: the read itself; a thought also brings its open/close markers.
        need = worst + 1 + (think + 8 if think else 0)
        if think:
            # think() refuses, on the worker, a thought whose prompt and budget overflow the context.
            need = max(need, count(self._thought_prompt(decision, media is not None)) + think + 1)
        return need

    def read(self, read: Read) -> ReadResult:
        t0 = time.perf_counter()
        built = [self._prompt(read, q) for q in read.questions]
        # The prompt's tokens fix the question and its option order, so they key the result.
        keys = [tuple(p.tokens) for p in built]
        todo = {k: p for k, p in zip(keys, built) if k not in self._slots}
        evaluated, reused = self._evaluated, self._reused
        self._salt = read.cache_salt
        media = self._media_for(read.images)
        # Every prompt of a read has the same head and images at the same places.
        self._layout = Layout(built[0].tokens, media.chunks) if media is not None else NO_IMAGES
        if todo:
            try:
                rows = self._evaluate([p.tokens for p in todo.values()])
            except BaseException:
                # A failed decode may leave cells the reader no longer knows
                # about: start the next read from an empty cache.
                self._clear()
                raise
            for (key, p), row in zip(todo.items(), rows):
                self._slots[key] = self._slot(p, row)
        return ReadResult(
            slots={p.question.id: self._slots[k] for k, p in zip(keys, built)},
            prompt_tokens=max(len(p.tokens) for p in built),
            output_tokens=len(todo),
            ms=(time.perf_counter() - t0) * 1000,
            evaluated_tokens=self._evaluated - evaluated,
            cached_tokens=self._reused - reused,
        )

    def _slot(self, p: _Prompt, row: np.ndarray) -> SlotRead:
        """Label log-probabilities over the full vocabulary, in the order the
        question lists its options."""
        lp = log_softmax(row)
        ids = [self.label_token(lab) for lab in p.question.labels]
        return SlotRead(tuple(float(lp[i]) for i in ids), int(np.argmax(row)) in set(ids))

    # -- prompts -----------------------------------------------------------
    def _kwargs(self, user: dict[str, Any] | None, thinking: bool) -> dict[str, Any]:
        kw = {"enable_thinking": thinking}
        kw.update(user or {})
        return kw

    def _render(self, instructions, state, q, answered, user_kwargs, thought: Thought | None,
                media: bool = False) -> str:
        # The decision core hands each question already in its sample's order
        # (decisions/orders.py): the options are listed as given. Images open
        # the user turn, before the state (MARKER, replaced in _encode).
        msgs = prompts.messages(instructions, MARKER + state if media else state, q, range(len(q.options)), answered)
        if thought is None:
            return self.template.render(msgs, True, self._kwargs(user_kwargs, False))
        # The reply opens with the thought block, closed, then the answer.
        text = self.template.render(msgs, True, self._kwargs(user_kwargs, True))
        return text + f"{THINK_OPEN}\n{literal(thought.text.strip())}\n{THINK_CLOSE}\n\n"

    def _prompt(self, read: Read, q: Question) -> _Prompt:
        deps = set(q.depends_on)
        # A question's prompt states the earlier answers it depends on.
        answered = tuple(a for a in read.answered if a.question.id in deps)
        media = self._media_for(read.images)
        text = self._render(read.instructions, read.state, q, answered, read.chat_template_kwargs, read.thought,
                            media=media is not None)
        return _Prompt(q, self._encode(text, media))

    # -- images ------------------------------------------------------------
    def _encode(self, text: str, media: MediaSet | None) -> list[int]:
        """A rendered prompt's tokens; with images, their tokens (engine/media.py)
        where the render put MARKER."""
        if media is None:
            return self.lm.encode_prompt(text)
        parts = split_at_marker(text)
        if parts is None:
            raise InvalidRequest(
                f"model {self.lm.model_id!r}: its chat template drops the start of the user message, where the "
                "images go; configure a chat_template that keeps the message text", param="images")
        head, rest = parts
        return self.lm.encode_prompt(head) + media.tokens + self.lm.encode_prompt(rest, bos=False)

    def _media_for(self, images: tuple) -> MediaSet | None:
        """The MediaSet of a read's images (made once per decision on the
        worker, freed at the next reset), or None."""
        images = images if self.projector is not None else ()
        if not images:
            return None
        key = tuple(im.key for im in images)
        if self._media is None or self._media.key != key:
            self._drop_media()
            self._media = MediaSet(self.projector, images)
        return self._media

    def _drop_media(self) -> None:
        if self._media is not None:
            self._media.close()
            self._media = None
        self._layout = NO_IMAGES

    def _entries(self, tokens: list[int], start: int, seq: int, logits_last: bool = False) -> list[Entry]:
        """Entries for tokens[start:] on `seq` at their positions (the read's Layout)."""
        last = len(tokens) - 1
        if not self._layout.runs:
            return [Entry(t, start + j, seq, logits_last and start + j == last) for j, t in enumerate(tokens[start:])]
        pos = self._layout.pos
        return [Entry(t, pos(start + j), seq, logits_last and start + j == last)
                for j, t in enumerate(tokens[start:])]

    # -- evaluation --------------------------------------------------------
    def _evaluate(self, prompts_tokens: list[list[int]]) -> list[np.ndarray]:
        """Logits of the last token of every prompt, sharing their common prefix."""
        if self.batch_invariant:
            return self._evaluate_invariant(prompts_tokens)
        return self._evaluate_batched(prompts_tokens)

    def _evaluate_invariant(self, prompts_tokens: list[list[int]]) -> list[np.ndarray]:
        """Each prompt's numbers exactly as if it were evaluated alone.

        Two things change a token's numbers on llama.cpp's CPU kernels (measured,
        docs/reads.md): the KV cells its sequence occupies (the attention sums
        run over cell indices, so a shifted cell rounds differently) and a
        decode of fewer than 8 tokens (another matmul path). So the shared
        prefix stays on sequence 0 in cells 0..P-1, each prompt's tail is
        evaluated on its own, right after it (cells P..), then removed, and
        no decode ever holds fewer than MIN_PIECE tokens. Then every prompt
        sees the same cells and the same kernels as its naive evaluation.
        """
        shortest = min(len(t) for t in prompts_tokens)
        lcp = _common_prefix(prompts_tokens, shortest)
        prefix_len = min(lcp, shortest - MIN_PIECE)
        media_end = self._layout.media_end
        if media_end:
            # The head and the images are pieces of their own whatever the
            # split; the text after them in the prefix is none or a full piece.
            if prefix_len < media_end + MIN_PIECE:
                prefix_len = media_end
        elif prefix_len < MIN_PIECE:
            prefix_len = 0
        self._hold_prefix(prompts_tokens[0][:prefix_len])
        rows: list[np.ndarray] = []
        for tokens in prompts_tokens:
            # Without a prefix the tail is the whole prompt, on the empty sequence 0.
            seq = 1 if prefix_len else 0
            if seq:
                self.ctx.seq_cp(0, 1, -1, -1)
            out = self._decode_run(self._entries(tokens, prefix_len, seq, True))
            rows.append(out[len(tokens) - prefix_len - 1])
            self.ctx.seq_rm(seq, -1, -1)
        return rows

    def _evaluate_batched(self, prompts_tokens: list[list[int]]) -> list[np.ndarray]:
        """`batch_invariant: false`: suffixes batched on sequences 1..parallel.
        Faster on long question sets; a suffix lands in other KV cells than it
        would alone, so its numbers depend slightly on the other questions."""
        shortest = min(len(t) for t in prompts_tokens)
        prefix_len = self._layout.snap(_common_prefix(prompts_tokens, shortest - 1))
        prefix = prompts_tokens[0][:prefix_len]
        self._hold_prefix(prefix)
        suffixes = [t[prefix_len:] for t in prompts_tokens]
        rows: list[np.ndarray | None] = [None] * len(suffixes)
        # Groups of suffixes, each on its own sequence 1..parallel, within the KV cells left.
        free_cells = self.ctx.n_ctx - prefix_len
        group: list[int] = []
        used = 0
        for i, s in enumerate(suffixes):
            if group and (len(group) == self.parallel or used + len(s) > free_cells):
                self._run_group(group, prompts_tokens, prefix_len, rows)
                group, used = [], 0
            group.append(i)
            used += len(s)
        if group:
            self._run_group(group, prompts_tokens, prefix_len, rows)
        return rows  # type: ignore[return-value]

    def _hold_prefix(self, prefix: list[int]) -> None:
        """Make sequence 0 hold exactly `prefix`, reusing what it already has
        (or a saved prefix under the same salt). Batch-invariant reads never
        extend it by fewer than MIN_PIECE tokens: some cached tokens are
        evaluated again instead."""
        if self._cache_limit:
            self._pick_cached(prefix)
        media_end = self._layout.media_within(len(prefix))
        keep = _reusable(self._cached, self._cached_media, prefix, media_end)
        if self.batch_invariant and 0 < len(prefix) - keep < MIN_PIECE:
            keep = max(0, len(prefix) - MIN_PIECE)
        if keep and keep < media_end:
            keep = media_end  # an image is never evaluated again in part
        if self._first_hold:
            self._first_hold = False
            self._reused += keep
        if keep < len(self._cached):
            if self._cache_limit and keep < len(self._cached) - MIN_PIECE:
                self._save_resident()  # a diverging prefix: keep the old one for later
            self.ctx.seq_rm(0, self._layout.pos(keep), -1)
        self._decode_run(self._entries(prefix, keep, 0))
        self._cached = list(prefix)
        self._cached_media = media_end

    # -- prefix cache ------------------------------------------------------
    def _pick_cached(self, prefix: list[int]) -> None:
        """Put on sequence 0 the cached prefix (same salt) sharing most tokens with `prefix`."""
        media_end = self._layout.media_within(len(prefix))
        resident = _reusable(self._cached, self._cached_media, prefix, media_end)
        if self._cached_salt != self._salt:
            resident = -1
        best, best_n = None, max(resident, 0)
        for key, (_, media) in self._saved.items():
            salt, tokens = key
            if salt != self._salt:
                continue
            n = _reusable(tokens, media, prefix, media_end)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            if resident < 0:  # another salt's prefix: never reused, put aside
                self._save_resident()
                self._clear()
                self._cached_salt = self._salt
            return
        data, media = self._saved[best]  # before saving the resident one evicts it
        self._save_resident()
        self._clear()
        if self.ctx.set_seq_state(data, 0):
            if best in self._saved:
                self._saved.move_to_end(best)
            self._cached = list(best[1])
            self._cached_media = media
        else:  # llama.cpp refused the state: evaluate from scratch
            self._clear()
        self._cached_salt = self._salt

    def _save_resident(self) -> None:
        """Keep sequence 0's prefix in host memory before it is replaced.

        Not past a sliding window: llama.cpp saves only the window's cells of a
        sliding-window layer and restores them from cell 0, where they round
        differently than in the cells they had (measured: a 990-token Gemma 3
        prefix restored changed the answers). Such a prefix stays reusable
        while it is resident on sequence 0."""
        if len(self._cached) < 2 * MIN_PIECE:
            return
        if self._swa and len(self._cached) > self._swa:
            return
        key = (self._cached_salt, tuple(self._cached))
        if key in self._saved:
            self._saved.move_to_end(key)
            return
        data = self.ctx.seq_state(0)
        if len(data) > self._cache_limit:
            return
        self._saved[key] = (data, self._cached_media)
        self._saved_bytes += len(data)
        while self._saved_bytes > self._cache_limit:
            _, (old, _) = self._saved.popitem(last=False)
            self._saved_bytes -= len(old)

    @property
    def prefix_cache_bytes(self) -> int:
        return self._saved_bytes

    def _run_group(self, group: list[int], prompts_tokens, start: int, rows) -> None:
        entries: list[Entry] = []
        want: dict[int, int] = {}  # entry index -> prompt index
        for slot, i in enumerate(group, start=1):
            self.ctx.seq_cp(0, slot, -1, -1)
            entries += self._entries(prompts_tokens[i], start, slot, True)
            want[len(entries) - 1] = i
        for index, row in self._decode_run(entries).items():
            rows[want[index]] = row
        for slot in range(1, len(group) + 1):
            self.ctx.seq_rm(slot, -1, -1)

    def _decode_run(self, entries: list[Entry], borrow: bool = True) -> dict[int, np.ndarray]:
        """Decode any number of entries in slices of at most n_batch; no slice
        but a lone short run is under MIN_PIECE tokens (see _evaluate_invariant;
        `borrow=False`: plain slices). An image chunk's placeholders are
        evaluated through the projector, in their own piece."""
        out: dict[int, np.ndarray] = {}
        self._evaluated += len(entries)
        for lo, hi in _pieces(entries):
            if entries[lo].token < 0:
                e = entries[lo]
                self.projector.eval_into(self.ctx, self._chunk(e.token), e.pos, e.seq)
                continue
            for start, stop in _slices(hi - lo, self.ctx.max_tokens, borrow):
                for i, row in self.ctx.decode(entries[lo + start:lo + stop]).items():
                    out[lo + start + i] = row
        return out

    def _chunk(self, token: int):
        from ..errors import ServerError

        chunk = self._media.chunks.get(token) if self._media is not None else None
        if chunk is None:
            raise ServerError("internal: an image placeholder without its image")
        return chunk[0]

    # -- thinking ----------------------------------------------------------
    def _thought_prompt(self, decision: Decision, media: bool = False) -> str:
        state = MARKER + decision.state if media else decision.state
        msgs = prompts.thought_messages(decision.instructions, state, decision.questions)
        return self.template.render(msgs, True, self._kwargs(decision.chat_template_kwargs, True)) + THINK_OPEN + "\n"

    def think(self, decision: Decision, budget: int, seed: int) -> Thought:
        """Write the template's thinking block with seeded sampling, once per
        decision, over a prompt that lists every question."""
        t0 = time.perf_counter()
        media = self._media_for(decision.images)
        tokens = self._encode(self._thought_prompt(decision, media is not None), media)
        if len(tokens) + budget + 1 > self.ctx.n_ctx:
            raise InvalidRequest("the thought does not fit the context", param="think_budget")
        # The thought is written from an empty cache (the cached prefix is put
        # aside first) and is not kept: its one-token decodes are no prefix.
        if self._cache_limit:
            self._save_resident()
        self._clear()
        self._layout = Layout(tokens, media.chunks) if media is not None else NO_IMAGES
        rows = self._decode_run(self._entries(tokens, 0, 0, True))
        row = rows[len(tokens) - 1]
        rng = np.random.default_rng(seed)
        out: list[int] = []
        closed = False
        stops = {t for t in (self.lm.special.eos, self.lm.special.eot) if t is not None}
        pos = self._layout.pos(len(tokens))
        while len(out) < budget:
            tok = _sample(row, rng)
            if tok == self.think_close:
                closed = True
                break
            if tok in stops:
                break
            out.append(tok)
            row = self.ctx.decode([Entry(tok, pos, 0, True)])[0]
            pos += 1
        self._clear()
        return Thought(
            text=self.lm.decode(out), tokens=len(out), closed=closed, ms=(time.perf_counter() - t0) * 1000
        )

    def close(self) -> None:
        self._drop_media()
        if self.projector is not None:
            self.projector.close()
        self.ctx.close()


def _sample(row: np.ndarray, rng: np.random.Generator, temperature: float = 0.6, top_k: int = 20, top_p: float = 0.95) -> int:
    """Seeded sampling with Qwen3's recommended thinking settings."""
    k = min(top_k, row.shape[0])
    idx = np.argpartition(-row, k - 1)[:k]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    logits = row[idx].astype(np.float64) / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
    p = p[:keep] / p[:keep].sum()
    return int(idx[rng.choice(keep, p=p)])


def _slices(n: int, step: int, borrow: bool = True) -> list[tuple[int, int]]:
    """[start, stop) slices of n items, each at most `step`; when the last would
    be shorter than MIN_PIECE it borrows from the one before it (`borrow`)."""
    cuts = list(range(0, n, step)) + [n]
    if borrow and len(cuts) > 2 and cuts[-1] - cuts[-2] < MIN_PIECE and step >= 2 * MIN_PIECE:
        cuts[-2] = n - MIN_PIECE
    return list(zip(cuts[:-1], cuts[1:]))


def _pieces(entries: list[Entry]) -> list[tuple[int, int]]:
    """[lo, hi) runs of entries: text tokens, or one image chunk's placeholders."""
    n = len(entries)
    if not entries:
        return []
    if min(e.token for e in entries) >= 0:
        return [(0, n)]

    def kind(token: int) -> int | None:
        return token if token < 0 else None

    out: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, n + 1):
        if i == n or kind(entries[i].token) != kind(entries[lo].token):
            out.append((lo, i))
            lo = i
    return out


def _reusable(cached, cached_media: int, prefix: list[int], media_end: int) -> int:
    """Tokens of a cached prefix that `prefix` can keep: their common prefix,
    or none when it stops before the end of either one's images. A head or an
    image is always evaluated as a piece of its own, which rounds unlike the
    same text inside a longer piece, so it is shared only with the images
    that follow it."""
    n = _common_prefix([cached, prefix], min(len(cached), len(prefix)))
    return n if n >= max(cached_media, media_end) else 0


def _common_prefix(seqs: list[list[int]], limit: int) -> int:
    n = 0
    first = seqs[0]
    while n < limit and all(s[n] == first[n] for s in seqs[1:]):
        n += 1
    return n
