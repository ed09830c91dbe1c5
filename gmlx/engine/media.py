"""Images on decision requests (SPEC 4.1 `images`, 5, 9): checking and decoding.

`images` is a list of data URLs (`data:image/png|jpeg|webp;base64,...`); http(s)
URLs only with `server.media.allow_urls`. Every problem is the SPEC error
envelope: 400 `invalid_request_error` for a malformed, undecodable or
unsupported image, too many images, or `audio` / `videos` (not supported);
413 `request_too_large` for an image over `max_image_bytes`. Images are
decoded with Pillow and converted to RGB; Liquid d1 shrinks them to fit
1024 x 1024 (aspect kept).

Images are read through libmtmd (`llama_cpp.mtmd_cpp`, `Projector` below) by
the Liquid d1 reader of a model configured with `mmproj`; every other reader
refuses a decision with images (400, `no_projector`), so nothing is read
without its images.

Imports no llama.cpp (the decision core calls it at parse time).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest, RequestTooLarge

FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
LIQUID_MAX_SIDE = 1024
SUPPORTED = "images: a list of PNG, JPEG or WebP data URLs, for a model configured with an mmproj projector"
_DATA_URL = re.compile(r"^data:image/([A-Za-z0-9.+-]+);base64,(.*)$", re.S)


@dataclass(frozen=True)
class MediaLimits:
    allow_urls: bool = False
    max_images: int = 8
    max_image_bytes: int = 10 * 1024 * 1024
    fetch_timeout_s: float = 10.0


_limits = MediaLimits()


def configure(media) -> None:
    """The server's `server.media` (gmlx.config.MediaConfig) for every later request."""
    global _limits
    _limits = MediaLimits(allow_urls=bool(media.allow_urls), max_images=int(media.max_images),
                          max_image_bytes=int(media.max_image_bytes), fetch_timeout_s=float(media.fetch_timeout_s))


def limits() -> MediaLimits:
    return _limits


def check_other_media(body: dict) -> None:
    """`audio` and `videos` are not read by any gmlx model: 400 saying what is."""
    for name in ("audio", "videos"):
        value = body.get(name)
        if value is None or (isinstance(value, (list, dict, str)) and not value):
            continue
        raise InvalidRequest(f"{name} is not supported; supported media are {SUPPORTED}", param=name)


def decode_images(images: Any, limits: MediaLimits | None = None) -> list:
    """The request's images as RGB Pillow images, in order; raises 400 / 413."""
    limits = limits or _limits
    if images is None:
        return []
    if not isinstance(images, list):
        raise InvalidRequest(f"images must be a list of data URLs; {SUPPORTED}", param="images")
    if len(images) > limits.max_images:
        raise InvalidRequest(f"too many images: {len(images)}, at most {limits.max_images}", param="images")
    return [decode_image(item, i, limits) for i, item in enumerate(images)]


def decode_image(item: Any, index: int, limits: MediaLimits | None = None):
    limits = limits or _limits
    param = "images"  # the index is in the message
    if isinstance(item, dict):  # {"url": ...} / {"image_url": {"url": ...}} shapes
        inner = item.get("image_url", item)
        item = inner.get("url") if isinstance(inner, dict) else inner
    if not isinstance(item, str):
        raise InvalidRequest(f"images[{index}] must be a data URL string", param=param)
    if item.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise InvalidRequest(
                f"images[{index}]: http(s) URLs are not fetched (server.media.allow_urls is off); send a data URL",
                param=param)
        raw = _fetch(item, index, limits)
        fmt = None
    else:
        m = _DATA_URL.match(item)
        if not m:
            raise InvalidRequest(f"images[{index}] is not a base64 data URL (data:image/png;base64,...)", param=param)
        fmt = FORMATS.get(m.group(1).lower())
        if fmt is None:
            raise InvalidRequest(f"images[{index}]: image/{m.group(1)} is not supported (PNG, JPEG, WebP)", param=param)
        b64 = m.group(2).strip()
        if len(b64) * 3 // 4 > limits.max_image_bytes + 3:
            raise RequestTooLarge(f"images[{index}] is larger than {limits.max_image_bytes} bytes", param=param)
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"images[{index}]: the data URL's base64 is malformed", param=param) from None
    if len(raw) > limits.max_image_bytes:
        raise RequestTooLarge(f"images[{index}] is larger than {limits.max_image_bytes} bytes", param=param)
    return _open(raw, fmt, index, param)


