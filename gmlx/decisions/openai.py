"""OpenAI's Decisions API (SPEC 8) on top of the decision core: pure Python.

    req = parse_openai(body, settings)     # 400 OpenAIRequestError naming the rule
    decision = req.decision(settings)      # the /v1/systemone Decision (SPEC 4.1)
    ... admit / queue / decide exactly as /v1/systemone ...
    reply = req.response(result)           # SPEC 4.8 response -> OpenAI's shape

An OpenAI request becomes the equivalent /v1/systemone body (`req.systemone`):
question i gets the id `q{i}`; a predicate is a `noul`, a choice a `choice`
whose option names are the values' texts, a score a `score` over the level
labels. The decision then runs through the same admission, queue and reads as
any other, and its answers are mapped back, in question order, with the
original typed choice values.

Choice option names are what the next-token prompt shows the model
(`A. name: description`), so they are the values themselves: a string as it is,
a boolean as `true`/`false`. Only where two values would show the same text
(the boolean true beside the string "true", or an empty string) do the
colliding ones get a marked name: `true (boolean)` / `"true" (text)`. The
mapping back goes through the option's index, never its text, so it is exact.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import GmlxError, InvalidRequest
from .questions import MAX_ALTERNATIVES, MIN_ALTERNATIVES
from .parse import parse_decision
from .fields import describe
from .types import Decision, DecisionSettings

# `calibrate` is gmlx's extension (SPEC 4.5); the rest are OpenAI's.
TOP_FIELDS = ("model", "input", "questions", "safety_identifier", "prompt_cache_key", "prompt_cache_options", "calibrate")
QUESTION_FIELDS = {
    "predicate": ("type", "instructions", "name"),
    "choice": ("type", "instructions", "name", "choices"),
    "score": ("type", "instructions", "name", "levels"),
}
TO_SYSTEMONE_TYPE = {"predicate": "noul", "choice": "choice", "score": "score"}
MESSAGE_FIELDS = ("role", "content", "type")
TEXT_PART_FIELDS = ("type", "text", "prompt_cache_breakpoint")
CHOICE_FIELDS = ("value", "description")
LEVEL_FIELDS = ("label", "description")
CACHE_OPTION_FIELDS = ("mode", "ttl")
# Input items of OpenAI's API that carry tool calls and their outputs.
TOOL_ITEMS = ("function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")

MAX_CHOICES = MAX_ALTERNATIVES  # OpenAI allows 255; gmlx labels options A..Z
MIN_CHOICES = MIN_ALTERNATIVES
MIN_LEVELS, MAX_LEVELS = 2, 10
MAX_SAFETY_IDENTIFIER = 128
# Thinking is off for these reads whatever server.systemone.think says: the
# API has no field to ask for it and its answers should not wait for a thought.
THINK = 0


class OpenAIRequestError(InvalidRequest):
    """A 400 on /v1/decisions in OpenAI's error envelope: `param` points at the
    field (`questions[2].choices`), `code` is a string naming the rule (OpenAI's
    codes are strings, such as `unknown_parameter`)."""

    def __init__(self, message: str, param: str | None, code: str):
        super().__init__(message, param=param)
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _err(message: str, param: str | None, code: str = "invalid_value") -> OpenAIRequestError:
    return OpenAIRequestError(message, param, code)


def _kind(value: Any) -> str:
    return describe(value, openai=True)


@dataclass(frozen=True)
class AskedQuestion:
    """One question as asked, for shaping its answer."""

    id: str  # the systemone id, q0..
    type: str  # predicate | choice | score
    name: str | None
    # choice: the typed values in request order; score: the level labels.
    values: tuple[Any, ...] = ()
    # choice: the option names the systemone body uses, one per value.
    option_names: tuple[str, ...] = ()
    # score: one description per level (None where absent).
    level_descriptions: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class OpenAIDecision:
    """A validated /v1/decisions request and its /v1/systemone equivalent."""

    systemone: dict[str, Any]
    questions: tuple[AskedQuestion, ...]
    model: str | None
    safety_identifier: str | None
    # Fields accepted with no effect (logged once, like the systemone warning).
    no_effect: tuple[str, ...] = ()

    def decision(self, settings: DecisionSettings) -> Decision:
        """The Decision /v1/systemone would build from `systemone`, with the score
        level descriptions (which that body cannot carry) on its questions."""
        decision = parse_decision(self.systemone, settings)
        described = {q.id: q.level_descriptions for q in self.questions if any(q.level_descriptions)}
        if described:
            decision.questions = tuple(
                dataclasses.replace(q, descriptions=described[q.id]) if q.id in described else q
                for q in decision.questions
            )
        return decision

    def response(self, result: dict) -> dict:
        """A SPEC 4.8 response -> OpenAI's Decision object."""
        answers = result["answers"]
        out = []
        for q in self.questions:
            a = answers.get(q.id)
            if a is None:  # no ask_if here, so never skipped; keep the order anyway
                out.append({"type": "refusal", "name": q.name})
                continue
            out.append(_answer(q, a))
        return {"model": result["model"], "answers": out, "usage": _usage(result)}

    def error(self, err: GmlxError) -> GmlxError:
        """Point an admission error about a generated id (`questions.q3...`) at the
        request's own field (`questions[3]`)."""
        m = re.fullmatch(r"questions\.q(\d+)(\.criteria.*)?", err.param or "")
        if not m:
            return err
        index = int(m.group(1))
        param = f"questions[{index}]"
        if m.group(2) and index < len(self.questions):
            param += {"choice": ".choices", "score": ".levels"}.get(self.questions[index].type, "")
        fixed = copy.copy(err)
        fixed.param = param
        fixed.message = re.sub(r"question 'q(\d+)'", lambda g: f"questions[{g.group(1)}]", err.message)
        fixed.args = (fixed.message,)
        return fixed


