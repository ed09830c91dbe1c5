"""Answer labels (SPEC 4.3) and the check that each one is a single token."""

from __future__ import annotations

import string
from typing import Callable, Iterable

from ..errors import ValidationError
from .types import Question

LETTERS = string.ascii_uppercase


def labels_for(qtype: str, count: int) -> tuple[str, ...]:
    """noul: yes/no; choice: A..; score: 1..9 up to nine levels, else A.."""
    if qtype == "noul":
        return ("yes", "no")
    if qtype == "score" and count <= 9:
        return tuple(str(i + 1) for i in range(count))
    return tuple(LETTERS[:count])


def check_label_tokens(questions: Iterable[Question], label_token: Callable[[str], int | None]) -> None:
    """Raise 422 naming the question and label when a label is not one token
    (`label_token` returns None) or two labels of a question share a token."""
    for q in questions:
        seen: dict[int, str] = {}
        for label in q.labels:
            token = label_token(label)
            if token is None:
                raise ValidationError(
                    f"question '{q.id}': label '{label}' is not a single token for this model",
                    param=f"questions.{q.id}",
                )
            if token in seen:
                raise ValidationError(
                    f"question '{q.id}': labels '{seen[token]}' and '{label}' are the same token for this model",
                    param=f"questions.{q.id}",
                )
            seen[token] = label
