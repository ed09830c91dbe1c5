"""The `questions` map of a request (SPEC 4.2) -> tuple of Question.

Each question is first checked on its own, then references between questions
(depends_on, ask_if) are checked once every id is known.
"""

from __future__ import annotations

from typing import Any

from .fields import describe, fail, want_bool, want_str
from .labels import labels_for
from .types import Question

QUESTION_FIELDS = ("type", "instructions", "criteria", "depends_on", "ask_if", "alone")
TYPES = ("noul", "choice", "score")
MIN_ALTERNATIVES = 2
MAX_ALTERNATIVES = 26


def parse_questions(raw: Any, max_questions: int) -> tuple[Question, ...]:
    if not isinstance(raw, dict) or not raw:
        raise fail(f"questions must be a non-empty object mapping ids to questions, got {describe(raw)}", "questions")
    if len(raw) > max_questions:
        raise fail(f"too many questions: {len(raw)}, at most {max_questions} are allowed", "questions")
    seen: set[str] = set()
    drafts = []
    for qid, spec in raw.items():
        _check_id(qid, seen)
        seen.add(qid)
        drafts.append(_parse_one(qid, spec))
    by_id = {q.id: q for q in drafts}
    for q in drafts:
        _check_references(q, by_id)
    _check_cycles(drafts, by_id)
    return tuple(drafts)


def _check_id(qid: Any, seen: set[str]) -> None:
    if not isinstance(qid, str) or not qid:
        raise fail("question ids must be non-empty strings", "questions")
    if ":" in qid:
        raise fail(f"question id '{qid}' must not contain ':'", f"questions.{qid}")
    if "\n" in qid or "\r" in qid:
        raise fail(f"question id {qid!r} must not contain a newline", f"questions.{qid}")
    if qid in seen:
        raise fail(f"question id '{qid}' is used twice", f"questions.{qid}")


def _parse_one(qid: str, spec: Any) -> Question:
    where = f"questions.{qid}"
    if not isinstance(spec, dict):
        raise fail(f"question '{qid}' must be an object, got {describe(spec)}", where)
    for key in spec:
        if key not in QUESTION_FIELDS:
            raise fail(
                f"question '{qid}' has unknown field '{key}' (allowed: {', '.join(QUESTION_FIELDS)})", f"{where}.{key}"
            )
    qtype = spec.get("type")
    if qtype is None:
        raise fail(f"question '{qid}' needs a type ({', '.join(TYPES)})", f"{where}.type")
    if qtype not in TYPES:
        raise fail(f"question '{qid}': type must be one of {', '.join(TYPES)}, got {qtype!r}", f"{where}.type")
    instructions = spec.get("instructions")
    instructions = "" if instructions is None else want_str(instructions, f"question '{qid}': instructions", f"{where}.instructions")
    options, descriptions = _criteria(qid, qtype, spec.get("criteria"))
    depends_on = _depends_on(qid, spec.get("depends_on"))
    ask_if = _ask_if(qid, spec.get("ask_if"))
    # ask_if keys are dependencies too: the question must see those answers.
    depends_on += tuple(k for k in ask_if if k not in depends_on)
    alone = spec.get("alone")
    alone = False if alone is None else want_bool(alone, f"question '{qid}': alone", f"{where}.alone")
    return Question(
        id=qid,
        type=qtype,
        instructions=instructions,
        options=options,
        descriptions=descriptions,
        labels=labels_for(qtype, len(options)),
        depends_on=depends_on,
        ask_if=ask_if,
        alone=alone,
    )


def _names(qid: str, names: list, what: str, where: str) -> list[str]:
    """Option or level names: each a non-empty string."""
    for name in names:
        if not isinstance(name, str) or not name:
            raise fail(f"question '{qid}': {what} names must be non-empty strings, got {describe(name)}", where)
    return names