def _answer(q: AskedQuestion, a: dict) -> dict:
    if q.type == "predicate":
        return {"type": "predicate", "name": q.name, "probability": a["noul"]}
    if q.type == "choice":
        probs = a["probabilities"]
        chosen = q.option_names.index(a["choice"])
        return {
            "type": "choice",
            "name": q.name,
            "choice": q.values[chosen],
            "probabilities": [
                {"value": value, "probability": probs[name]} for value, name in zip(q.values, q.option_names)
            ],
            "confidence": a["confidence"],
        }
    probs = a["probabilities"]
    return {
        "type": "score",
        "name": q.name,
        "score": a["score"],
        "probabilities": [
            {"value": i, "label": label, "probability": probs[str(i)]} for i, label in enumerate(q.values)
        ],
        "confidence": a["confidence"],
    }


def _usage(result: dict) -> dict:
    usage = result.get("usage") or {}
    thought = (result.get("diagnostics") or {}).get("thought") or {}
    input_tokens = int(usage.get("input_tokens", 0))
    output_tokens = int(usage.get("output_tokens", 0))
    return {
        "input_tokens": input_tokens,
        # Prompt tokens taken from the model's prefix cache (an earlier
        # decision under the same prompt_cache_key had evaluated them).
        "input_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0)), "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": int(thought.get("tokens", 0) or 0)},
        "total_tokens": input_tokens + output_tokens,
    }


# -- the request ------------------------------------------------------------------


