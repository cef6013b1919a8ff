"""Shared fixtures for renderer tests: the real tokenizer directories (scripts/fetch_tokenizers.sh)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TOKENIZERS_ROOT = Path(__file__).resolve().parents[2] / ".cache" / "tokenizers"
NAMES = ("qwen3", "llama3_1", "gemma3", "deepseek_v3", "gptoss", "llama2")


def tok_dir(name: str) -> str:
    """Path of one real tokenizer directory; skips the test when the cache was not fetched."""
    path = TOKENIZERS_ROOT / name
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"{path} missing: run scripts/fetch_tokenizers.sh")
    return str(path)


_HF: dict[str, object] = {}


def hf_tokenizer(name: str):
    """transformers' AutoTokenizer for a directory (the reference), loaded once per process."""
    if name not in _HF:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        _HF[name] = AutoTokenizer.from_pretrained(tok_dir(name))
    return _HF[name]
