"""A render-only deployment (api + Celery render workers, no engine; ``manage.py serve --no-engine``)
serves /tokenize, /detokenize and the render routes; generation answers 503, not 500. Run on the shared live
platform (``shared_live``) with a model of this module's own that no engine serves: the api and render workers are
the same processes, the engine that serves the demo model plays no part for this one."""

from __future__ import annotations

import uuid

import httpx
import pytest

from harness.assets import MODEL_DIR
from tests.e2e.test_usage_e2e import records
from tests.support.live import ensure_model, limited_key

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


def test_a_request_no_engine_took_costs_nothing(shared_live, render_only):
    """503 ``engine_unavailable`` (no replica serves the model): the usage record counts no tokens and an
    error, and the key's token budget is not spent (OpenAI bills no failed request). Before, each such refusal
    was charged its prompt: this budget ran out after 5 refusals."""
    tag = uuid.uuid4().hex[:8]
    key = limited_key(shared_live, token_budget=2000, budget_period="'day'")
    prompt = " ".join(f"word{i}" for i in range(100))  # ~300 tokens, ~800 bytes (the key's estimate: ~1,000)
    statuses = []
    for i in range(12):
        r = render_only.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}",
                                                               "X-Request-Id": f"nobill-{tag}-{i}"},
                             json={"model": M, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
        statuses.append((r.status_code, r.json()["error"]["code"]))
    assert statuses == [(503, "engine_unavailable")] * 12  # never 429 insufficient_quota
    rows = records(shared_live, f"chatcmpl-nobill-{tag}", 12)
    assert len(rows) == 12
    assert {(r["status_code"], r["prompt_tokens"], r["completion_tokens"], r["finish_reason"]) for r in rows} == \
        {(503, 0, 0, "error")}
