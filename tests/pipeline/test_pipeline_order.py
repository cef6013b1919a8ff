"""The request path's order (docs/ARCHITECTURE.md §2, docs/request_path.md): a streamed chat through the real consumer
(``ChatCompletionsConsumer`` over ASGI), with a real API key and served model in the database, real Redis (key
limits, admission, usage stream) and the renderer inline; a fake engine link stands in for the engine. Each step
is observed by a spy that records its name and then calls the real function."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import pytest
from asgiref.testing import ApplicationCommunicator

from gateway.endpoints.chat import ChatCompletionsConsumer
from gateway import clients
from gateway.pipeline import admission, engine, inputs, limits, media, preamble
from gateway.pipeline.usage import UsageRecorder
from gateway.http import GatewayConsumer
from registry.services import served_model_register
from tenancy.services import api_key_create, tenant_get_or_create
from tests.support.fake_engine import FakeLink
from tests.support.redis import TEST_REDIS_URL, fresh_prefix

MODEL_DIR = Path(__file__).resolve().parents[2] / ".cache" / "models" / "tiny-qwen3"
MODEL = "order-m"
# docs/ARCHITECTURE.md §2 order of a streamed chat's steps: the key's request and concurrency limits right after
# authentication, before the body is parsed; its token estimate (TPM, budgets) once validated, before render
DESIGN_ORDER = ["authenticate", "key limits", "validate", "model", "key limits (tokens)", "admission pre-check", "render",
                "input processing", "admission reserve", "engine add", "output", "usage"]


def _spy(monkeypatch, steps: list[str], owner, name: str, step: str) -> None:
    """Replace ``owner.name`` by a function that appends ``step`` to ``steps`` and then runs the original."""
    real = getattr(owner, name)
    if asyncio.iscoroutinefunction(real):
        @functools.wraps(real)
        async def spy(*args, **kwargs):
            steps.append(step)
            return await real(*args, **kwargs)
    else:
        @functools.wraps(real)
        def spy(*args, **kwargs):
            steps.append(step)
            return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, spy)


@pytest.fixture
def platform(settings, monkeypatch, transactional_db, db_connections_closed_in_their_threads):
    """A served model and a tenant's keys in the database, the pipeline on a fresh Redis prefix, the steps
    spied on; yields ``(steps, keys, fake_link)`` with ``keys`` = ``{"free": ..., "rpm1": ...}``."""
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip(f"{MODEL_DIR} missing")
    with fresh_prefix("ordertest") as prefix:
        settings.REDIS_URL, settings.LINK_PREFIX, settings.RENDER_ROUTE = TEST_REDIS_URL, prefix, "inline"
        monkeypatch.setattr("usage.events.settings.LINK_PREFIX", prefix, raising=False)
        served_model_register(served_model_name=MODEL, model_dir=str(MODEL_DIR), max_model_len=256)
        tenant = tenant_get_or_create(name="order-tenant")
        keys = {"free": api_key_create(tenant=tenant, name="free")[1],
                "rpm1": api_key_create(tenant=tenant, name="rpm1", limits={"rpm_limit": 1})[1]}
        fake = FakeLink(default=[{"new_token_ids": [9707]}, {"new_token_ids": [11], "finish_reason": "stop"}])
        monkeypatch.setattr(engine, "link", lambda: fake)
        monkeypatch.setattr("gateway.pipeline.conversation.link", lambda: fake)
        clients._pools.clear()
        steps: list[str] = []
        for owner, name, step in [
            (preamble, "authenticate", "authenticate"), (preamble, "parse", "validate"),
            (preamble, "resolve_model", "model"), (limits, "acquire", "key limits"),
            (limits, "add_tokens", "key limits (tokens)"),
            (admission, "precheck", "admission pre-check"), (media, "call_render", "render"),
            (inputs, "process", "input processing"), (admission, "reserve", "admission reserve"),
            (FakeLink, "add_requests", "engine add"), (GatewayConsumer, "start_sse", "output"),
            (GatewayConsumer, "send_event", "output"), (UsageRecorder, "emit", "usage"),
        ]:
            _spy(monkeypatch, steps, owner, name, step)
        yield steps, keys, fake


async def _chat(key: str, body: bytes | None = None) -> tuple[int, bytes]:
    body = body if body is not None else json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                       "stream": True}).encode()
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    comm = ApplicationCommunicator(ChatCompletionsConsumer.as_asgi(), scope)
    await comm.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await comm.receive_output(timeout=60)
    chunks = []
    while True:  # bounded by the communicator's timeout: the response ends with more_body False
        message = await comm.receive_output(timeout=60)
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    await comm.send_input({"type": "http.disconnect"})
    await comm.wait(timeout=10)
    return start["status"], b"".join(chunks)


async def _until_usage(steps: list[str]) -> None:
    """The usage event of a refused request is written in the background: wait for it (bounded)."""
    for _ in range(500):
        if "usage" in steps:
            return
        await asyncio.sleep(0.01)


async def _spend_the_minute(steps: list[str], key: str) -> None:
    """One accepted chat with ``key`` (rpm=1), recorded; then ``steps`` is cleared for the next request."""
    status, _ = await _chat(key)
    assert status == 200
    await _until_usage(steps)
    steps.clear()


def _collapsed(steps: list[str]) -> list[str]:
    """``steps`` with repeats of the same step in a row counted once (one ``output`` per SSE event)."""
    return [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]


async def test_a_streamed_chat_takes_the_steps_in_design_order(platform):
    steps, keys, fake = platform
    status, body = await _chat(keys["free"])
    assert status == 200, body
    assert body.rstrip().endswith(b"data: [DONE]")
    await _until_usage(steps)
    assert _collapsed(steps) == DESIGN_ORDER
    assert len(fake.added) == 1


async def test_an_over_limit_key_gets_its_429_before_any_render(platform):
    steps, keys, fake = platform
    await _spend_the_minute(steps, keys["rpm1"])
    status, body = await _chat(keys["rpm1"])  # the second request of the minute: over rpm=1
    assert status == 429, body
    assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    await _until_usage(steps)
    assert _collapsed(steps) == ["authenticate", "key limits", "usage"]  # 429 before the body is parsed, recorded
    assert len(fake.added) == 1  # only the first request reached the engine


async def test_an_over_limit_key_gets_429_for_an_invalid_body_without_parsing_it(platform):
    steps, keys, fake = platform
    await _spend_the_minute(steps, keys["rpm1"])
    status, body = await _chat(keys["rpm1"], body=b"{not json" + b" " * 1_000_000)
    assert status == 429, body  # not 400: the key's RPM comes before any parse
    assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    await _until_usage(steps)
    assert "validate" not in steps and _collapsed(steps) == ["authenticate", "key limits", "usage"]
