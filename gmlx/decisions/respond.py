"""Step 5, respond: the passes of a decision -> the response body (SPEC 4.8).

Answers come from the final pass; usage and timing count the work of every
pass (both when think "auto" read twice).
"""

from __future__ import annotations

import time
import uuid

from . import aggregate
from .plan import Plan
from .read import Pass, calibrate_mode
from .types import Decision, DecisionSettings, Reader, Thought


def respond(
    decision: Decision,
    reader: Reader,
    plan: Plan,
    settings: DecisionSettings,
    model_id: str,
    passes: list[Pass],
    thought: Thought | None,
    think_auto: dict | None,
    start: float,
) -> dict:
    """The response body; `passes[-1]` is the pass that answers, `start` the
    decision's perf_counter start (for timing.total_ms)."""
    final = passes[-1]
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


def _answers(plan: Plan, run: Pass, settings: DecisionSettings) -> dict:
    out: dict = {}
    for q in plan.asked:
        if q.id in run.probs:
            out[q.id] = aggregate.answer(q, run.probs[q.id], settings.confidence)
        elif settings.skipped != "omit":
            out[q.id] = None
    return out


def _diagnostics(decision, reader, plan, run: Pass, thought, think_auto, passes) -> dict:
    # One chunk in all: plain values; stages, chunks or skips: one entry per chunk.
    per_chunk = len(plan.stages) > 1 or len(run.groups) > 1 or bool(run.skipped)
    n = [g.n for g in run.groups]  # distinct reads per chunk
    sample_tops = [aggregate.tops(g) for g in run.groups]
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
