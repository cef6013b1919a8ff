"""The demo vision model for the multimodal tests (the live platform, ``live_vl``, is in tests/conftest.py so that
every directory shares one instance): Redis, Celery render+usage worker, a Celery ``mm`` worker
(concurrency 1), beat, api, and an engine replica of the demo Qwen2-VL model (random weights, real Qwen3
tokenizer, built by scripts/build_demo_vl_model.py). The ``mm`` worker may fetch from 127.0.0.1 only
(``MM_FETCH_ALLOW_NETS``), so the stall server below is reachable for it; nothing else is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


from tests.live_platform import REPO, TOKENIZER_DIR, ensure_demo_assets

VL_MODEL = "tiny-vl"
VL_DIR = REPO / ".cache" / "models" / "tiny-qwen2-vl"


def ensure_vl_model() -> Path:
    ensure_demo_assets()
    if not (VL_DIR / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo_vl_model.py"), "--tokenizer-dir",
                        str(TOKENIZER_DIR), "--out", str(VL_DIR)], check=True, timeout=600)
    return VL_DIR
