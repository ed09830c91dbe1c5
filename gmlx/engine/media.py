"""Images on decision requests (SPEC 4.1 `images`, 5, 9): checking and decoding.

`images` is a list of data URLs (`data:image/png|jpeg|webp;base64,...`); http(s)
URLs only with `server.media.allow_urls`. Every problem is the SPEC error
envelope: 400 `invalid_request_error` for a malformed, undecodable or
unsupported image, too many images, or `audio` / `videos` (not supported);
413 `request_too_large` for an image over `max_image_bytes`. Images are
decoded with Pillow and converted to RGB; Liquid d1 shrinks them to fit
1024 x 1024 (aspect kept).

Images are read through libmtmd (`llama_cpp.mtmd_cpp`, `Projector` below) by
the next-token readers (next-token, Qwen3.5, Liquid d1) of a model configured
with `mmproj`: admission puts them on the decision's state (`attach`), the
reader renders its prompt with MARKER where they go and puts each image's
tokens there (`MediaSet`, placeholders keyed by the pixels' hash), and
evaluates the image chunks where their placeholders are (`Layout`). Every
other reader refuses a decision with images (400, `no_projector`), so nothing
is read without its images.

Imports no llama.cpp (the decision core calls it at parse time).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ..decisions.literal import CLOSE as LITERAL_CLOSE
from ..decisions.literal import OPEN as LITERAL_OPEN
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


# -- images on an admitted decision ----------------------------------------------


@dataclass(frozen=True)
class ReadImage:
    image: Any  # RGB Pillow image, as the projector reads it
    key: bytes  # its identity for the prefix caches: a hash of mode, size and pixels


def image_key(image) -> bytes:
    """blake2b of the decoded pixels (never an object id): the same picture
    sent again, in any encoding that decodes to the same pixels, is the same key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.digest()


def attach(decision, images) -> None:
    """Replace the decision's images by `images` (RGB Pillow images, as the
    reader will read them) with their content keys; every Read of the decision
    carries them (`Read.images`), a content-free calibration read none."""
    decision.images = tuple(ReadImage(im, image_key(im)) for im in images)


# Where a rendered prompt's images go: a random marker (caller text cannot
# forge it), split out before tokenization (split_at_marker).
MARKER = "\ue002" + secrets.token_hex(8) + "\ue002"


def split_at_marker(text: str) -> tuple[str, str] | None:
    """The rendered prompt before and after the images' marker, each still
    marked up for LoadedModel.encode_prompt: when the marker sits inside caller
    text (a chat template wraps the whole message), the text after it is
    reopened as caller text. None when the template dropped the marker."""
    at = text.find(MARKER)
    if at < 0:
        return None
    head, rest = text[:at], text[at + len(MARKER):]
    if head.rfind(LITERAL_OPEN) > head.rfind(LITERAL_CLOSE):
        rest = LITERAL_OPEN + rest
    return head, rest


# -- libmtmd: the projector ------------------------------------------------------


@dataclass
class ImageSpan:
    """One image as the text model reads it: mtmd's chunks for one image marker.

    `tokens` holds the text tokens of the projector's own wrappers (such as
    `<|vision_start|>`) and, for each image chunk, one placeholder per image
    token: a negative id derived from the image's key, its place among the
    decision's images and the chunk's index, so two prompts share the
    placeholders exactly when they share the picture there. `chunks` maps a
    placeholder to (chunk, tokens, positions); under M-RoPE an image takes
    fewer positions than tokens."""

    handle: Any
    tokens: list[int]
    chunks: dict[int, tuple[Any, int, int]]


def placeholder(key: bytes, occurrence: int, index: int) -> int:
    digest = hashlib.blake2b(key + occurrence.to_bytes(4, "little") + index.to_bytes(4, "little"), digest_size=7)
    return -1 - int.from_bytes(digest.digest(), "little")


class Projector:
    """A model's multimodal projector (`mmproj`), loaded through libmtmd.

    `span(image, i)` turns the decision's i-th image into an ImageSpan;
    `eval_into` evaluates one image chunk into a llama.cpp context at a given
    position on one sequence and returns the next position (mtmd's: under
    M-RoPE an image advances it by max(width, height) in patches, not by its
    tokens). Caller text is never tokenized through mtmd: gmlx's own tokenizer
    keeps it plain (decisions/literal.py)."""

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
        self.mrope = bool(mt.mtmd_decode_use_mrope(self.ctx))

    def span(self, image: ReadImage, occurrence: int) -> ImageSpan:
        import ctypes

        mt = self.mt
        data = image.image.tobytes()
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        bitmap = mt.mtmd_bitmap_init(image.image.width, image.image.height, buf)
        handle = mt.mtmd_input_chunks_init()
        text = mt.mtmd_input_text()
        raw = self.marker.encode()
        text.text = raw
        if hasattr(text, "text_len"):
            text.text_len = len(raw)
        text.add_special = False
        text.parse_special = False
        arr = (ctypes.c_void_p * 1)(bitmap)
        rc = mt.mtmd_tokenize(self.ctx, handle, ctypes.byref(text), arr, 1)
        mt.mtmd_bitmap_free(bitmap)
        if rc != 0:
            mt.mtmd_input_chunks_free(handle)
            raise InvalidRequest(f"images[{occurrence}]: the projector could not process it (mtmd_tokenize {rc})",
                                 param="images")
        tokens: list[int] = []
        chunks: dict[int, tuple[Any, int, int]] = {}
        for i in range(mt.mtmd_input_chunks_size(handle)):
            c = mt.mtmd_input_chunks_get(handle, i)
            if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ptr = mt.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                tokens += [int(ptr[k]) for k in range(n.value)]
                continue
            n_tok = int(mt.mtmd_input_chunk_get_n_tokens(c))
            n_pos = int(mt.mtmd_input_chunk_get_n_pos(c))
            ph = placeholder(image.key, occurrence, i)
            chunks[ph] = (c, n_tok, n_pos)
            tokens += [ph] * n_tok
        return ImageSpan(handle, tokens, chunks)

    def non_causal(self, chunk) -> bool:
        return bool(self.mt.mtmd_decode_use_non_causal(self.ctx, chunk))

    def eval_into(self, context, chunk, n_past: int, seq: int) -> int:
        """Evaluate one image chunk at n_past on `seq`; returns the next position."""
        import ctypes

        from ..errors import ServerError

        if not 0 <= seq < context.n_seq_max:
            raise ServerError(f"internal: sequence id {seq} outside 0..{context.n_seq_max - 1}")
        n_tok = int(self.mt.mtmd_input_chunk_get_n_tokens(chunk))
        # An image is decoded in slices of n_batch by the helper; a non-causal
        # image must fit one ubatch or llama.cpp aborts (admission checks it
        # first: MediaSet.check_fits).
        if self.non_causal(chunk) and n_tok > context.n_ubatch:
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


