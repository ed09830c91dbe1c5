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
from tiny_gguf_more import build_lfm2, build_mmproj

from fake_reader import ticket_body
from gmlx.config import LOAD_DEFAULTS
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import admit, decide
from gmlx.decisions.types import DecisionSettings, Read
from gmlx.engine import open_reader
from gmlx.engine.model import load_model
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


def test_parse_decision_decodes_images_onto_the_decision():
    body = {"state": "s", "questions": {"q": {"type": "noul"}}}
    d = parse_decision({**body, "images": [_data_url(), _data_url("JPEG")]}, DecisionSettings())
    assert [im.size for im in d.images] == [(8, 6), (8, 6)]
    with pytest.raises(InvalidRequest) as e:
        parse_decision({**body, "videos": ["x"]}, DecisionSettings())
    assert e.value.param == "videos"
    d = parse_decision({**body, "images": [], "audio": None}, DecisionSettings())
    assert d.ignored == []


# -- reading images through libmtmd (tiny lfm2 + tiny mlp projector) ---------------

QS = {"u": {"type": "noul", "instructions": "Is it red?"},
      "t": {"type": "choice", "instructions": "Which?", "criteria": {"A": None, "B": None}}}
SETTINGS = DecisionSettings()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("media_models")
    return build_lfm2(d / "lfm2.gguf"), build_mmproj(d / "mmproj.gguf")


def _load(path, **over):
    s = {**LOAD_DEFAULTS, "n_gpu_layers": 0, "n_ctx": 2048, "n_threads": 1, "read_strategy": "liquid", **over}
    lm = load_model("d1", path, s)
    return lm, open_reader(lm, s)


@pytest.fixture(scope="module")
def d1(files):
    lm, r = _load(files[0], mmproj="mmproj.gguf")  # relative to the model's directory
    yield r
    r.close()
    lm.close()


def _decide(reader, images, state="ticket"):
    d = parse_decision({"state": state, "questions": QS, "images": images}, SETTINGS)
    admit(d, reader, SETTINGS)
    return decide(d, reader, SETTINGS, "d1")


def test_projector_loaded(d1):
    assert d1.reads_images and d1.projector is not None


def test_images_change_the_read_and_count_in_usage(d1):
    plain = _decide(d1, [])
    red = _decide(d1, [_data_url(color=(255, 0, 0))])
    blue = _decide(d1, [_data_url(color=(0, 0, 255))])
    assert red["usage"]["input_tokens"] == plain["usage"]["input_tokens"] + 16  # 16 image tokens
    two = _decide(d1, [_data_url(color=(255, 0, 0)), _data_url(color=(0, 0, 255))])
    assert two["usage"]["input_tokens"] == plain["usage"]["input_tokens"] + 32
    assert red["answers"]["u"]["noul"] != plain["answers"]["u"]["noul"]
    assert red["answers"]["u"]["noul"] != blue["answers"]["u"]["noul"]
    again = _decide(d1, [_data_url(color=(255, 0, 0))])
    assert again["answers"] == red["answers"]  # deterministic


def test_image_tokens_come_before_the_state(d1):
    d = parse_decision({"state": "ticket", "questions": QS, "images": [_data_url()]}, SETTINGS)
    admit(d, d1, SETTINGS)
    d1.reset()
    read = Read(state=d.state, instructions=None, questions=d.questions, listed=d.questions, answered=(),
                sample=0, seed=0, images=d.images)
    d1.read(read)
    head = d1.lm.encode_prompt("<|startoftext|><|im_start|>user\n")
    toks = d1._prompt(read, d.questions[0]).tokens
    assert toks[:len(head)] == head
    # the image's 16 tokens (placeholders of one chunk) right after the head, then the state
    image = toks[len(head):len(head) + 16]
    assert len(set(image)) == 1 and image[0] < 0 and toks[len(head) + 16] >= 0
    assert d1.lm.decode(toks[len(head) + 16:len(head) + 18]).startswith("ti")
    # positions len(head) .. len(head)+15 for the image; the state's tokens continue right after
    assert d1._layout.runs[0][:2] == (len(head), len(head) + 16)
    assert d1._layout.pos(len(head) + 16) == len(head) + 16
    d1.reset()


