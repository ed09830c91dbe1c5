"""The decision core's entry points for the server and the CLI: the flow in one place.

    decision = parse_decision(body, settings)      # 1. parse.py: 422/400
    admit(decision, reader, settings)              # 2. checks before queueing
    response = decide(decision, reader, settings, model_id, checkpoint)
        # 2. plan.py -> 3. read.py (passes) -> 4. aggregate.py -> 5. respond.py
"""

from __future__ import annotations

import time
from dataclasses import replace

from .aggregate import confidences
from .plan import check_rows, make_plan
from .read import Pass, run_pass
from .respond import respond
from .seeds import thought_seed
from .types import Checkpoint, Decision, DecisionSettings, Reader, Thought

# Fields that only shape canvas reads; a next-token model ignores them.
CANVAS_ONLY = ("steps", "chunk_rows", "chunk_prompt", "sequential")


def unsupported(decision: Decision, reader: Reader) -> list[str]:
    """Fields the body set that this reader will not use (beyond those
    parse_decision already found), for the ignoring-parameters warning."""
    out: list[str] = []
    if not reader.can_think and "think" in decision.given and decision.think != 0:
        out.append("think")
        if decision.think == "auto":
            out += [k for k in ("think_threshold", "think_budget") if k in decision.given]
    if reader.strategy == "next-token":
        out += [k for k in CANVAS_ONLY if k in decision.given]
    return out


def served(settings: DecisionSettings, reader: Reader) -> DecisionSettings:
    """The settings as this reader serves them: a canvas model may hold fewer
    canvas rows (its `diffusion.canvas_length`) than the server offers, and
    chunks must be planned for the canvas the reads will really have."""
    rows = getattr(reader, "canvas", None)
    if isinstance(rows, int) and 0 < rows < settings.canvas:
        return replace(settings, canvas=rows)
    return settings


def admit(decision: Decision, reader: Reader, settings: DecisionSettings | None = None) -> None:
    """Admission checks before queueing: the reader's own (labels, templates,
    context), the canvas rows when settings are given, and the reader-specific
    unused fields added to `decision.ignored` (log it after this call)."""
    reader.check(decision)
    if settings is not None:
        check_rows(decision, reader, served(settings, reader))
    _note_unsupported(decision, reader)


def decide(
    decision: Decision,
    reader: Reader,
    settings: DecisionSettings,
    model_id: str,
    checkpoint: Checkpoint | None = None,
) -> dict:
    """Answer a validated decision; the response body of SPEC 4.8."""
    start = time.perf_counter()
    check = checkpoint or (lambda: None)
    _note_unsupported(decision, reader)
    # A reader that keeps state (a cached prefix) starts every decision clean,
    # so no decision's numbers depend on the one before it.
    reset = getattr(reader, "reset", None)
    if reset is not None:
        reset()
    settings = served(settings, reader)
    plan = make_plan(decision, settings)
    think = decision.think if reader.can_think else 0

    first: Pass | None = None
    thought: Thought | None = None
    if think == "auto":
        first = run_pass(decision, reader, settings, plan, None, check)
        confs = confidences(plan.asked, first.probs, settings.confidence)
        unsure = [qid for qid, c in confs.items() if c < decision.think_threshold]
        final = first
        if unsure:
            check()
            thought = reader.think(decision, decision.think_budget, thought_seed(decision.seed))
            final = run_pass(decision, reader, settings, plan, thought, check)
        think_auto = {
            "threshold": decision.think_threshold,
            "budget": decision.think_budget,
            "thought": thought is not None,
            "unsure": unsure,
            "confidences": confs,
            "reads": first.reads,
            "ms": first.ms,
        }
    else:
        if think > 0:
            check()
            thought = reader.think(decision, think, thought_seed(decision.seed))
        final = run_pass(decision, reader, settings, plan, thought, check)
        think_auto = None

    # usage counts the work done: both passes when think "auto" ran twice.
    passes = [final] if first is None or first is final else [first, final]
    return respond(decision, reader, plan, settings, model_id, passes, thought, think_auto, start)


def _note_unsupported(decision: Decision, reader: Reader) -> None:
    for name in unsupported(decision, reader):
        if name not in decision.ignored:
            decision.ignored.append(name)