def load_projector(lm, settings: dict) -> Projector | None:
    """The model's `mmproj` (a path, relative to the model's GGUF directory), or
    None without one; a missing or unloadable file fails the load."""
    from pathlib import Path

    from ..errors import ModelLoadError

    mmproj = settings.get("mmproj")
    if not mmproj:
        return None
    path = Path(mmproj).expanduser()
    if not path.is_absolute():
        path = Path(lm.path).parent / path
    if not path.is_file():
        raise ModelLoadError(f"model {lm.model_id!r}: mmproj {path} is missing")
    try:
        return Projector(lm, path, settings.get("n_threads"))
    except ValueError as err:
        raise ModelLoadError(f"model {lm.model_id!r}: {err}") from None


class MediaSet:
    """The spans of one decision's images, in request order: the tokens that
    stand for them in a prompt and the chunks behind their placeholders.
    Holds libmtmd memory until close()."""

    def __init__(self, projector: Projector, images: tuple):
        self.key = tuple(im.key for im in images)
        self.spans: list[ImageSpan] = []
        try:
            for i, im in enumerate(images):
                self.spans.append(projector.span(im, i))
        except BaseException:
            self.close(projector)
            raise
        self.projector = projector
        self.tokens = [t for s in self.spans for t in s.tokens]
        self.chunks = {ph: c for s in self.spans for ph, c in s.chunks.items()}

    @property
    def image_tokens(self) -> int:
        return sum(n for _, n, _ in self.chunks.values())

    def check_fits(self, n_ubatch: int) -> None:
        """A non-causal image must fit one ubatch (llama.cpp aborts otherwise)."""
        for chunk, n_tok, _ in self.chunks.values():
            if n_tok > n_ubatch and self.projector.non_causal(chunk):
                raise InvalidRequest(f"an image takes {n_tok} tokens, more than this model's n_ubatch {n_ubatch}; "
                                     "send smaller images or serve the model with a larger n_ubatch", param="images")

    def close(self, projector: Projector | None = None) -> None:
        mt = (projector or self.projector).mt
        for s in self.spans:
            mt.mtmd_input_chunks_free(s.handle)
        self.spans = []


class Layout:
    """Where a prompt's image chunks lie among its tokens, and each token's
    position: an image chunk's tokens all sit at the chunk's first position
    (libmtmd gives them their own 2-D positions under M-RoPE), and the text
    after it continues at the position libmtmd returns for it (start + its
    positions, which under M-RoPE are fewer than its tokens)."""

    def __init__(self, tokens=(), chunks: dict | None = None):
        self.runs: list[tuple[int, int, int, Any]] = []  # (start, stop, shift before, chunk)
        self.shift = 0  # tokens minus positions of every run
        if not chunks:
            self.media_end = 0
            return
        i, n = 0, len(tokens)
        while i < n:
            t = tokens[i]
            if t >= 0:
                i += 1
                continue
            chunk, n_tok, n_pos = chunks[t]
            self.runs.append((i, i + n_tok, self.shift, chunk))
            self.shift += n_tok - n_pos
            i += n_tok
        self.media_end = self.runs[-1][1] if self.runs else 0

    def pos(self, i: int) -> int:
        for start, stop, shift, _ in self.runs:
            if i < start:
                return i - shift
            if i < stop:
                return start - shift
        return i - self.shift

    def snap(self, i: int) -> int:
        """`i`, or the start of the image chunk it falls inside."""
        for start, stop, _, _ in self.runs:
            if start < i < stop:
                return start
        return i

    def media_within(self, n: int) -> int:
        """The end of the last image chunk among the first n tokens (0: none)."""
        end = 0
        for _, stop, _, _ in self.runs:
            if stop <= n:
                end = stop
        return end

    def chunk_at(self, i: int):
        for start, _, _, chunk in self.runs:
            if start == i:
                return chunk
        return None


NO_IMAGES = Layout()


def no_projector(model_id: str, strategy: str | None) -> InvalidRequest:
    if strategy == "winnow":
        why = ("images are not part of Winnow's turn serialization: the winnow read strategy reads text (and JSON "
               "states) only")
    elif strategy == "canvas":
        why = "canvas reads take text only"
    else:
        why = f"images need a model configured with an mmproj projector; model {model_id!r} ({strategy}) has none"
    return InvalidRequest(why, param="images")
