"""A render-only deployment (api + Celery render workers, no engine; ``manage.py serve --no-engine``)
serves /tokenize, /detokenize and the render routes; generation answers 503, not 500."""

from __future__ import annotations

import httpx
import pytest

from tests.live_platform import start_platform

M = "tiny-qwen3"
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def render_only(tmp_path_factory):
    platform = start_platform(tmp_path_factory.mktemp("render-only"), engine=False)
    try:
        with httpx.Client(base_url=platform.base_url, timeout=60,
                          headers={"Authorization": f"Bearer {platform.api_key}"}) as client:
            yield client
    finally:
        platform.stop()


def test_render_only_serves_frontend_routes(render_only):
    tok = render_only.post("/tokenize", json={"model": M, "messages": MSGS})
    assert tok.status_code == 200, tok.text
    ids = tok.json()["tokens"]
    assert render_only.post("/detokenize", json={"model": M, "tokens": ids}).json()["prompt"].startswith("<|im_start|>")
    r = render_only.post("/v1/chat/completions/render", json={"model": M, "messages": MSGS, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["token_ids"] == ids
    c = render_only.post("/v1/completions/render", json={"model": M, "prompt": "hello"})
    assert c.status_code == 200 and c.json()[0]["sampling_params"]["max_tokens"] == 16
    gen = render_only.post("/inference/v1/generate", json=r.json())
    assert gen.status_code == 503, gen.text
    assert gen.json()["error"]["code"] == "engine_unavailable" and "retry-after" in gen.headers
