"""Test images made with Pillow (fixed seeds)."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def image_bytes(fmt: str = "PNG", size=(90, 60), seed: int = 0) -> bytes:
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
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def bomb_png() -> bytes:
    """A small file that decodes to 8000×8000 pixels (64 MP > the 40 MP limit)."""
    buf = io.BytesIO()
    Image.new("1", (8000, 8000)).save(buf, "PNG")
    return buf.getvalue()
