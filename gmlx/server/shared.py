"""Profiles of one model share one loaded llama_model (issue 16).

A profile that changes only context settings (n_ctx, threads, batch sizes,
flash attention, how reads run) needs no second copy of the weights: every
(model, profile) slot whose weight settings are equal gets a handle on the
same LoadedModel, and the model is freed when the last handle closes. A
profile that changes how the weights are loaded (GPU layers, mmap, RPC, chat
template, read strategy...) loads its own.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

# Settings a llama.cpp context takes; everything else shapes the loaded model.
CONTEXT_KEYS = frozenset({
    "n_ctx", "n_threads", "n_batch", "n_ubatch", "flash_attn", "batch_invariant", "calibrate",
    "prefix_cache_mib", "decision_temperature", "decision_state_format", "parallel",
})


def weights_key(model_id: str, path: Path, settings: dict[str, Any]) -> tuple:
    return (model_id, str(path), tuple(sorted((k, repr(v)) for k, v in settings.items() if k not in CONTEXT_KEYS)))


class _Entry:
    def __init__(self, lm) -> None:
        self.lm = lm
        self.refs = 0


class Handle:
    """A LoadedModel as one slot sees it: everything forwarded, but close()
    only releases this slot's hold."""

    def __init__(self, registry: "SharedModels", key: tuple, entry: _Entry) -> None:
        self._registry, self._key, self._entry = registry, key, entry
        self._closed = False

    def __getattr__(self, name: str):
        return getattr(self._entry.lm, name)

    @property
    def shared_by(self) -> int:
        return self._entry.refs

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._registry.release(self._key, self._entry)


class SharedModels:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple, _Entry] = {}
        self._loading: dict[tuple, threading.Lock] = {}

    def acquire(self, key: tuple, load: Callable[[], Any]) -> Handle:
        """A handle on the model for `key`, loading it (once) if no slot holds it."""
        with self._lock:
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:  # two slots loading the same weights at once: one load
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.refs += 1
                    return Handle(self, key, entry)
            lm = load()
            with self._lock:
                entry = _Entry(lm)
                entry.refs = 1
                self._entries[key] = entry
                return Handle(self, key, entry)

    def release(self, key: tuple, entry: _Entry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self._entries.get(key) is entry:
                del self._entries[key]
        entry.lm.close()

    def __len__(self) -> int:
        return len(self._entries)