def _criteria(qid: str, qtype: str, criteria: Any) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    where = f"questions.{qid}.criteria"
    if qtype == "noul":
        return ("yes", "no"), _noul_criteria(qid, criteria, where)
    if criteria is None:
        kind = "an object of option names" if qtype == "choice" else "a list of level names"
        raise fail(f"question '{qid}': a {qtype} needs criteria ({kind})", where)
    if qtype == "choice":
        if not isinstance(criteria, dict):
            raise fail(f"question '{qid}': choice criteria must be an object of option name -> description, got {describe(criteria)}", where)
        names = _names(qid, list(criteria), "option", where)
        for name in names:
            desc = criteria[name]
            if desc is not None and not isinstance(desc, str):
                raise fail(f"question '{qid}': the description of option '{name}' must be a string or null, got {describe(desc)}", f"{where}.{name}")
        descriptions = tuple(criteria[n] for n in names)
    else:
        if not isinstance(criteria, list):
            raise fail(f"question '{qid}': score criteria must be a list of level names, got {describe(criteria)}", where)
        names = _names(qid, list(criteria), "level", where)
        descriptions = (None,) * len(names)
    noun = "options" if qtype == "choice" else "levels"
    if not MIN_ALTERNATIVES <= len(names) <= MAX_ALTERNATIVES:
        raise fail(
            f"question '{qid}': a {qtype} needs {MIN_ALTERNATIVES} to {MAX_ALTERNATIVES} {noun}, got {len(names)}", where
        )
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise fail(f"question '{qid}': {noun} must be unique, '{dup}' appears twice", where)
    return tuple(names), descriptions


def _noul_criteria(qid: str, criteria: Any, where: str) -> tuple[str | None, str | None]:
    if criteria is None:
        return (None, None)
    if not isinstance(criteria, dict):
        raise fail(f"question '{qid}': noul criteria must be null or an object with 'true'/'false' descriptions, got {describe(criteria)}", where)
    for key, desc in criteria.items():
        if key not in ("true", "false"):
            raise fail(f"question '{qid}': noul criteria take only 'true' and 'false', not '{key}'", f"{where}.{key}")
        if desc is not None and not isinstance(desc, str):
            raise fail(f"question '{qid}': criteria '{key}' must be a string or null, got {describe(desc)}", f"{where}.{key}")
    return (criteria.get("true"), criteria.get("false"))


def _depends_on(qid: str, value: Any) -> tuple[str, ...]:
    where = f"questions.{qid}.depends_on"
    if value is None:
        return ()
    if not isinstance(value, list):
        raise fail(f"question '{qid}': depends_on must be a list of question ids, got {describe(value)}", where)
    out: list[str] = []
    for dep in value:
        if not isinstance(dep, str):
            raise fail(f"question '{qid}': depends_on must list question ids (strings), got {describe(dep)}", where)
        if dep not in out:
            out.append(dep)
    return tuple(out)


def _ask_if(qid: str, value: Any) -> dict[str, tuple[str, ...]]:
    where = f"questions.{qid}.ask_if"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"question '{qid}': ask_if must be an object of question id -> answer names, got {describe(value)}", where)
    out: dict[str, tuple[str, ...]] = {}
    for key, answers in value.items():
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise fail(f"question '{qid}': ask_if '{key}' must be a non-empty list of answer names", f"{where}.{key}")
        out[key] = tuple(dict.fromkeys(answers))
    return out


def _check_references(q: Question, by_id: dict[str, Question]) -> None:
    for dep in q.depends_on:
        field = "ask_if" if dep in q.ask_if else "depends_on"
        where = f"questions.{q.id}.{field}"
        if dep == q.id:
            raise fail(f"question '{q.id}' cannot depend on itself ({field})", where)
        if dep not in by_id:
            raise fail(f"question '{q.id}': {field} names unknown question '{dep}'", where)
    for key, answers in q.ask_if.items():
        target = by_id[key]
        for name in answers:
            if name not in target.options:
                allowed = ", ".join(target.options)
                raise fail(
                    f"question '{q.id}': ask_if '{key}' names '{name}', which is not an answer of '{key}' (answers: {allowed})",
                    f"questions.{q.id}.ask_if.{key}",
                )


def _check_cycles(questions: list[Question], by_id: dict[str, Question]) -> None:
    # Depth-first search; `path` holds the current chain to report the cycle.
    done: set[str] = set()
    for start in questions:
        if start.id in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()

        def visit(qid: str) -> None:
            if qid in done:
                return
            if qid in on_path:
                cycle = path[path.index(qid):] + [qid]
                raise fail(
                    f"questions {' -> '.join(repr(c) for c in cycle)} form a dependency cycle",
                    f"questions.{cycle[0]}.depends_on",
                )
            on_path.add(qid)
            path.append(qid)
            for dep in by_id[qid].depends_on:
                visit(dep)
            path.pop()
            on_path.discard(qid)
            done.add(qid)

        visit(start.id)
