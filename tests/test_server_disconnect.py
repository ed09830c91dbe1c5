"""A client that goes away still gets the SPEC 5 envelope (for the proxy and
the logs that do read it): 400 while sending its body, 499 once queued."""

from __future__ import annotations

import asyncio
import json

from gmlx.config import parse_config
from gmlx.errors import ClientClosed
from gmlx.server.app import create_app
from gmlx.server.errors import error_response


def _drive(app, chunks):
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": "/v1/systemone",
             "raw_path": b"/v1/systemone", "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    messages = iter(chunks)
    sent = []

    async def receive():
        try:
            return next(messages)
        except StopIteration:
            await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_disconnect_while_sending_the_body_gets_the_envelope():
    app = create_app(parse_config({"models": {"m": {"path": "/nonexistent.gguf"}}, "server": {"systemone": {"model": "m"}}}))
    status, body = _drive(app, [{"type": "http.request", "body": b'{"sta', "more_body": True}, {"type": "http.disconnect"}])
    assert status == 400
    assert body == {"error": {"message": "the client closed the connection before sending the whole body",
                              "type": "invalid_request_error", "param": None, "code": 400}}


def test_cancelled_decision_answer_is_an_envelope_too():
    r = error_response(ClientClosed("the client closed the connection; the decision was cancelled"))
    assert r.status_code == 499
    assert json.loads(r.body)["error"]["type"] == "client_closed_request"
    assert r.headers["x-request-id"]
