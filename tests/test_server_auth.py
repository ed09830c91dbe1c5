"""A server with an API key, two models and no fallback model, and a tiny
token_queue_timeout_s: 401, 400 no_model_specified, 404 model_not_found, 504."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_harness import assert_error, noul_body, start  # noqa: E402

from fake_reader import ticket_body  # noqa: E402

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    d = tmp_path_factory.mktemp("server_auth")
    config = {
        "models": {
            "a": {"path": str(gemma_path), "n_ctx": 512},
            "b": {"path": str(gemma_path), "n_ctx": 512},
        },
        "server": {"api_key": KEY, "token_queue_timeout_s": 0.001},
    }
    s = start(d, config)
    yield s
    s.stop()


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": "Bearer"},
    {"Authorization": KEY},
])
def test_401_without_the_key(server, headers):
    err = assert_error(server.post(noul_body(model="a"), headers=headers), 401, "authentication_error")
    assert KEY not in err["message"]
    r = httpx.get(server.url + "/v1/models", headers=headers)
    assert_error(r, 401, "authentication_error")
    assert r.headers["www-authenticate"] == "Bearer"
    # Liveness stays open.
    assert httpx.get(server.url + "/health", headers=headers).status_code == 200


def test_auth_is_checked_before_the_body(server):
    # An unauthenticated client learns nothing about its body.
    r = server.post(content=b"not json", headers={"Content-Type": "application/json"})
    assert_error(r, 401, "authentication_error")


def test_models_with_the_key(server):
    r = httpx.get(server.url + "/v1/models", headers=AUTH)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["a", "b"]


def test_400_no_model_specified(server):
    assert_error(server.post(noul_body(), headers=AUTH), 400, "no_model_specified", "model")


@pytest.mark.parametrize("name", ["jev-latest", "typesafe/jev-1.13", "c"])
def test_404_model_not_found(server, name):
    err = assert_error(server.post(noul_body(model=name), headers=AUTH), 404, "model_not_found", "model")
    assert name in err["message"]


def test_504_timeout_after_leaving_the_queue(server):
    assert_error(server.post(ticket_body(model="a"), headers=AUTH), 504, "timeout")
    queue = server.health()["models"]["a"]["slots"]["default"]["queue"]
    assert queue["timeouts"] >= 1 and queue["served"] == 0
    # The worker keeps taking decisions (and times them out too).
    assert_error(server.post(noul_body(model="a", samples=1), headers=AUTH), 504, "timeout")
