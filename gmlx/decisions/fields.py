"""Small JSON type checks shared by the request and question parsers.

JSON `true` is not an integer here (Python's bool is an int subclass), and an
integral float such as 3.0 counts as the integer 3.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ValidationError


def is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value) and value.is_integer()


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fail(message: str, param: str) -> ValidationError:
    return ValidationError(message, param=param)


def want_int(value: Any, name: str, param: str) -> int:
    if not is_int(value):
        raise fail(f"{name} must be an integer, got {describe(value)}", param)
    return int(value)


def want_str(value: Any, name: str, param: str) -> str:
    if not isinstance(value, str):
        raise fail(f"{name} must be a string, got {describe(value)}", param)
    return value


def want_bool(value: Any, name: str, param: str) -> bool:
    if not isinstance(value, bool):
        raise fail(f"{name} must be true or false, got {describe(value)}", param)
    return value


def describe(value: Any, openai: bool = False) -> str:
    """A short name of a JSON value's type, for messages. OpenAI's wording
    (`openai`) says "an array" and does not repeat numbers."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number" if openai else f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array" if openai else "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
