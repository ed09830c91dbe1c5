"""OpenAPI descriptions of the decision routes' bodies (SPEC 4.1, 4.2, 4.8, 5 and 8).

The decision routes read their raw body themselves (size limits, gzip/zstd,
the SPEC 5 errors), so FastAPI cannot infer a request schema from a handler
signature. These JSON schemas describe what the parsers in gmlx.decisions
accept; they only document (and let schemathesis generate meaningful
bodies): nothing validates a request against them.

Server settings shape them: `max_questions` bounds the questions, and
`profile` lists the configured profiles.
"""

from __future__ import annotations

from typing import Any

from ..decisions.openai import MAX_CHOICES, MAX_LEVELS, MAX_SAFETY_IDENTIFIER, MIN_CHOICES, MIN_LEVELS
from ..decisions.questions import MAX_ALTERNATIVES, MIN_ALTERNATIVES
from ..decisions.parse import MAX_STEPS, MAX_THINK, MIN_CHUNK_ROWS, MIN_STEPS
from ..decisions.types import DecisionSettings

REF = "#/components/schemas/"

# Error statuses each decision route documents (SPEC 5).
DECISION_ERRORS = {
    "400": "Not a JSON object, images for a model without a projector or a bad image, prompt larger than the "
           "context, unknown profile, no model",
    "401": "The server has an API key and the request lacks it",
    "404": "The model names nothing (no fallback), or its file is missing",
    "413": "Body larger than server.max_body_bytes (after decompression too)",
    "415": "Content-Encoding other than identity, gzip, zstd",
    "422": "A field fails validation",
    "500": "The engine failed; the server keeps serving",
    "501": "The model has no read strategy",
    "503": "Queue full or model loading; see Retry-After",
    "504": "The decision ran past token_queue_timeout_s",
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF + name}


