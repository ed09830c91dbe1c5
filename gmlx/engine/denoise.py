"""The entropy-bound denoise sampler of canvas reads and thoughts (numpy only).

One step of the loop, at every open canvas position:
  * temperature t from a linear schedule, t_max at the first step down
    towards t_min (`Schedule.temperature`);
  * the entropy of softmax(logits / t), its argmax, and a sample drawn with a
    uniform number pre-drawn from the seed (`position_stats`);
  * acceptance: positions sorted by entropy are accepted while the entropies
    of the positions before them sum to at most `entropy_bound` (at least one
    is always accepted) (`accept`); an accepted position holds its sample for
    the next forward, every other open position is renoised with a fresh
    random token;
  * the loop stops when the argmax has been stable for `stability` steps and
    the mean entropy is below `confidence`, or at the step cap.

This is the rule of llama.cpp's DiffusionGemma entropy-bound sampler
(`diffusion_generate_entropy_bound`), whose parameters a DiffusionGemma GGUF
may carry as `diffusion.eb_*` keys. The defaults are the ones that sampler
falls back to when the keys are absent.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

# GGUF key -> Schedule field.
META_KEYS = {
    "diffusion.eb_t_min": "t_min",
    "diffusion.eb_t_max": "t_max",
    "diffusion.eb_entropy_bound": "entropy_bound",
    "diffusion.eb_stability_threshold": "stability",
    "diffusion.eb_confidence_threshold": "confidence",
    "diffusion.eb_max_steps": "max_steps",
}


@dataclass(frozen=True)
class Schedule:
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1  # nats: acceptance bound on the summed entropies
    stability: int = 1  # steps the argmax must hold still to stop early
    confidence: float = 0.005  # nats: mean entropy below which a stable canvas stops
    max_steps: int = 48  # steps per thought canvas (reads use the request's `steps`)

    @classmethod
    def from_meta(cls, meta: Callable[[str], str | None]) -> "Schedule":
        """Defaults overridden by the GGUF's `diffusion.eb_*` keys that parse."""
        values = {}
        kinds = {f.name: f.type for f in fields(cls)}
        for key, name in META_KEYS.items():
            raw = meta(key)
            if raw is None:
                continue
            try:
                value = float(raw) if kinds[name] in (float, "float") else int(float(raw))
            except ValueError:
                continue
            if name in ("stability", "max_steps") and value < 1:
                continue
            values[name] = value
        return cls(**values)

    def temperature(self, step: int, steps: int) -> float:
        """Step `step` (0-based) of `steps`: t_max at the first step, then
        linearly down, reaching t_min + (t_max - t_min) / steps at the last."""
        remaining = steps - step
        return self.t_min + (self.t_max - self.t_min) * (remaining / steps)


def position_stats(logits: np.ndarray, t: float, u: float) -> tuple[float, int, int]:
    """Entropy (nats) of softmax(logits / t), the index of its argmax, and the
    index sampled with the uniform number `u` in [0, 1)."""
    z = logits.astype(np.float64) / t
    z -= z.max()
    e = np.exp(z)
    total = e.sum()
    p = e / total
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    cum = np.cumsum(e)
    sampled = int(np.searchsorted(cum, u * cum[-1], side="left"))
    return entropy, int(np.argmax(z)), min(sampled, logits.shape[0] - 1)


def rows_stats(rows: np.ndarray, t: float, u: np.ndarray, block: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """position_stats for every row of `rows` (n, V), `block` rows at a time
    (a 262k vocabulary in float64 is 2 MiB a row)."""
    n = rows.shape[0]
    entropy = np.empty(n)
    argmax = np.empty(n, dtype=np.int64)
    sampled = np.empty(n, dtype=np.int64)
    for a in range(0, n, block):
        z = rows[a : a + block].astype(np.float64) / t
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        total = e.sum(axis=1, keepdims=True)
        p = e / total
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(p > 0, p * np.log(p), 0.0)
        entropy[a : a + block] = -plogp.sum(axis=1)
        argmax[a : a + block] = z.argmax(axis=1)
        cum = np.cumsum(e, axis=1)
        for k in range(cum.shape[0]):
            s = int(np.searchsorted(cum[k], u[a + k] * cum[k, -1], side="left"))
            sampled[a + k] = min(s, rows.shape[1] - 1)
    return entropy, argmax, sampled


def accept(entropy: np.ndarray, bound: float) -> np.ndarray:
    """Entropy-bound acceptance: sorted by entropy (ties by position), a
    position is accepted when the entropies of the ones before it sum to at
    most `bound`; the lowest-entropy position is always accepted."""
    order = np.argsort(entropy, kind="stable")
    accepted = np.zeros(entropy.shape[0], dtype=bool)
    before = 0.0
    for i in order:
        if before <= bound:
            accepted[i] = True
        before += float(entropy[i])
    return accepted
