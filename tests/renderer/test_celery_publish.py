"""inference.api.celery_publish: the message pushed from the event loop is the one ``app.send_task`` pushes, field by
field, on the real Redis; a real prefork worker runs it and answers on the reply channel."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from celery import Celery

from inference.api.celery_publish import RedisTaskPublisher, redis_broker
from inference.protocol.render import (
    ChatRenderRequest,
    DetokenizeRenderRequest,
    RenderedText,
    RenderedTokens,
    RenderFailure,
    TokenizeRenderRequest,
)
from inference.api.render_client import RenderReplyWaiter, expires_at
from tests.renderer.tokdirs import tok_dir
from tests.support.redis import TEST_REDIS_URL, fresh_prefix

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = {"tokenizer_dir": "/nowhere", "messages": [{"role": "user", "content": "héllo 東京 \u2028 \"\\ 🙂"}],
           "add_generation_prompt": True, "chat_template_kwargs": {"f": 0.1, "n": -3}, "reply_to": "chan",
           "reply_id": "abc"}
BIG = {**PAYLOAD, "chat_template_kwargs": {"big": 2**70}}  # past orjson's 64 bits: kombu's encoder writes it


@pytest.fixture(scope="module")
def client():
    c = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        c.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")
    yield c
    c.close()


def _app(prefix: str, finalized: bool = False, **conf) -> Celery:
    app = Celery("publish-test", broker=TEST_REDIS_URL, include=["inference.workers.tasks"])
    app.conf.update(broker_transport_options={"global_keyprefix": f"{prefix}:celery:"}, task_serializer="json",
                    accept_content=["json"], **conf)
    if finalized:  # the render tasks registered in the app: send_task puts their time limits in the headers
        app.loader.import_default_modules()
        app.finalize()
    return app


def _decoded(raw: bytes) -> dict:
    msg = json.loads(raw)
    msg["body"] = json.loads(base64.b64decode(msg["body"]))
    return msg


@pytest.mark.parametrize("transport,finalized,payload", [(None, False, PAYLOAD), ("config.broker:Transport", True, PAYLOAD),
                                                         (None, True, BIG)])
def test_message_equals_send_task(client, transport, finalized, payload):
    with fresh_prefix("publish") as prefix:
        app = _app(prefix, finalized, **({"broker_transport": transport} if transport else {}))
        assert redis_broker(app)
        expires = expires_at(20)

        async def ours() -> tuple[str, str, bytes]:
            publisher = RedisTaskPublisher.for_app(app)
            assert publisher is not None
            try:
                task_id, key, envelope = publisher.message("inference.render_chat", [payload], queue="render",
                                                           expires=expires, argsrepr="[<payload>]")
                await publisher.send("inference.render_chat", [payload], queue="render", expires=expires,
                                     argsrepr="[<payload>]")
                return task_id, key, envelope
            finally:
                await publisher.client.aclose()

        task_id, key, envelope = asyncio.run(ours())
        assert key == f"{prefix}:celery:render"
        app.send_task("inference.render_chat", args=[payload], queue="render", ignore_result=True, expires=expires,
                      argsrepr="[<payload>]", kwargsrepr="{}", task_id=task_id)
        theirs, pushed = client.lpop(key), client.lpop(key)  # LPUSH: the newest first
        assert client.llen(key) == 0
        want, got = _decoded(theirs), _decoded(envelope)
        assert got["headers"]["timelimit"] == want["headers"]["timelimit"]
        assert (want["headers"]["timelimit"] != [None, None]) is finalized
        for msg in (want, got):
            assert abs(int(msg["properties"].pop("expiration")) - 20_000) < 3_000  # ms left, read at the send
            msg["properties"].pop("delivery_tag")  # a fresh uuid per message
        assert got == want and got["body"][0] == [payload]
        assert json.loads(pushed)["headers"]["task"] == "inference.render_chat"


def test_other_brokers_keep_send_task():
    assert not redis_broker(Celery("x", broker="memory://"))
    assert not redis_broker(Celery("x", broker="rediss://127.0.0.1:6380/0"))
    assert not redis_broker(Celery("x", broker="redis://127.0.0.1:6379/0", broker_transport="memory"))
    assert RedisTaskPublisher.for_app(Celery("x", broker="amqp://guest@127.0.0.1//")) is None


def test_a_prefork_worker_answers_a_direct_message(client):
    """The whole hop: RenderReplyWaiter (which publishes through RedisTaskPublisher) to a real prefork worker of the
    render tasks and back on the reply channel."""
    with fresh_prefix("publish") as prefix:
        env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'platform'}", PUBLISH_TEST_PREFIX=prefix,
                   PUBLISH_TEST_REDIS_URL=TEST_REDIS_URL)
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.renderer.publish_worker_app", "worker", "-P", "prefork",
             "-c", "1", "-Q", "render", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l",
             "warning"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            app = _app(prefix)

            async def render() -> dict:
                waiter = RenderReplyWaiter(TEST_REDIS_URL, prefix)
                deadline = time.monotonic() + 90
                while True:  # a cold worker (imports, tokenizer) may take a while on a busy box
                    try:
                        return await waiter.call(app, "inference.tokenize_prompt",
                                                 {"tokenizer_dir": tok_dir("qwen3"), "prompt": "Hello"},
                                                 queue="render", timeout=30)
                    except Exception:
                        if time.monotonic() > deadline:
                            raise

            assert asyncio.run(render()) == {"ok": True, "prompt_token_ids": [9707]}

            async def typed() -> list:
                waiter = RenderReplyWaiter(TEST_REDIS_URL, prefix)
                return [await waiter.request(app, req, timeout=60) for req in (
                    TokenizeRenderRequest(tok_dir("qwen3"), "Hello"),
                    DetokenizeRenderRequest(tok_dir("qwen3"), [9707]),
                    DetokenizeRenderRequest(tok_dir("qwen3"), [10**9]),
                    ChatRenderRequest(tok_dir("qwen3"), [{"role": "user", "content": "Hi " * 1000}], max_model_len=1))]

            # the typed requests over the same hop: each answer read back as its result or a typed failure
            tokens, text, bad_id, too_long = asyncio.run(typed())
            assert tokens == RenderedTokens([9707]) and text == RenderedText("Hello")
            assert isinstance(bad_id, RenderFailure) and (bad_id.type, bad_id.param, bad_id.code) == (
                "TokenIdError", "tokens", "invalid_prompt")
            assert isinstance(too_long, RenderFailure) and (too_long.type, too_long.param, too_long.code) == (
                "ContextLengthError", "messages", "context_length_exceeded")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
