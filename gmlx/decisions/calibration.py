"""Contextual calibration (SPEC 4.5, `calibrate: "content_free"`).

A label read carries the model's bias for a label independent of the state
(a favourite letter, a habit of saying yes). Reading the same question with
states that say nothing measures that bias: the average label distribution over
a few content-free states is the prior; the real read's label probabilities
are divided by it and renormalized (Zhao et al. 2021, "Calibrate Before Use").

The prior depends only on what the prompt holds besides the state: the model
(file and profile), instructions, the question as listed (options, order,
labels), earlier answers, and for canvas reads the template and its seed. It
is kept in a bounded cache per reader, so a question set asked again costs
no prior reads.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Hashable, Sequence

from . import stats
from .types import Question, Read

MODES = ("none", "content_free")
# Content-free states: a placeholder, nothing at all, and a neutral sentence.
CONTENT_FREE_STATES = ("N/A", "", "[no content]")


@dataclass
class PriorCache:
    """LRU of priors: key -> label distribution in listed order."""

    max_entries: int = 4096

    def __post_init__(self) -> None:
        self._items: OrderedDict[Hashable, tuple[float, ...]] = OrderedDict()

    def get(self, key: Hashable) -> tuple[float, ...] | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Sequence[float]) -> None:
        self._items[key] = tuple(value)
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def cache_of(reader) -> PriorCache:
    """The reader's prior cache (made on first use)."""
    cache = getattr(reader, "prior_cache", None)
    if cache is None:
        cache = PriorCache()
        reader.prior_cache = cache
    return cache


def _question_key(q: Question) -> tuple:
    return (q.id, q.type, q.instructions, q.options, q.descriptions, q.labels)


def prior_key(reader, read: Read, q: Question) -> tuple:
    """Everything the prior of `q` (as listed in `read`) depends on."""
    base = (
        read.instructions,
        tuple((a.question.id, a.option) for a in read.answered),
        json.dumps(read.chat_template_kwargs, sort_keys=True, default=str),
        read.cache_salt,
    )
    if reader.strategy == "canvas":
        # One forward reads every slot of the template: the whole layout and
        # the seeded slot tokens shape each question's prior.
        base += (
            tuple(_question_key(x) for x in read.listed),
            tuple(_question_key(x) for x in read.questions),
            read.seed, read.total, read.steps, read.constrained,
        )
    return (getattr(reader, "model_key", id(reader)), reader.strategy, base, _question_key(q))


def calibrated(probs: Sequence[float], prior: Sequence[float]) -> list[float]:
    """probs / prior, renormalized. A zero prior entry keeps its probability
    out (it cannot be divided by) and a degenerate result falls back to probs."""
    weights = [p / q if q > 0 else 0.0 for p, q in zip(probs, prior)]
    total = math.fsum(weights)
    if not (total > 0 and math.isfinite(total)):
        return list(probs)
    return [w / total for w in weights]


@dataclass
class Priors:
    """Priors for the questions of one read, in listed order, and how many
    content-free reads it took to get them."""

    values: dict[str, tuple[float, ...]]
    cached: dict[str, bool]
    reads: int = 0
    evaluated_tokens: int = 0


def priors_for(reader, read: Read, checkpoint) -> Priors:
    """The prior of every question of `read` (each as listed there)."""
    cache = cache_of(reader)
    keys = {q.id: prior_key(reader, read, q) for q in read.questions}
    values: dict[str, tuple[float, ...]] = {}
    cached: dict[str, bool] = {}
    for q in read.questions:
        hit = cache.get(keys[q.id])
        if hit is not None:
            values[q.id] = hit
            cached[q.id] = True
    missing = [q for q in read.questions if q.id not in values]
    out = Priors(values, cached)
    if not missing:
        return out
    # Canvas: the whole template is one forward, so it is read whole.
    ask = read.questions if reader.strategy == "canvas" else tuple(missing)
    dists: dict[str, list[list[float]]] = {q.id: [] for q in missing}
    for state in CONTENT_FREE_STATES:
        checkpoint()
        result = reader.read(replace(read, state=state, questions=ask, thought=None, images=()))
        out.reads += 1
        out.evaluated_tokens += result.evaluated_tokens or 0
        for q in missing:
            dists[q.id].append(stats.label_probs(result.slots[q.id].logprobs))
    for q in missing:
        prior = stats.average(dists[q.id])
        cache.put(keys[q.id], prior)
        values[q.id] = tuple(prior)
        cached[q.id] = False
    return out
