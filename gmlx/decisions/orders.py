"""Option orders of a question's samples and the permuted question a read sees
(SPEC 4.5). The decision core permutes; read engines always list a question's
options in the order they are given, so every engine is balanced the same way.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Sequence

from .types import Question


def option_order(question: Question, sample: int, seed: int) -> list[int]:
    """The order sample `sample` lists a question's options in (SPEC 4.5):
    listed position k shows option order[k].

    Orders are balanced so that no option owes its answer to its place:
    - a choice takes cyclic rotations of the request order: sample 0 the
      request order, samples 1..n-1 the other n-1 rotations starting from a
      seeded one, so n samples put every option at every position exactly
      once; samples n..2n-1 do the same with the request order reversed, so
      2n samples read every listing a reversed request would read too (its
      answer cannot depend on which way round the options were sent); then
      the cycle repeats;
    - a noul alternates yes-first and no-first;
    - a score alternates forward and reversed listing.
    The seed and the question id pick the first rotation, so the questions of
    one read do not all move together.
    """
    n = len(question.options)
    order = list(range(n))
    if question.type != "choice":
        return order[::-1] if sample % 2 == 1 else order
    if n < 2:
        return order
    m = sample % distinct_orders(question)
    if m >= n:  # the reversed request order's rotations
        order, m = order[::-1], m - n
    if m == 0:
        return order
    start = random.Random(f"{seed}:{question.id}").randrange(n - 1)
    shift = 1 + (start + m - 1) % (n - 1)
    return order[shift:] + order[:shift]


def distinct_orders(question: Question) -> int:
    """How many distinct orders option_order cycles through: 2n for a choice of
    three or more options (rotations, then reversed rotations), 2 otherwise."""
    n = len(question.options)
    if question.type == "choice" and n >= 3:
        return 2 * n
    return min(2, n)


def listed(question: Question, order: Sequence[int]) -> Question:
    """The question as a read lists it in `order`: options and descriptions
    permuted. A choice's letters follow the position (A is always listed
    first); a noul's yes/no and a score's level labels follow their option,
    so the label still names the same answer."""
    order = list(order)
    if order == list(range(len(question.options))):
        return question
    labels = question.labels if question.type == "choice" else tuple(question.labels[i] for i in order)
    return replace(
        question,
        options=tuple(question.options[i] for i in order),
        descriptions=tuple(question.descriptions[i] for i in order),
        labels=labels,
        order=tuple(order),
    )


def order_of(question: Question) -> list[int]:
    return list(question.order) if question.order else list(range(len(question.options)))


def by_option(values: Sequence[float], order: Sequence[int]) -> list[float]:
    """Values a read returned in listed order, back in the question's option order."""
    out = [0.0] * len(order)
    for k, opt in enumerate(order):
        out[opt] = values[k]
    return out
