"""Images on next-token reads (engine/nexttoken.py, engine/media.py) through the
real llama.cpp and libmtmd: a tiny f32 Qwen3 (plain RoPE), a tiny Qwen3-VL text
model (interleaved M-RoPE: 4 position dims per token) and a tiny Qwen3.5
(hybrid memory, M-RoPE), each with the tiny llava-style projector.

The reference for every number is libmtmd's own pipeline: the rendered prompt
with mtmd's media marker tokenized by mtmd_tokenize and evaluated from an
empty cache by mtmd_helper_eval_chunks (which sets the image's positions and
continues the text after it the way llama.cpp's own tools do)."""

from __future__ import annotations

import base64
import ctypes
import io
from contextlib import contextmanager

import llama_cpp
import numpy as np
import pytest
from PIL import Image
from tiny_gguf import build_qwen3, build_qwen3vl
from tiny_gguf_more import build_gemma4, build_mmproj, build_qwen35

from gmlx.config import LOAD_DEFAULTS
from gmlx.decisions.decide import admit, decide
from gmlx.decisions.literal import strip_marks
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.types import DecisionSettings, Read
from gmlx.engine import open_reader
from gmlx.engine.context import log_softmax
from gmlx.engine.media import MARKER
from gmlx.engine.model import load_model
from gmlx.errors import InvalidRequest

SETTINGS = DecisionSettings()
STATE = ("Photo of the parcel as delivered. The customer says the box was crushed on one corner and the "
         "screen inside is cracked; they want a replacement before Friday.")
QS = {
    "damaged": {"type": "noul", "instructions": "Is the item damaged?"},
    "team": {"type": "choice", "instructions": "Which team handles it?",
             "criteria": {"returns": "replacements", "billing": "refunds", "shipping": "carriers"}},
    "severity": {"type": "score", "instructions": "How bad is it?", "criteria": ["cosmetic", "broken", "unusable"]},
}
OTHER_QS = {
    "urgent": {"type": "noul", "instructions": "Does the customer need an answer today?"},
    "tone": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "angry"]},
}
IMAGE_TOKENS = 16  # one image on the tiny projector: (32 / 8)^2 patches


