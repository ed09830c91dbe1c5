"""Step 4, aggregate: a question's distinct reads -> its answer and diagnostics (SPEC 4.8).

The reads arrive already mapped back to option names (sampling.py); here they
are averaged, summarized (stderr, agreement over distinct reads only) and put
in each question type's answer shape. The label math itself is in stats.py.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from . import stats
from .sampling import ChunkReads, Sample
from .types import Question


def averaged(samples: Sequence[Sample]) -> list[float]:
    return stats.average([s.probs for s in samples])


def answer(question: Question, probs: Sequence[float], mode: str) -> dict:
    """The answer object of one question, in its type's shape."""
    conf = stats.confidence(question.type, probs, mode)
    if question.type == "noul":
        return {
            "type": "noul",
            "noul": probs[0],
            "probabilities": {"yes": probs[0], "no": probs[1]},
            "confidence": conf,
        }
    if question.type == "choice":
        return {
            "type": "choice",
            "choice": question.options[stats.argmax(probs)],
            "probabilities": dict(zip(question.options, probs)),
            "confidence": conf,
        }
    keys = [str(i) for i in range(len(probs))]
    return {
        "type": "score",
        "score": stats.expected_index(probs),
        "legend": dict(zip(keys, question.options)),
        "probabilities": dict(zip(keys, probs)),
        "confidence": conf,
    }


def diagnostics(samples: Sequence[Sample], probs: Sequence[float]) -> dict:
    """label_mass, argmax_is_label and entropy; stderr and agreement of the top
    answer when there is more than one sample."""
    n = len(samples)  # distinct reads (sampling.py never records a repeat)
    out: dict = {
        "label_mass": math.fsum(s.mass for s in samples) / n,
        "argmax_is_label": all(s.argmax_is_label for s in samples),
        "entropy": stats.entropy(probs),
        "reads": n,
    }
    if n > 1:
        top = stats.argmax(probs)
        out["stderr"] = stats.stderr([s.probs[top] for s in samples])
        out["agreement"] = sum(stats.argmax(s.probs) == top for s in samples) / n
    return out


def calibration(question: Question, samples: Sequence[Sample], cached: bool) -> dict | None:
    """The prior (averaged over the question's orders, by option name), the
    uncalibrated answer distribution, and whether the prior came from the cache."""
    priors = [s.prior for s in samples if s.prior is not None]
    if not priors:
        return None
    return {
        "mode": "content_free",
        "prior": dict(zip(_keys(question), stats.average(priors))),
        "uncalibrated": dict(zip(_keys(question), stats.average([s.raw for s in samples if s.raw is not None]))),
        "cached": cached,
    }


def _keys(question: Question) -> list[str]:
    if question.type == "score":
        return [str(i) for i in range(len(question.options))]
    return list(question.options)


def top(question: Question, sample: Sample) -> dict:
    """One sample's top label, as the template writes it (request-order label)."""
    i = stats.argmax(sample.probs)
    return {"label": question.labels[i], "p": sample.probs[i], "entropy": sample.entropy}


def tops(group: ChunkReads) -> list[dict]:
    """Per distinct read: question id -> its top label, probability and entropy
    (the questions that read answered)."""
    by_id = {q.id: q for q in group.questions}
    return [{qid: top(by_id[qid], s) for qid, s in read.items()} for read in group.per_read]


def confidences(asked: Iterable[Question], probs: Mapping[str, Sequence[float]], mode: str) -> dict[str, float]:
    """Confidence of every answered question, in request order."""
    return {q.id: stats.confidence(q.type, probs[q.id], mode) for q in asked if q.id in probs}
