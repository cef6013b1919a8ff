"""The frontend suite's platform: the shared live platform (``shared_live``, tests/conftest.py) with

* ``tiny-qwen3`` and its engine (the generation features),
* one tokenize-only served model per real tokenizer (``tok-<name>``: the demo model dir with
  ``--tokenizer-dir .cache/tokenizers/<name>``; no engine needed for /tokenize),
* ``tiny-qwen3-trusted``: same model, ``--allow-request-chat-template true``,
* a second api process with ``RENDER_ROUTE=inline`` (``live.extra["inline_url"]``).
"""

from __future__ import annotations

import httpx
import pytest

from harness.assets import MODEL_DIR
from harness import REPO
from tests.support.live import ensure_inline_api, ensure_model

TOKENIZER_NAMES = ("qwen3", "llama3_1", "gemma3", "deepseek_v3", "gptoss", "llama2")


@pytest.fixture(scope="package")
def live(shared_live):
    for name in TOKENIZER_NAMES:
        ensure_model(shared_live, f"tok-{name}", MODEL_DIR, "--tokenizer-dir",
                     str(REPO / ".cache" / "tokenizers" / name), "--max-model-len", "32768")
    ensure_model(shared_live, "tiny-qwen3-trusted", MODEL_DIR, "--max-model-len", "512",
                 "--allow-request-chat-template", "true")
    ensure_inline_api(shared_live)
    return shared_live


def _client(url, key):
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="package")
def http(live):
    """httpx client on the default (Celery route) api process."""
    with _client(live.base_url, live.api_key) as c:
        yield c


@pytest.fixture(scope="package")
def http_inline(live):
    """httpx client on the ``RENDER_ROUTE=inline`` api process."""
    with _client(live.extra["inline_url"], live.api_key) as c:
        yield c