def data_url(color=(200, 10, 30), size=(8, 6), fmt="PNG", **save) -> str:
    buf = io.BytesIO()
    im = Image.new("RGB", size, color)
    im.putpixel((1, 1), (color[2], color[0], color[1]))
    im.save(buf, format=fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


RED, BLUE = data_url((220, 20, 20)), data_url((20, 20, 220))


def _settings(**over):
    return {**LOAD_DEFAULTS, "n_gpu_layers": 0, "n_ctx": 2048, "n_threads": 1, **over}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("image_models")
    build_mmproj(d / "mmproj.gguf")
    build_mmproj(d / "merger.gguf", kind="qwen2vl")
    return {"qwen3": build_qwen3(d / "qwen3.gguf"), "qwen3vl": build_qwen3vl(d / "qwen3vl.gguf"),
            "qwen35": build_qwen35(d / "qwen35.gguf"), "gemma4": build_gemma4(d / "gemma4.gguf"), "dir": d}


class Pair:
    """A model with two readers: `cached` (the prefix caches on) and `cold` (prefix_cache_mib 0)."""

    def __init__(self, path, mmproj="mmproj.gguf", **over):
        self.lm = load_model("v", path, _settings(**over))
        self.cached = open_reader(self.lm, _settings(mmproj=mmproj, **over))
        self.cold = open_reader(self.lm, _settings(mmproj=mmproj, prefix_cache_mib=0, **over))

    def close(self):
        self.cached.close()
        self.cold.close()
        self.lm.close()


@contextmanager
def reader_of(path, model_id="v", **over):
    """A reader of the model at `path` with these settings, closed afterwards."""
    lm = load_model(model_id, path, _settings(**over))
    r = open_reader(lm, _settings(**over))
    try:
        yield r
    finally:
        r.close()
        lm.close()


@pytest.fixture(scope="module", params=["qwen3", "qwen3vl", "qwen35"])
def pair(request, files):
    p = Pair(files[request.param])
    p.arch = request.param
    yield p
    p.close()


@pytest.fixture(scope="module", params=["qwen3vl", "qwen35"])
def merger(request, files):
    """An M-RoPE text model with the Qwen2-VL projector: an image takes fewer positions than tokens."""
    p = Pair(files[request.param], mmproj="merger.gguf")
    p.arch = request.param
    yield p
    p.close()


@pytest.fixture(scope="module")
def vl(files):
    p = Pair(files["qwen3vl"])
    yield p
    p.close()


def run(reader, images, state=STATE, questions=QS, **extra):
    body = {"state": state, "questions": questions, "samples": 1, **extra}
    if images:
        body["images"] = images
    d = parse_decision(body, SETTINGS)
    admit(d, reader, SETTINGS)
    return decide(d, reader, SETTINGS, "v")


def logprobs(out) -> dict:
    """What a response says of each question's label log-probabilities: its
    probabilities and its label mass (floats made from them: equal exactly when they are)."""
    return {qid: (out["answers"][qid], q["label_mass"]) for qid, q in out["diagnostics"]["questions"].items()}


def _read(reader, images, questions=QS, state=STATE):
    body = {"state": state, "questions": questions, "images": images}
    d = parse_decision(body, SETTINGS)
    admit(d, reader, SETTINGS)
    reader.reset()
    return d, Read(state=d.state, instructions=None, questions=d.questions, listed=d.questions, answered=(),
                   sample=0, seed=0, images=d.images)


def mtmd_reference(reader, read, q):
    """libmtmd's own evaluation of question q's prompt: label log-probabilities
    and the text tokens mtmd tokenized (to check the prompts are the same)."""
    mt = reader.projector.mt
    text = reader._render(None, read.state, q, (), None, None, media=True)
    images = read.images
    text = strip_marks(text).replace(MARKER, reader.projector.marker * len(images))
    chunks = mt.mtmd_input_chunks_init()
    inp = mt.mtmd_input_text()
    raw = text.encode()
    inp.text = raw
    inp.text_len = len(raw)
    inp.add_special = bool(reader.lm.add_bos)
    inp.parse_special = True
    keep = []
    bitmaps = []
    for im in images:
        data = im.image.tobytes()
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        keep.append(buf)
        bitmaps.append(mt.mtmd_bitmap_init(im.image.width, im.image.height, buf))
    arr = (ctypes.c_void_p * len(bitmaps))(*bitmaps)
    assert mt.mtmd_tokenize(reader.projector.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps)) == 0
    for b in bitmaps:
        mt.mtmd_bitmap_free(b)
    text_tokens = []
    for i in range(mt.mtmd_input_chunks_size(chunks)):
        c = mt.mtmd_input_chunks_get(chunks, i)
        if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t(0)
            ptr = mt.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
            text_tokens += [ptr[k] for k in range(n.value)]
    reader.clear_cache()
    n_past = llama_cpp.llama_pos(0)
    ctx = reader.ctx
    assert mt.mtmd_helper_eval_chunks(reader.projector.ctx, ctx.ctx, chunks, 0, 0, ctx.n_batch, True,
                                      ctypes.byref(n_past)) == 0
    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, -1), shape=(ctx.n_vocab,)).copy()
    mt.mtmd_input_chunks_free(chunks)
    reader.clear_cache()
    lp = log_softmax(row)
    return [float(lp[reader.label_token(lab)]) for lab in q.labels], text_tokens, int(n_past.value)


# -- reading images -----------------------------------------------------------------


def test_images_are_read_and_counted(pair):
    r = pair.cached
    assert r.reads_images and r.strategy == "next-token"
    assert r.projector.mrope == (pair.arch in ("qwen3vl", "qwen35"))
    plain = run(r, None)
    red = run(r, [RED])
    blue = run(r, [BLUE])
    two = run(r, [RED, BLUE])
    text_tokens = plain["usage"]["input_tokens"]
    assert red["usage"]["input_tokens"] == text_tokens + IMAGE_TOKENS
    assert two["usage"]["input_tokens"] == text_tokens + 2 * IMAGE_TOKENS
    assert red["diagnostics"]["strategy"] == "next-token"
    assert red["answers"]["damaged"]["noul"] != plain["answers"]["damaged"]["noul"]
    assert red["answers"]["damaged"]["noul"] != blue["answers"]["damaged"]["noul"]
    assert run(pair.cold, [RED])["answers"] == red["answers"]  # deterministic, cached or not


