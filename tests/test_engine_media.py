"""Request media (gmlx/engine/media.py): data URLs decoded with Pillow, the
400/413 errors with the SPEC envelope, audio/videos refused, Liquid's shrink;
and through a real server on both routes."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image
from server_harness import assert_error, start
from tiny_gguf_more import build_lfm2

from gmlx.decisions.fake import ticket_body
from gmlx.decisions.request import parse_decision
from gmlx.decisions.types import DecisionSettings
from gmlx.engine.media import MediaLimits, check_other_media, decode_image, decode_images, shrink
from gmlx.errors import InvalidRequest, RequestTooLarge


def _data_url(fmt="PNG", size=(8, 6), color=(200, 10, 30), mime=None):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    mime = mime or {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_decodes_png_jpeg_webp(fmt):
    (im,) = decode_images([_data_url(fmt)])
    assert im.mode == "RGB" and im.size == (8, 6)
    r, g, b = im.getpixel((3, 3))
    assert abs(r - 200) < 12 and g < 30 and b < 45


@pytest.mark.parametrize("item,words", [
    ("http://example.com/a.png", "allow_urls"),
    ("data:image/gif;base64,R0lGOD", "image/gif is not supported"),
    ("data:image/png;base64,@@@@", "base64 is malformed"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "cannot be decoded"),
    ("just text", "not a base64 data URL"),
    (42, "must be a data URL"),
])
def test_malformed_images_are_400(item, words):
    with pytest.raises(InvalidRequest) as e:
        decode_image(item, 0)
    assert words in str(e.value) and e.value.param == "images" and e.value.status == 400


def test_format_mismatch_is_400():
    with pytest.raises(InvalidRequest) as e:
        decode_image(_data_url("PNG", mime="jpeg"), 2)
    assert "says JPEG but the bytes are PNG" in str(e.value) and e.value.param == "images"


def test_oversized_is_413_and_too_many_is_400():
    big = _data_url("PNG", size=(256, 256))
    with pytest.raises(RequestTooLarge) as e:
        decode_image(big, 0, MediaLimits(max_image_bytes=64))
    assert e.value.status == 413 and e.value.param == "images"
    with pytest.raises(InvalidRequest) as e:
        decode_images([_data_url()] * 3, MediaLimits(max_images=2))
    assert "too many images: 3, at most 2" in str(e.value)
    with pytest.raises(InvalidRequest):
        decode_images("data:image/png;base64,xx")


@pytest.mark.parametrize("name", ["audio", "videos"])
def test_audio_and_videos_are_400(name):
    with pytest.raises(InvalidRequest) as e:
        check_other_media({name: ["data:audio/wav;base64,AAAA"]})
    assert e.value.param == name and f"{name} is not supported" in str(e.value) and "PNG, JPEG or WebP" in str(e.value)
    check_other_media({name: []})  # an empty list is harmless


def test_liquid_shrink_keeps_aspect():
    im = Image.new("RGB", (3000, 1500))
    out = shrink(im)
    assert out.size == (1024, 512)
    small = Image.new("RGB", (100, 50))
    assert shrink(small) is small


def test_parse_decision_refuses_images_until_a_projector_reads_them():
    body = {"state": "s", "questions": {"q": {"type": "noul"}}}
    with pytest.raises(InvalidRequest) as e:
        parse_decision({**body, "images": [_data_url()]}, DecisionSettings())
    assert e.value.param == "images" and "mmproj" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        parse_decision({**body, "videos": ["x"]}, DecisionSettings())
    assert e.value.param == "videos"
    d = parse_decision({**body, "images": [], "audio": None}, DecisionSettings())
    assert d.ignored == []


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("server_media")
    lf = build_lfm2(d / "lfm2.gguf")
    s = start(d, {"models": {"d1": {"path": str(lf), "n_ctx": 2048, "n_threads": 1, "read_strategy": "liquid"}},
                  "server": {"max_body_bytes": 20 * 1024 * 1024}})
    yield s
    s.stop()


@pytest.mark.parametrize("path", ["/v1/systemone", "/systemone"])
def test_server_media_errors(server, path):
    ok = httpx.post(server.url + path, json=ticket_body(), timeout=60)
    assert ok.status_code == 200, ok.text
    r = server.post(ticket_body(images=[_data_url()]), path=path)
    assert "mmproj" in assert_error(r, 400, "invalid_request_error", "images")["message"]
    r = server.post(ticket_body(images=["data:image/png;base64,@@"]), path=path)
    assert_error(r, 400, "invalid_request_error", "images")
    huge = "data:image/png;base64," + base64.b64encode(b"\0" * (11 * 1024 * 1024)).decode()
    r = server.post(ticket_body(images=[huge]), path=path)
    assert "larger than 10485760 bytes" in assert_error(r, 413, "request_too_large", "images")["message"]
    r = server.post(ticket_body(audio=["data:audio/wav;base64,AAAA"]), path=path)
    assert_error(r, 400, "invalid_request_error", "audio")
    # nothing else affected
    again = httpx.post(server.url + path, json=ticket_body(), timeout=60)
    assert again.status_code == 200 and again.json()["answers"] == ok.json()["answers"]
