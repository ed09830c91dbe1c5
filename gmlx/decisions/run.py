"""Entry points of the decision core for the server and the CLI.

    decision = parse_decision(body, settings)      # request.py, 422/400
    admit(decision, reader, settings)              # before queueing
    response = decide(decision, reader, settings, model_id, checkpoint)
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from . import answers
from .plan import Plan, check_rows, make_plan
from .runner import Pass, calibrate_mode, confidences, run_pass, tops
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
        confs = confidences(plan, first, settings.confidence)
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
    diagnostics = _diagnostics(decision, reader, plan, final, thought, think_auto, passes)
    diagnostics["timing"]["total_ms"] = (time.perf_counter() - start) * 1000.0
    answers_out = _answers(plan, final, settings)
    # A strategy may define its own confidence (Winnow: the winning label's
    # full-vocabulary probability); the engine says so through finish_answers.
    finish = getattr(reader, "finish_answers", None)
    if callable(finish):
        answers_out = finish(answers_out)
    usage = {
        "input_tokens": max(p.prompt_tokens for p in passes),
        "output_tokens": sum(p.output_tokens for p in passes) + (thought.tokens if thought else 0),
        # Prompt tokens an earlier decision had evaluated (cross-request prefix cache).
        "cached_tokens": sum(p.cached_tokens for p in passes),
    }
    if diagnostics["calibrate"] != "none":
        # Content-free reads this decision paid for (0 when every prior was cached).
        usage["prior_reads"] = sum(p.prior_reads for p in passes)
    return {
        "id": f"decision-{uuid.uuid4().hex}",
        "object": "structured_decision",
        "created": int(time.time()),
        "model": model_id,
        "answers": answers_out,
        "usage": usage,
        "diagnostics": diagnostics,
    }


def _note_unsupported(decision: Decision, reader: Reader) -> None:
    for name in unsupported(decision, reader):
        if name not in decision.ignored:
            decision.ignored.append(name)


def _answers(plan: Plan, run: Pass, settings: DecisionSettings) -> dict:
    out: dict = {}
    for q in plan.asked:
        if q.id in run.probs:
            out[q.id] = answers.answer(q, run.probs[q.id], settings.confidence)
        elif settings.skipped != "omit":
            out[q.id] = None
    return out


def _diagnostics(decision, reader, plan, run: Pass, thought, think_auto, passes) -> dict:
    # One chunk in all: plain values; stages, chunks or skips: one entry per chunk.
    per_chunk = len(plan.stages) > 1 or len(run.groups) > 1 or bool(run.skipped)
    n = [g.n for g in run.groups]  # distinct reads per chunk
    sample_tops = [tops(g) for g in run.groups]
    policy = [g.policy for g in run.groups]
    samples = {"n": n, "tops": sample_tops, "policy": policy}
    if not per_chunk:
        samples = {"n": n[0], "tops": sample_tops[0], "policy": policy[0]}
    out = {
        "questions": {q.id: run.diagnostics[q.id] for q in plan.asked if q.id in run.diagnostics},
        "stages": [[q.id for q in stage] for stage in plan.stages],
        "chunks": run.chunks,
        "skipped": run.skipped,
        "chunk_prompt": plan.chunk_prompt,
        "sequential": decision.sequential,
        # How later reads saw earlier answers: canvas reads write them into the
        # reply before the canvas ("prefill"); next-token reads state them in
        # the user message ("prompt").
        "conditioning": (("prefill" if reader.strategy == "canvas" else "prompt") if run.conditioned else None),
        "steps": decision.steps,
        "thought": _thought(thought),
        "samples": samples,
        "timing": {"total_ms": 0.0, "reads": sum(p.reads for p in passes), "queue_ms": 0,
                   "prior_reads": sum(p.prior_reads for p in passes)},
        "prompt_tokens": run.prompt_tokens,
        # Tokens llama.cpp evaluated (shared prefixes once, priors included).
        "evaluated_tokens": sum(p.evaluated_tokens for p in passes),
        "calibrate": calibrate_mode(decision, reader),
        "strategy": reader.strategy,
        "ignored": list(decision.ignored),
    }
    if think_auto is not None:
        out["think_auto"] = think_auto
    # What the engine itself reports (e.g. DiffusionGemma's self-conditioning).
    extra = getattr(reader, "diagnostics", None)
    if callable(extra):
        for key, value in (extra() or {}).items():
            out.setdefault(key, value)
    return out


def _thought(thought: Thought | None) -> dict | None:
    if thought is None:
        return None
    return {"tokens": thought.tokens, "closed": thought.closed, "ms": thought.ms, "text": thought.text}
