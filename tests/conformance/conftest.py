"""The conformance cases' platform: the shared live platform (``shared_live``, tests/conftest.py), plus a second
served model using the Llama 3.1 tokenizer (its template writes BOS: conformance C01) with its own engine."""

from __future__ import annotations

import httpx
import pytest

from harness.assets import MODEL_DIR
from harness import REPO
from tests.support.live import ensure_model

LLAMA_MODEL = "tiny-llama3tok"


@pytest.fixture(scope="package")
def live(shared_live):
    ensure_model(shared_live, LLAMA_MODEL, MODEL_DIR, "--tokenizer-dir", str(REPO / ".cache" / "tokenizers" / "llama3_1"),
                 "--max-model-len", "512", engine=True)
    return shared_live


@pytest.fixture(scope="session")
def model_name():
    return "tiny-qwen3"


@pytest.fixture(scope="package")
def http(live):
    """An httpx client on the api with the test key."""
    with httpx.Client(base_url=live.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {live.api_key}"}) as client:
        yield client
