"""Session fixture: one live platform for the conformance cases (tests/live_platform.py), plus a second
served model using the Llama 3.1 tokenizer (its template writes BOS: conformance C01) with its own engine."""

from __future__ import annotations

import httpx
import pytest

from tests.live_platform import MODEL_DIR, REPO, start_platform

LLAMA_MODEL = "tiny-llama3tok"


@pytest.fixture(scope="package")
def live(tmp_path_factory):
    platform = start_platform(tmp_path_factory.mktemp("live"))
    try:
        platform.manage("register_model", LLAMA_MODEL, str(MODEL_DIR), "--tokenizer-dir",
                        str(REPO / ".cache" / "tokenizers" / "llama3_1"), "--max-model-len", "512")
        platform.start_engine(name="engine-llama", model=LLAMA_MODEL)
        yield platform
    finally:
        platform.stop()


@pytest.fixture(scope="session")
def model_name():
    return "tiny-qwen3"


@pytest.fixture(scope="package")
def http(live):
    """An httpx client on the api with the test key."""
    with httpx.Client(base_url=live.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {live.api_key}"}) as client:
        yield client
