"""Image decoding with Pillow under decompression-bomb limits.

``decode_image(data, part)`` accepts PNG, JPEG, WebP and GIF (first frame) bytes and returns an RGB
``PIL.Image``. Every failure is an ``ImageError`` (HTTP 400) whose message and ``param`` name the message
part, never a 500:

* unsupported format (anything Pillow identifies as another format, or nothing);
* more than ``MAX_IMAGE_PIXELS`` pixels (checked from the header before decoding, and by Pillow's own
  ``DecompressionBombError``) or a side above ``MAX_IMAGE_SIDE``;
* broken or truncated data (``Image.load`` fails; truncated images are not accepted half-decoded).

Limits come from the environment: ``MM_MAX_IMAGE_PIXELS`` (default 40 megapixels, far below vLLM's
178,956,970), ``MM_MAX_IMAGE_SIDE`` (default 16384).
"""

from __future__ import annotations

import binascii
import io
import re
import warnings
from typing import TYPE_CHECKING

import pybase64

from inference.shared.config import SETTINGS

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

MAX_IMAGE_PIXELS = SETTINGS.mm_max_image_pixels
MAX_IMAGE_SIDE = SETTINGS.mm_max_image_side
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


class ImageError(ValueError):
    """A client image that cannot be used (HTTP 400); ``param`` names the message part."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_image"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def parse_data_url(url: str, part: str, max_bytes: int) -> bytes:
    """The bytes of an RFC 2397 ``data:`` URL (base64 only, as vLLM). Raises ``ImageError``."""
    m = _DATA_URL.match(url[:512])
    if not m:
        raise ImageError(f"{part}: malformed data: URL", part)
    if not m.group("b64"):
        raise ImageError(f"{part}: only base64 data: URLs are supported", part)
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise ImageError(f"{part}: data: URL media type {mime!r} is not an image", part)
    payload = url[m.end():]
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageError(f"{part}: image is larger than {max_bytes} bytes", part, "image_too_large")
    try:
        # pybase64: SIMD decoding, ~50x faster than the standard library's (0.2 ms vs 10 ms for 4 MB)
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{part}: data: URL is not valid base64", part) from None


def decode_image(data: bytes, part: str) -> PILImage:
    """Decode ``data`` to an RGB ``PIL.Image.Image`` (GIF: first frame). Raises ``ImageError``."""
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS  # Pillow raises DecompressionBombError above 2× this
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(FORMATS))
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS or max(w, h) > MAX_IMAGE_SIDE:
                raise ImageError(f"{part}: image is {w}x{h} pixels; the limit is {MAX_IMAGE_PIXELS} pixels "
                                 f"and {MAX_IMAGE_SIDE} per side", part, "image_too_large")
            if getattr(img, "is_animated", False):
                img.seek(0)
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{part}: image has too many pixels (decompression bomb limit)", part,
                         "image_too_large") from None
    except UnidentifiedImageError:
        raise ImageError(f"{part}: not a supported image (PNG, JPEG, WebP or GIF)", part,
                         "unsupported_image") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"{part}: broken or truncated image ({exc})", part) from None
