"""A llama.cpp context and the one way gmlx calls llama_decode.

llama.cpp aborts the whole process (GGML_ASSERT) on a batch larger than
n_batch / n_ubatch, and refuses a sequence id >= n_seq_max. Every decode in
gmlx goes through `Context.decode`, which checks both before calling in.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import llama_cpp
import numpy as np

from ..errors import ServerError
from .model import LoadedModel


_FLASH = {True: 1, False: 0, "auto": -1, None: -1}


@dataclass(frozen=True)
class Entry:
    token: int
    pos: int
    seq: int
    logits: bool = False


class Context:
    def __init__(
        self,
        lm: LoadedModel,
        *,
        n_ctx: int,
        n_batch: int,
        n_ubatch: int,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        flash_attn: bool | str | None = "auto",
        unified: bool = True,
    ):
        self.lm = lm
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_ubatch
        cp.n_seq_max = n_seq_max
        if hasattr(cp, "kv_unified"):
            # One pool of KV cells shared by all sequences: copying the prefix to a
            # sequence is metadata only, and n_ctx is not split per sequence.
            cp.kv_unified = unified
        if n_threads:
            cp.n_threads = n_threads
            cp.n_threads_batch = n_threads
        if hasattr(cp, "flash_attn_type"):
            # "auto" (llama.cpp's default): on where the backend supports it for this model.
            cp.flash_attn_type = _FLASH[flash_attn if flash_attn in _FLASH else "auto"]
        elif hasattr(cp, "flash_attn"):
            cp.flash_attn = flash_attn is True
        cp.no_perf = True
        ctx = llama_cpp.llama_init_from_model(lm.model, cp)
        if not ctx:
            raise ServerError(f"model {lm.model_id!r}: llama.cpp could not create a context (n_ctx {n_ctx}; out of memory?)")
        self.ctx = ctx
        # What llama.cpp actually gave us (it may round n_ctx up, clamp n_ubatch).
        self.n_ctx = llama_cpp.llama_n_ctx(ctx)
        self.n_batch = llama_cpp.llama_n_batch(ctx)
        self.n_ubatch = llama_cpp.llama_n_ubatch(ctx)
        self.n_seq_max = llama_cpp.llama_n_seq_max(ctx)
        self.memory = llama_cpp.llama_get_memory(ctx) if hasattr(llama_cpp, "llama_get_memory") else None
        self.n_vocab = lm.n_vocab
        # Diffusion architectures run llama.cpp's encoder path: the whole batch
        # must fit one ubatch.
        self.max_tokens = self.n_ubatch if lm.strategy == "canvas" else self.n_batch
        self._batch = llama_cpp.llama_batch_init(self.max_tokens, 0, 1)

    # -- memory ------------------------------------------------------------
    def clear(self) -> None:
        if self.memory:
            llama_cpp.llama_memory_clear(self.memory, True)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        if self.memory:
            llama_cpp.llama_memory_seq_rm(self.memory, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        if self.memory:
            llama_cpp.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_state(self, seq: int) -> bytes:
        """Sequence `seq`'s KV cells as bytes (llama_state_seq_get_data), to
        restore later with set_seq_state."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, seq)
        if n != size:
            raise ServerError(f"llama.cpp saved {n} of {size} bytes of sequence {seq}")
        return bytes(buf)

    def set_seq_state(self, data: bytes, seq: int) -> bool:
        """Restore bytes from seq_state into sequence `seq` (empty it first)."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(data), seq) == len(data)

    # -- decode ------------------------------------------------------------
    def decode(self, entries: Sequence[Entry]) -> dict[int, np.ndarray]:
        """Decode `entries` (at most max_tokens) and return the logits rows that
        were asked for, keyed by entry index, copied out (the next decode
        overwrites llama.cpp's buffer)."""
        n = len(entries)
        if n == 0:
            return {}
        if n > self.max_tokens:
            raise ServerError(f"internal: a batch of {n} tokens exceeds the context's {self.max_tokens}")
        b = self._batch
        for i, e in enumerate(entries):
            if not 0 <= e.seq < self.n_seq_max:
                raise ServerError(f"internal: sequence id {e.seq} outside 0..{self.n_seq_max - 1}")
            b.token[i] = e.token
            b.pos[i] = e.pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = e.seq
            b.logits[i] = 1 if e.logits else 0
        b.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise ServerError(f"llama_decode failed (code {rc}) on a batch of {n} tokens")
        out: dict[int, np.ndarray] = {}
        for i, e in enumerate(entries):
            if e.logits:
                out[i] = self.logits_row(i)
        return out

    def logits_row(self, i: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise ServerError(f"llama.cpp returned no logits for batch row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def logits_rows(self, first: int, count: int) -> np.ndarray:
        """Rows first..first+count-1 of the last decode (a diffusion forward
        returns every row): a view while they lie contiguous, else a copy.
        Valid until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, first)
        if not ptr:
            raise ServerError(f"llama.cpp returned no logits for batch row {first}")
        if count > 1:
            last = llama_cpp.llama_get_logits_ith(self.ctx, first + count - 1)
            step = np.dtype(np.float32).itemsize * self.n_vocab
            a = ctypes.cast(ptr, ctypes.c_void_p).value or 0
            b = ctypes.cast(last, ctypes.c_void_p).value or 0
            if b - a != (count - 1) * step:  # not contiguous: copy row by row
                return np.stack([self.logits_row(first + k) for k in range(count)])
        return np.ctypeslib.as_array(ptr, shape=(count, self.n_vocab))

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64, copy=False)
    m = row.max()
    return row - (m + np.log(np.exp(row - m).sum()))
