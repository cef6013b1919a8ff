"""Live platform for the multimodal tests: Redis, Celery render+usage worker, a Celery ``mm`` worker
(concurrency 1), beat, api, and an engine replica of the demo Qwen2-VL model (random weights, real Qwen3
tokenizer, built by scripts/build_demo_vl_model.py). The ``mm`` worker may fetch from 127.0.0.1 only
(``MM_FETCH_ALLOW_NETS``), so the stall server below is reachable for it; nothing else is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.live_platform import REPO, TOKENIZER_DIR, ensure_demo_assets
from tests.support.live import running_platform, start_replica

VL_MODEL = "tiny-vl"
VL_DIR = REPO / ".cache" / "models" / "tiny-qwen2-vl"


def ensure_vl_model() -> Path:
    ensure_demo_assets()
    if not (VL_DIR / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo_vl_model.py"), "--tokenizer-dir",
                        str(TOKENIZER_DIR), "--out", str(VL_DIR)], check=True, timeout=600)
    return VL_DIR


@pytest.fixture(scope="session")
def live_vl(tmp_path_factory):
    ensure_vl_model()
    with running_platform(tmp_path_factory.mktemp("live-vl"), engine=False, max_model_len=1024,
                          mm_worker=False) as live:  # its own mm worker below may fetch from loopback
        live.manage("register_model", VL_MODEL, str(VL_DIR), "--max-model-len", "1024")
        env = dict(live.env, MM_FETCH_ALLOW_NETS="127.0.0.1/32", MM_FETCH_TIMEOUT_S="3")
        live.sup.env = env
        live.sup.start("mm-worker", [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "mm", "-c", "1",
                                     "-I", "inference.mm_tasks", "--pool", "prefork", "-n", f"mm-{live.prefix}@%h",
                                     "--without-gossip", "--without-mingle", "-l", "WARNING"])
        start_replica(live, "vl-engine", VL_MODEL, VL_DIR, "--max-model-len", "1024", "--num-threads", "2")
        yield live
