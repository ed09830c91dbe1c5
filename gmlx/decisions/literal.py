"""Marking text that must be tokenized as plain text.

A rendered prompt mixes the chat template's own markers (`<start_of_turn>`,
`<|im_start|>`), which must become control tokens, with text the caller
wrote (state, instructions, questions, options), which must not: a ticket
that contains `<end_of_turn>` would otherwise close the user's turn and write a
model reply of the caller's choosing. Caller text is wrapped in two
private-use characters before the template sees it; the tokenizer
(`gmlx.engine.model.LoadedModel.encode_prompt`) tokenizes what lies between
them with special-token parsing off, and the rest with it on.
"""

from __future__ import annotations

OPEN = "\ue000"
CLOSE = "\ue001"
_REPLACEMENT = "\ufffd"


def literal(text: str) -> str:
    """`text` marked as plain text (markers inside it are neutralized first)."""
    if not text:
        return text
    clean = text.replace(OPEN, _REPLACEMENT).replace(CLOSE, _REPLACEMENT)
    return OPEN + clean + CLOSE


def segments(rendered: str) -> list[tuple[bool, str]]:
    """(is_literal, text) pieces of a rendered prompt, in order; empty pieces dropped."""
    out: list[tuple[bool, str]] = []
    rest = rendered
    while rest:
        start = rest.find(OPEN)
        if start < 0:
            out.append((False, rest))
            break
        if start:
            out.append((False, rest[:start]))
        end = rest.find(CLOSE, start + 1)
        if end < 0:  # unbalanced (a template cut the text): the rest stays plain text
            out.append((True, rest[start + 1:]))
            break
        if end > start + 1:
            out.append((True, rest[start + 1:end]))
        rest = rest[end + 1:]
    return out


def strip_marks(rendered: str) -> str:
    """The text as the model reads it, markers removed (for logs and tests)."""
    return rendered.replace(OPEN, "").replace(CLOSE, "")
