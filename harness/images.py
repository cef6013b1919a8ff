"""Test images made with Pillow (fixed seeds), and the data URLs a chat request carries them in."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def image_bytes(fmt: str = "PNG", size=(90, 60), seed: int = 0) -> bytes:
    """An image of ``size`` (width, height) random pixels drawn from ``seed``, encoded as ``fmt`` (a Pillow format;
    ``GIF``: two frames)."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))
    buf = io.BytesIO()
    if fmt == "GIF":
        frames = [img.convert("P"), Image.new("P", size, 3)]
        frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    else:
        img.save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    """``data`` as a base64 ``data:`` URL of type ``mime`` (RFC 2397)."""
    return f"data:{mime};base64," + base64.b64encode(data).decode()
