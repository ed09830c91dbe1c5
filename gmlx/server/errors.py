"""The error envelope of SPEC 5 for every failure the HTTP layer can meet.

`{"error": {"message", "type", "param", "code"}}` is the only error shape the
server sends: gmlx's own errors, Starlette's 404/405, FastAPI's request
validation errors, and anything unexpected (500 `server_error`).
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import GmlxError

log = logging.getLogger("gmlx.server")

REQUEST_ID_HEADERS = ("x-request-id", "x-typesafe-request-id")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def envelope(status: int, type_: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def id_headers(request_id: str) -> dict[str, str]:
    return {name: request_id for name in REQUEST_ID_HEADERS}


def error_response(err: GmlxError, request_id: str | None = None) -> JSONResponse:
    headers = id_headers(request_id or new_request_id())
    if err.retry_after is not None:
        headers["Retry-After"] = str(int(err.retry_after))
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


# Types for HTTP statuses that the error table of SPEC 5 does not name
# (unknown routes, wrong methods): the closest OpenAI-style type.
_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    503: "overloaded",
}


async def _gmlx_error(request: Request, exc: GmlxError) -> JSONResponse:  # noqa: ARG001
    return error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        message = f"no route {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail) if exc.detail else "request failed"
    type_ = _HTTP_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    headers = dict(exc.headers or {})
    headers.update(id_headers(new_request_id()))
    return JSONResponse(envelope(status, type_, message), status_code=status, headers=headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:  # noqa: ARG001
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = str(first.get("msg") or "request validation failed")
    if param:
        message = f"{param}: {message}"
    return JSONResponse(envelope(422, "validation_error", message, param), status_code=422,
                        headers=id_headers(new_request_id()))


def install(app: FastAPI) -> None:
    app.add_exception_handler(GmlxError, _gmlx_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


class EnvelopeMiddleware:
    """Pure ASGI middleware: adds the request-id headers to every response that
    lacks them, and turns any exception that escaped the handlers into a 500
    envelope instead of a bare error page (the process keeps serving)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_with_ids(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers") or [])
                names = {k.lower() for k, _ in headers}
                rid = None
                for k, v in headers:
                    if k.lower() in (b"x-request-id", b"x-typesafe-request-id"):
                        rid = v
                rid = rid or new_request_id().encode()
                for name in REQUEST_ID_HEADERS:
                    if name.encode() not in names:
                        headers.append((name.encode(), rid))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_ids)
        except Exception:  # noqa: BLE001 - the last line of defence: never a bare 500
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                return  # too late for a response of our own; the connection closes
            response = JSONResponse(
                envelope(500, "server_error", "internal server error; the server keeps serving"),
                status_code=500,
                headers=id_headers(new_request_id()),
            )
            await response(scope, receive, send)