def test_image_tokens_open_the_user_turn_before_the_state(pair):
    r = pair.cached
    d, read = _read(r, [RED])
    toks = r._prompt(read, d.questions[0]).tokens
    head = r.lm.encode_prompt("<|im_start|>user\n")
    assert toks[:len(head)] == head
    image = toks[len(head):len(head) + IMAGE_TOKENS]
    assert len(set(image)) == 1 and image[0] < 0
    assert r.lm.decode(toks[len(head) + IMAGE_TOKENS:len(head) + IMAGE_TOKENS + 8]).startswith("Photo of")
    assert all(t >= 0 for t in toks[len(head) + IMAGE_TOKENS:])
    # the same picture has the same placeholders in another decision; another picture has others
    d2, read2 = _read(r, [RED], questions=OTHER_QS)
    assert r._prompt(read2, d2.questions[0]).tokens[len(head):len(head) + IMAGE_TOKENS] == image
    d3, read3 = _read(r, [BLUE])
    assert r._prompt(read3, d3.questions[0]).tokens[len(head)] != image[0]
    r.reset()


def test_reads_equal_libmtmd_own_evaluation(pair):
    """Each question's label log-probabilities equal libmtmd evaluating its
    whole prompt (text chunks, image at mtmd's positions) from an empty cache:
    bitwise on the KV-cache models, to float tolerance on the hybrid qwen35."""
    r = pair.cold
    for images in ([RED], [RED, BLUE]):
        d, read = _read(r, images)
        slots = r.read(read).slots
        for q in d.questions:
            ours = r._prompt(read, q).tokens
            ref, ref_text, n_past = mtmd_reference(r, read, q)
            assert [t for t in ours if t >= 0] == ref_text  # the same prompt
            assert n_past == len(ours)  # mtmd's positions: 16 per image (max(16 x 1) patches under M-RoPE)
            if pair.arch == "qwen35":
                assert list(slots[q.id].logprobs) == pytest.approx(ref, abs=1e-4)
            else:
                assert list(slots[q.id].logprobs) == ref, q.id


WIDE = data_url((30, 120, 200), size=(64, 32))  # 4 x 2 merged patches on the Qwen2-VL projector


def test_an_m_rope_image_takes_fewer_positions_than_tokens(merger):
    r = merger.cold
    d, read = _read(r, [WIDE])
    slots = r.read(read).slots
    media = r._media_for(read.images)
    ((_, n_tok, n_pos),) = media.chunks.values()
    assert (n_tok, n_pos) == (8, 4)  # 4 x 2 tokens, max(4, 2) positions
    wrap = [t for t in media.tokens if t >= 0]
    assert r.lm.decode(wrap) == "<|vision_start|><|vision_end|>"  # libmtmd's wrapper text, kept
    for q in d.questions:
        toks = r._prompt(read, q).tokens
        ref, ref_text, n_past = mtmd_reference(r, read, q)
        assert [t for t in toks if t >= 0] == ref_text
        assert n_past == len(toks) - (n_tok - n_pos)  # the text after the image continues 4 positions on
        layout = r._layout
        start = layout.runs[0][0]
        assert layout.pos(start + n_tok) == start + n_pos
        if merger.arch == "qwen35":
            assert list(slots[q.id].logprobs) == pytest.approx(ref, abs=1e-4)
        else:
            assert list(slots[q.id].logprobs) == ref, q.id
    plain = run(r, None)
    assert run(r, [WIDE])["usage"]["input_tokens"] == plain["usage"]["input_tokens"] + n_tok + len(wrap)