def parse_openai(body: Any, settings: DecisionSettings) -> OpenAIDecision:
    if not isinstance(body, dict):
        raise _err("the request body must be a JSON object", None, "invalid_type")
    for key in body:
        if key in TOOL_FIELDS:
            raise _err(f"'{key}': tools are not supported by this server's decisions", key, "unsupported_parameter")
        if key not in TOP_FIELDS:
            raise _err(
                f"unknown parameter '{key}' (this server takes: {', '.join(TOP_FIELDS)})", key, "unknown_parameter"
            )

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _err(f"model must be a string, got {_kind(model)}", "model", "invalid_type")
    if "input" not in body or body["input"] is None:
        raise _err("input is required: a string, or an array of user messages", "input", "missing_required_parameter")
    state = _input(body["input"])
    questions = _questions(body.get("questions"), settings.max_questions)

    safety = body.get("safety_identifier")
    if safety is not None:
        if not isinstance(safety, str):
            raise _err(f"safety_identifier must be a string, got {_kind(safety)}", "safety_identifier", "invalid_type")
        if len(safety) > MAX_SAFETY_IDENTIFIER:
            raise _err(
                f"safety_identifier is {len(safety)} characters long; at most {MAX_SAFETY_IDENTIFIER} are allowed",
                "safety_identifier", "string_above_max_length",
            )
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and not isinstance(cache_key, str):
        raise _err(f"prompt_cache_key must be a string, got {_kind(cache_key)}", "prompt_cache_key", "invalid_type")
    no_effect = ("prompt_cache_options",) if _cache_options(body.get("prompt_cache_options")) else ()

    systemone: dict[str, Any] = {
        "state": state,
        "questions": {q.id: spec for q, spec in questions},
        "think": THINK,
    }
    if model is not None:
        systemone["model"] = model
    if cache_key is not None:
        systemone["cache_salt"] = cache_key
    if body.get("calibrate") is not None:
        # Validated with the /v1/systemone rules when the body is parsed.
        systemone["calibrate"] = body["calibrate"]
    return OpenAIDecision(
        systemone=systemone,
        questions=tuple(q for q, _ in questions),
        model=model,
        safety_identifier=safety,
        no_effect=no_effect,
    )


def _cache_options(value: Any) -> bool:
    """Checks prompt_cache_options (accepted, no effect); True when it was sent."""
    if value is None:
        return False
    where = "prompt_cache_options"
    if not isinstance(value, dict):
        raise _err(f"{where} must be an object, got {_kind(value)}", where, "invalid_type")
    for key, v in value.items():
        if key not in CACHE_OPTION_FIELDS:
            raise _err(f"unknown parameter '{where}.{key}'", f"{where}.{key}", "unknown_parameter")
        if key == "mode" and v not in (None, "implicit", "explicit"):
            raise _err(f"{where}.mode must be 'implicit' or 'explicit'", f"{where}.mode")
        if key == "ttl" and v is not None and not isinstance(v, str):
            raise _err(f"{where}.ttl must be a string such as '30m'", f"{where}.ttl", "invalid_type")
    return True


def _objects(value: Any, where: str, of: str, each: str) -> list[tuple[str, dict]]:
    """(path, item) of a non-empty array of objects (input messages, content parts)."""
    if not isinstance(value, list):
        raise _err(f"{where} must be a string or an array of {of}, got {_kind(value)}", where, "invalid_type")
    if not value:
        raise _err(f"{where} must not be an empty array", where, "empty_array")
    return _each_object(value, where, each)


def _input(value: Any) -> str:
    if isinstance(value, str):
        return value
    texts = []
    for where, item in _objects(value, "input", "user messages", "a message object"):
        kind = item.get("type")
        if kind in TOOL_ITEMS:
            raise _err(f"{where}: {kind} items are not supported (no tools); send user messages", f"{where}.type",
                       "unsupported_input_item")
        if kind is not None and kind != "message":
            raise _err(f"{where}.type must be 'message', got {kind!r}", f"{where}.type", "unsupported_input_item")
        role = item.get("role")
        if role != "user":
            if role is None:
                raise _err(f"{where}.role is required ('user')", f"{where}.role", "missing_required_parameter")
            raise _err(f"{where}: role {role!r} is not supported; only user messages are", f"{where}.role",
                       "unsupported_role")
        for key in item:
            if key not in MESSAGE_FIELDS:
                raise _err(f"unknown parameter '{where}.{key}'", f"{where}.{key}", "unknown_parameter")
        if "content" not in item:
            raise _err(f"{where}.content is required", f"{where}.content", "missing_required_parameter")
        texts.append(_text(item["content"], f"{where}.content"))
    return "\n\n".join(texts)


