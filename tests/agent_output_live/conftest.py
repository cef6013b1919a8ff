"""One live platform for this package (harness/live_platform.py) and the official ``openai`` client on it."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="package")
def live(shared_live):
    """The shared live platform (tests/conftest.py)."""
    return shared_live
MODEL = "tiny-qwen3"


@pytest.fixture(scope="package")
def client(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def forced(client):
    """The structured-outputs request extension (``structured_outputs.regex``, branch i16/structured) that makes
    the random-weights demo model write exact markup. Skips (saying why) on a platform without it."""
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8, temperature=1.0,
        extra_body={"structured_outputs": {"regex": "abc"}})
    if out.choices[0].message.content != "abc":
        pytest.skip("structured_outputs.regex is not enforced on this platform (the engine mask of i16/structured "
                    "is not merged)")

    def create(regex: str, **kw):
        extra = {**kw.pop("extra_body", {}), "structured_outputs": {"regex": regex}}
        return client.chat.completions.create(model=MODEL, extra_body=extra, **kw)

    return create