def test_m_rope_image_prefix_in_the_cache(merger):
    r, cold = merger.cached, merger.cold
    r.clear_cache()
    run(r, [WIDE], questions=QS)
    second = run(r, [WIDE], questions=OTHER_QS)
    assert second["usage"]["cached_tokens"] >= 8 + len(r.lm.encode(STATE))
    assert logprobs(second) == logprobs(run(cold, [WIDE], questions=OTHER_QS))
    if merger.arch == "qwen3vl":  # put aside in host memory and restored (KV cache only)
        run(r, None, state="another state entirely, long enough to be a prefix of its own " * 3)
        back = run(r, [WIDE], questions=QS)
        assert back["usage"]["cached_tokens"] >= 8 + len(r.lm.encode(STATE))
        assert logprobs(back) == logprobs(run(cold, [WIDE], questions=QS))


def test_text_after_the_image_must_continue_at_mtmd_position(vl):
    """The check above can fail: on M-RoPE, text one position later than mtmd's
    reads other numbers (llama.cpp accepts the gap)."""
    r = vl.cold
    d, read = _read(r, [RED])
    q = d.questions[0]
    ref, _, _ = mtmd_reference(r, read, q)
    toks = r._prompt(read, q).tokens
    media = r._media_for(read.images)
    from gmlx.engine.media import Layout

    r.clear_cache()
    r._layout = Layout(toks, media.chunks)
    entries = r._entries(toks, 0, 0, True)
    shifted = [e if e.token < 0 or i < r._layout.media_end else type(e)(e.token, e.pos + 1, e.seq, e.logits)
               for i, e in enumerate(entries)]
    row = r._decode_run(shifted)[len(toks) - 1]
    lp = log_softmax(row)
    moved = [float(lp[r.label_token(lab)]) for lab in q.labels]
    assert max(abs(a - b) for a, b in zip(moved, ref)) > 1e-3
    r.reset()
    r.clear_cache()


@pytest.mark.parametrize("images", [[RED], None], ids=["image", "text"])
def test_batch_invariance_with_images(pair, images):
    """A question's numbers do not depend on the questions beside it (bitwise),
    on the hybrid qwen35 too."""
    r = pair.cold
    alone = run(r, images, questions={"damaged": QS["damaged"]})
    together = run(r, images, questions={**OTHER_QS, "damaged": QS["damaged"], "team": QS["team"]})
    assert logprobs(alone)["damaged"] == logprobs(together)["damaged"]
    assert alone["answers"]["damaged"] == together["answers"]["damaged"]


def test_a_thought_sees_the_images(files):
    p = Pair(files["qwen3"])
    try:
        plain = run(p.cold, None, think=12, seed=3)
        seen = run(p.cold, [RED], think=12, seed=3)
        again = run(p.cold, [RED], think=12, seed=3)
        assert seen["diagnostics"]["thought"]["text"] != plain["diagnostics"]["thought"]["text"]
        assert seen["diagnostics"]["thought"]["text"] == again["diagnostics"]["thought"]["text"]
        assert seen["answers"] == again["answers"]
    finally:
        p.close()


# -- the image prefix in the prefix cache --------------------------------------------


def test_same_images_and_state_reuse_the_image_prefix(pair):
    r, cold = pair.cached, pair.cold
    r.clear_cache()
    first = run(r, [RED], questions=QS)
    second = run(r, [RED], questions=OTHER_QS)
    reference = run(cold, [RED], questions=OTHER_QS)
    assert second["answers"] == reference["answers"]
    assert logprobs(second) == logprobs(reference)  # bitwise
    # the template's head, the image and the state came from the first decision
    # (on qwen35's hybrid memory too: its prefix ends at the end of the state, engine/hybrid.py)
    assert second["usage"]["cached_tokens"] >= IMAGE_TOKENS + len(r.lm.encode(STATE))
    assert second["diagnostics"]["evaluated_tokens"] < reference["diagnostics"]["evaluated_tokens"] / 2
    assert first["usage"]["cached_tokens"] == 0
    assert reference["usage"]["cached_tokens"] == 0


