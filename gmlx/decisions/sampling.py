"""The reads of one chunk: a fixed number of samples, or "auto" (SPEC 4.5)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import ServerError
from . import stats
from .types import Question, Read, ReadResult, Reader


@dataclass(frozen=True)
class Sample:
    """One question's result in one read."""

    probs: list[float]  # normalized over the labels, request option order
    mass: float
    argmax_is_label: bool

    @property
    def entropy(self) -> float:
        return stats.entropy(self.probs)


@dataclass
class ChunkReads:
    questions: tuple[Question, ...]
    policy: str  # "fixed", "auto" (one read was enough) or "auto-extended"
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    results: list[ReadResult] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.results)


def read_chunk(
    reader: Reader,
    read: Read,
    seed_of: Callable[[int], int],
    samples: int | str,
    auto_max: int,
    auto_threshold: float,
    checkpoint: Callable[[], None],
) -> ChunkReads:
    """Read `read` (its sample and seed are set here) as many times as the
    sample policy asks. `seed_of(k)` gives sample k's seed."""
    out = ChunkReads(questions=read.questions, policy="fixed" if samples != "auto" else "auto")
    count = samples if samples != "auto" else 1
    for k in range(count):
        _one(reader, replace(read, sample=k, seed=seed_of(k)), out, checkpoint)
    if samples == "auto" and auto_max > 1 and _unsure(out, auto_threshold):
        out.policy = "auto-extended"
        for k in range(1, auto_max):
            _one(reader, replace(read, sample=k, seed=seed_of(k)), out, checkpoint)
    return out


def _unsure(chunk: ChunkReads, threshold: float) -> bool:
    """Whether any label position of the first read is above the entropy threshold."""
    return any(chunk.samples[q.id][0].entropy > threshold for q in chunk.questions)


def _one(reader: Reader, read: Read, out: ChunkReads, checkpoint: Callable[[], None]) -> None:
    checkpoint()
    result = reader.read(read)
    for q in read.questions:
        slot = result.slots.get(q.id)
        if slot is None or len(slot.logprobs) != len(q.options):
            raise ServerError(f"the read engine returned no usable result for question '{q.id}'")
        sample = Sample(stats.label_probs(slot.logprobs), stats.label_mass(slot.logprobs), slot.argmax_is_label)
        if not all(math.isfinite(p) for p in sample.probs):
            # NaN or infinite logits (a broken model file, a backend fault): an
            # engine failure (500), never NaN answers sent as nulls with a 200.
            raise ServerError(f"the model returned non-finite logits (NaN or infinity) for question '{q.id}'")
        out.samples.setdefault(q.id, []).append(sample)
    out.results.append(result)
