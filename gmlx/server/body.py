"""Reading a decision request body: size limits, Content-Encoding, JSON.

The limit (`server.max_body_bytes`) holds for the bytes on the wire and for the
decoded bytes: decompression stops as soon as its output passes the limit, so
a small compressed body that expands to gigabytes (a "zip bomb") costs at most
the limit in memory before it is refused with 413.
"""

from __future__ import annotations

import io
import json
import re
import zlib
from typing import Any

from starlette.requests import Request

from ..errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType

SUPPORTED_ENCODINGS = ("identity", "gzip", "x-gzip", "zstd")
_CHUNK = 64 * 1024


def _too_large(limit: int, decoded: bool = False) -> RequestTooLarge:
    what = "decompressed body" if decoded else "request body"
    return RequestTooLarge(f"the {what} is larger than the server's limit of {limit} bytes (server.max_body_bytes)")


def encodings_of(header: str | None) -> list[str]:
    """The codings of a Content-Encoding header in the order they were applied;
    raises 415 for any coding gmlx does not decode."""
    if not header:
        return []
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    for c in codings:
        if c not in SUPPORTED_ENCODINGS:
            raise UnsupportedMediaType(
                f"Content-Encoding {c!r} is not supported; send identity, gzip or zstd",
                param="Content-Encoding",
            )
    return [c for c in codings if c != "identity"]


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """gzip -> bytes, raising 413 once the output passes `limit` (concatenated
    members allowed, as gzip itself allows them)."""
    out = bytearray()
    rest = data
    while True:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        pending = rest
        while pending:
            try:
                chunk = d.decompress(pending, _CHUNK)
            except zlib.error as err:
                raise InvalidRequest(f"the body is not valid gzip data ({err})") from None
            out += chunk
            if len(out) > limit:
                raise _too_large(limit, decoded=True)
            pending = d.unconsumed_tail
            if d.eof:
                break
        if not d.eof:
            # Everything consumed but no end of stream: flush what is buffered.
            try:
                out += d.flush(limit + 1 - len(out))
            except zlib.error as err:  # pragma: no cover - flush rarely fails
                raise InvalidRequest(f"the body is not valid gzip data ({err})") from None
            if len(out) > limit:
                raise _too_large(limit, decoded=True)
            raise InvalidRequest("the body is not valid gzip data (truncated stream)")
        rest = d.unused_data
        if not rest.strip(b"\x00"):
            return bytes(out)


def unzstd_bounded(data: bytes, limit: int) -> bytes:
    """zstd -> bytes, raising 413 once the output passes `limit` (several frames allowed)."""
    import zstandard

    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
        with reader:
            while True:
                chunk = reader.read(_CHUNK)
                if not chunk:
                    break
                out += chunk
                if len(out) > limit:
                    raise _too_large(limit, decoded=True)
    except zstandard.ZstdError as err:
        raise InvalidRequest(f"the body is not valid zstd data ({err})") from None
    # A truncated frame yields its decoded part; the JSON parse refuses it.
    return bytes(out)


def decode(data: bytes, codings: list[str], limit: int) -> bytes:
    # Codings were applied in header order; undo them last to first.
    for c in reversed(codings):
        data = unzstd_bounded(data, limit) if c == "zstd" else gunzip_bounded(data, limit)
    return data


async def read_raw(request: Request, limit: int) -> bytes:
    """The body as sent, refusing with 413 as soon as it passes `limit`."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > limit:
                raise _too_large(limit)
        except ValueError:
            raise InvalidRequest("Content-Length is not a number", param="Content-Length") from None
    out = bytearray()
    async for chunk in request.stream():
        out += chunk
        if len(out) > limit:
            raise _too_large(limit)
    return bytes(out)


def check_content_type(request: Request) -> None:
    ctype = (request.headers.get("content-type") or "").lower()
    if ctype.startswith("multipart/"):
        # Multipart bodies carry images (Jev clients' assets): text-only models.
        raise InvalidRequest(
            "multipart bodies (images and other assets) are not supported: the served models read text only",
            param="images",
        )


def parse_json_object(data: bytes) -> dict[str, Any]:
    if not data.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not UTF-8 text") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequest("the request body nests too deeply") from None
    except ValueError as err:
        raise InvalidRequest(f"the request body is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(value)
    return value


# JSON may escape a lone UTF-16 surrogate ("\ud800"); Python's parser keeps it
# as a str that no UTF-8 encoder (tokenizer, template, log) accepts. Only a
# body with such an escape is walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(value: Any) -> None:
    stack = [value]
    while stack:  # iterative: the value may nest as deep as the parser allows
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise InvalidRequest(
                    "the request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff without its "
                    "pair): not text"
                )
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