def test_other_images_or_none_reuse_nothing(vl):
    r, cold = vl.cached, vl.cold
    r.clear_cache()
    run(r, [RED])
    blue = run(r, [BLUE])
    text = run(r, None)  # the same state, no images: not even the template's head is shared
    assert blue["usage"]["cached_tokens"] == 0 and text["usage"]["cached_tokens"] == 0
    assert logprobs(blue) == logprobs(run(cold, [BLUE]))
    assert logprobs(text) == logprobs(run(cold, None))
    back = run(r, [RED], questions=OTHER_QS)  # RED's prefix was put aside in host memory
    assert back["usage"]["cached_tokens"] >= IMAGE_TOKENS + len(r.lm.encode(STATE))
    assert logprobs(back) == logprobs(run(cold, [RED], questions=OTHER_QS))


def test_the_cache_keys_images_by_their_pixels(vl):
    """The same pixels sent as PNG and as lossless WebP are one image to the cache."""
    r = vl.cached
    r.clear_cache()
    png = run(r, [data_url((90, 160, 30))])
    webp = run(r, [data_url((90, 160, 30), fmt="WEBP", lossless=True)], questions=OTHER_QS)
    assert webp["usage"]["cached_tokens"] >= IMAGE_TOKENS
    assert png["usage"]["cached_tokens"] == 0
    assert logprobs(webp) == logprobs(run(vl.cold, [data_url((90, 160, 30))], questions=OTHER_QS))


def test_cache_salt_partitions_image_prefixes(vl):
    r = vl.cached
    r.clear_cache()
    run(r, [RED], cache_salt="a")
    other = run(r, [RED], questions=OTHER_QS, cache_salt="b")
    same = run(r, [RED], questions=OTHER_QS, cache_salt="a")
    assert other["usage"]["cached_tokens"] == 0
    assert same["usage"]["cached_tokens"] >= IMAGE_TOKENS
    assert logprobs(other) == logprobs(same)


# -- errors --------------------------------------------------------------------------


def test_no_projector_and_winnow_refuse_images(files):
    d = parse_decision({"state": "s", "questions": QS, "images": [RED]}, SETTINGS)
    with reader_of(files["qwen3"], "plain") as r, pytest.raises(InvalidRequest) as e:
        admit(d, r, SETTINGS)
    assert e.value.status == 400 and e.value.param == "images"
    assert "'plain' (next-token) has none" in str(e.value) and "mmproj" in str(e.value)
    with reader_of(files["gemma4"], "w", read_strategy="winnow", mmproj="mmproj.gguf") as w:
        assert w.projector is None and not w.reads_images
        d = parse_decision({"state": "s", "questions": QS, "images": [RED]}, SETTINGS)
        with pytest.raises(InvalidRequest) as e:
            admit(d, w, SETTINGS)
    assert e.value.param == "images" and "not part of Winnow's turn serialization" in str(e.value)


def test_images_count_against_the_context(files):
    with reader_of(files["qwen3"], n_ctx=256, mmproj="mmproj.gguf") as r:
        state = "word " * 70
        ok = parse_decision({"state": state, "questions": {"q": QS["damaged"]}}, SETTINGS)
        admit(ok, r, SETTINGS)  # fits without images
        d = parse_decision({"state": state, "questions": {"q": QS["damaged"]}, "images": [RED] * 8}, SETTINGS)
        with pytest.raises(InvalidRequest) as e:
            admit(d, r, SETTINGS)
    assert e.value.status == 400 and f"({8 * IMAGE_TOKENS} of them for the images)" in str(e.value)


def test_a_template_that_drops_the_images_place_is_400(files):
    cut = ("{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'][3:] }}<|im_end|>\n{%- endfor -%}"
           "<|im_start|>assistant\n")
    d = parse_decision({"state": STATE, "questions": QS, "images": [RED]}, SETTINGS)
    with reader_of(files["qwen3"], chat_template=cut, mmproj="mmproj.gguf") as r, pytest.raises(InvalidRequest) as e:
        admit(d, r, SETTINGS)
    assert e.value.param == "images" and "drops the start of the user message" in str(e.value)
