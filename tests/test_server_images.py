"""Images on next-token models behind a real `gmlx serve`: a tiny Qwen3 and a
tiny Qwen3.5 (hybrid, M-RoPE), each with the tiny llava-style projector, on
both decision routes; the image prefix reused by a later decision; the 400s of
a model without a projector and of Winnow."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image
from server_harness import assert_error, start
from tiny_gguf import build_qwen3
from tiny_gguf_more import build_gemma4, build_mmproj, build_qwen35

STATE = "Photo of the parcel as delivered: the box is crushed on one corner."
QS = {"damaged": {"type": "noul", "instructions": "Is the item damaged?"},
      "team": {"type": "choice", "instructions": "Which team?", "criteria": {"returns": None, "shipping": None}}}
OTHER_QS = {"urgent": {"type": "noul", "instructions": "Does the customer need an answer today?"}}
IMAGE_TOKENS = 16  # one image on the tiny projector


def _png(color) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED = _png((220, 20, 20))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("server_images")
    q3, q35, g4 = build_qwen3(d / "q3.gguf"), build_qwen35(d / "q35.gguf"), build_gemma4(d / "g4.gguf")
    build_mmproj(d / "mmproj.gguf")
    common = {"n_ctx": 2048, "n_threads": 1}
    s = start(d, {"models": {"vision": {"path": str(q3), "mmproj": "mmproj.gguf", **common},
                             "q35v": {"path": str(q35), "mmproj": "mmproj.gguf", **common},
                             "text": {"path": str(q3), **common},
                             "winnow": {"path": str(g4), "read_strategy": "winnow", "mmproj": "mmproj.gguf",
                                        **common}},
                  "server": {"systemone": {"model": "vision"}}})
    yield s
    s.stop()


def _post(server, path="/v1/systemone", **body):
    return server.ok({"state": STATE, "questions": QS, "samples": 1, **body}, path)


@pytest.mark.parametrize("model", ["vision", "q35v"])
def test_images_on_both_routes(server, model):
    plain = _post(server, model=model)
    a = _post(server, model=model, images=[RED])
    b = _post(server, "/systemone", model=model, images=[RED])
    assert a["model"] == b["model"] == model
    assert a["diagnostics"]["strategy"] == "next-token"
    assert a["usage"]["input_tokens"] == plain["usage"]["input_tokens"] + IMAGE_TOKENS
    assert a["answers"] == b["answers"]  # the same bits, whether the prefix came from the cache or not
    assert b["usage"]["cached_tokens"] >= IMAGE_TOKENS
    assert a["answers"]["damaged"]["noul"] != plain["answers"]["damaged"]["noul"]
    other = _post(server, model=model, images=[RED], questions=OTHER_QS)
    assert other["usage"]["cached_tokens"] >= IMAGE_TOKENS + 10  # head, image and state reused


def test_images_without_a_projector_or_on_winnow_are_400(server):
    body = {"state": STATE, "questions": QS, "images": [RED]}
    err = assert_error(server.post({**body, "model": "text"}), 400, "invalid_request_error", "images")
    assert "mmproj" in err["message"] and "'text'" in err["message"]
    err = assert_error(server.post({**body, "model": "winnow"}), 400, "invalid_request_error", "images")
    assert "not part of Winnow's turn serialization" in err["message"]
    err = assert_error(server.post({**body, "model": "vision", "images": ["data:image/png;base64,@@"]}), 400,
                       "invalid_request_error", "images")
    assert "base64" in err["message"]
    # nothing else affected
    assert _post(server, model="vision", images=[RED])["usage"]["input_tokens"] > IMAGE_TOKENS
