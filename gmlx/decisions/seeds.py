"""Seeds derived from the request seed, so every random choice of a decision
is fixed by (seed, where it happens) and nothing else."""

from __future__ import annotations

import hashlib


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