def _text(value: Any, where: str) -> str:
    """A string, or a non-empty array of input_text parts joined with newlines."""
    if isinstance(value, str):
        return value
    lines = []
    for at, part in _objects(value, where, "input_text parts", "an input_text part"):
        kind = part.get("type")
        if kind == "input_image":
            raise _err(f"{at}: images are not supported: the served models read text only", f"{at}.type",
                       "unsupported_input_image")
        if kind != "input_text":
            raise _err(f"{at}.type must be 'input_text', got {kind!r} (only text parts are supported)",
                       f"{at}.type", "unsupported_content_type")
        for key in part:
            if key not in TEXT_PART_FIELDS:
                raise _err(f"unknown parameter '{at}.{key}'", f"{at}.{key}", "unknown_parameter")
        text = part.get("text")
        if not isinstance(text, str):
            raise _err(f"{at}.text must be a string, got {_kind(text)}", f"{at}.text", "invalid_type")
        lines.append(text)
    return "\n".join(lines)


def _questions(value: Any, max_questions: int) -> list[tuple[AskedQuestion, dict]]:
    if not isinstance(value, list):
        if value is None:
            raise _err("questions is required: an array of 1 or more questions", "questions",
                       "missing_required_parameter")
        raise _err(f"questions must be an array, got {_kind(value)}", "questions", "invalid_type")
    if not value:
        raise _err("questions must not be empty: ask 1 or more questions", "questions", "empty_array")
    if len(value) > max_questions:
        raise _err(
            f"too many questions: {len(value)}; this server answers at most {max_questions} per decision "
            "(server.systemone.max_questions)", "questions", "too_many_questions",
        )
    return [_question(spec, i) for i, spec in enumerate(value)]


def _question(spec: Any, i: int) -> tuple[AskedQuestion, dict]:
    where = f"questions[{i}]"
    if not isinstance(spec, dict):
        raise _err(f"{where} must be an object, got {_kind(spec)}", where, "invalid_type")
    qtype = spec.get("type")
    if not isinstance(qtype, str) or qtype not in QUESTION_FIELDS:
        raise _err(f"{where}.type must be 'predicate', 'choice' or 'score', got {qtype!r}", f"{where}.type")
    for key in spec:
        if key not in QUESTION_FIELDS[qtype]:
            raise _err(
                f"unknown parameter '{where}.{key}' (a {qtype} takes: {', '.join(QUESTION_FIELDS[qtype])})",
                f"{where}.{key}", "unknown_parameter",
            )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise _err(f"{where}.name must be a string, got {_kind(name)}", f"{where}.name", "invalid_type")
    if spec.get("instructions") is None:
        raise _err(f"{where}.instructions is required", f"{where}.instructions", "missing_required_parameter")
    instructions = _text(spec["instructions"], f"{where}.instructions")
    qid = f"q{i}"
    out: dict[str, Any] = {"type": TO_SYSTEMONE_TYPE[qtype], "instructions": instructions}
    if qtype == "predicate":
        return AskedQuestion(id=qid, type=qtype, name=name), out
    if qtype == "choice":
        values, descriptions = _choices(spec.get("choices"), f"{where}.choices")
        names = option_names(values)
        out["criteria"] = dict(zip(names, descriptions))
        return AskedQuestion(id=qid, type=qtype, name=name, values=values, option_names=names), out
    labels, descriptions = _levels(spec.get("levels"), f"{where}.levels")
    out["criteria"] = list(labels)
    return AskedQuestion(id=qid, type=qtype, name=name, values=labels, level_descriptions=descriptions), out


