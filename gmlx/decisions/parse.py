"""A decision request body (SPEC 4.1) -> Decision, defaults applied.

Every failure is a 422 ValidationError whose message names the field (or the
question) and the rule, with `param` set to the field's path; `images` is the
one 400. JSON null means "absent" for every optional field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..errors import InvalidRequest, ValidationError
from .fields import describe, fail, is_int, is_number, want_bool, want_int, want_str
from .questions import parse_questions
from .types import Decision, DecisionSettings, Question

KNOWN_FIELDS = (
    "model", "profile", "state", "questions", "instructions", "seed", "samples", "auto_max",
    "auto_threshold", "steps", "think", "think_threshold", "think_budget", "ask", "chunk_rows",
    "chunk_prompt", "sequential", "chat_template_kwargs", "cache_salt", "images",
    "calibrate", "audio", "videos",
)  # fmt: skip
REQUIRED_FIELDS = ("state", "questions")
MIN_STEPS, MAX_STEPS = 1, 8
MAX_THINK = 4096
MIN_CHUNK_ROWS = 8
CHUNK_PROMPTS = ("own", "shared")
# A request's defaults are the Decision's field defaults: one source.
_DEFAULT = {f.name: f.default for f in dataclasses.fields(Decision)}
# Names the server itself gives every chat template render (gmlx.engine.chat).
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def parse_decision(body: Any, settings: DecisionSettings) -> Decision:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    images = _check_images(body.get("images"), body)

    state = _state(body)
    questions = parse_questions(body.get("questions"), settings.max_questions)
    # Only non-null values count: null means the field was not sent.
    given = {k: v for k, v in body.items() if k in KNOWN_FIELDS and k not in REQUIRED_FIELDS and v is not None}

    think = _think(given.get("think", settings.think))
    decision = Decision(
        state=state,
        questions=questions,
        model=_opt_str(given, "model"),
        profile=_opt_str(given, "profile"),
        instructions=_opt_str(given, "instructions"),
        seed=want_int(given["seed"], "seed", "seed") if "seed" in given else _DEFAULT["seed"],
        samples=_samples(given.get("samples", _DEFAULT["samples"]), settings.max_samples),
        auto_max=_auto_max(given.get("auto_max", settings.auto_max), settings.max_samples),
        auto_threshold=_auto_threshold(given.get("auto_threshold", _DEFAULT["auto_threshold"])),
        steps=_steps(given.get("steps", _DEFAULT["steps"])),
        think=think,
        # Used (and so checked) only by think "auto"; otherwise ignored with the warning below.
        think_threshold=_unused_ok(_think_threshold, given.get("think_threshold", settings.think_threshold),
                                   think == "auto", settings.think_threshold),
        think_budget=_think_budget(given.get("think_budget", settings.think_budget)),
        ask=_ask(given.get("ask"), questions),
        chunk_rows=_chunk_rows(given.get("chunk_rows")),
        chunk_prompt=_chunk_prompt(given.get("chunk_prompt", _DEFAULT["chunk_prompt"])),
        sequential=want_bool(given["sequential"], "sequential", "sequential") if "sequential" in given else False,
        chat_template_kwargs=_kwargs(given.get("chat_template_kwargs")),
        cache_salt=_opt_str(given, "cache_salt"),
        calibrate=_calibrate(given.get("calibrate")),
        given=frozenset(given),
    )
    if images:
        # Decoded images ride on the decision (engine/media.py); readers without
        # a projector refuse them at admission.
        decision.images = images
    decision.ignored = [k for k in body if k not in KNOWN_FIELDS]
    if think != "auto":
        decision.ignored += [k for k in ("think_threshold", "think_budget") if k in given]
    return decision


def _check_images(images: Any, body: dict | None = None) -> tuple:
    # Media (gmlx/engine/media.py): audio/videos 400; images checked (400/413),
    # then refused until a projector reads them; an empty container is harmless.
    from ..engine.media import check_request_media

    return check_request_media({**(body or {}), "images": images})


def _state(body: dict) -> str:
    if "state" not in body:
        raise fail("state is required (a string, or any JSON value)", "state")
    state = body["state"]
    if isinstance(state, str):
        return state
    # JSON null is a JSON value too: its text "null" (a Liquid read then leaves
    # the images, or the question alone, as the prompt; engine/liquid.py).
    # Non-string states reach the model as JSON text with their characters kept.
    return json.dumps(state, ensure_ascii=False)


def _unused_ok(parse, value: Any, used: bool, default: Any) -> Any:
    """A field that only matters in some modes: checked when used; when unused a
    bad value is ignored (the body is warned about it) rather than refused."""
    if used:
        return parse(value)
    try:
        return parse(value)
    except ValidationError:
        return default


def _calibrate(value: Any) -> str | None:
    from .calibration import MODES

    if value is None:
        return None
    if not isinstance(value, str) or value not in MODES:
        raise fail(f'calibrate must be "none" or "content_free", got {_show(value)}', "calibrate")
    return value


def _opt_str(given: dict, name: str) -> str | None:
    return want_str(given[name], name, name) if name in given else None


def _samples(value: Any, max_samples: int) -> int | str:
    if value == "auto" and isinstance(value, str):
        return "auto"
    if not is_int(value) or value < 1:
        raise fail(f'samples must be an integer >= 1 or "auto", got {_show(value)}', "samples")
    return min(int(value), max_samples)


def _auto_max(value: Any, max_samples: int) -> int:
    n = want_int(value, "auto_max", "auto_max")
    if n < 1:
        raise fail(f"auto_max must be >= 1, got {n}", "auto_max")
    return min(n, max_samples)


def _auto_threshold(value: Any) -> float:
    if not is_number(value) or value < 0:
        raise fail(f"auto_threshold must be a number >= 0 (nats), got {_show(value)}", "auto_threshold")
    return float(value)


def _steps(value: Any) -> int:
    # Out-of-range step counts are clamped, not refused (SPEC 4.1).
    return max(MIN_STEPS, min(MAX_STEPS, want_int(value, "steps", "steps")))


def _think(value: Any) -> int | str:
    if isinstance(value, str) and value == "auto":
        return "auto"
    if not is_int(value) or not 0 <= value <= MAX_THINK:
        raise fail(f'think must be an integer 0..{MAX_THINK} or "auto", got {_show(value)}', "think")
    return int(value)


def _think_threshold(value: Any) -> float:
    if not is_number(value) or not 0 < value <= 1:
        raise fail(f"think_threshold must be a number in (0, 1], got {_show(value)}", "think_threshold")
    return float(value)


def _think_budget(value: Any) -> int:
    n = want_int(value, "think_budget", "think_budget")
    if not 1 <= n <= MAX_THINK:
        raise fail(f"think_budget must be 1..{MAX_THINK}, got {n}", "think_budget")
    return n


def _ask(value: Any, questions: tuple[Question, ...]) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise fail(f"ask must be a non-empty list of question ids, got {_show(value)}", "ask")
    by_id = {q.id: q for q in questions}
    ids: list[str] = []
    for qid in value:
        if not isinstance(qid, str):
            raise fail(f"ask must list question ids (strings), got {describe(qid)}", "ask")
        if qid not in by_id:
            raise fail(f"ask names unknown question '{qid}'", "ask")
        if qid not in ids:
            ids.append(qid)
    # Checking direct dependencies of every asked id covers the transitive ones.
    for qid in ids:
        for dep in by_id[qid].depends_on:
            if dep not in ids:
                raise fail(f"ask includes '{qid}' but not '{dep}', which '{qid}' depends on", "ask")
    return tuple(ids)


def _chunk_rows(value: Any) -> int | None:
    if value is None:
        return None
    n = want_int(value, "chunk_rows", "chunk_rows")
    if n < MIN_CHUNK_ROWS:
        raise fail(f"chunk_rows must be >= {MIN_CHUNK_ROWS}, got {n}", "chunk_rows")
    return n


def _chunk_prompt(value: Any) -> str:
    if value not in CHUNK_PROMPTS or not isinstance(value, str):
        raise fail(f'chunk_prompt must be "own" or "shared", got {_show(value)}', "chunk_prompt")
    return value


def _kwargs(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail(f"chat_template_kwargs must be an object, got {describe(value)}", "chat_template_kwargs")
    taken = [k for k in RESERVED_TEMPLATE_KWARGS if k in value]
    if taken:
        raise fail(
            f"chat_template_kwargs cannot set {', '.join(taken)}: the server passes those to the chat template itself",
            f"chat_template_kwargs.{taken[0]}",
        )
    return value


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else describe(value)
