"""Issue 14: a client-supplied chat template (``chat_template`` in the request, accepted only where the registry
allows it) is never rendered in the api process, not even by an api running ``RENDER_ROUTE=inline``: it always
goes to a Celery render worker, whose time limit kills a render the sandbox's budgets do not stop.

The shared live platform (``shared_live``, tests/conftest.py); the render workers count
the tasks they answer in Redis (``inference.workers.tasks.render_tasks_counter_key``)."""

from __future__ import annotations

import httpx
import pytest

from harness.assets import MODEL_DIR
from tests.support.live import ensure_inline_api, ensure_model

TRUSTED = "tiny-qwen3-trusted"
MESSAGES = [{"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def live(shared_live):
    ensure_model(shared_live, TRUSTED, MODEL_DIR, "--max-model-len", "512", "--allow-request-chat-template", "true")
    ensure_inline_api(shared_live)
    return shared_live


@pytest.fixture(scope="module")
def inline(live):
    with httpx.Client(base_url=live.extra["inline_url"], timeout=120,
                      headers={"Authorization": f"Bearer {live.api_key}"}) as client:
        yield client


def _tasks_done(live) -> int:
    from inference.workers.tasks import render_tasks_counter_key

    return int(live.redis.get(render_tasks_counter_key(live.prefix)) or 0)


def test_inline_api_sends_client_templates_to_the_workers(live, inline):
    before = _tasks_done(live)
    own = inline.post("/tokenize", json={"model": TRUSTED, "messages": MESSAGES})
    assert own.status_code == 200, own.text
    assert _tasks_done(live) == before  # the model's own template: rendered inline, no task

    client = inline.post("/tokenize", json={"model": TRUSTED, "messages": MESSAGES, "chat_template": TEMPLATE})
    assert client.status_code == 200, client.text
    assert _tasks_done(live) == before + 1  # the client's template: one render task on a worker
    detok = inline.post("/detokenize", json={"model": TRUSTED, "tokens": client.json()["tokens"]})
    assert detok.json()["prompt"] == "<user>hi"


def test_client_template_bomb_is_a_template_limit_error(live, inline):
    """A width bomb is refused by the sandbox (before building it) with 400 ``template_limit``."""
    r = inline.post("/tokenize", json={"model": TRUSTED, "messages": MESSAGES,
                                       "chat_template": '{{ ""|center(100000000) }}'})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "template_limit" and err["param"] == "chat_template"
