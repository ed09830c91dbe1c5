"""Numbers over one question's labels: distributions, entropy, confidence.

All probabilities here are normalized over the question's labels only; the
mass the model put elsewhere in the vocabulary is reported separately.
"""

from __future__ import annotations

import math
from typing import Sequence


def label_probs(logprobs: Sequence[float]) -> list[float]:
    """Softmax over the label logprobs (the distribution among the labels)."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = math.fsum(weights)
    return [w / total for w in weights]


def label_mass(logprobs: Sequence[float]) -> float:
    """Probability the model put on the labels over its whole vocabulary."""
    return math.fsum(math.exp(lp) for lp in logprobs)


def entropy(probs: Sequence[float]) -> float:
    """Shannon entropy in nats."""
    return -math.fsum(p * math.log(p) for p in probs if p > 0.0)


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; ties go to the earliest (request order)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def average(dists: Sequence[Sequence[float]]) -> list[float]:
    """Mean of several distributions, renormalized so it sums to 1 exactly
    enough (float error of the mean would otherwise leak into answers)."""
    n = len(dists)
    mean = [math.fsum(col) / n for col in zip(*dists)]
    total = math.fsum(mean)
    return [p / total for p in mean]


def expected_index(probs: Sequence[float]) -> float:
    return math.fsum(i * p for i, p in enumerate(probs))


def stderr(values: Sequence[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n))."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(var / n)


def confidence(qtype: str, probs: Sequence[float], mode: str = "probability") -> float:
    """SPEC 4.8. A noul's confidence is max(P(yes), P(no)) in both modes."""
    top = max(probs)
    if mode != "typesafe" or qtype == "noul":
        return top
    n = len(probs)
    if qtype == "choice":
        return (top - 1.0 / n) / (1.0 - 1.0 / n)
    # score: spread around the mode relative to the spread of a uniform answer.
    mode_i = argmax(probs)
    center = (n - 1) / 2.0
    spread = math.fsum(p * abs(i - mode_i) for i, p in enumerate(probs))
    uniform = math.fsum(abs(i - center) for i in range(n)) / n
    return max(0.0, 1.0 - spread / uniform)
