"""Seeds derived from the request seed, so every random choice of a decision
is fixed by (seed, where it happens) and nothing else."""

from __future__ import annotations

import hashlib
import random

from .types import Question


def derive_seed(seed: int, *where: object) -> int:
    """A 31-bit seed for one place in the decision (e.g. stage, chunk, sample).
    31 bits because llama.cpp and numpy both take it as a non-negative int32."""
    text = ":".join(str(part) for part in (seed, *where))
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def sample_seed(seed: int, stage: int, chunk: int, sample: int) -> int:
    return derive_seed(seed, "read", stage, chunk, sample)


def thought_seed(seed: int) -> int:
    return derive_seed(seed, "think")


def option_order(question: Question, sample: int, seed: int) -> list[int]:
    """The order a next-token read lists a question's options in: request order
    for sample 0, a seeded permutation for later samples of a choice.

    Scores keep their order (levels are ordered), and nouls too (their labels
    are the words yes/no, which carry the meaning, not a position). Position k
    of the prompt shows option order[k] with label question.labels[k]; a reader
    maps the logprob at position k back to option order[k]. The question id is
    mixed in so questions of one read get different permutations.
    """
    order = list(range(len(question.options)))
    if sample == 0 or question.type != "choice":
        return order
    random.Random(f"{seed}:{question.id}").shuffle(order)
    return order