def test_large_images_are_shrunk_to_1024(d1):
    d = parse_decision({"state": "s", "questions": QS, "images": [_data_url(size=(2048, 1024))]}, SETTINGS)
    admit(d, d1, SETTINGS)
    (im,) = d.images
    assert im.image.size == (1024, 512)


def test_a_model_without_projector_refuses_images(files):
    lm, r = _load(files[0])
    try:
        d = parse_decision({"state": "s", "questions": QS, "images": [_data_url()]}, SETTINGS)
        with pytest.raises(InvalidRequest) as e:
            admit(d, r, SETTINGS)
        assert e.value.param == "images" and "mmproj" in str(e.value)
    finally:
        r.close()
        lm.close()


def test_a_qwen35_without_projector_refuses_images(files, tmp_path):
    from tiny_gguf_more import build_qwen35

    lm = load_model("q", build_qwen35(tmp_path / "q.gguf"), {**LOAD_DEFAULTS, "n_gpu_layers": 0, "n_ctx": 1024})
    r = open_reader(lm, {**LOAD_DEFAULTS, "n_ctx": 1024})
    try:
        d = parse_decision({"state": "s", "questions": QS, "images": [_data_url()]}, SETTINGS)
        with pytest.raises(InvalidRequest) as e:
            admit(d, r, SETTINGS)
        assert e.value.param == "images" and "'q' (next-token) has none" in str(e.value)
    finally:
        r.close()
        lm.close()


def test_missing_projector_file_fails_the_load(files):
    from gmlx.errors import ModelLoadError

    lm = load_model("d1", files[0], {**LOAD_DEFAULTS, "n_gpu_layers": 0, "read_strategy": "liquid"})
    try:
        with pytest.raises(ModelLoadError) as e:
            open_reader(lm, {**LOAD_DEFAULTS, "n_ctx": 1024, "read_strategy": "liquid", "mmproj": "nope.gguf"})
        assert "nope.gguf is missing" in str(e.value)
    finally:
        lm.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("server_media")
    lf = build_lfm2(d / "lfm2.gguf")
    build_mmproj(d / "mmproj.gguf")
    s = start(d, {"models": {"d1": {"path": str(lf), "n_ctx": 2048, "n_threads": 1, "read_strategy": "liquid",
                                    "mmproj": "mmproj.gguf"},
                             "plain": {"path": str(lf), "n_ctx": 2048, "n_threads": 1, "read_strategy": "liquid"}},
                  "server": {"max_body_bytes": 20 * 1024 * 1024, "systemone": {"model": "d1"}}})
    yield s
    s.stop()


@pytest.mark.parametrize("path", ["/v1/systemone", "/systemone"])
def test_server_media_errors(server, path):
    ok = httpx.post(server.url + path, json=ticket_body(), timeout=60)
    assert ok.status_code == 200, ok.text
    img = httpx.post(server.url + path, json=ticket_body(images=[_data_url()]), timeout=60)
    assert img.status_code == 200, img.text
    assert img.json()["usage"]["input_tokens"] == ok.json()["usage"]["input_tokens"] + 16
    assert img.json()["diagnostics"]["strategy"] == "liquid"
    r = server.post(ticket_body(model="plain", images=[_data_url()]), path=path)
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


def test_server_media_limits_come_from_the_config(tmp_path):
    from gmlx.config import parse_config
    from gmlx.engine import media

    saved = media.limits()
    try:
        media.configure(parse_config({"server": {"media": {"max_images": 1, "max_image_bytes": 2048}}}).server.media)
        assert media.limits() == MediaLimits(max_images=1, max_image_bytes=2048)
        with pytest.raises(InvalidRequest):
            decode_images([_data_url(), _data_url()])
        with pytest.raises(RequestTooLarge):
            decode_images([_data_url(size=(400, 400), fmt="PNG", color=(1, 2, 3))[:22] +
                           base64.b64encode(b"\0" * 4096).decode()])
    finally:
        media._limits = saved