def _count(items: Any, where: str, noun: str, low: int, high: int) -> list:
    if not isinstance(items, list):
        if items is None:
            raise _err(f"{where} is required: {low} to {high} {noun}", where, "missing_required_parameter")
        raise _err(f"{where} must be an array, got {_kind(items)}", where, "invalid_type")
    if len(items) < low:
        raise _err(f"{where}: at least {low} {noun} are needed, got {len(items)}", where, f"too_few_{noun}")
    if len(items) > high:
        raise _err(f"{where}: {len(items)} {noun}; this server takes at most {high}", where, f"too_many_{noun}")
    return items


def _description(item: dict, where: str) -> str | None:
    desc = item.get("description")
    if desc is not None and not isinstance(desc, str):
        raise _err(f"{where}.description must be a string, got {_kind(desc)}", f"{where}.description", "invalid_type")
    return desc


def _entries(items: list, where: str, holding: str, fields) -> list[tuple[str, dict]]:
    """(path, item) for each entry of a choices or levels list: an object with
    only the known fields."""
    out = _each_object(items, where, f"an object with {holding}")
    for at, item in out:
        for key in item:
            if key not in fields:
                raise _err(f"unknown parameter '{at}.{key}'", f"{at}.{key}", "unknown_parameter")
    return out


def _each_object(items: list, where: str, each: str) -> list[tuple[str, dict]]:
    out = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _err(f"{at} must be {each}, got {_kind(item)}", at, "invalid_type")
        out.append((at, item))
    return out


def _choices(items: Any, where: str) -> tuple[tuple[Any, ...], tuple[str | None, ...]]:
    items = _count(items, where, "choices", MIN_CHOICES, MAX_CHOICES)
    values: list[Any] = []
    descriptions: list[str | None] = []
    for at, item in _entries(items, where, "a value", CHOICE_FIELDS):
        if "value" not in item:
            raise _err(f"{at}.value is required", f"{at}.value", "missing_required_parameter")
        value = item["value"]
        if not isinstance(value, (str, bool)):
            raise _err(f"{at}.value must be a string or a boolean, got {_kind(value)}", f"{at}.value", "invalid_type")
        # `true` and "true" are different values: compare type and value.
        if any(type(v) is type(value) and v == value for v in values):
            raise _err(f"{at}.value {json.dumps(value)} appears twice; choices must be unique", f"{at}.value",
                       "duplicate_value")
        values.append(value)
        descriptions.append(_description(item, at))
    return tuple(values), tuple(descriptions)


def _levels(items: Any, where: str) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    items = _count(items, where, "levels", MIN_LEVELS, MAX_LEVELS)
    labels: list[str] = []
    descriptions: list[str | None] = []
    for at, item in _entries(items, where, "a label", LEVEL_FIELDS):
        label = item.get("label")
        if not isinstance(label, str) or not label:
            raise _err(f"{at}.label must be a non-empty string, got {_kind(label)}", f"{at}.label", "invalid_type")
        if label in labels:
            raise _err(f"{at}.label {label!r} appears twice; level labels must be unique", f"{at}.label",
                       "duplicate_value")
        labels.append(label)
        descriptions.append(_description(item, at))
    return tuple(labels), tuple(descriptions)


def value_text(value: str | bool) -> str:
    """How a choice value reads in a prompt: a string as it is, a boolean as JSON."""
    return ("true" if value else "false") if isinstance(value, bool) else value


def option_names(values: tuple[Any, ...]) -> tuple[str, ...]:
    """Distinct, non-empty option names for typed choice values, as close to the
    values' own text as possible (they are what the model reads)."""
    texts = [value_text(v) for v in values]
    names = []
    for v, text in zip(values, texts):
        if text and texts.count(text) == 1:
            names.append(text)
        elif isinstance(v, bool):
            names.append(f"{text} (boolean)")
        else:
            names.append(f"{json.dumps(v, ensure_ascii=False)} (text)")
    if len(set(names)) == len(names):
        return tuple(names)
    # A string that spells another value's marked name: JSON texts are always distinct.
    return tuple(json.dumps(v, ensure_ascii=False) for v in values)
