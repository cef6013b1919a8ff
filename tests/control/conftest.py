"""Fixtures for the control-plane tests: real Redis (``REDIS_URL`` or db 4), a real model directory."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import redis

REPO_DIR = Path(__file__).resolve().parents[2]
QWEN3_TOKENIZER_DIR = REPO_DIR / ".cache" / "tokenizers" / "qwen3"


@pytest.fixture
def redis_url() -> str:
    return os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/4"


@pytest.fixture
def link_prefix(settings) -> str:
    """A LINK_PREFIX unique to this test, so parallel test runs on one Redis never share keys."""
    prefix = f"llmptest-{uuid.uuid4().hex[:10]}"
    settings.LINK_PREFIX = prefix
    return prefix


@pytest.fixture
def redis_client(redis_url, link_prefix):
    client = redis.Redis.from_url(redis_url)
    client.ping()
    yield client
    keys = list(client.scan_iter(match=f"{link_prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A Hugging Face-style model directory: a Qwen3 config.json plus the real Qwen3 tokenizer files."""
    if not (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.fail(f"{QWEN3_TOKENIZER_DIR} missing: run scripts/fetch_tokenizers.sh")
    path = tmp_path / "qwen3-tiny"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_TOKENIZER_DIR / name, path / name)
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 40960})
    )
    return path
