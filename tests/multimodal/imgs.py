"""An image the multimodal tests refuse (the seeded images tests and benchmarks share are in harness/images.py)."""

from __future__ import annotations

import io

from PIL import Image


def bomb_png() -> bytes:
    """A small file that decodes to 8000×8000 pixels (64 MP > the 40 MP limit)."""
    buf = io.BytesIO()
    Image.new("1", (8000, 8000)).save(buf, "PNG")
    return buf.getvalue()