def _open(raw: bytes, fmt: str | None, index: int, param: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as im:
            if im.format not in set(FORMATS.values()):
                raise InvalidRequest(f"images[{index}]: {im.format} images are not supported (PNG, JPEG, WebP)",
                                     param=param)
            if fmt is not None and im.format != fmt:
                raise InvalidRequest(f"images[{index}]: the data URL says {fmt} but the bytes are {im.format}",
                                     param=param)
            if im.width * im.height > 64 * 1024 * 1024:
                raise RequestTooLarge(f"images[{index}] has too many pixels ({im.width} x {im.height})", param=param)
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise InvalidRequest(f"images[{index}] cannot be decoded as PNG, JPEG or WebP", param=param) from None


def _fetch(url: str, index: int, limits: MediaLimits) -> bytes:
    import httpx

    param = "images"  # the index is in the message
    try:
        with httpx.stream("GET", url, timeout=limits.fetch_timeout_s, follow_redirects=False) as r:
            if r.status_code != 200:
                raise InvalidRequest(f"images[{index}]: fetching it answered HTTP {r.status_code}", param=param)
            out = bytearray()
            for chunk in r.iter_bytes():
                out += chunk
                if len(out) > limits.max_image_bytes:
                    raise RequestTooLarge(f"images[{index}] is larger than {limits.max_image_bytes} bytes", param=param)
            return bytes(out)
    except httpx.HTTPError as err:
        raise InvalidRequest(f"images[{index}] could not be fetched ({type(err).__name__})", param=param) from None


def shrink(image, max_side: int = LIQUID_MAX_SIDE):
    """At most max_side x max_side, aspect kept (Liquid d1's reference)."""
    if image.width <= max_side and image.height <= max_side:
        return image
    out = image.copy()
    out.thumbnail((max_side, max_side))
    return out


def check_request_media(body: dict, limits: MediaLimits | None = None) -> tuple:
    """Admission of a body's media: audio/videos 400; images checked and
    decoded (400/413). Returns the decoded images (a model without a projector
    refuses them with 400 at its reader's check: `no_projector`)."""
    check_other_media(body)
    images = body.get("images")
    if images is None or (isinstance(images, (list, dict, str)) and not images):
        return ()
    return tuple(decode_images(images, limits))


# -- libmtmd: the projector ------------------------------------------------------


class Projector:
    """A model's multimodal projector (`mmproj`), loaded through libmtmd.

    `encode(image)` turns one RGB image into an mtmd image chunk; `eval_into`
    evaluates such chunks into a llama.cpp context at given positions on one
    sequence. Text is never tokenized through mtmd: gmlx's own tokenizer keeps
    caller text plain (decisions/literal.py)."""

    def __init__(self, lm, path, n_threads: int | None = None):
        import llama_cpp.mtmd_cpp as mt

        self.mt = mt
        self.path = str(path)
        params = mt.mtmd_context_params_default()
        params.use_gpu = bool(lm.gpu_layers)
        params.print_timings = False
        if n_threads:
            params.n_threads = int(n_threads)
        if hasattr(params, "warmup"):
            params.warmup = True
        try:  # libmtmd's chatter goes where llama.cpp's does (debug log)
            import ctypes

            from .model import _llama_log

            mt.mtmd_helper_log_set(_llama_log, ctypes.c_void_p(0))
        except Exception:  # noqa: BLE001 - a binding without it: stderr it is
            pass
        self.ctx = mt.mtmd_init_from_file(self.path.encode(), lm.model, params)
        if not self.ctx:
            raise ValueError(f"libmtmd could not load the projector {self.path} for this model")
        if not mt.mtmd_support_vision(self.ctx):
            mt.mtmd_free(self.ctx)
            self.ctx = None
            raise ValueError(f"the projector {self.path} has no vision encoder")
        self.marker = mt.mtmd_default_marker().decode()

    def chunks(self, image):
        """(chunks handle, [image chunk pointers], positions they take, tokens they count)."""
        import ctypes

        mt = self.mt
        data = image.tobytes()
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        bitmap = mt.mtmd_bitmap_init(image.width, image.height, buf)
        chunks = mt.mtmd_input_chunks_init()
        text = mt.mtmd_input_text()
        raw = self.marker.encode()
        text.text = raw
        if hasattr(text, "text_len"):
            text.text_len = len(raw)
        text.add_special = False
        text.parse_special = False
        arr = (ctypes.c_void_p * 1)(bitmap)
        rc = mt.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), arr, 1)
        mt.mtmd_bitmap_free(bitmap)
        if rc != 0:
            mt.mtmd_input_chunks_free(chunks)
            raise InvalidRequest(f"the projector could not process an image (mtmd_tokenize {rc})", param="images")
        out, pos, toks = [], 0, 0
        for i in range(mt.mtmd_input_chunks_size(chunks)):
            c = mt.mtmd_input_chunks_get(chunks, i)
            if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                out.append(c)
                pos += int(mt.mtmd_input_chunk_get_n_pos(c))
                toks += int(mt.mtmd_input_chunk_get_n_tokens(c))
        return chunks, out, pos, toks

    def eval_into(self, context, chunk, n_past: int, seq: int) -> int:
        """Evaluate one image chunk at n_past on `seq`; returns the next position."""
        import ctypes

        from ..errors import ServerError

        if not 0 <= seq < context.n_seq_max:
            raise ServerError(f"internal: sequence id {seq} outside 0..{context.n_seq_max - 1}")
        n_tok = int(self.mt.mtmd_input_chunk_get_n_tokens(chunk))
        # An image is decoded in slices of n_batch by the helper; a non-causal
        # image must fit one ubatch or llama.cpp aborts.
        if self.mt.mtmd_decode_use_non_causal(self.ctx, chunk) and n_tok > context.n_ubatch:
            raise InvalidRequest(f"an image takes {n_tok} tokens, more than n_ubatch {context.n_ubatch}",
                                 param="images")
        new = ctypes.c_int(0)
        rc = self.mt.mtmd_helper_eval_chunk_single(self.ctx, context.ctx, chunk, n_past, seq,
                                                   int(context.n_batch), False, ctypes.byref(new))
        if rc != 0:
            raise ServerError(f"libmtmd failed to evaluate an image (code {rc})")
        return int(new.value)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.mt.mtmd_free(self.ctx)
            self.ctx = None


def no_projector(model_id: str, strategy: str | None) -> InvalidRequest:
    return InvalidRequest(
        f"images need a model configured with an mmproj projector read by the liquid strategy; model "
        f"{model_id!r} ({strategy}) has none", param="images")


class ImageRegistry:
    """Decoded images of admitted decisions, found again from a read's state.

    The decision core hands readers a Read (state, questions, ...), not the
    request's images; a decision's reads carry its state object itself, so the
    images are keyed by that object's identity (the object is kept alive with
    them, so its id cannot be reused). Bounded: the oldest entries go first."""

    def __init__(self, size: int = 256):
        import threading
        from collections import OrderedDict

        self._items: "OrderedDict[int, tuple[str, tuple]]" = OrderedDict()
        self._lock = threading.Lock()
        self.size = size

    def put(self, state: str, images: tuple) -> None:
        with self._lock:
            self._items[id(state)] = (state, images)
            self._items.move_to_end(id(state))
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, state: str) -> tuple:
        with self._lock:
            item = self._items.get(id(state))
        return item[1] if item is not None and item[0] is state else ()
