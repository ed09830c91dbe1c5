"""Step 3, read: one pass over a plan - stages in order, skipping, chunks, samples.

Each chunk's distinct reads come from `sampling.read_chunk`; its answers are
aggregated (`aggregate.py`) right away, because a later stage's `ask_if` and
prompt depend on them. think "auto" runs two passes (without and with a
thought); everything a pass produces is collected in a Pass so the caller can
pick which one answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from . import aggregate, stats
from .plan import Plan, chunk_stage, skip_reason
from .sampling import ChunkReads, read_chunk
from .seeds import sample_seed
from .types import Answered, Decision, DecisionSettings, Read, Reader, Thought


@dataclass
class Pass:
    probs: dict[str, list[float]] = field(default_factory=dict)  # averaged, per read question
    diagnostics: dict[str, dict] = field(default_factory=dict)
    skipped: dict[str, dict] = field(default_factory=dict)
    chunks: list[list[list[str]]] = field(default_factory=list)  # per stage: chunk id lists
    groups: list[ChunkReads] = field(default_factory=list)  # every chunk, stage by stage
    conditioned: bool = False  # some read saw earlier answers
    ms: float = 0.0

    @property
    def reads(self) -> int:
        return sum(g.n for g in self.groups)

    @property
    def prompt_tokens(self) -> int:
        return max((r.prompt_tokens for g in self.groups for r in g.results), default=0)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for g in self.groups for r in g.results)

    @property
    def evaluated_tokens(self) -> int:
        return sum((r.evaluated_tokens or 0) for g in self.groups for r in g.results) + sum(
            g.prior_tokens for g in self.groups
        )

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for g in self.groups for r in g.results)

    @property
    def prior_reads(self) -> int:
        return sum(g.prior_reads for g in self.groups)


def run_pass(
    decision: Decision,
    reader: Reader,
    settings: DecisionSettings,
    plan: Plan,
    thought: Thought | None,
    checkpoint: Callable[[], None],
) -> Pass:
    start = time.perf_counter()
    out = Pass()
    calibrate = calibrate_mode(decision, reader)
    chosen: dict[str, int] = {}  # answered id -> top option index
    for s, stage in enumerate(plan.stages):
        to_read = []
        for q in stage:
            names = {d: decision.question(d).options[i] for d, i in chosen.items()}
            reason = skip_reason(q, names, out.skipped)
            if reason is None:
                to_read.append(q)
            else:
                out.skipped[q.id] = reason
        chunks = chunk_stage(plan, tuple(to_read), reader)
        out.chunks.append([[q.id for q in c] for c in chunks])
        # Without `sequential`, chunks of one stage see only earlier stages.
        visible = dict(chosen)
        for c, chunk in enumerate(chunks):
            seen = _answered(plan, chosen if decision.sequential else visible)
            out.conditioned |= bool(seen)
            base = Read(
                state=decision.state,
                instructions=decision.instructions,
                questions=chunk,
                listed=plan.listed(chunk),
                answered=seen,
                sample=0,
                seed=0,
                total=plan.total,
                steps=decision.steps,
                thought=thought,
                chat_template_kwargs=decision.chat_template_kwargs,
                cache_salt=decision.cache_salt,
                constrained=settings.constrained,
                images=decision.images,
            )
            group = read_chunk(
                reader,
                base,
                lambda k, s=s, c=c: sample_seed(decision.seed, s, c, k),
                decision.samples,
                decision.auto_max,
                decision.auto_threshold,
                checkpoint,
                calibrate,
            )
            out.groups.append(group)
            for q in chunk:
                samples = group.samples[q.id]
                probs = aggregate.averaged(samples)
                out.probs[q.id] = probs
                out.diagnostics[q.id] = aggregate.diagnostics(samples, probs)
                cal = aggregate.calibration(q, samples, group.prior_cached.get(q.id, False))
                if cal is not None:
                    out.diagnostics[q.id]["calibration"] = cal
                chosen[q.id] = stats.argmax(probs)
    out.ms = (time.perf_counter() - start) * 1000.0
    return out


def _answered(plan: Plan, chosen: dict[str, int]) -> tuple[Answered, ...]:
    # Request order, so a prompt does not depend on which chunk finished first.
    return tuple(Answered(q, chosen[q.id]) for q in plan.asked if q.id in chosen)


def calibrate_mode(decision: Decision, reader: Reader) -> str:
    """The request's `calibrate`, else the model's or profile's default."""
    return decision.calibrate or getattr(reader, "calibrate", None) or "none"