def components(settings: DecisionSettings, profiles: list[str]) -> dict[str, Any]:
    """The component schemas the decision routes refer to."""
    text = {"type": "string"}
    opt_text = _nullable(text)
    question_id = {"type": "string", "minLength": 1, "description": "no ':' and no newline"}
    option_name = {"type": "string", "minLength": 1}
    noul = {
        "type": "object",
        "required": ["type"],
        "additionalProperties": False,
        "properties": {
            "type": {"const": "noul"},
            "instructions": opt_text,
            "criteria": _nullable({
                "type": "object",
                "additionalProperties": False,
                "properties": {"true": opt_text, "false": opt_text},
            }),
            "depends_on": {"type": "array", "items": question_id},
            "ask_if": {"type": "object", "additionalProperties": {"type": "array", "minItems": 1, "items": text}},
            "alone": {"type": "boolean"},
        },
    }

    def typed(qtype: str, criteria: dict) -> dict:
        """A choice or a score: a noul's fields with criteria required."""
        return {**noul, "required": ["type", "criteria"],
                "properties": {**noul["properties"], "type": {"const": qtype}, "criteria": criteria}}

    choice = typed("choice", {
        "type": "object",
        "description": "option name -> description (or null), in request order",
        "minProperties": MIN_ALTERNATIVES,
        "maxProperties": MAX_ALTERNATIVES,
        "propertyNames": option_name,
        "additionalProperties": opt_text,
    })
    score = typed("score", {
        "type": "array",
        "description": "level names, lowest first",
        "minItems": MIN_ALTERNATIVES,
        "maxItems": MAX_ALTERNATIVES,
        "uniqueItems": True,
        "items": option_name,
    })
    think = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_THINK}, {"const": "auto"}]}
    systemone_request = {
        "type": "object",
        "description": "A structured decision (SPEC 4.1). Unknown top-level fields are ignored with a warning; "
        "null means absent for every optional field.",
        "required": ["state", "questions"],
        "additionalProperties": True,
        "properties": {
            "model": _nullable({"type": "string", "description": "model id or alias; unknown names fall back"}),
            "profile": _nullable({"enum": list(profiles)} if profiles else {"type": "string"}),
            "state": {
                "description": "a string, or any JSON value (sent to the model as its JSON text)",
                "anyOf": [text, {"type": "number"}, {"type": "boolean"}, {"type": "array"}, {"type": "object"}],
            },
            "questions": {
                "type": "object",
                "description": "question id -> question, asked in map order",
                "minProperties": 1,
                "maxProperties": settings.max_questions,
                "propertyNames": question_id,
                "additionalProperties": _ref("Question"),
            },
            "instructions": opt_text,
            "seed": _nullable({"type": "integer"}),
            "samples": _nullable({"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}]}),
            "auto_max": _nullable({"type": "integer", "minimum": 1}),
            "auto_threshold": _nullable({"type": "number", "minimum": 0}),
            "steps": _nullable({"type": "integer", "description": f"clamped to {MIN_STEPS}..{MAX_STEPS}"}),
            "think": _nullable(think),
            "think_threshold": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
            "think_budget": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_THINK}),
            "ask": _nullable({"type": "array", "minItems": 1, "items": question_id}),
            "chunk_rows": _nullable({"type": "integer", "minimum": MIN_CHUNK_ROWS}),
            "chunk_prompt": _nullable({"enum": ["own", "shared"]}),
            "sequential": _nullable({"type": "boolean"}),
            "chat_template_kwargs": _nullable({"type": "object"}),
            "cache_salt": opt_text,
            "images": _nullable({"description": "PNG, JPEG or WebP data URLs, read before the state by a model with "
                                                "an mmproj projector; any other model answers 400",
                                 "type": "array",
                                 "items": {"anyOf": [{"type": "string", "pattern": "^(data:image/|https?://)"},
                                                     {"type": "object"}]}}),
        },
    }
    probabilities = {"type": "object", "additionalProperties": {"type": "number"}}
    answer = {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["noul", "choice", "score"]},
            "noul": {"type": "number"},
            "choice": {"type": "string"},
            "score": {"type": "number"},
            "legend": {"type": "object", "additionalProperties": {"type": "string"}},
            "probabilities": probabilities,
            "confidence": {"type": "number"},
        },
    }
    systemone_response = {
        "type": "object",
        "required": ["id", "object", "created", "model", "answers", "usage", "diagnostics"],
        "properties": {
            "id": {"type": "string", "pattern": "^decision-"},
            "object": {"const": "structured_decision"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "answers": {"type": "object", "additionalProperties": _nullable(answer)},
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens"],
                "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}},
            },
            "diagnostics": {"type": "object"},
        },
    }

    # -- SPEC 8: OpenAI's Decisions API ------------------------------------------------
    input_text = {
        "type": "object",
        "required": ["type", "text"],
        "additionalProperties": False,
        "properties": {"type": {"const": "input_text"}, "text": text, "prompt_cache_breakpoint": {}},
    }
    content = {"anyOf": [text, {"type": "array", "minItems": 1, "items": input_text}]}
    message = {
        "type": "object",
        "required": ["role", "content"],
        "additionalProperties": False,
        "properties": {"role": {"const": "user"}, "type": {"const": "message"}, "content": content},
    }
    name = _nullable(text)
    predicate_q = {
        "type": "object",
        "required": ["type", "instructions"],
        "additionalProperties": False,
        "properties": {"type": {"const": "predicate"}, "instructions": content, "name": name},
    }
    def listed_q(qtype: str, field: str, low: int, high: int, key: str, key_schema: dict) -> dict:
        """A choice or score question: a predicate's fields plus its list of alternatives."""
        entry = {"type": "object", "required": [key], "additionalProperties": False,
                 "properties": {key: key_schema, "description": opt_text}}
        return {**predicate_q, "required": ["type", "instructions", field],
                "properties": {**predicate_q["properties"], "type": {"const": qtype},
                               field: {"type": "array", "minItems": low, "maxItems": high, "items": entry}}}

    choice_q = listed_q("choice", "choices", MIN_CHOICES, MAX_CHOICES, "value", {"type": ["string", "boolean"]})
    score_q = listed_q("score", "levels", MIN_LEVELS, MAX_LEVELS, "label", {"type": "string", "minLength": 1})
    openai_request = {
        "type": "object",
        "description": "OpenAI's Decisions API request (SPEC 8); unknown fields are refused (400).",
        "required": ["input", "questions"],
        "additionalProperties": False,
        "properties": {
            "model": _nullable(text),
            "input": {"anyOf": [text, {"type": "array", "minItems": 1, "items": message}]},
            "questions": {
                "type": "array",
                "minItems": 1,
                "maxItems": settings.max_questions,
                "items": {"anyOf": [predicate_q, choice_q, score_q]},
            },
            "safety_identifier": _nullable({"type": "string", "maxLength": MAX_SAFETY_IDENTIFIER}),
            "prompt_cache_key": _nullable(text),
            "prompt_cache_options": _nullable({
                "type": "object",
                "additionalProperties": False,
                "properties": {"mode": _nullable({"enum": ["implicit", "explicit"]}), "ttl": _nullable(text)},
            }),
        },
    }
    openai_response = {
        "type": "object",
        "required": ["model", "answers", "usage"],
        "properties": {
            "model": {"type": "string"},
            "answers": {
                "type": "array",
                "items": {"type": "object", "required": ["type", "name"],
                          "properties": {"type": {"enum": ["predicate", "choice", "score", "refusal"]}}},
            },
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens", "total_tokens"],
                "properties": {k: {"type": "integer"} for k in ("input_tokens", "output_tokens", "total_tokens")},
            },
        },
    }
    error = {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": text,
                    "type": text,
                    "param": opt_text,
                    # SPEC 5: the HTTP status; /v1/decisions' own 400s carry OpenAI's string codes.
                    "code": {"type": ["integer", "string"]},
                },
            }
        },
    }
    return {
        "Question": {"anyOf": [noul, choice, score]},
        "SystemOneRequest": systemone_request,
        "SystemOneResponse": systemone_response,
        "DecisionsRequest": openai_request,
        "DecisionsResponse": openai_response,
        "Error": error,
    }


def decision_route(request: str, response: str) -> dict[str, Any]:
    """`openapi_extra` for a decision route: its body and responses."""
    error = {"application/json": {"schema": _ref("Error")}}
    responses: dict[str, Any] = {
        "200": {"description": "The decision", "content": {"application/json": {"schema": _ref(response)}}},
    }
    for status, what in DECISION_ERRORS.items():
        responses[status] = {"description": what, "content": error}
    return {
        "requestBody": {
            "required": True,
            "description": "JSON, optionally sent with Content-Encoding gzip or zstd",
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": responses,
    }
