"""A render-only deployment (api + Celery render workers, no engine; ``manage.py serve --no-engine``)
serves /tokenize, /detokenize and the render routes; generation answers 503, not 500. Run on the shared live
platform (``shared_live``) with a model of this module's own that no engine serves: the api and render workers are
the same processes, the engine that serves the demo model plays no part for this one."""

from __future__ import annotations

import httpx
import pytest

from tests.live_platform import MODEL_DIR
from tests.support.live import ensure_model

M = "render-only"  # the demo model's directory, registered for this module: no engine serves it
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def render_only(shared_live):
    ensure_model(shared_live, M, MODEL_DIR, "--max-model-len", "512")
    with httpx.Client(base_url=shared_live.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {shared_live.api_key}"}) as client:
        yield client


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
