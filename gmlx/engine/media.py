"""Images on decision requests (SPEC 4.1 `images`, 5, 9): checking and decoding.

`images` is a list of data URLs (`data:image/png|jpeg|webp;base64,...`); http(s)
URLs only with `server.media.allow_urls`. Every problem is the SPEC error
envelope: 400 `invalid_request_error` for a malformed, undecodable or
unsupported image, too many images, or `audio` / `videos` (not supported);
413 `request_too_large` for an image over `max_image_bytes`. Images are
decoded with Pillow and converted to RGB; Liquid d1 shrinks them to fit
1024 x 1024 (aspect kept).

What this build does not do yet: read images through libmtmd
(`llama_cpp.mtmd_cpp`). Every request whose images pass these checks still gets
400 naming the missing projector support (`images_unsupported`), so nothing is
read without its images.

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


def check_other_media(body: dict) -> None:
    """`audio` and `videos` are not read by any gmlx model: 400 saying what is."""
    for name in ("audio", "videos"):
        value = body.get(name)
        if value is None or (isinstance(value, (list, dict, str)) and not value):
            continue
        raise InvalidRequest(f"{name} is not supported; supported media are {SUPPORTED}", param=name)


def decode_images(images: Any, limits: MediaLimits = MediaLimits()) -> list:
    """The request's images as RGB Pillow images, in order; raises 400 / 413."""
    if images is None:
        return []
    if not isinstance(images, list):
        raise InvalidRequest(f"images must be a list of data URLs; {SUPPORTED}", param="images")
    if len(images) > limits.max_images:
        raise InvalidRequest(f"too many images: {len(images)}, at most {limits.max_images}", param="images")
    return [decode_image(item, i, limits) for i, item in enumerate(images)]


def decode_image(item: Any, index: int, limits: MediaLimits = MediaLimits()):
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


def check_request_media(body: dict, limits: MediaLimits = MediaLimits()) -> None:
    """Admission of a body's media: audio/videos 400; images checked and
    decoded (400/413), then 400 because no served model reads them yet."""
    check_other_media(body)
    images = body.get("images")
    if images is None or (isinstance(images, (list, dict, str)) and not images):
        return
    decoded = decode_images(images, limits)
    raise InvalidRequest(
        f"{len(decoded)} image(s) given, but images need a model configured with an mmproj projector, and this "
        "build of gmlx does not read images through libmtmd yet",
        param="images",
    )
