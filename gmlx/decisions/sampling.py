"""The reads of one chunk: a fixed number of samples, or "auto" (SPEC 4.5).

Sample k lists every question in its balanced order (orders.py). A sample is
one distinct read: a next-token question whose order sample k repeats (a
noul's third sample, a choice's (n+1)-th) is not read again and does not
count again; a canvas read is distinct by its seed too. Probabilities are
mapped back to option names before anything is averaged, and with
`calibrate: "content_free"` each read is divided by the prior of its order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import ServerError
from . import calibration, stats
from .orders import by_option, listed, option_order, order_of
from .types import Question, Read, ReadResult, Reader


@dataclass(frozen=True)
class Sample:
    """One question's result in one distinct read, in request option order."""

    probs: list[float]  # normalized over the labels (calibrated when asked)
    mass: float
    argmax_is_label: bool
    raw: list[float] | None = None  # before calibration
    prior: list[float] | None = None

    @property
    def entropy(self) -> float:
        return stats.entropy(self.probs)


@dataclass
class ChunkReads:
    questions: tuple[Question, ...]
    policy: str  # "fixed", "auto" (one read was enough) or "auto-extended"
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    results: list[ReadResult] = field(default_factory=list)
    # Per distinct read: the questions it answered (id -> its Sample).
    per_read: list[dict[str, Sample]] = field(default_factory=list)
    asked: int = 0  # samples the policy asked for (repeats included)
    prior_reads: int = 0
    prior_cached: dict[str, bool] = field(default_factory=dict)
    prior_tokens: int = 0
    _seen: dict[str, set] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """Distinct reads done."""
        return len(self.results)


def read_chunk(
    reader: Reader,
    read: Read,
    seed_of: Callable[[int], int],
    samples: int | str,
    auto_max: int,
    auto_threshold: float,
    checkpoint: Callable[[], None],
    calibrate: str = "none",
) -> ChunkReads:
    """Read `read` as many times as the sample policy asks. `seed_of(k)` gives
    sample k's seed; sample 0's seed also picks the chunk's first rotation."""
    out = ChunkReads(questions=read.questions, policy="fixed" if samples != "auto" else "auto")
    count = samples if samples != "auto" else 1
    for k in range(count):
        _one(reader, read, k, seed_of, out, checkpoint, calibrate)
    if samples == "auto" and auto_max > 1 and _unsure(out, auto_threshold):
        out.policy = "auto-extended"
        for k in range(1, auto_max):
            _one(reader, read, k, seed_of, out, checkpoint, calibrate)
    return out


def _unsure(chunk: ChunkReads, threshold: float) -> bool:
    """Whether any label position of the first read is above the entropy threshold."""
    return any(chunk.samples[q.id][0].entropy > threshold for q in chunk.questions)


def _one(reader: Reader, read: Read, k: int, seed_of, out: ChunkReads, checkpoint, calibrate: str) -> None:
    out.asked += 1
    seeded = reader.strategy == "canvas"  # a canvas read's slot tokens come from its seed
    lq = {q.id: listed(q, option_order(q, k, seed_of(0))) for q in read.questions}
    keys = {q.id: ((k,) if seeded else ()) + tuple(order_of(lq[q.id])) for q in read.questions}
    new = [q for q in read.questions if keys[q.id] not in out._seen.setdefault(q.id, set())]
    if not new:
        return
    # A canvas template writes every question of the chunk; next-token reads only the new ones.
    ask = read.questions if seeded else tuple(new)
    this = replace(
        read,
        sample=k,
        seed=seed_of(k),
        questions=tuple(lq[q.id] for q in ask),
        listed=tuple(lq.get(x.id, x) for x in read.listed),
    )
    checkpoint()
    result = reader.read(this)
    priors = calibration.priors_for(reader, replace(this, questions=tuple(lq[q.id] for q in new)), checkpoint) \
        if calibrate == "content_free" else None
    mine: dict[str, Sample] = {}
    for q in new:
        slot = result.slots.get(q.id)
        if slot is None or len(slot.logprobs) != len(q.options):
            raise ServerError(f"the read engine returned no usable result for question '{q.id}'")
        order = order_of(lq[q.id])
        logprobs = by_option(slot.logprobs, order)
        raw = stats.label_probs(logprobs)
        if not all(math.isfinite(p) for p in raw):
            # NaN or infinite logits (a broken model file, a backend fault): an
            # engine failure (500), never NaN answers sent as nulls with a 200.
            raise ServerError(f"the model returned non-finite logits (NaN or infinity) for question '{q.id}'")
        if priors is not None:
            prior = by_option(priors.values[q.id], order)
            sample = Sample(calibration.calibrated(raw, prior), stats.label_mass(logprobs), slot.argmax_is_label,
                            raw=raw, prior=prior)
            out.prior_cached[q.id] = out.prior_cached.get(q.id, True) and priors.cached[q.id]
        else:
            sample = Sample(raw, stats.label_mass(logprobs), slot.argmax_is_label)
        out.samples.setdefault(q.id, []).append(sample)
        out._seen[q.id].add(keys[q.id])
        mine[q.id] = sample
    if priors is not None:
        out.prior_reads += priors.reads
        out.prior_tokens += priors.evaluated_tokens
    out.results.append(result)
    out.per_read.append(mine)
